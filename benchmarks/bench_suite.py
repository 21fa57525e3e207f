"""One command for the save/restore benchmark suite: sync save, async stall, step interference, restore, memory.

For each size in ``--sizes`` it builds a model + AdamW state (a stack of square
``nn.Linear`` layers, AdamW stepped once so ``exp_avg``/``exp_avg_sq`` exist;
parameters are about a third of the tensor bytes) and runs the selected parts.
Within every part, repetition ``r`` runs each method once, in an order rotated by
``r``, so drift in load or disk speed lands on every method alike.

Parts (``--only save,async,step,restore,rss``; all by default):

``save``     Synchronous, durable save. ``trainstate``: ``CheckpointManager(fresh dir,
             keep_last=1).save(state)``. ``raw`` (the baseline): ``os.write`` of the same
             tensor bytes in 64 MiB chunks straight from the tensors' own (preallocated)
             memory, fsync of the file and of its directory. ``torch.save`` + fsync;
             ``safetensors.save_file`` of the flat dict (model params + optimizer moments)
             + fsync; ``dcp``: ``torch.distributed.checkpoint.save(sd,
             storage_writer=FileSystemWriter(path, sync_files=True), no_dist=True)`` + fsync
             of the directories (DCP fsyncs files, not directory entries). Every method also
             fsyncs the parent directory. Ratios are raw_time / method_time (>1: faster than raw).
``async``    How long ``save(state, blocking=False)`` blocks the caller (the stall), against a
             synchronous ``save`` in the same repetition. Each rep makes two async saves with one
             fresh manager (the first allocates the staging buffers; the second reuses them: the
             steady state) and two sync saves with another; each second save lands beside the
             first and prunes it (keep_last=1), as in a long run, so "steady" compares like with
             like. Also records stall + background (until ``wait()`` returns).
             (The ``save`` part writes every save into a fresh directory: no pruning there.)
``step``     A fixed CPU training step on a separate small MLP (``--step-*``), timed
             repeatedly with no background write, during the background part of a trainstate
             async save, and during a raw write+fsync running in a Python thread; once per
             ``torch.set_num_threads`` value in ``--step-threads``. Only steps that start and
             end while the write is running count.
``restore``  Into the live model and optimizer: ``trainstate`` (``CheckpointManager.restore``),
             ``raw`` (``readinto`` the live tensors' memory, 64 MiB at a time: the baseline),
             ``torch.load(weights_only=True)`` + ``load_state_dict``, ``safetensors``
             (``load_file`` + ``copy_``) and ``dcp.load`` (in place) + ``optimizer.load_state_dict``.
             Warm (files read once just before) and, when ``/proc/sys/vm/drop_caches`` works,
             cold (``sync; echo 3 > drop_caches`` before each run).
``rss``      Peak resident memory above the live state during each save method, an async
             save (its stall, then stall + background) and each restore. The kernel's
             high-water mark (``VmHWM``) is reset before each operation
             (``echo 5 > /proc/self/clear_refs``), so the peak is exact, not sampled; a 5 ms
             sampler splits it into anonymous and file-mapped pages. In-process by default
             (after ``gc.collect()`` and ``malloc_trim``); ``--rss-child`` runs each
             measurement in a fresh interpreter instead (slower: each child imports torch and
             rebuilds the state).

Usage::

    python benchmarks/bench_suite.py --sizes 256M,1G,4G --reps 5 --out results.json
    python benchmarks/bench_suite.py --sizes 64M --reps 2            # smoke test, ~1 minute
    python benchmarks/bench_suite.py --sizes 1G --torch-threads 1 --only async,step
    python benchmarks/bench_suite.py --sizes 1G --only save,restore

Sizes are binary (``256M`` = 256 MiB of tensor bytes); GB/s figures use 10^9 bytes.
Sizes that do not fit the free disk (about 6.6x the size with restore/rss, 2.2x without) or
memory (3x the size + 1 GiB of MemAvailable) are refused: skipped with a message.
At most two copies of the state are held at once (live + async staging buffers, or live + a
decoded checkpoint from torch.load); building it briefly adds gradients (+1/3 of it).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import blake3
import numpy as np
import safetensors
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

import trainstate as ts

CHUNK = 64 << 20
DIGEST_CHUNK = 4 << 20
GB = 1e9
MiB = 1 << 20
PARTS = ("save", "async", "step", "restore", "rss")
SAVE_METHODS = ("trainstate", "raw", "torch.save", "safetensors", "dcp")
RESTORE_METHODS = ("trainstate", "trainstate-v2", "raw", "digest", "digest+copy", "torch.load", "safetensors", "dcp")
RESTORE_SOURCE = {"trainstate": "trainstate", "trainstate-v2": "trainstate-v2", "raw": "raw", "digest": "raw",
                  "digest+copy": "raw",
                  "torch.load": "torch.save", "safetensors": "safetensors", "dcp": "dcp"}
STEP_CONDITIONS = ("none", "trainstate-async", "raw-thread")
DROP_CACHES = "/proc/sys/vm/drop_caches"

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*torch.distributed is not initialized.*")
warnings.filterwarnings("ignore", message=".*will assume the intent is to.*")


T0 = time.perf_counter()


def log(msg: str) -> None:
    print(msg, flush=True)


def progress(msg: str) -> None:
    """A progress line, stamped with seconds since start."""
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# sizes and the state ---------------------------------------------------------
def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def size_label(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes / 2**30:.3g}G"


def pick_hidden(nbytes: int) -> int:
    """A layer width giving at least ~6 layers, capped at 4096, a multiple of 256."""
    return max(256, min(4096, int(math.sqrt(nbytes / (12 * 6))) // 256 * 256))


@dataclass
class Bench:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    state: ts.TrainState
    hidden: int

    def tensors(self) -> dict[str, torch.Tensor]:
        """Model params and optimizer tensors by flat name, read live (restores may replace optimizer tensors)."""
        out = {f"model.{k}": v.detach() for k, v in self.model.state_dict().items()}
        for pid, slots in self.opt.state_dict()["state"].items():
            out.update({f"optim.{pid}.{k}": v for k, v in slots.items() if isinstance(v, torch.Tensor)})
        return out

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())


def build(nbytes: int, hidden: int | None = None, seed: int = 0) -> Bench:
    """Linear layers + AdamW (stepped once) whose tensors total about ``nbytes``."""
    torch.manual_seed(seed)
    hidden = hidden or pick_hidden(nbytes)
    per_layer = 3 * (hidden * hidden + hidden) * 4  # fp32 weight+bias x (param, exp_avg, exp_avg_sq)
    layers = max(1, round(nbytes / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, hidden)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)  # gradients are not part of the saved state
    state = ts.TrainState(model=model, optimizer=opt)
    state.next_update = 1
    return Bench(model, opt, state, hidden)


def byte_views(tensors: dict[str, torch.Tensor]) -> list[memoryview]:
    return [memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for t in tensors.values()]


# filesystem and memory helpers -----------------------------------------------
def fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def settle() -> None:
    """Flush what the previous step left dirty (deletes, discards) so it is not billed to the next."""
    os.sync()
    time.sleep(0.1)


def tidy() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def drop_caches() -> bool:
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def cold_cache_check(root: Path) -> tuple[bool, str]:
    """Whether writing drop_caches really empties the page cache (not just whether the write succeeds)."""
    probe = root / "drop-probe"
    with open(probe, "wb") as f:
        block = os.urandom(MiB)
        for _ in range(128):
            f.write(block)
    before = meminfo("Cached")
    try:
        ok = drop_caches()
        if not ok:
            return False, f"cannot write {DROP_CACHES} (not root, or read-only /proc/sys); cold restores skipped"
        after = meminfo("Cached")
        if after > before - (100 << 20):
            return False, "drop_caches accepted but the page cache did not shrink; cold restores skipped"
        return True, "drop_caches works"
    finally:
        probe.unlink()


def prewarm(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    buf = memoryview(bytearray(CHUNK))
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rotated(items: list[str] | tuple[str, ...], r: int) -> list[str]:
    items = list(items)
    k = r % len(items)
    return items[k:] + items[:k]


# save methods: each writes ``out`` (a file or directory) durably ---------------
class Saves:
    def __init__(self, verify: str):
        self.verify = verify

    def trainstate(self, b: Bench, out: Path, digest: str = "blake3-chunked") -> None:
        b.state.next_update += 1
        with ts.CheckpointManager(out, keep_last=1, verify=self.verify, digest=digest) as ckpt:
            ckpt.save(b.state)

    def trainstate_v2(self, b: Bench, out: Path) -> None:
        """Format 2: one BLAKE3 digest per file (restore reads twice on one core); the format-3 control."""
        self.trainstate(b, out, digest="blake3")

    @staticmethod
    def raw(b: Bench, out: Path) -> None:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for view in byte_views(b.tensors()):
                for start in range(0, len(view), CHUNK):
                    chunk = view[start:start + CHUNK]
                    while chunk:
                        chunk = chunk[os.write(fd, chunk):]
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_path(out.parent, directory=True)

    @staticmethod
    def torch_save(b: Bench, out: Path) -> None:
        with open(out, "wb") as f:
            torch.save({"model": b.model.state_dict(), "optim": b.opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(out.parent, directory=True)

    @staticmethod
    def safetensors(b: Bench, out: Path) -> None:
        safetensors.torch.save_file({k: v.contiguous() for k, v in b.tensors().items()}, str(out))
        fsync_path(out)
        fsync_path(out.parent, directory=True)

    @staticmethod
    def dcp(b: Bench, out: Path) -> None:
        sd = {"model": b.model.state_dict(), "optim": b.opt.state_dict()}
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(out), sync_files=True), no_dist=True)
        fsync_path(out, directory=True)  # DCP fsyncs its files but not their directory entries
        fsync_path(out.parent, directory=True)

    def get(self, method: str) -> Callable[[Bench, Path], None]:
        return {"trainstate": self.trainstate, "trainstate-v2": self.trainstate_v2, "raw": self.raw,
                "torch.save": self.torch_save, "safetensors": self.safetensors, "dcp": self.dcp}[method]


OUTPUT_NAME = {"trainstate": "ts", "trainstate-v2": "ts-v2", "raw": "raw.bin", "torch.save": "model.pt", "safetensors": "model.safetensors",
               "dcp": "dcp"}


# restore methods: each loads ``src`` into the live model and optimizer --------
def restore_trainstate(b: Bench, src: Path) -> None:
    with ts.CheckpointManager(src, keep_last=1) as ckpt:
        if ckpt.restore(b.state) is None:
            raise RuntimeError(f"{src} holds no generation")


def restore_raw(b: Bench, src: Path) -> None:
    with open(src, "rb", buffering=0) as f:
        for view in byte_views(b.tensors()):
            got = 0
            while got < len(view):
                n = f.readinto(view[got:got + CHUNK])
                if not n:
                    raise RuntimeError(f"{src} is shorter than the state")
                got += n


def restore_digest(b: Bench, src: Path) -> None:
    """Not a restore: the digest throughput of every core (4 MiB BLAKE3 chunks of the state's bytes on a
    thread per core, as restore digests them). With the raw read, it bounds what a verified restore can do."""
    views = [v[i : i + DIGEST_CHUNK] for v in byte_views(b.tensors()) for i in range(0, len(v), DIGEST_CHUNK)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda v: blake3.blake3(v).digest(), views))


_IN_MEMORY: dict[Path, np.ndarray] = {}  # the raw source's bytes, read once per size (dropped after the part)


def restore_digest_copy(b: Bench, src: Path) -> None:
    """Not a restore: the least CPU work a verified restore does once the bytes are in memory. Each 4 MiB
    chunk of an in-memory copy of the state is digested and copied into the live tensor, on a thread per
    core. On few cores a verified restore cannot beat this (the digest and the copy share the cores),
    whereas the raw read and the digest alone each have all the cores to themselves."""
    data = _IN_MEMORY.get(src)
    if data is None:
        data = _IN_MEMORY[src] = np.fromfile(src, dtype=np.uint8)
    pairs, offset = [], 0
    for view in byte_views(b.tensors()):
        live = np.frombuffer(view, np.uint8)
        for i in range(0, len(live), DIGEST_CHUNK):
            part = live[i : i + DIGEST_CHUNK]
            pairs.append((part, data[offset + i : offset + i + len(part)]))
        offset += len(live)

    def one(pair: tuple[np.ndarray, np.ndarray]) -> None:
        blake3.blake3(pair[1]).digest()
        np.copyto(pair[0], pair[1])
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(one, pairs))


def restore_torch(b: Bench, src: Path) -> None:
    saved = torch.load(src, weights_only=True)
    b.model.load_state_dict(saved["model"])
    b.opt.load_state_dict(saved["optim"])


def restore_safetensors(b: Bench, src: Path) -> None:
    loaded = safetensors.torch.load_file(str(src))
    with torch.no_grad():
        for name, tensor in b.tensors().items():
            tensor.copy_(loaded[name])


def restore_dcp(b: Bench, src: Path) -> None:
    sd = {"model": b.model.state_dict(), "optim": b.opt.state_dict()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(src)), no_dist=True)
    b.opt.load_state_dict(sd["optim"])  # param_groups; the tensors were filled in place


RESTORERS: dict[str, Callable[[Bench, Path], None]] = {
    "trainstate": restore_trainstate, "trainstate-v2": restore_trainstate, "raw": restore_raw,
    "digest": restore_digest, "digest+copy": restore_digest_copy, "torch.load": restore_torch,
    "safetensors": restore_safetensors, "dcp": restore_dcp}


# part: save ------------------------------------------------------------------
def part_save(b: Bench, root: Path, reps: int, saves: Saves, loads: list[float]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {m: [] for m in SAVE_METHODS}
    for r in range(reps):
        loads.append(os.getloadavg()[0])
        work = root / f"save-rep{r}"
        work.mkdir()
        for method in rotated(SAVE_METHODS, r):
            out = work / OUTPUT_NAME[method]
            settle()
            times[method].append(timed(lambda m=method, o=out: saves.get(m)(b, o)))
            progress(f"save    rep {r} {method:12s} {times[method][-1]:7.3f} s")
            remove(out)
        remove(work)
    return times


# part: async stall -----------------------------------------------------------
def part_async(b: Bench, root: Path, reps: int, saves: Saves, loads: list[float]) -> dict[str, list[float]]:
    """Per rep, in rotated order: two blocking saves into one fresh directory, and two async saves into another.

    The second save of each pair lands beside the first, so (keep_last=1) it also prunes it, as every
    save of a long run does; "steady" numbers compare like with like. The first async save of a
    manager allocates its staging buffers; the second reuses them.
    """
    keys = ("sync-first", "sync-steady", "stall-first", "total-first", "stall-steady", "total-steady",
            "raw-first", "raw-steady", "stall-preallocated")
    times: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(reps):
        loads.append(os.getloadavg()[0])
        for kind in rotated(("sync", "async", "raw", "preallocated"), r):
            work = root / f"async-rep{r}-{kind}"
            if kind == "raw":  # the disk's own control: the same bytes written twice, the first removed after
                work.mkdir()
                for phase in ("first", "steady"):
                    settle()
                    times[f"raw-{phase}"].append(timed(lambda o=work / f"{phase}.bin": saves.raw(b, o)))
                    progress(f"async   rep {r} {phase:6s} raw write {times[f'raw-{phase}'][-1]:7.3f} s")
                (work / "first.bin").unlink()
                remove(work)
                continue
            ckpt = ts.CheckpointManager(work, keep_last=1, verify=saves.verify)
            try:
                if kind == "preallocated":  # ckpt.preallocate (untimed, as after a restore), then a first async save
                    ckpt.preallocate(b.state)
                    settle()
                    b.state.next_update += 1
                    start = time.perf_counter()
                    handle = ckpt.save(b.state, blocking=False)
                    times["stall-preallocated"].append(time.perf_counter() - start)
                    handle.wait()
                    del handle
                    progress(f"async   rep {r} first  stall after preallocate {times['stall-preallocated'][-1]:7.3f} s")
                    continue
                for phase in ("first", "steady"):
                    settle()
                    b.state.next_update += 1
                    start = time.perf_counter()
                    if kind == "sync":
                        ckpt.save(b.state)
                        times[f"sync-{phase}"].append(time.perf_counter() - start)
                        progress(f"async   rep {r} {phase:6s} sync save {times[f'sync-{phase}'][-1]:7.3f} s")
                        continue
                    handle = ckpt.save(b.state, blocking=False)
                    stall = time.perf_counter() - start
                    handle.wait()
                    total = time.perf_counter() - start
                    del handle  # a handle keeps the writer, and so its staging buffers, alive
                    times[f"stall-{phase}"].append(stall)
                    times[f"total-{phase}"].append(total)
                    progress(f"async   rep {r} {phase:6s} stall {stall:7.3f} s, stall+background {total:7.3f} s")
            finally:
                ckpt.close()
                del ckpt
            remove(work)
            tidy()
    return times


# part: training-step interference ---------------------------------------------
class Stepper:
    """A fixed, matmul-heavy CPU training step on its own small MLP."""

    def __init__(self, width: int, batch: int, layers: int):
        g = torch.Generator().manual_seed(1)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-6)
        self.x = torch.randn(batch, width, generator=g)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.model(self.x).square().mean().backward()
        self.opt.step()


def steps_while(stepper: Stepper, busy: Callable[[], bool]) -> list[float]:
    """Step times of steps that started and ended while ``busy()`` held."""
    out = []
    while busy():
        start = time.perf_counter()
        stepper.step()
        elapsed = time.perf_counter() - start
        if busy():
            out.append(elapsed)
    return out


def part_step(b: Bench, root: Path, reps: int, saves: Saves, args: argparse.Namespace,
              loads: list[float]) -> dict[str, dict]:
    stepper = Stepper(args.step_width, args.step_batch, args.step_layers)
    original_threads = torch.get_num_threads()
    results: dict[str, dict] = {}
    ckpt = ts.CheckpointManager(root / "step-ts", keep_last=1, verify=saves.verify)
    try:
        b.state.next_update += 1
        ckpt.save(b.state, blocking=False).wait()  # warm-up: staging buffers allocated once, reused after
        for threads in args.step_threads:
            torch.set_num_threads(threads)
            for _ in range(3):
                stepper.step()
            res = {c: {"steps": [], "per_rep_median": [], "window_s": []} for c in STEP_CONDITIONS}
            res["trainstate-async"]["stall_s"] = []
            for cond in STEP_CONDITIONS[1:]:
                res[cond]["write_s"] = []  # each background write, from its start (after any stall) to its end
            windows: list[float] = []
            for r in range(reps):
                loads.append(os.getloadavg()[0])
                for cond in rotated(STEP_CONDITIONS, r):
                    settle()
                    if cond == "none":
                        window = min(10.0, max(0.5, statistics.median(windows) if windows else args.step_window))
                        stop = time.perf_counter() + window
                        steps = steps_while(stepper, lambda t=stop: time.perf_counter() < t)
                    else:
                        steps, window, writes = [], 0.0, 0
                        while writes == 0 or window < args.step_min_window:  # short writes: repeat them
                            writes += 1
                            if cond == "trainstate-async":
                                b.state.next_update += 1
                                start = time.perf_counter()
                                handle = ckpt.save(b.state, blocking=False)
                                res[cond]["stall_s"].append(time.perf_counter() - start)
                                start = time.perf_counter()  # the stall is not part of the window
                                steps += steps_while(stepper, lambda h=handle: not h.done())
                                handle.wait()
                                del handle
                            else:
                                out = root / "step-raw.bin"
                                worker = threading.Thread(target=Saves.raw, args=(b, out), name="bench-raw-writer")
                                start = time.perf_counter()
                                worker.start()
                                steps += steps_while(stepper, worker.is_alive)
                                worker.join()
                                remove(out)
                            res[cond]["write_s"].append(time.perf_counter() - start)
                            window += res[cond]["write_s"][-1]
                    if cond != "none":
                        windows.append(window)
                    res[cond]["steps"].extend(steps)
                    res[cond]["window_s"].append(window)
                    res[cond]["per_rep_median"].append(statistics.median(steps) if steps else None)
                    med = f"{statistics.median(steps) * 1e3:8.2f} ms" if steps else "    (none)"
                    progress(f"step    threads={threads} rep {r} {cond:16s} {len(steps):4d} steps, median {med}, "
                             f"window {window:6.2f} s")
            results[str(threads)] = res
    finally:
        torch.set_num_threads(original_threads)
        ckpt.close()
        del ckpt
        remove(root / "step-ts")
        tidy()
    return results


# part: restore ---------------------------------------------------------------
def make_sources(b: Bench, root: Path, saves: Saves) -> dict[str, Path]:
    work = root / "sources"
    work.mkdir(exist_ok=True)
    sources = {}
    for method in RESTORE_METHODS:
        src = work / OUTPUT_NAME[RESTORE_SOURCE[method]]
        if not src.exists():
            saves.get(RESTORE_SOURCE[method])(b, src)
        sources[method] = src
    return sources


def part_restore(b: Bench, sources: dict[str, Path], reps: int, cold: bool, loads: list[float]
                 ) -> dict[str, dict[str, list[float]]]:
    times: dict[str, dict[str, list[float]]] = {"warm": {m: [] for m in sources}}
    if cold:
        times["cold"] = {m: [] for m in sources}
    for r in range(reps):
        loads.append(os.getloadavg()[0])
        for method in rotated(list(sources), r):
            for cache in (("cold", "warm") if cold else ("warm",)):
                if cache == "cold":
                    drop_caches()
                else:
                    prewarm(sources[method])
                times[cache][method].append(timed(lambda m=method: RESTORERS[m](b, sources[m])))
                progress(f"restore rep {r} {method:12s} {cache:4s} {times[cache][method][-1]:7.3f} s")
                tidy()
    _IN_MEMORY.clear()
    return times


# part: peak memory -------------------------------------------------------------
def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS
        return True
    except OSError:
        return False


class Sampler(threading.Thread):
    """Peak RssAnon / RssFile / VmRSS every 5 ms (VmHWM is the exact total; this splits it)."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="bench-rss-sampler")
        self.peak = {k: status_kib(k) for k in ("VmRSS", "RssAnon", "RssFile")}
        self._done = threading.Event()

    def sample(self) -> None:
        for k in self.peak:
            self.peak[k] = max(self.peak[k], status_kib(k))

    def run(self) -> None:
        while not self._done.wait(0.005):
            self.sample()

    def stop(self) -> dict[str, int]:
        self._done.set()
        self.join()
        self.sample()
        return dict(self.peak)


