"""Where a trainstate save spends its time, and what the publication steps would cost rearranged.

Part 1 times the stages of ``CheckpointManager.save`` by wrapping library
functions at run time (the library itself is not modified): state capture,
header planning, hashing on the write path, ``os.write``, the file fsync and
the read-back that runs beside it, the commit (directory fsyncs and rename),
post-commit verification, the pointer write and pruning.

Part 2 does the same for a warm-cache restore (verify, read, apply).

Part 3 runs prototypes of the write path on the same bytes, interleaved with
a raw write, to size the suggested changes:

- ``raw``: write, fsync file, fsync directory (the floor bench_save.py uses).
- ``hash-then-write``: trainstate's order up to 63a4381: hash each chunk, then
  write it; fsync, with the file re-read and hashed beside the fsync.
- ``hash-beside-write``: trainstate's order from 8170f9f: a worker thread hashes
  each chunk while the main thread writes it; then fsync beside the re-read + hash.
- ``hash-in-fsync``: write first, then hash the source memory and re-read the
  file (two threads) while the fsync runs.
- ``source-hash-in-fsync``: write first, then hash only the source memory while the fsync runs.
- ``hash-in-fsync+kick``: ``hash-in-fsync`` with ``sync_file_range(SYNC_FILE_RANGE_WRITE)``
  after each chunk, so the device starts writing while Python is still writing.
- ``raw+kick``: the floor with the same kick.

Usage::

    python benchmarks/profile_save.py [--size-gib 1.0] [--saves 3] [--dir PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import stat
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import blake3  # noqa: E402

import trainstate as ts  # noqa: E402
from bench_save import CHUNK, build, byte_views, fsync_dir, remove, settle  # noqa: E402
from trainstate import publish, restore  # noqa: E402
from trainstate.format import digest, tensorfile  # noqa: E402
from trainstate.storage import local as localfs, posix, verify  # noqa: E402
from trainstate.state import snapshot  # noqa: E402

SYNC_FILE_RANGE_WRITE = 2
_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


# part 1: instrumentation -----------------------------------------------------
class Clock:
    """Seconds per label for the current save; wrapped functions add to it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start

        setattr(owner, name, timed)


class TimedHasher:
    def __init__(self, inner: digest.Hasher, clock: Clock) -> None:
        self._inner, self._clock = inner, clock

    def update(self, data) -> None:
        start = time.perf_counter()
        self._inner.update(data)
        self._clock.seconds["write path: hash (all update() calls, any thread)"] += time.perf_counter() - start

    def hexdigest(self) -> str:
        return self._inner.hexdigest()


def instrument() -> tuple[Clock, list[str]]:
    """Wrap the library's stages; returns the clock and the hooks this version of the library lacks."""
    clock = Clock()
    missing = []
    hooks = [
        (snapshot, "capture", "capture (state_dict walk)"),
        (tensorfile, "plan", "plan header"),
        (localfs, "_hash_while_writing", "write + hash beside it, wall"),
        (localfs, "_write_all", "write path: os.write"),
        (posix, "_write_all", "write path: os.write"),
        (localfs, "digest_stream", "read-back: re-read + hash (beside fsync)"),
        (localfs.LocalStaging, "_sync_and_read_back", "fsync || read-back, wall"),
        (localfs.LocalStaging, "commit", "commit: fsync staging dir, rename, fsync run dir"),
        (verify, "digest_stream", "verify: re-read + hash (post-commit / old restore)"),
        (publish, "verify_generation", "verify_generation, wall (post-commit)"),
        (restore, "decode_verified", "restore: decode_verified (one read, digest beside it), wall"),
        (tensorfile, "read_tensor", "restore: read_tensor (readinto fresh tensors)"),
        (snapshot, "check_components", "restore: check_components"),
        (snapshot, "apply", "restore: apply (load_state_dict copies)"),
        (localfs.LocalStore, "write_pointer", "pointer write"),
        (publish.Publisher, "prune", "prune"),
    ]
    ops = getattr(localfs, "PosixOps", None)
    if ops is not None:  # newer library: every fsync goes through PosixOps
        hooks += [(ops, "fsync", "fsync file (thread)"), (ops, "fsync_dir", "fsync directory (commit + pointer)")]
    else:
        localfs.os = FsyncShim(clock)
    for owner, name, label in hooks:
        if hasattr(owner, name):
            clock.wrap(owner, name, label)
        else:
            missing.append(f"{getattr(owner, '__name__', owner)}.{name}")
    real_new_hasher = localfs.new_hasher
    localfs.new_hasher = lambda algorithm: TimedHasher(real_new_hasher(algorithm), clock)
    return clock, missing


