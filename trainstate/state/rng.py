"""Capture and restore every random-number source a training step may draw from.

The global sources are separate streams and each is captured on its own:
Python ``random``, NumPy's legacy global ``RandomState``, torch's CPU generator
and one generator per CUDA device, once this process has initialized CUDA (a
job that never touches the GPU does not create a context to save, and restores
on a machine without one). The CUDA streams are kept by role as well as by
index: the device this process draws on (``torch.cuda.current_device()``, the
one ``torchrun`` gives a rank) is recorded, and a restore puts that stream on
the device the restarted process draws on, whatever its index there (one GPU
visible per task instead of eight, another rank-to-device mapping).
:func:`cuda_plan` is that decision, pure. Generators the user creates
(``numpy.random.default_rng()``, ``torch.Generator``, ``random.Random``) are not
covered by any global state, so they are passed by name in ``rngs`` and
captured individually. Restoring validates every source before changing any.

A NumPy ``Generator`` is more than its bit generator's state: ``spawn()``
derives child streams from the bit generator's ``SeedSequence`` (entropy,
spawn key, pool size, and how many children it has spawned), so that is
captured and restored too (``seed_seq``; None when the generator has no
``SeedSequence``, and the live one's is then left as it is). A record
written before it was captured (no ``seed_seq``) restores the draws exactly
as before and returns a warning: ``spawn()`` may hand out other children
than the uninterrupted run, and a restore that cannot promise that is not
an identical continuation. The next save records it, so the warning does
not repeat.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping
from typing import Any, Union

import numpy as np
import torch

from ..errors import InvalidType, StateMismatch, TopologyMismatch, UnsupportedValue
from ..format.codec import TensorTable, encode

Generator = Union[np.random.Generator, np.random.RandomState, torch.Generator, random.Random]


def check_generator(name: str, rng: object) -> None:
    """Refuse, at construction, a generator that no save could capture."""
    if type(name) is not str:
        raise InvalidType(f"rngs keys name the generators and must be strings, not {name!r}")
    if not isinstance(rng, (np.random.Generator, np.random.RandomState, torch.Generator, random.Random)):
        raise InvalidType(
            f"rngs[{name!r}] is a {type(rng).__qualname__}; pass a numpy.random.Generator, "
            "numpy.random.RandomState, torch.Generator or random.Random")
    if isinstance(rng, random.SystemRandom):
        raise InvalidType(
            f"rngs[{name!r}] is a random.SystemRandom, which draws from the operating system and has no state "
            "to capture: no restart could continue it. Use random.Random(seed) for a stream that resumes, or "
            "keep it out of rngs")
    try:
        encode(_capture_one(rng), f"rngs.{name}", TensorTable())
    except (NotImplementedError, TypeError, ValueError, RuntimeError, AttributeError, UnsupportedValue) as exc:
        raise InvalidType(f"rngs[{name!r}] ({type(rng).__qualname__}): its state cannot be captured ({exc!s:.200}); "
                          "pass a generator whose state can be saved, or keep it out of rngs") from None


def _kind(rng: Generator) -> str:
    if isinstance(rng, np.random.Generator):
        return "numpy.Generator"
    if isinstance(rng, np.random.RandomState):
        return "numpy.RandomState"
    if isinstance(rng, torch.Generator):
        return "torch.Generator"
    return "random.Random"


def _seed_seq(bit_generator: np.random.BitGenerator) -> dict[str, Any] | None:
    """What ``spawn()`` derives children from; None when the generator has no SeedSequence."""
    seq = getattr(bit_generator, "seed_seq", None) or getattr(bit_generator, "_seed_seq", None)
    if not isinstance(seq, np.random.SeedSequence):
        return None
    entropy = seq.entropy
    entropy = int(entropy) if isinstance(entropy, (int, np.integer)) else [int(v) for v in entropy]
    return {"entropy": entropy, "spawn_key": [int(k) for k in seq.spawn_key], "pool_size": int(seq.pool_size),
            "n_children_spawned": int(seq.n_children_spawned)}


def _seed_sequence(record: object) -> np.random.SeedSequence | None:
    """The SeedSequence a record describes; ValueError if it is malformed."""
    if record is None:
        return None

    def count(value: object) -> bool:
        return type(value) is int and value >= 0

    entropy = record.get("entropy") if type(record) is dict else None
    if not (type(record) is dict and set(record) == {"entropy", "spawn_key", "pool_size", "n_children_spawned"}
            and (count(entropy) or (type(entropy) is list and entropy and all(count(v) for v in entropy)))
            and type(record["spawn_key"]) is list and all(count(v) for v in record["spawn_key"])
            and count(record["pool_size"]) and count(record["n_children_spawned"])):
        raise ValueError(f"malformed SeedSequence record {record!r:.120}")
    return np.random.SeedSequence(entropy, spawn_key=tuple(record["spawn_key"]), pool_size=record["pool_size"],
                                  n_children_spawned=record["n_children_spawned"])


@functools.lru_cache(maxsize=None)
def _seed_seq_restorable() -> bool:
    """NumPy 2.0 and later set a bit generator's SeedSequence through ``__setstate__``; 1.x cannot."""
    probe = np.random.PCG64(0)
    try:
        probe.__setstate__((probe.state, np.random.SeedSequence(1)))
    except (TypeError, ValueError, KeyError):
        return False
    return getattr(probe, "_seed_seq", None) is not None and probe._seed_seq.entropy == 1