class PeakMeter:
    """Peak RSS above a baseline taken right before the operation (bytes)."""

    def __enter__(self) -> PeakMeter:
        tidy()
        self.base = {k: status_kib(k) for k in ("VmRSS", "RssAnon", "RssFile")}
        self.hwm_ok = reset_hwm()
        self.sampler = Sampler()
        self.sampler.start()
        return self

    def snapshot(self) -> dict:
        """Peaks above baseline so far: total (exact when VmHWM could be reset), anon and file (sampled)."""
        self.sampler.sample()
        peak = dict(self.sampler.peak)
        total = status_kib("VmHWM") if self.hwm_ok else peak["VmRSS"]
        return {"baseline_rss": self.base["VmRSS"] << 10, "peak_rss_delta": (total - self.base["VmRSS"]) << 10,
                "peak_anon_delta": (peak["RssAnon"] - self.base["RssAnon"]) << 10,
                "peak_file_delta": (peak["RssFile"] - self.base["RssFile"]) << 10, "exact": self.hwm_ok}

    def __exit__(self, *exc: object) -> None:
        self.result = self.snapshot()
        self.sampler.stop()
        tidy()
        self.result["retained_delta"] = (status_kib("VmRSS") - self.base["VmRSS"]) << 10  # after gc + trim