class FsyncShim:
    """Stands in for the ``os`` module inside an older trainstate.storage.local, timing fsync by what it syncs."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock

    def __getattr__(self, name: str):
        return getattr(os, name)

    def fsync(self, fd: int) -> None:
        label = "fsync directory (commit + pointer)" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file (thread)"
        start = time.perf_counter()
        try:
            os.fsync(fd)
        finally:
            self._clock.seconds[label] += time.perf_counter() - start


def profile_saves(bench, root: Path, saves: int, clock: Clock) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {"full": defaultdict(list), "fast": defaultdict(list)}
    for i in range(saves):
        for mode in ("full", "fast") if i % 2 == 0 else ("fast", "full"):
            run = root / f"ts-{mode}"
            settle()
            clock.seconds.clear()
            bench.state.next_update += 1
            start = time.perf_counter()
            with ts.CheckpointManager(run, keep_last=1, verify=mode) as ckpt:
                ckpt.save(bench.state)
            total = time.perf_counter() - start
            for label, seconds in clock.seconds.items():
                out[mode][label].append(seconds)
            out[mode]["TOTAL save"].append(total)
            print(f"  profiled save verify={mode}: {total:.2f} s", flush=True)
            remove(run)
    return out


def profile_restores(bench, root: Path, restores: int, clock: Clock) -> dict[str, list[float]]:
    """Warm-cache restores of one generation into the live state."""
    run = root / "ts-restore"
    with ts.CheckpointManager(run, keep_last=1) as ckpt:
        bench.state.next_update += 1
        ckpt.save(bench.state)
    out: dict[str, list[float]] = defaultdict(list)
    for _ in range(restores):
        clock.seconds.clear()
        start = time.perf_counter()
        with ts.CheckpointManager(run, keep_last=1) as ckpt:
            ckpt.restore(bench.state)
        total = time.perf_counter() - start
        for label, seconds in clock.seconds.items():
            out[label].append(seconds)
        out["TOTAL restore"].append(total)
        print(f"  profiled restore (warm): {total:.2f} s", flush=True)
    remove(run)
    return out


# part 3: write-path prototypes -----------------------------------------------
PHASES: dict[str, float] = {}  # phase -> seconds, for the prototype being run


def _mark(phase: str, since: float) -> float:
    now = time.perf_counter()
    PHASES[phase] = now - since
    return now


def _write(fd: int, views: list[memoryview], hasher=None, kick: bool = False) -> None:
    began = time.perf_counter()
    offset = 0
    for view in views:
        for start in range(0, len(view), CHUNK):
            chunk = view[start:start + CHUNK]
            if hasher is not None:
                hasher.update(chunk)
            n = len(chunk)
            while chunk:
                chunk = chunk[os.write(fd, chunk):]
            if kick:
                _libc.sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)
            offset += n
    _mark("write (incl. inline hash if any)", began)


def _hash_views(views: list[memoryview]) -> str:
    h = blake3.blake3()
    for view in views:
        for start in range(0, len(view), CHUNK):
            h.update(view[start:start + CHUNK])
    return h.hexdigest()


def _hash_file(path: Path) -> str:
    with open(path, "rb", buffering=0) as f:
        return digest.digest_stream(f, "blake3")[1]


def _in_thread(fn: Callable[[], object], phase: str | None = None) -> threading.Thread:
    def run() -> None:
        start = time.perf_counter()
        fn()
        if phase:
            _mark(phase, start)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def proto_raw(views, path: Path, kick: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write(fd, views, kick=kick)
        start = time.perf_counter()
        os.fsync(fd)
        _mark("fsync", start)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def proto_hash_then_write(views, path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write(fd, views, hasher=blake3.blake3())
        syncer = _in_thread(lambda: os.fsync(fd), "fsync")
        start = time.perf_counter()
        _hash_file(path)
        _mark("read-back hash", start)
        syncer.join()
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def proto_hash_beside_write(views, path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        hasher = blake3.blake3()
        with ThreadPoolExecutor(max_workers=1) as pool:
            began = time.perf_counter()
            pending = []
            for view in views:
                for start in range(0, len(view), CHUNK):
                    chunk = view[start:start + CHUNK]
                    pending.append(pool.submit(hasher.update, chunk))
                    while chunk:
                        chunk = chunk[os.write(fd, chunk):]
            for future in pending:
                future.result()
            _mark("write + hash beside it", began)
        syncer = _in_thread(lambda: os.fsync(fd), "fsync")
        start = time.perf_counter()
        _hash_file(path)
        _mark("read-back hash", start)
        syncer.join()
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def proto_hash_during_fsync(views, path: Path, kick: bool = False, read_back: bool = True) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write(fd, views, kick=kick)
        syncer = _in_thread(lambda: os.fsync(fd), "fsync")
        source = _in_thread(lambda: _hash_views(views), "source hash")
        if read_back:
            start = time.perf_counter()
            _hash_file(path)
            _mark("read-back hash", start)
        source.join()
        syncer.join()
    finally:
        os.close(fd)
    fsync_dir(path.parent)


PROTOTYPES: dict[str, Callable[[list[memoryview], Path], None]] = {
    "raw": proto_raw,
    "hash-then-write": proto_hash_then_write,
    "hash-beside-write": proto_hash_beside_write,
    "hash-in-fsync": proto_hash_during_fsync,
    "source-hash-in-fsync": lambda v, p: proto_hash_during_fsync(v, p, read_back=False),
    "hash-in-fsync+kick": lambda v, p: proto_hash_during_fsync(v, p, kick=True),
    "raw+kick": lambda v, p: proto_raw(v, p, kick=True),
}


def prototype_rounds(bench, root: Path, rounds: int, names: list[str]) -> dict[str, list[float]]:
    views = byte_views(bench.tensors())
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            path = root / "proto.bin"
            settle()
            PHASES.clear()
            start = time.perf_counter()
            PROTOTYPES[name](views, path)
            times[name].append(time.perf_counter() - start)
            phases = ", ".join(f"{k} {v:.2f}" for k, v in PHASES.items())
            print(f"  prototype round {r} {name:44s} {times[name][-1]:6.2f} s  ({phases})", flush=True)
            remove(path)
    return times


def hash_rates(bench) -> dict[str, float]:
    """GB/s of blake3 over the state's memory, one thread and two threads at once."""
    views = byte_views(bench.tensors())
    nbytes = sum(len(v) for v in views)
    start = time.perf_counter()
    _hash_views(views)
    one = nbytes / 1e9 / (time.perf_counter() - start)
    start = time.perf_counter()
    threads = [_in_thread(lambda: _hash_views(views)) for _ in range(2)]
    for t in threads:
        t.join()
    two = 2 * nbytes / 1e9 / (time.perf_counter() - start)
    return {"blake3, 1 thread": one, "blake3, 2 threads together (GIL released?)": two}