def _capture_one(rng: Generator) -> dict[str, Any]:
    kind = _kind(rng)
    if kind == "numpy.Generator":
        return {"type": kind, "state": rng.bit_generator.state, "seed_seq": _seed_seq(rng.bit_generator)}
    if kind == "numpy.RandomState":
        return {"type": kind, "state": rng.get_state(legacy=False)}
    if kind == "torch.Generator":
        return {"type": kind, "device": str(rng.device), "state": rng.get_state()}
    return {"type": kind, "state": rng.getstate()}


def _cuda_in_use() -> bool:
    """Whether this process has initialized CUDA: only then has it CUDA streams to save (asking for them
    otherwise would create a context on every visible device)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture(named: Mapping[str, Generator], *, include_globals: bool = True) -> dict[str, Any]:
    """Snapshot the global sources (unless disabled) and every named generator."""
    out: dict[str, Any] = {"named": {name: _capture_one(rng) for name, rng in named.items()}}
    if include_globals:
        out["python"] = random.getstate()
        out["numpy_global"] = np.random.get_state(legacy=False)
        out["torch_cpu"] = torch.get_rng_state()
        cuda = _cuda_in_use()
        out["torch_cuda"] = list(torch.cuda.get_rng_state_all()) if cuda else []
        out["torch_cuda_current"] = torch.cuda.current_device() if cuda else None
    return out


def cuda_plan(saved_count: int, saved_current: int | None, live_count: int, live_current: int | None
              ) -> tuple[dict[int, int], list[str], str | None]:
    """Which saved CUDA stream goes on which live device: ``({live index: saved index}, warnings, refusal)``.

    The stream of the device the saving process drew on (``saved_current``) goes on the device this process
    draws on (``live_current``), whatever their indices; with as many devices on both sides, every other stream
    by its index. A record without the saving process's device (written before it was recorded) maps by index
    only, so it needs the same number of devices. ``refusal`` (a reason) when no exact continuation is possible:
    no CUDA here, or an old record and another device count."""
    if saved_count == 0:
        return {}, [], None
    if live_count == 0 or live_current is None:
        return {}, [], (f"the checkpoint holds RNG streams for {saved_count} CUDA device(s) but this process sees "
                        "none")
    same_count = saved_count == live_count
    if saved_current is None or not 0 <= saved_current < saved_count:
        if same_count:
            return {i: i for i in range(live_count)}, [], None
        return {}, [], (f"the checkpoint holds RNG streams for {saved_count} CUDA device(s), by index only (written "
                        f"before the device each process draws on was recorded), but this process sees {live_count}")
    plan = {i: i for i in range(live_count)} if same_count else {}
    plan[live_current] = saved_current
    warnings = [] if same_count or live_count == 1 else [
        f"this process's CUDA device (cuda:{live_current}) continues the stream of the device the saving process "
        f"drew on (cuda:{saved_current}); the {live_count - 1} other visible device(s) here were not given a saved "
        f"stream ({saved_count} saved): if this process draws on them too, their randomness continues "
        "statistically, not bitwise"]
    return plan, warnings, None


def _live_cuda() -> tuple[int, int | None]:
    """This process's visible CUDA devices and the one it draws on (``(0, None)`` without CUDA)."""
    if not torch.cuda.is_available():
        return 0, None
    return torch.cuda.device_count(), torch.cuda.current_device()