def rss_ops(sources: dict[str, Path]) -> list[tuple[str, str]]:
    return ([("save", m) for m in SAVE_METHODS] + [("async", "trainstate")]
            + [("restore", m) for m in sources if m != "digest+copy"])  # that one holds a copy by design


def rss_measure(b: Bench, phase: str, method: str, root: Path, sources: dict[str, Path], saves: Saves) -> list[dict]:
    """One measurement (in this process); returns one or more result rows."""
    rows = []
    if phase == "save":
        out = root / f"rss-{OUTPUT_NAME[method]}"
        settle()
        with PeakMeter() as meter:
            seconds = timed(lambda: saves.get(method)(b, out))
        remove(out)
        rows.append({"phase": "save", "method": method, "seconds": seconds, **meter.result})
    elif phase == "async":
        out = root / "rss-async"
        settle()
        ckpt = ts.CheckpointManager(out, keep_last=1, verify=saves.verify)
        try:
            with PeakMeter() as meter:
                b.state.next_update += 1
                handle = ckpt.save(b.state, blocking=False)
                at_stall = meter.snapshot()
                handle.wait()
                del handle
            rows.append({"phase": "async", "method": "trainstate first (stall)", **at_stall,
                         "retained_delta": None})
            rows.append({"phase": "async", "method": "trainstate first (stall+bg)", **meter.result})
            settle()
            with PeakMeter() as meter:
                b.state.next_update += 1
                handle = ckpt.save(b.state, blocking=False)
                handle.wait()
                del handle
            rows.append({"phase": "async", "method": "trainstate steady (stall+bg)", **meter.result})
        finally:
            ckpt.close()
            del ckpt
            remove(out)
    else:
        settle()
        with PeakMeter() as meter:
            seconds = timed(lambda: RESTORERS[method](b, sources[method]))
        rows.append({"phase": "restore", "method": method, "seconds": seconds, **meter.result})
    tidy()
    return rows


