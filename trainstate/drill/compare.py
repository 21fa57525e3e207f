"""Bitwise comparison of the reference and the interrupted run's final states."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any
import numpy as np
import torch
from ..localfs import LocalStore
from ..manifest import POINTER, parse_pointer
from ..verify import load_verified
from .worker import DRAWS_FILE, DrillConfig, DrillError, build_model


# parent: comparison ------------------------------------------------------------
@dataclass
class Comparison:
    """The outcome of comparing two finished runs; equal only if every compared value is bitwise equal."""

    differences: list[str]
    compared: dict[str, str]  # part -> what was compared in it, for reports
    values: int  # leaves compared (tensors, numbers, strings)
    elements: int  # tensor elements compared

    @property
    def equal(self) -> bool:
        return not self.differences


@dataclass
class _Final:
    files: dict[str, tuple[int, str]]
    payload: dict[str, Any]
    draws: dict[str, Any]


def _final(directory: Path) -> _Final:
    store = LocalStore(directory, create=False)
    data = store.read_pointer(POINTER)
    if data is None:
        raise DrillError(f"{directory} has no {POINTER} pointer: the run did not finish")
    pointer = parse_pointer(data, POINTER)
    verified, payload = load_verified(store, pointer.generation, pointer)  # one verified read
    draws = json.loads((directory / DRAWS_FILE).read_text())
    return _Final({f.name: (f.size, f.digest) for f in verified.manifest.files}, payload, draws)


def compare_runs(cfg: DrillConfig, reference: Path, candidate: Path) -> Comparison:
    """Compare the final generations and next draws of two finished runs, bitwise."""
    ref, got = _final(reference), _final(candidate)
    differences: list[str] = []
    counts = [0, 0]
    compare_values(ref.payload, got.payload, "state", differences, counts)
    compare_values(ref.draws, got.draws, DRAWS_FILE, differences, counts)
    if ref.files != got.files:
        differences.append(f"generation files differ: {ref.files} vs {got.files}")
    return Comparison(differences, describe_compared(cfg, ref.payload, ref.draws, ref.files), counts[0], counts[1])


def compare_values(a: Any, b: Any, path: str, out: list[str], counts: list[int]) -> None:
    """Append to ``out`` every place where ``b`` is not bitwise ``a`` (same types, dtypes, shapes, bits).

    Bits, not ``==``: -0.0 equals 0.0 and NaN never equals itself, but a
    faithful resume reproduces both exactly.
    """
    if type(a) is not type(b):
        out.append(f"{path}: {type(a).__name__} vs {type(b).__name__}")
    elif isinstance(a, (torch.Tensor, np.ndarray)):
        counts[0] += 1
        ta, tb = torch.as_tensor(a), torch.as_tensor(b)
        counts[1] += ta.numel()
        if ta.dtype != tb.dtype or ta.shape != tb.shape:
            out.append(f"{path}: {ta.dtype} {tuple(ta.shape)} vs {tb.dtype} {tuple(tb.shape)}")
        elif not torch.equal(_bits(ta), _bits(tb)):
            differ = (_bits(ta) != _bits(tb)).reshape(ta.numel(), -1).any(dim=1).sum().item()
            out.append(f"{path}: {differ} of {ta.numel()} elements differ")
    elif type(a) is dict:
        if list(a) != list(b):
            out.append(f"{path}: keys {list(a)!r:.200} vs {list(b)!r:.200}")
        for key in a.keys() & b.keys():
            compare_values(a[key], b[key], f"{path}.{key}", out, counts)
    elif type(a) in (list, tuple):
        if len(a) != len(b):
            out.append(f"{path}: length {len(a)} vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            compare_values(x, y, f"{path}[{i}]", out, counts)
    else:
        counts[0] += 1
        same = struct.pack("<d", a) == struct.pack("<d", b) if type(a) is float else (
            a.tobytes() == b.tobytes() and a.dtype == b.dtype if isinstance(a, np.generic) else a == b)
        if not same:
            out.append(f"{path}: {a!r:.80} vs {b!r:.80}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(t.numel(), 1).view(torch.uint8)


def describe_compared(cfg: DrillConfig, payload: dict[str, Any], draws: dict[str, Any],
                      files: dict[str, Any]) -> dict[str, str]:
    """What a comparison covered, part by part, in words."""
    comps = {name: c["state"] for name, c in payload["components"].items()}
    params = {name for name, _ in build_model(cfg).named_parameters()}
    buffers = [k for k in comps["model"] if k not in params]
    moments = sorted({k for s in comps["optimizer"]["state"].values() for k in s})
    rng = payload["rng"]
    streams = [k for k in ("python", "numpy_global", "torch_cpu") if k in rng]
    streams += [f"{n} ({r['type']})" for n, r in rng["named"].items()]
    return {
        "model": f"{len(comps['model']) - len(buffers)} parameters, {len(buffers)} buffers ({', '.join(buffers)})",
        "optimizer": f"{', '.join(moments)} for {len(comps['optimizer']['state'])} parameters; param_groups",
        "scheduler": ", ".join(comps["scheduler"]),
        "scaler": ", ".join(f"{k}={v}" for k, v in comps["scaler"].items()),
        "rng state": ", ".join(streams),
        "clocks": f"{payload['clocks']}, counters {payload['counters']}, facts {payload['facts']}",
        "next draws": f"{', '.join(draws['draws'])}; a probe update (loss, state digest)",
        "files": f"{', '.join(files)}: sizes and digests",
    }