# main ------------------------------------------------------------------------
def breakdown_table(profile: dict[str, dict[str, list[float]]]) -> str:
    labels = list(dict.fromkeys(label for mode in profile.values() for label in mode))
    rows = ["| stage (median seconds per save) | verify=full | verify=fast |", "|---|---:|---:|"]
    for label in labels:
        cells = [f"{statistics.median(profile[m][label]):.2f}" if profile[m].get(label) else "-"
                 for m in ("full", "fast")]
        rows.append(f"| {label} | {cells[0]} | {cells[1]} |")
    return "\n".join(rows)


def restore_table(profile: dict[str, list[float]]) -> str:
    rows = ["| restore stage (median seconds, warm cache) | seconds |", "|---|---:|"]
    rows += [f"| {label} | {statistics.median(v):.2f} |" for label, v in profile.items()]
    return "\n".join(rows)


def prototype_table(times: dict[str, list[float]], nbytes: int) -> str:
    raw = times["raw"]
    rows = ["| write path prototype | median s | GB/s | x raw (per-round median) |", "|---|---:|---:|---:|"]
    for name, samples in times.items():
        med = statistics.median(samples)
        paired = statistics.median(a / b for a, b in zip(raw, samples))
        rows.append(f"| {name} | {med:.2f} | {nbytes / 1e9 / med:.2f} | {paired:.2f} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--saves", type=int, default=3, help="profiled saves per verify mode")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the write-path prototypes")
    p.add_argument("--dir")
    p.add_argument("--parts", default="save,restore,prototypes", help="comma-separated subset to run")
    p.add_argument("--prototypes", default=",".join(PROTOTYPES), help="comma-separated prototype names")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    names = [n for n in args.prototypes.split(",") if n]
    unknown = [n for n in names if n not in PROTOTYPES]
    if unknown or "raw" not in names:
        raise SystemExit(f"prototypes must include raw and come from: {', '.join(PROTOTYPES)} (got {unknown})")
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="trainstate-profile-", dir=base))
    try:
        bench = build(args.size_gib, args.hidden)
        nbytes = bench.nbytes()
        print(f"# state {nbytes / 2**30:.3f} GiB, dir {root}", flush=True)
        rates = hash_rates(bench)
        clock, missing = instrument()
        if missing:
            print(f"# hooks absent in this trainstate version (not timed): {', '.join(missing)}", flush=True)
        profile = profile_saves(bench, root, args.saves, clock) if "save" in parts else None
        restores = profile_restores(bench, root, args.saves, clock) if "restore" in parts else None
        protos = prototype_rounds(bench, root, args.rounds, names) if "prototypes" in parts else None
        print("\n" + "\n".join(f"- {k}: {v:.2f} GB/s" for k, v in rates.items()))
        if profile:
            print("\n" + breakdown_table(profile))
        if restores:
            print("\n" + restore_table(restores))
        if protos:
            print("\n" + prototype_table(protos, nbytes))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