def part_rss(b: Bench | None, nbytes: int, hidden: int, root: Path, sources: dict[str, Path], saves: Saves,
             args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    for phase, method in rss_ops(sources):
        if args.rss_child:
            threads = ["--torch-threads", str(args.torch_threads)] if args.torch_threads else []
            cmd = [sys.executable, os.path.abspath(__file__), *threads, "--child", json.dumps(
                {"phase": phase, "method": method, "nbytes": nbytes, "hidden": hidden, "root": str(root),
                 "sources": {k: str(v) for k, v in sources.items()}, "verify": saves.verify})]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"rss child {phase}:{method} failed:\n{done.stderr[-3000:]}")
            new = json.loads(done.stdout.strip().splitlines()[-1])
        else:
            new = rss_measure(b, phase, method, root, sources, saves)
        for row in new:
            row["state_bytes"] = nbytes
            progress(f"rss     {row['phase']:7s} {row['method']:28s} +{row['peak_rss_delta'] / MiB:9.1f} MiB "
                     f"(anon +{row['peak_anon_delta'] / MiB:.0f}, file +{row['peak_file_delta'] / MiB:.0f}, "
                     f"retained {mib(row.get('retained_delta'))})")
        rows.extend(new)
    return rows


def child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    b = build(spec["nbytes"], spec["hidden"])
    if spec["phase"] == "restore":
        b.state.next_update = 0
    rows = rss_measure(b, spec["phase"], spec["method"], Path(spec["root"]),
                       {k: Path(v) for k, v in spec["sources"].items()}, Saves(spec["verify"]))
    print(json.dumps(rows))


