"""torchtitan's objects as trainstate components, and the experiment contract of a torchtitan run.

The data loader's position without torchtitan's ``pickle.dumps`` (:class:`TitanDataLoader`), DTensor's RNG
tracker settings (:class:`DTensorRNG`), the loader's own generator (:func:`own_generator`), and the fields a
resume must not change (:func:`experiment_contract`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import _random as dtensor_random
from torchdata.stateful_dataloader import StatefulDataLoader

from ...errors import StateMismatch


class TitanDataLoader:
    """A torchtitan data loader's position, without the ``pickle.dumps`` torchtitan wraps it in.

    ``ParallelAwareDataloader.state_dict`` pickles ``StatefulDataLoader``'s
    state under a ``dp_rank_<r>`` key; this reads and writes the same state
    unpickled (plain ints, strings and lists the codec stores), one per rank.
    At another world size a position cannot be mapped onto other ranks: the
    restore is refused unless ``dataloader`` is in ``exclude_from_loading``,
    and then each rank starts its shard of the data afresh, as torchtitan does.
    """

    def __init__(self, loader: StatefulDataLoader, excluded: bool):
        self.loader = loader
        self.excluded = excluded

    def state_dict(self) -> dict[str, Any]:
        return StatefulDataLoader.state_dict(self.loader)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.excluded:
            StatefulDataLoader.load_state_dict(self.loader, state)

    def resharded_state(self, saved: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
        if not self.excluded:
            raise StateMismatch(
                f"the data loader's position was saved by {len(saved)} data-parallel ranks and cannot be mapped onto "
                "another number: torchtitan's datasets split the data by rank. To reshard the model and optimizer "
                "and start each rank's data afresh, add --checkpoint.exclude-from-loading dataloader")
        return self.state_dict(), ["the data loader's position was not loaded (exclude_from_loading): each rank "
                                   "starts its shard of the data afresh"]


class DTensorRNG:
    """DTensor's RNG tracker, beyond the device generator it draws from (captured with every CUDA device's).

    torch 2.13's ``OffsetBasedRNGTracker`` keeps its Philox state in the
    device's default generator; what it adds is whether random ops on
    DTensors run in a distributed region, and (older versions) named states.
    """

    def state_dict(self) -> dict[str, Any]:
        tracker = dtensor_random._rng_tracker
        if tracker is None:
            return {}
        out: dict[str, Any] = {"distribute_region_enabled": bool(tracker.distribute_region_enabled)}
        states = getattr(tracker, "rng_states", None)
        if isinstance(states, dict):
            out["rng_states"] = {str(k): v.detach().cpu().clone() for k, v in states.items()}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        tracker = dtensor_random._rng_tracker
        if tracker is None or not state:
            return
        tracker.distribute_region_enabled = state["distribute_region_enabled"]
        states = getattr(tracker, "rng_states", None)
        for name, value in (state.get("rng_states") or {}).items():
            if isinstance(states, dict) and name in states:
                states[name] = value.to(states[name].device)


def own_generator(loader: StatefulDataLoader) -> None:
    """Give the loader a generator of its own, seeded alike in every process of the run.

    Each ``iter(loader)`` draws the workers' base seed from ``loader.generator``,
    by default torch's global one. torchtitan makes the iterator after the
    checkpoint loads, so a resumed process would draw once more from the
    global stream than the uninterrupted one did (which drew before step 1),
    and every later dropout mask would shift. The loader's own generator,
    seeded from the run's seed (``torch.initial_seed()``, which
    ``--debug.seed`` sets), leaves the global stream to the model. It is not
    saved: every process draws from it once, at its one ``iter()``, so it
    ends in the same state in a resumed process as in the uninterrupted one,
    and the base seed the workers use is restored with the loader's position.
    """
    if loader.generator is None:
        loader.generator = torch.Generator().manual_seed(torch.initial_seed())


def _fingerprint(folder: str | None) -> str | None:
    """A digest of the tokenizer files in ``folder`` (names and bytes), or ``None`` without any."""
    if not folder or not os.path.isdir(folder):
        return None
    digest = hashlib.sha256()
    for path in sorted(Path(folder).iterdir()):
        if path.is_file() and (path.name.startswith("tokenizer") or path.suffix in (".model", ".tiktoken")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def experiment_contract(trainer: Any) -> dict[str, Any]:
    """What gives a torchtitan run's numbers their meaning: checked on restore, a change refused by name."""
    config = getattr(trainer, "config", None)
    if config is None:
        return {}
    training, dataloader = config.training, config.dataloader
    spec = config.model_spec
    return {
        "model": {"name": str(getattr(spec, "name", type(spec).__name__)),
                  "flavor": str(getattr(spec, "flavor", "")),
                  "parameters": sum(p.numel() for m in trainer.model_parts for p in m.parameters())},
        "tokenizer": _fingerprint(getattr(config, "hf_assets_path", None)),
        "dataset": {"name": str(getattr(dataloader, "dataset", "")), "path": getattr(dataloader, "dataset_path", None)},
        "training": {"seq_len": training.seq_len, "local_batch_size": training.local_batch_size,
                     "global_batch_size": training.global_batch_size},
    }