def restore(saved: Mapping[str, Any], named: Mapping[str, Generator], *, statistical_cuda: bool = False,
            restore_globals: bool = True) -> list[str]:
    """Validate ``saved`` against the live generators, then restore them all.

    Returns warnings (for example, CUDA streams skipped under
    ``statistical_cuda``). Raises before touching any generator if a source is
    missing, of another kind, malformed, or the CUDA device count differs.
    With ``restore_globals=False`` the process's global sources are left as
    they are (a TrainState built with ``capture_global_rngs=False``).
    """
    warnings = validate(saved, named, statistical_cuda=statistical_cuda, restore_globals=restore_globals)
    apply_validated(saved, named, restore_globals=restore_globals)
    return warnings


def apply_validated(saved: Mapping[str, Any], named: Mapping[str, Generator], *, restore_cuda: bool = True,
                    restore_globals: bool = True) -> None:
    """Set every generator from a record that :func:`validate` already accepted.

    The CUDA streams are set as :func:`cuda_plan` maps them (validation refused
    what it could not map, unless it was accepted as a statistical continuation).
    """
    for name, rng in named.items():
        _restore_one(rng, saved["named"][name])
    if "python" in saved and restore_globals:
        random.setstate(saved["python"])
        np.random.set_state(saved["numpy_global"])
        torch.set_rng_state(_own(saved["torch_cpu"]))
        if saved["torch_cuda"] and restore_cuda:
            plan, _, refusal = cuda_plan(len(saved["torch_cuda"]), saved.get("torch_cuda_current"), *_live_cuda())
            if refusal is None:
                for live, index in plan.items():
                    torch.cuda.set_rng_state(_own(saved["torch_cuda"][index]), live)


def _check_cuda(saved: Mapping[str, Any], statistical_cuda: bool) -> list[str]:
    if "torch_cuda" not in saved:
        return []
    count, current = len(saved["torch_cuda"]), saved.get("torch_cuda_current")
    if not count:  # (asking for this process's device would initialize CUDA: a CPU job stays off the GPU)
        return []
    if current is not None and (type(current) is not int or not 0 <= current < count):
        raise StateMismatch(f"the checkpoint's RNG record names CUDA device {current!r} of {count}")
    _, warnings, refusal = cuda_plan(count, current, *_live_cuda())
    if refusal is None:
        return warnings
    if not statistical_cuda:
        raise TopologyMismatch(
            f"{refusal}; exact continuation needs that stream on this process's device. Pass "
            "rng_statistical_cuda=True to restore() to accept a statistical continuation of CUDA randomness.")
    return [f"CUDA RNG streams not restored ({refusal}): CUDA randomness continues statistically, not bitwise"]


def _check_globals(saved: Mapping[str, Any], restore_globals: bool) -> list[str]:
    """A difference in ``capture_global_rngs`` between the saving and the restoring run."""
    if "python" not in saved and restore_globals:
        return ["the global RNG streams (Python random, NumPy global, torch CPU and CUDA) were not saved (the "
                "saving run had capture_global_rngs=False), so they were not restored: they continue from this "
                "process's state. Save with capture_global_rngs=True for an exact continuation"]
    if "python" in saved and not restore_globals:
        return ["the checkpoint holds the global RNG streams, but this TrainState has capture_global_rngs=False: "
                "they were left as they are in this process, not restored"]
    return []


def _check_seed_seqs(saved_named: Mapping[str, Any], named: Mapping[str, Generator]) -> list[str]:
    warnings = []
    for name, rng in named.items():
        record = saved_named[name]
        if record["type"] != "numpy.Generator":
            continue
        if "seed_seq" not in record:
            warnings.append(f"rngs[{name!r}]: the checkpoint predates SeedSequence capture; its draws continue "
                            "exactly, but Generator.spawn() may hand out other child streams than the "
                            "uninterrupted run. The next save records it")
        elif not _seed_seq_restorable() and record["seed_seq"] != _seed_seq(rng.bit_generator):
            warnings.append(f"rngs[{name!r}]: this NumPy ({np.__version__}) cannot restore a Generator's "
                            "SeedSequence (NumPy 2.0 can); its draws continue exactly, but Generator.spawn() "
                            "may hand out other child streams than the uninterrupted run")
    return warnings