# reporting -------------------------------------------------------------------
def med(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def throughput_table(times: dict[str, list[float]], nbytes: int, title: str) -> str:
    raw = times["raw"]
    rows = [f"  {title:22s} {'median s':>9s} {'GB/s':>6s} {'x raw':>6s} {'x raw/rep':>9s} {'min-max s':>15s}"]
    for method, samples in times.items():
        m = med(samples)
        per_rep = med([a / s for a, s in zip(raw, samples)])
        rows.append(f"  {method:22s} {m:9.3f} {nbytes / GB / m:6.2f} {med(raw) / m:6.2f} {per_rep:9.2f} "
                    f"{min(samples):7.3f}-{max(samples):.3f}")
    return "\n".join(rows)


def summarize_save(times: dict[str, list[float]], nbytes: int) -> dict:
    raw = times["raw"]
    return {m: {"median_s": med(s), "gb_per_s": nbytes / GB / med(s), "ratio_vs_raw_medians": med(raw) / med(s),
                "ratio_vs_raw_per_rep_median": med([a / x for a, x in zip(raw, s)])} for m, s in times.items()}


def async_table(t: dict[str, list[float]]) -> tuple[str, dict]:
    def per_rep(key: str, ref: str) -> float:
        return med([a / s for a, s in zip(t[key], t[ref])])

    summary: dict = {k: med(v) for k, v in t.items()}
    summary.update(stall_first_over_sync_first=per_rep("stall-first", "sync-first"),
                   stall_steady_over_sync_steady=per_rep("stall-steady", "sync-steady"),
                   total_first_over_sync_first=per_rep("total-first", "sync-first"),
                   total_steady_over_sync_steady=per_rep("total-steady", "sync-steady"))
    lines = [f"  {'async':34s} {'median s':>9s} {'/ sync, same phase (per rep)':>29s}"]
    for k, label, ref in (("sync-first", "sync save, fresh dir", "sync-first"),
                          ("sync-steady", "sync save, steady (prunes prev)", "sync-steady"),
                          ("stall-first", "stall, first (allocates buffers)", "sync-first"),
                          ("stall-steady", "stall, steady", "sync-steady"),
                          ("total-first", "stall+background, first", "sync-first"),
                          ("total-steady", "stall+background, steady", "sync-steady")):
        lines.append(f"  {label:34s} {med(t[k]):9.3f} {per_rep(k, ref):29.3f}")
    summary["steady_over_fresh_sync"] = per_rep("sync-steady", "sync-first")
    summary["raw_second_over_first"] = per_rep("raw-steady", "raw-first")
    summary["stall_preallocated_over_stall_steady"] = med([a / s for a, s in zip(t["stall-preallocated"],
                                                                                t["stall-steady"])])
    lines.append(f"  {'stall, first after preallocate':34s} {med(t['stall-preallocated']):9.3f} "
                 f"{summary['stall_preallocated_over_stall_steady']:22.3f} (/ stall, steady)")
    lines.append(f"  {'steady sync save / fresh-dir save':34s} {'':9s} {summary['steady_over_fresh_sync']:29.3f}")
    lines.append(f"  {'control: raw 2nd write / 1st':34s} {'':9s} {summary['raw_second_over_first']:29.3f}")
    return "\n".join(lines), summary


def step_table(res: dict[str, dict]) -> tuple[str, dict]:
    lines = [(f"  {'threads':>7s} {'background':18s} {'steps':>6s} {'median ms':>10s} {'slowdown':>9s} "
              f"{'slowdown/rep':>12s}")]
    summary: dict = {}
    for threads, by_cond in res.items():
        base = med(by_cond["none"]["steps"])
        summary[threads] = {}
        for cond in STEP_CONDITIONS:
            d = by_cond[cond]
            m = med(d["steps"])
            slow = m / base - 1
            per_rep = med([(a / n - 1) if a and n else None
                           for a, n in zip(d["per_rep_median"], by_cond["none"]["per_rep_median"])])
            summary[threads][cond] = {"median_step_s": m, "n_steps": len(d["steps"]), "slowdown": slow,
                                      "slowdown_per_rep_median": per_rep, "median_window_s": med(d["window_s"])}
            lines.append(f"  {threads:>7s} {cond:18s} {len(d['steps']):6d} {m * 1e3:10.2f} {slow:+9.1%} "
                         f"{per_rep:+12.1%}")
    return "\n".join(lines), summary


def rss_table(rows: list[dict]) -> str:
    lines = [(f"  {'phase':8s} {'method':30s} {'peak MiB':>9s} {'x state':>8s} {'anon MiB':>9s} {'file MiB':>9s} "
              f"{'retained MiB':>12s}")]
    for r in rows:
        lines.append(f"  {r['phase']:8s} {r['method']:30s} {r['peak_rss_delta'] / MiB:9.1f} "
                     f"{r['peak_rss_delta'] / r['state_bytes']:8.2f} {r['peak_anon_delta'] / MiB:9.1f} "
                     f"{r['peak_file_delta'] / MiB:9.1f} {mib(r['retained_delta']):>12s}")
    lines.append("  (peak: VmHWM above the RSS just before, exact; anon/file: 5 ms samples; retained: RSS above "
                 "the baseline after the operation, gc and malloc_trim)")
    return "\n".join(lines)


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MiB:.1f}".replace("-0.0", "0.0")


