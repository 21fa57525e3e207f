"""Capture and restore every random-number source a training step may draw from.

The global sources are separate streams and each is captured on its own:
Python ``random``, NumPy's legacy global ``RandomState``, torch's CPU generator
and one generator per CUDA device. Generators the user creates
(``numpy.random.default_rng()``, ``torch.Generator``, ``random.Random``) are not
covered by any global state, so they are passed by name in ``rngs`` and
captured individually. Restoring validates every source before changing any.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Union

import numpy as np
import torch

from ..errors import StateMismatch, TopologyMismatch

Generator = Union[np.random.Generator, np.random.RandomState, torch.Generator, random.Random]


def check_generator(name: str, rng: object) -> None:
    if not isinstance(rng, (np.random.Generator, np.random.RandomState, torch.Generator, random.Random)):
        raise TypeError(
            f"rngs[{name!r}] is a {type(rng).__qualname__}; pass a numpy.random.Generator, "
            "numpy.random.RandomState, torch.Generator or random.Random")


def _kind(rng: Generator) -> str:
    if isinstance(rng, np.random.Generator):
        return "numpy.Generator"
    if isinstance(rng, np.random.RandomState):
        return "numpy.RandomState"
    if isinstance(rng, torch.Generator):
        return "torch.Generator"
    return "random.Random"


def _capture_one(rng: Generator) -> dict[str, Any]:
    kind = _kind(rng)
    if kind == "numpy.Generator":
        return {"type": kind, "state": rng.bit_generator.state}
    if kind == "numpy.RandomState":
        return {"type": kind, "state": rng.get_state(legacy=False)}
    if kind == "torch.Generator":
        return {"type": kind, "device": str(rng.device), "state": rng.get_state()}
    return {"type": kind, "state": rng.getstate()}


def capture(named: Mapping[str, Generator], *, include_globals: bool = True) -> dict[str, Any]:
    """Snapshot the global sources (unless disabled) and every named generator."""
    out: dict[str, Any] = {"named": {name: _capture_one(rng) for name, rng in named.items()}}
    if include_globals:
        out["python"] = random.getstate()
        out["numpy_global"] = np.random.get_state(legacy=False)
        out["torch_cpu"] = torch.get_rng_state()
        cuda = torch.cuda.is_available()
        out["torch_cuda"] = list(torch.cuda.get_rng_state_all()) if cuda else []
    return out


def restore(saved: Mapping[str, Any], named: Mapping[str, Generator], *, statistical_cuda: bool = False) -> list[str]:
    """Validate ``saved`` against the live generators, then restore them all.

    Returns warnings (for example, CUDA streams skipped under
    ``statistical_cuda``). Raises before touching any generator if a source is
    missing, of another kind, malformed, or the CUDA device count differs.
    """
    warnings = validate(saved, named, statistical_cuda=statistical_cuda)
    apply_validated(saved, named, restore_cuda=not warnings)
    return warnings


def apply_validated(saved: Mapping[str, Any], named: Mapping[str, Generator], *, restore_cuda: bool) -> None:
    """Set every generator from a record that :func:`validate` already accepted."""
    for name, rng in named.items():
        _restore_one(rng, saved["named"][name])
    if "python" in saved:
        random.setstate(saved["python"])
        np.random.set_state(saved["numpy_global"])
        torch.set_rng_state(saved["torch_cpu"])
        if saved["torch_cuda"] and restore_cuda:
            torch.cuda.set_rng_state_all(saved["torch_cuda"])


def _check_cuda(saved: Mapping[str, Any], statistical_cuda: bool) -> list[str]:
    if "torch_cuda" not in saved:
        return []
    count = len(saved["torch_cuda"])
    live = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == live:
        return []
    if not statistical_cuda:
        raise TopologyMismatch(
            f"the checkpoint holds RNG streams for {count} CUDA device(s) but this process sees {live}; "
            "exact continuation needs the same devices. Pass rng_statistical_cuda=True to restore() "
            "to accept a statistical continuation of CUDA randomness.")
    return [f"CUDA RNG streams not restored ({count} saved, {live} present): "
            "CUDA randomness continues statistically, not bitwise"]


def validate(saved: Mapping[str, Any], named: Mapping[str, Generator], *,
             statistical_cuda: bool = False) -> list[str]:
    """Check every saved source against the live ones without changing any; return warnings."""
    saved_named = saved.get("named", {})
    if set(saved_named) != set(named):
        raise StateMismatch(
            f"the checkpoint has RNG sources {sorted(saved_named)} but this run passes rngs={sorted(named)}; "
            "pass the same named generators to TrainState(rngs=...)")
    for name, rng in named.items():
        record = saved_named[name]
        if type(record) is not dict or record.get("type") != _kind(rng):
            raise StateMismatch(f"rngs[{name!r}]: the checkpoint holds a {record.get('type')!r}, "
                                f"this run passes a {_kind(rng)}")
        if record["type"] == "numpy.Generator":
            saved_bits = record["state"].get("bit_generator")
            live_bits = type(rng.bit_generator).__name__
            if saved_bits != live_bits:
                raise StateMismatch(f"rngs[{name!r}]: the checkpoint's bit generator is {saved_bits!r}, "
                                    f"this run's is {live_bits!r}")
        if record["type"] == "torch.Generator" and record.get("device") != str(rng.device):
            raise StateMismatch(f"rngs[{name!r}]: saved on device {record.get('device')!r}, "
                                f"this generator is on {str(rng.device)!r}")
    if "python" in saved and not {"numpy_global", "torch_cpu", "torch_cuda"} <= set(saved):
        raise StateMismatch("the checkpoint's global RNG record is incomplete")
    _dry_run(saved, named)
    return _check_cuda(saved, statistical_cuda)


def _dry_run(saved: Mapping[str, Any], named: Mapping[str, Generator]) -> None:
    """Apply every saved state to a scratch generator, so a malformed one fails
    here, before any live object has been touched."""
    try:
        for name, rng in named.items():
            record = saved["named"][name]
            if record["type"] == "numpy.Generator":
                scratch: Any = np.random.Generator(type(rng.bit_generator)())
            elif record["type"] == "numpy.RandomState":
                scratch = np.random.RandomState()
            elif record["type"] == "torch.Generator":
                scratch = torch.Generator(device=rng.device)
            else:
                scratch = random.Random()
            _restore_one(scratch, record)
        if "python" in saved:
            random.Random().setstate(saved["python"])
            np.random.RandomState().set_state(saved["numpy_global"])
            torch.Generator().set_state(saved["torch_cpu"])
            for state in saved["torch_cuda"]:
                if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
                    raise TypeError("CUDA RNG state must be a uint8 tensor")
    except (TypeError, ValueError, KeyError, RuntimeError, AttributeError) as exc:
        raise StateMismatch(f"the checkpoint's RNG record is malformed: {exc!r:.200}") from None


def _restore_one(rng: Generator, record: dict) -> None:
    kind = record["type"]
    if kind == "numpy.Generator":
        rng.bit_generator.state = record["state"]
    elif kind == "numpy.RandomState":
        rng.set_state(record["state"])
    elif kind == "torch.Generator":
        rng.set_state(record["state"])
    else:
        rng.setstate(record["state"])
