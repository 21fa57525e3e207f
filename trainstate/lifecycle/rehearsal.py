"""Restart rehearsal: load a generation into freshly built objects, away from the live run.

Digests and a key check prove the bytes are the ones written; they do not
prove a restart works. An empty model dict verifies perfectly and still fails
``load_state_dict``; a swapped optimizer param group loads without complaint
and trains the wrong moments. A rehearsal does what a restart does, into
objects built by your factory (the same code a restarted job runs), and adds
the checks ``load_state_dict`` skips. The process's global RNG state is left
as it was, so a live run can rehearse its own newest generation.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..state import contract as contract_mod
from ..state import rng as rng_mod
from ..state import snapshot
from ..errors import DataMismatch, InvalidArgument, InvalidType, WeightsOnlyGeneration
from ..format.manifest import Manifest
from ..format.signing import SigningKey
from ..state.train_state import TrainState
from ..storage.base import Store
from ..storage.verify import load_verified

Factory = Callable[[], TrainState]


@dataclass(frozen=True)
class Rehearsal:
    """A generation that restored into fresh objects, and what was checked."""

    generation: str
    checks: tuple[str, ...]
    warnings: tuple[str, ...] = ()


def load_factory(spec: str) -> Factory:
    """``"package.module:function"`` -> the function (the working directory is importable)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidArgument(f"factory {spec!r} must look like 'module:function'")
    added = "" not in sys.path
    if added:
        sys.path.insert(0, "")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise InvalidArgument(f"cannot load factory {spec!r}: {exc}") from exc
    finally:
        if added and "" in sys.path:
            sys.path.remove("")
    if not callable(factory):
        raise InvalidArgument(f"factory {spec!r} is not callable")
    return factory


def rehearse(store: Store, generation: str, factory: Factory, *, key: SigningKey | None = None,
             allow_changes: tuple[str, ...] = ()) -> Rehearsal:
    """Restore ``generation`` into ``factory()``'s fresh objects; raise what a restart would hit.

    Checks, in order: every byte against its digest; the experiment contract;
    component names and kinds (the identity rule of
    :func:`~trainstate.state.snapshot.check_components`: a class moved out of
    the training script still restores), module keys, shapes and dtypes; optimizer
    pairing (group sizes and each parameter's state shapes); the RNG record
    (sources, kinds, CUDA device count); then loads every component (the
    scheduler's and scaler's own schema checks run here) and compares each
    data position's next-batch fingerprint with the manifest's.
    """
    verified, payload = load_verified(store, generation, key=key)
    if verified.manifest.kind != "full":
        raise WeightsOnlyGeneration(f"{generation} holds weights only: a restart cannot resume from it, so there is "
                                    "nothing to rehearse; rehearse a full generation")
    saved_globals = rng_mod.capture({}, include_globals=True)
    try:
        fresh = factory()
        if not isinstance(fresh, TrainState):
            raise InvalidType(f"the rehearsal factory returned a {type(fresh).__qualname__}, not a TrainState")
        return _rehearse(verified.manifest, payload, fresh, allow_changes)
    finally:
        rng_mod.apply_validated(saved_globals, {}, restore_cuda=True)


def _rehearse(manifest: Manifest, payload: dict[str, Any], fresh: TrainState,
              allow_changes: tuple[str, ...]) -> Rehearsal:
    name = manifest.generation
    checks = ["digests"]
    fresh.settle_contract(payload["contract"]["fields"], allow_changes)
    contract_mod.check(payload["contract"]["fields"], fresh.contract_fields(), name, allow_changes)
    checks.append("contract")
    snapshot.check_components(fresh, payload, name)
    checks += ["components", "shapes and dtypes", "optimizer pairing"]
    warnings = snapshot.apply(fresh, payload, apply_rng=False)
    checks += ["rng schema", "load_state_dict"]
    for component, position in manifest.data.items():
        live = fresh.components.get(component)
        if live is None or not callable(getattr(live, "data_position", None)):
            raise DataMismatch(f"{name} records a data position for {component!r}, which the factory's "
                               "TrainState does not have")
        if {f"loader.{component}.batch_size", f"loader.{component}.mixture.weights"} & set(allow_changes):
            continue  # an allowed regrouping or reweighting: the next batch is deliberately another one
        got = live.data_position()
        if (got["epoch"], got["cursor"], got["next_batch"]) != (
                position["epoch"], position["cursor"], position["next_batch"]):
            raise DataMismatch(f"{name}: the next batch of {component!r} after restore (epoch {got['epoch']}, "
                               f"batch {got['cursor']}, sample-id fingerprint {got['next_batch']}) is not the one "
                               f"recorded (epoch {position['epoch']}, batch {position['cursor']}, fingerprint "
                               f"{position['next_batch']}): the data pipeline changed (dataset, order or sharding)")
    if manifest.data:
        checks.append("next-batch fingerprint")
    return Rehearsal(name, tuple(checks), tuple(warnings))
