"""Bitwise comparison of the reference and the interrupted run's final states,
and (with a loader) of the sample ids each update consumed."""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
import numpy as np
import torch
from ..storage.local import LocalStore
from ..format.manifest import POINTER, parse_pointer
from ..storage.verify import load_verified
from .worker import DRAWS_FILE, IDS_LOG, DrillConfig, DrillError, build_model


# parent: comparison ------------------------------------------------------------
@dataclass
class Comparison:
    """The outcome of comparing two finished runs; equal only if every compared value is bitwise equal."""

    differences: list[str]
    compared: dict[str, str]  # part -> what was compared in it, for reports
    values: int  # leaves compared (tensors, numbers, strings)
    elements: int  # tensor elements compared
    ids: ConsumedIds | None = None  # the interrupted run's consumed ids, when the runs had a loader

    @property
    def equal(self) -> bool:
        return not self.differences


@dataclass
class ConsumedIds:
    """What a run's ``consumed_ids.log`` says each update trained on, after resolving resumes.

    The log is read in order. ``<update> <ids...> <crc>`` sets the entry for
    that update (a later one for the same update, written by a start that
    redid it, replaces it). ``resume <n> <crc>`` ends the entries past ``n``:
    they came from a start that was killed before any checkpoint kept them.
    What is left is the work of the starts whose state survived, the last
    one ending the run. Lines whose checksum fails (cut by a kill) are
    counted and ignored.
    """

    updates: dict[int, list[int]] = field(default_factory=dict)
    lines: int = 0
    torn: int = 0
    resumes: int = 0
    superseded: int = 0  # entries replaced by a later one for the same update, or ended by a resume


def read_consumed_ids(path: Path) -> ConsumedIds:
    out = ConsumedIds()
    for raw in path.read_bytes().split(b"\n"):
        if not raw:
            continue
        out.lines += 1
        text, _, crc = raw.rpartition(b" ")
        try:
            valid = len(crc) == 8 and zlib.crc32(text) == int(crc, 16)
            fields = [int(w) for w in text.split()[1:]]
        except ValueError:
            valid = False
        if not valid or not text:
            out.torn += 1
            continue
        head = text.split()[0]
        if head == b"resume":
            out.resumes += 1
            dropped = [u for u in out.updates if u > fields[0]]
            for u in dropped:
                del out.updates[u]
            out.superseded += len(dropped)
        else:
            update = int(head)
            out.superseded += update in out.updates
            out.updates[update] = fields
    return out


def compare_consumed(ref: ConsumedIds, got: ConsumedIds, total: int, limit: int = 10) -> list[str]:
    """Differences between the consumed ids of each update 1..total (and none after), reference first."""
    expected = set(range(1, total + 1))
    problems = []
    if set(ref.updates) != expected:
        problems.append(f"consumed ids: the reference log covers updates {_spans(set(ref.updates))}, not 1-{total}")
    missing, extra = sorted(expected - set(got.updates)), sorted(set(got.updates) - expected)
    if missing:
        problems.append(f"consumed ids: no entry for updates {_spans(set(missing))}")
    if extra:
        problems.append(f"consumed ids: entries for updates {_spans(set(extra))} beyond the run")
    differ = [u for u in sorted(expected & set(got.updates) & set(ref.updates)) if got.updates[u] != ref.updates[u]]
    for u in differ[:limit]:
        a, b = ref.updates[u], got.updates[u]
        problems.append(f"consumed ids: update {u} trained on {len(b)} samples {b[:6]}..., the reference on "
                        f"{len(a)} samples {a[:6]}...")
    if len(differ) > limit:
        problems.append(f"consumed ids: ... {len(differ) - limit} more updates differ (updates {_spans(set(differ))})")
    return problems


def _spans(values: set[int]) -> str:
    if not values:
        return "(none)"
    out, ordered = [], sorted(values)
    start = prev = ordered[0]
    for v in ordered[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(out)


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
    compared = describe_compared(cfg, ref.payload, ref.draws, ref.files)
    ids = None
    logs = [reference / IDS_LOG, candidate / IDS_LOG]
    if any(log.exists() for log in logs):
        missing = [str(log) for log in logs if not log.exists()]
        if missing:
            differences.append(f"consumed ids: {', '.join(missing)} is missing")
        else:
            ref_ids, ids = read_consumed_ids(logs[0]), read_consumed_ids(logs[1])
            differences += compare_consumed(ref_ids, ids, cfg.total)
            compared["consumed ids"] = (
                f"updates 1-{cfg.total}, {sum(map(len, ref_ids.updates.values()))} sample ids; the interrupted "
                f"log: {ids.lines} lines, {ids.resumes} starts, {ids.superseded} entries redone, {ids.torn} torn")
    return Comparison(differences, compared, counts[0], counts[1], ids)


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
    elif isinstance(a, dict):  # a module's state is an OrderedDict
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
    described = {
        "model": f"{len(comps['model']) - len(buffers)} parameters, {len(buffers)} buffers ({', '.join(buffers)})",
        "optimizer": f"{', '.join(moments)} for {len(comps['optimizer']['state'])} parameters; param_groups",
        "scheduler": ", ".join(comps["scheduler"]),
        "scaler": ", ".join(f"{k}={v}" for k, v in comps["scaler"].items()),
        "rng state": ", ".join(streams),
        "clocks": f"{payload['clocks']}, counters {payload['counters']}, facts {payload['facts']}",
        "next draws": f"{', '.join(draws['draws'])}; a probe update (loss, state digest)",
        "files": f"{', '.join(files)}: sizes and digests",
    }
    if "loader" in comps:
        position = comps["loader"]
        described["loader"] = (f"position epoch {position['epoch']} batch {position['cursor']}, "
                               f"{position['samples_seen']} samples seen, the next batch's ids digest, the plan"
                               + ("; the ids of the probe's batch" if "loader" in draws else ""))
    return described