def validate(saved: Mapping[str, Any], named: Mapping[str, Generator], *,
             statistical_cuda: bool = False, restore_globals: bool = True) -> list[str]:
    """Check every saved source against the live ones without changing any; return warnings."""
    saved_named = saved.get("named", {})
    if set(saved_named) != set(named):
        raise StateMismatch(
            f"the checkpoint has RNG sources {sorted(saved_named)} but this run passes rngs={sorted(named)}; "
            "pass the same named generators to TrainState(rngs=...)")
    for name, rng in named.items():
        record = saved_named[name]
        if type(record) is not dict or record.get("type") != _kind(rng):
            got = record.get("type") if type(record) is dict else type(record).__name__
            raise StateMismatch(f"rngs[{name!r}]: the checkpoint holds a {got!r}, this run passes a {_kind(rng)}")
        if record["type"] == "numpy.Generator":
            saved_bits = record["state"].get("bit_generator") if type(record.get("state")) is dict else None
            live_bits = type(rng.bit_generator).__name__
            if saved_bits != live_bits:
                raise StateMismatch(f"rngs[{name!r}]: the checkpoint's bit generator is {saved_bits!r}, "
                                    f"this run's is {live_bits!r}")
        if record["type"] == "torch.Generator" and _device_type(record.get("device")) != rng.device.type:
            # (a CUDA generator's state is its seed and offset: the same on any index, so only the type counts)
            raise StateMismatch(f"rngs[{name!r}]: saved on device {record.get('device')!r}, "
                                f"this generator is on {str(rng.device)!r}")
    if "python" in saved and not {"numpy_global", "torch_cpu", "torch_cuda"} <= set(saved):
        raise StateMismatch("the checkpoint's global RNG record is incomplete")
    _dry_run(saved, named)
    warnings = _check_cuda(saved, statistical_cuda) if restore_globals else []
    return warnings + _check_globals(saved, restore_globals) + _check_seed_seqs(saved_named, named)


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
            torch.Generator().set_state(_own(saved["torch_cpu"]))
            for state in saved["torch_cuda"]:
                if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
                    raise TypeError("CUDA RNG state must be a uint8 tensor")
    except (TypeError, ValueError, KeyError, RuntimeError, AttributeError) as exc:
        raise StateMismatch(f"the checkpoint's RNG record is malformed: {exc!r:.200}") from None


def _restore_one(rng: Generator, record: dict) -> None:
    kind = record["type"]
    if kind == "numpy.Generator":
        seq = _seed_sequence(record.get("seed_seq"))
        if seq is not None and _seed_seq_restorable():
            # one call sets both: the state and the SeedSequence spawn() continues from
            rng.bit_generator.__setstate__((record["state"], seq))
        else:  # an older record, a saved generator without a SeedSequence, or NumPy 1.x: the draws only
            rng.bit_generator.state = record["state"]
    elif kind == "numpy.RandomState":
        rng.set_state(record["state"])
    elif kind == "torch.Generator":
        rng.set_state(_own(record["state"]))
    else:
        rng.setstate(record["state"])


def keep_dtensor_streams(modules: Mapping[str, Any]) -> bool:
    """After the CUDA streams were restored: create DTensor's RNG tracker now, without its state sync, if a module
    holds DTensors on a CUDA-like mesh and no tracker exists yet. torch creates it lazily at the first DTensor
    random op (tensor-parallel dropout) with ``run_state_sync=True``, which broadcasts rank 0's stream onto every
    rank: after a restore that would overwrite what each rank restored (the uninterrupted run synced once, at its
    start, and each rank's stream went its own way since). Returns whether it created one."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor import _random as dtensor_random
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    if getattr(dtensor_random, "_rng_tracker", None) is not None or not hasattr(dtensor_random, "OffsetBasedRNGTracker"):
        return False
    for module in modules.values():
        for param in module.parameters():
            if isinstance(param, DTensor) and param.device_mesh.device_type != "cpu":
                dtensor_random._rng_tracker = dtensor_random.OffsetBasedRNGTracker(param.device_mesh,
                                                                                    run_state_sync=False)
                return True
    return False


def _device_type(name: object) -> str | None:
    try:
        return torch.device(name).type if type(name) is str else None
    except (RuntimeError, ValueError):
        return None


def _own(state: torch.Tensor) -> torch.Tensor:
    """``state`` on the CPU with a storage of its own: torch's ``set_state`` takes a CPU byte tensor (Lightning's
    ``map_location="cuda"`` moves the callback's RNG states to the GPU) and reads its storage from its start, so a
    view into a larger buffer (a heal's received body) would hand it the wrong bytes."""
    if isinstance(state, torch.Tensor) and state.device.type != "cpu":
        state = state.cpu()
    return state if state.storage_offset() == 0 and state.is_contiguous() else state.clone()