def library_commit() -> str:
    """The trainstate checkout's HEAD, read from .git files (no git process)."""
    repo = Path(ts.__file__).resolve().parent.parent
    try:
        head = (repo / ".git" / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head[:12]
        ref = head[5:]
        ref_file = repo / ".git" / ref
        if ref_file.exists():
            return ref_file.read_text().strip()[:12]
        for line in (repo / ".git" / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0][:12]
    except OSError:
        pass
    return "?"


def machine(root: Path) -> dict:
    with open("/proc/mounts") as f:
        disk = next((line.split()[0] for line in f if line.split()[1] == "/"), "?")
    return {"host": platform.node(), "platform": platform.platform(), "nproc": os.cpu_count(),
            "affinity_cpus": len(os.sched_getaffinity(0)), "mem_total": meminfo("MemTotal"),
            "mem_available": meminfo("MemAvailable"), "root_device": disk, "dir": str(root),
            "disk_free": shutil.disk_usage(root).free, "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "safetensors": safetensors.__version__, "trainstate": ts.__version__,
            "trainstate_commit": library_commit()}


def disk_need(nbytes: int, parts: list[str]) -> int:
    copies = 2  # save: one output at a time; async: previous + new generation in one directory
    if "restore" in parts or "rss" in parts:
        copies = len(RESTORE_METHODS) + 1  # every restore source, plus one save output (rss)
    return int(nbytes * copies * 1.1) + (256 << 20)


def mem_need(nbytes: int) -> int:
    return 3 * nbytes + (1 << 30)  # live state + staging copy (async) or decoded copy (restore) + slack


# main --------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256M", help="comma-separated tensor byte totals, e.g. 256M,1G,4G")
    p.add_argument("--reps", type=int, default=5, help="repetitions per method (interleaved)")
    p.add_argument("--out", help="write every raw sample and the summaries here (JSON)")
    p.add_argument("--only", default=",".join(PARTS), help=f"parts to run, from {','.join(PARTS)}")
    p.add_argument("--dir", help="where checkpoints are written (default: a fresh temp dir under /tmp)")
    p.add_argument("--verify", default="fast", choices=("fast", "full"), help="trainstate verify mode")
    p.add_argument("--hidden", type=int, help="Linear width of the state (default: picked per size)")
    p.add_argument("--torch-threads", type=int,
                   help="torch.set_num_threads for every part but step (default: torch's own choice)")
    p.add_argument("--step-threads", default="1,2", help="torch.set_num_threads values for the step part")
    p.add_argument("--step-width", type=int, default=512)
    p.add_argument("--step-batch", type=int, default=64)
    p.add_argument("--step-layers", type=int, default=4)
    p.add_argument("--step-window", type=float, default=1.5,
                   help="seconds of undisturbed steps before any background write has been timed "
                        "(afterwards: the median background write duration, clamped to 0.5-10 s)")
    p.add_argument("--step-min-window", type=float, default=1.0,
                   help="repeat a background write until this many seconds of it were covered")
    p.add_argument("--rss-child", action="store_true", help="measure memory in a fresh interpreter per operation")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.parts = [x for x in args.only.split(",") if x]
    bad = [x for x in args.parts if x not in PARTS]
    if bad:
        p.error(f"unknown part(s) {bad}; choose from {PARTS}")
    args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    args.step_threads = [int(x) for x in args.step_threads.split(",") if x]
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


def run_size(nbytes: int, args: argparse.Namespace, root: Path, saves: Saves, cold: bool) -> dict:
    label = size_label(nbytes)
    out: dict = {"requested_bytes": nbytes, "load_before": os.getloadavg(), "loads": []}
    need_disk, free = disk_need(nbytes, args.parts), shutil.disk_usage(root).free
    need_mem, avail = mem_need(nbytes), meminfo("MemAvailable")
    if free < need_disk or avail < need_mem:
        why = (f"refused: needs ~{need_disk / 2**30:.1f} GiB free disk (have {free / 2**30:.1f}) and "
               f"~{need_mem / 2**30:.1f} GiB available memory (have {avail / 2**30:.1f})")
        log(f"{label}: {why}")
        return {**out, "refused": why}
    work = root / label
    work.mkdir()
    b = build(nbytes, args.hidden)
    state_bytes, hidden = b.nbytes(), b.hidden
    out.update(state_bytes=state_bytes, hidden=hidden, layers=len(b.model), tensors=len(b.tensors()))
    log(f"\n## {label}: {len(b.model)} x Linear({hidden}, {hidden}) + AdamW = {len(b.tensors())} tensors, "
        f"{state_bytes:,} bytes ({state_bytes / 2**30:.3f} GiB); load {out['load_before'][0]:.2f}; "
        f"disk free {free / 2**30:.1f} GiB")
    sources: dict[str, Path] = {}
    loads = out["loads"]
    try:
        progress(f"{label}: built the state")
        if "save" in args.parts:
            out["save"] = part_save(b, work, args.reps, saves, loads)
            out["save_summary"] = summarize_save(out["save"], state_bytes)
            tidy()
        if "async" in args.parts:
            out["async"] = part_async(b, work, args.reps, saves, loads)
            tidy()
        if "step" in args.parts:
            out["step"] = part_step(b, work, args.reps, saves, args, loads)
            tidy()
        if "restore" in args.parts or "rss" in args.parts:
            settle()
            sources = make_sources(b, work, saves)
            progress(f"{label}: wrote the restore sources")
        if "restore" in args.parts:
            out["restore"] = part_restore(b, sources, args.reps, cold, loads)
            out["restore_summary"] = {c: summarize_save(t, state_bytes) for c, t in out["restore"].items()}
            tidy()
        if "rss" in args.parts:
            if args.rss_child:
                del b  # the children build their own state; do not hold a copy here meanwhile
                b = None
                tidy()
            out["rss"] = part_rss(b, state_bytes, hidden, work, sources, saves, args)
    finally:
        del b
        tidy()
        shutil.rmtree(work, ignore_errors=True)
        os.sync()
    out["load_after"] = os.getloadavg()
    return out


def report_size(label: str, res: dict) -> None:
    if "refused" in res:
        log(f"\n### {label}: {res['refused']}")
        return
    nbytes = res["state_bytes"]
    log(f"\n### {label}: {nbytes:,} tensor bytes ({res['layers']} x Linear({res['hidden']}) + AdamW); "
        f"load avg before {res['load_before'][0]:.2f}, after {res['load_after'][0]:.2f}; "
        f"per-rep loads {', '.join(f'{x:.1f}' for x in res['loads'])}")
    if "save" in res:
        log("\n" + throughput_table(res["save"], nbytes, "sync save"))
    if "async" in res:
        text, res["async_summary"] = async_table(res["async"])
        log("\n" + text)
    if "step" in res:
        text, res["step_summary"] = step_table(res["step"])
        log("\n" + text)
    for cache, times in res.get("restore", {}).items():
        log("\n" + throughput_table(times, nbytes, f"restore ({cache})"))
        limit = max(med(times["raw"]), med(times["digest"]))  # the slower of reading and digesting on all cores
        res.setdefault("restore_limit", {})[cache] = {
            "limit_gb_per_s": nbytes / GB / limit, "trainstate_over_limit": limit / med(times["trainstate"]),
            "trainstate_over_torch_load": med(times["torch.load"]) / med(times["trainstate"]),
            "trainstate_over_dcp": med(times["dcp"]) / med(times["trainstate"]),
            "trainstate_over_v2": med(times["trainstate-v2"]) / med(times["trainstate"])}
        if "digest+copy" in times:  # what a verified restore must do on the same cores, in memory
            ceiling = max(med(times["raw"]), med(times["digest+copy"]))
            res["restore_limit"][cache].update(ceiling_gb_per_s=nbytes / GB / ceiling,
                                               trainstate_over_ceiling=ceiling / med(times["trainstate"]))
        r = res["restore_limit"][cache]
        log(f"  machine limit ({cache}): {r['limit_gb_per_s']:.2f} GB/s = min(raw read, digest on all cores); "
            f"trainstate {r['trainstate_over_limit']:.2f}x the limit, {r['trainstate_over_torch_load']:.2f}x "
            f"torch.load, {r['trainstate_over_dcp']:.2f}x DCP, {r['trainstate_over_v2']:.2f}x format 2")
        if "ceiling_gb_per_s" in r:
            log(f"  verified ceiling ({cache}): {r['ceiling_gb_per_s']:.2f} GB/s = min(raw read, digest and copy "
                f"in memory on all cores); trainstate {r['trainstate_over_ceiling']:.2f}x it")
    if "rss" in res:
        log("\n" + rss_table(res["rss"]))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    gc.freeze()  # keep the import-time heap out of every gc.collect() (0.5 s each otherwise)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.child:
        return child_main(args.child)
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="trainstate-suite-", dir=base))
    results: dict = {"command": command, "argv": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "parts": args.parts, "reps": args.reps, "verify": args.verify,
                     "load_before": os.getloadavg(), "sizes": {}}
    saves = Saves(args.verify)
    try:
        results["machine"] = machine(root)
        m = results["machine"]
        log(f"# command: {command}")
        log(f"# machine: {m['platform']}, nproc {m['nproc']} (affinity {m['affinity_cpus']}), "
            f"RAM {m['mem_total'] / 2**30:.1f} GiB ({m['mem_available'] / 2**30:.1f} available), "
            f"disk free {m['disk_free'] / 2**30:.1f} GiB at {root} ({m['root_device']}); "
            f"torch {m['torch']} ({m['torch_threads']} threads), safetensors {m['safetensors']}, "
            f"trainstate {m['trainstate']} @ {m['trainstate_commit']}, verify={args.verify}")
        log(f"# load average before: {' '.join(f'{x:.2f}' for x in results['load_before'])}")
        cold = False
        if "restore" in args.parts:
            cold, note = cold_cache_check(root)
            results["cold_cache"] = {"available": cold, "note": note}
            log(f"# cold cache: {note}")
        for nbytes in args.size_list:
            label = size_label(nbytes)
            results["sizes"][label] = run_size(nbytes, args, root, saves, cold)
            if args.out:  # keep what is done so far if a later size fails
                Path(args.out).write_text(json.dumps(results, indent=1, default=str))
        results["load_after"] = os.getloadavg()
        log("\n# ================= summary =================")
        log(f"# command: {command}")
        for label, res in results["sizes"].items():
            report_size(label, res)
        la = results["load_after"]
        log(f"\n# load average before {' '.join(f'{x:.2f}' for x in results['load_before'])}; "
            f"after {' '.join(f'{x:.2f}' for x in la)} ({os.cpu_count()} CPUs); "
            f"disk free after {shutil.disk_usage(root).free / 2**30:.1f} GiB")
        all_loads = [x for r in results["sizes"].values() for x in r.get("loads", [])]
        if max(all_loads + [la[0]], default=0) > 0.5 * (os.cpu_count() or 1):
            log("WARNING: other processes were busy during this run (load average above half the CPUs); "
                "compare methods within this run, and prefer the per-rep ratios.")
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1, default=str))
            log(f"# wrote {args.out}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
