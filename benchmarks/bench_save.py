"""Save and restore throughput, and peak memory, of trainstate against plain baselines.

Everything runs in one process on one model+AdamW state (an MLP of square
``Linear`` layers, AdamW stepped once so ``exp_avg``/``exp_avg_sq`` exist),
in interleaved rounds: round ``r`` runs every method once, in an order
rotated by ``r``, so slow drift of a shared disk lands on every method alike.

Save methods (each ends durable: file fsync'd, then its directory fsync'd):

- ``trainstate-full`` / ``trainstate-fast``: ``CheckpointManager.save`` with
  ``verify="full"`` / ``"fast"`` into a fresh run directory (digests included).
- ``raw``: ``os.write`` of the same tensor bytes, straight from tensor memory
  in 64 MiB chunks, then fsync of the file and of the directory. The floor.
- ``torch.save``: model and optimizer state dicts, then flush + fsync.
- ``safetensors``: ``safetensors.torch.save_file`` of the flattened tensors, then fsync.
- ``dcp``: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter(sync_files=True)``
  and ``no_dist=True`` (no process group; DCP would assume it anyway, with a warning).

Restore methods load into the live model and optimizer, each from its own
checkpoint: ``trainstate`` (verifies every digest, then loads), ``raw``
(``readinto`` the live tensors' memory: the floor), ``torch.load``
(``weights_only=True`` + ``load_state_dict``), ``safetensors`` (``load_file`` +
``copy_``) and ``dcp`` (in-place ``dcp.load``). Each is timed with a warm page
cache and, when ``/proc/sys/vm/drop_caches`` accepts a write, a cold one.

Peak memory is measured in a child process per method: it builds the same
state, records its RSS, resets the kernel's high-water mark
(``/proc/self/clear_refs``), runs one save or restore and reports
``VmHWM - baseline`` (a 5 ms sampler of ``RssAnon`` runs alongside, to tell
anonymous memory from mapped file pages).

Usage::

    python benchmarks/bench_save.py [--size-gib 1.0] [--rounds 5] [--dir PATH] [--json out.json]
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
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

import trainstate as ts

CHUNK = 64 << 20
GB = 1e9
SAVE_METHODS = ("trainstate-full", "trainstate-fast", "raw", "torch.save", "safetensors", "dcp")
RESTORE_METHODS = ("trainstate", "raw", "torch.load", "safetensors", "dcp")
# Which save method writes the checkpoint each restore method reads.
RESTORE_SOURCE = {"trainstate": "trainstate-full", "raw": "raw", "torch.load": "torch.save",
                  "safetensors": "safetensors", "dcp": "dcp"}
DROP_CACHES = "/proc/sys/vm/drop_caches"
LOAD: list[float] = []  # 1-minute load average at the start of each round: other tenants show up here

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


# the state -------------------------------------------------------------------
@dataclass
class Bench:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    state: ts.TrainState

    def tensors(self) -> dict[str, torch.Tensor]:
        """Model and optimizer tensors by flat name, read live (restore may replace optimizer tensors)."""
        out = {f"model.{k}": v.detach() for k, v in self.model.state_dict().items()}
        for pid, slots in self.opt.state_dict()["state"].items():
            out.update({f"optim.{pid}.{k}": v for k, v in slots.items() if isinstance(v, torch.Tensor)})
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def build(size_gib: float, hidden: int, seed: int = 0) -> Bench:
    """An MLP whose parameters plus AdamW moments hold at least ``size_gib`` GiB."""
    torch.manual_seed(seed)
    per_layer = 3 * (hidden * hidden + hidden) * 4  # fp32 weight+bias, times (param, exp_avg, exp_avg_sq)
    layers = max(1, math.ceil(size_gib * (1 << 30) / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, hidden)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)  # free the gradients: they are not part of the state we save
    state = ts.TrainState(model=model, optimizer=opt)
    state.next_update = 1
    return Bench(model, opt, state)


def byte_views(tensors: dict[str, torch.Tensor]) -> list[memoryview]:
    return [memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for t in tensors.values()]


# filesystem helpers ----------------------------------------------------------
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
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
    """Flush what a previous step left dirty (deletes, discards) so it is not billed to the next."""
    os.sync()
    time.sleep(0.5)


def drop_caches() -> bool:
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def cached_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def cold_cache_works(root: Path) -> bool:
    """True when writing drop_caches really empties the page cache (not just when the write succeeds)."""
    probe = root / "drop-probe"
    with open(probe, "wb") as f:
        f.write(os.urandom(1 << 20) * 256)
    before = cached_bytes()
    ok = drop_caches() and cached_bytes() < before - (200 << 20)
    probe.unlink()
    return ok


def prewarm(path: Path) -> None:
    """Read every file under ``path`` once so the page cache holds it."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    buf = memoryview(bytearray(CHUNK))
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# save methods: each writes ``out`` (a file or a directory) durably ----------
def save_trainstate(bench: Bench, out: Path, verify: str) -> None:
    bench.state.next_update += 1
    with ts.CheckpointManager(out, keep_last=1, verify=verify) as ckpt:
        ckpt.save(bench.state)


def save_raw(bench: Bench, out: Path) -> None:
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for view in byte_views(bench.tensors()):
            for start in range(0, len(view), CHUNK):
                chunk = view[start:start + CHUNK]
                while chunk:
                    chunk = chunk[os.write(fd, chunk):]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(out.parent)


def save_torch(bench: Bench, out: Path) -> None:
    with open(out, "wb") as f:
        torch.save({"model": bench.model.state_dict(), "optim": bench.opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(out.parent)


def save_safetensors(bench: Bench, out: Path) -> None:
    safetensors.torch.save_file({k: v.contiguous() for k, v in bench.tensors().items()}, str(out))
    fsync_file(out)
    fsync_dir(out.parent)


def save_dcp(bench: Bench, out: Path) -> None:
    state_dict = {"model": bench.model.state_dict(), "optim": bench.opt.state_dict()}
    dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(str(out), sync_files=True), no_dist=True)
    fsync_dir(out)  # DCP fsyncs its files but not their directory entries
    fsync_dir(out.parent)


SAVERS: dict[str, Callable[[Bench, Path], None]] = {
    "trainstate-full": lambda b, p: save_trainstate(b, p, "full"),
    "trainstate-fast": lambda b, p: save_trainstate(b, p, "fast"),
    "raw": save_raw,
    "torch.save": save_torch,
    "safetensors": save_safetensors,
    "dcp": save_dcp,
}


# restore methods: each loads ``src`` into the live model and optimizer ------
def restore_trainstate(bench: Bench, src: Path) -> None:
    with ts.CheckpointManager(src, keep_last=1) as ckpt:
        if ckpt.restore(bench.state) is None:
            raise RuntimeError(f"{src} holds no generation")


def restore_raw(bench: Bench, src: Path) -> None:
    with open(src, "rb", buffering=0) as f:
        for view in byte_views(bench.tensors()):
            got = 0
            while got < len(view):
                n = f.readinto(view[got:got + CHUNK])
                if not n:
                    raise RuntimeError(f"{src} is shorter than the state")
                got += n


def restore_torch(bench: Bench, src: Path) -> None:
    saved = torch.load(src, weights_only=True)
    bench.model.load_state_dict(saved["model"])
    bench.opt.load_state_dict(saved["optim"])


def restore_safetensors(bench: Bench, src: Path) -> None:
    loaded = safetensors.torch.load_file(str(src))
    with torch.no_grad():
        for name, tensor in bench.tensors().items():
            tensor.copy_(loaded[name])


def restore_dcp(bench: Bench, src: Path) -> None:
    state_dict = {"model": bench.model.state_dict(), "optim": bench.opt.state_dict()}
    dcp.load(state_dict, storage_reader=dcp.FileSystemReader(str(src)), no_dist=True)
    bench.opt.load_state_dict(state_dict["optim"])  # param_groups; the tensors were filled in place


RESTORERS: dict[str, Callable[[Bench, Path], None]] = {
    "trainstate": restore_trainstate,
    "raw": restore_raw,
    "torch.load": restore_torch,
    "safetensors": restore_safetensors,
    "dcp": restore_dcp,
}


def output_name(method: str) -> str:
    return {"raw": "raw.bin", "torch.save": "model.pt", "safetensors": "model.safetensors"}.get(method, method)


# timed rounds ----------------------------------------------------------------
def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rotated(methods: list[str], r: int) -> list[str]:
    k = r % len(methods)
    return methods[k:] + methods[:k]


def save_rounds(bench: Bench, root: Path, methods: list[str], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {m: [] for m in methods}
    work = root / "save"
    work.mkdir()
    for r in range(rounds):
        LOAD.append(os.getloadavg()[0])
        for method in rotated(methods, r):
            out = work / output_name(method)
            settle()
            times[method].append(timed(lambda: SAVERS[method](bench, out)))
            print(f"  save    round {r} {method:16s} {times[method][-1]:7.2f} s", flush=True)
            remove(out)
    return times


def prepare_restore(bench: Bench, root: Path, methods: list[str]) -> dict[str, Path]:
    work = root / "restore"
    work.mkdir()
    sources = {}
    for method in methods:
        sources[method] = work / output_name(RESTORE_SOURCE[method])
        SAVERS[RESTORE_SOURCE[method]](bench, sources[method])
    return sources


def restore_rounds(bench: Bench, sources: dict[str, Path], rounds: int,
                   cold: bool) -> dict[str, list[float]]:
    """Per round and method: a cold run (caches dropped) if possible, then a warm one."""
    times: dict[str, list[float]] = {}
    for r in range(rounds):
        LOAD.append(os.getloadavg()[0])
        for method in rotated(list(sources), r):
            for cache in ("cold", "warm") if cold else ("warm",):
                if cache == "cold":
                    drop_caches()
                else:
                    prewarm(sources[method])
                key = f"{method} ({cache})"
                times.setdefault(key, []).append(timed(lambda: RESTORERS[method](bench, sources[method])))
                print(f"  restore round {r} {key:22s} {times[key][-1]:7.2f} s", flush=True)
    return times


# peak memory, one child process per measurement ------------------------------
def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class AnonSampler(threading.Thread):
    """Samples RssAnon every 5 ms: the kernel's VmHWM also counts mapped file pages."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = status_kib("RssAnon")
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, status_kib("RssAnon"))

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, status_kib("RssAnon"))


def child_main(args: argparse.Namespace) -> None:
    phase, method = args.child.split(":", 1)
    bench = build(args.size_gib, args.hidden)
    if phase == "restore":
        bench.state.next_update = 0  # the saved generation is ahead of us, as in a real resume
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    base_rss, base_anon = status_kib("VmRSS"), status_kib("RssAnon")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    sampler = AnonSampler()
    sampler.start()
    target = Path(args.ckpt)
    seconds = timed(lambda: (SAVERS[method] if phase == "save" else RESTORERS[method])(bench, target))
    peak_anon = sampler.stop()
    print(json.dumps({"phase": phase, "method": method, "state_bytes": bench.nbytes(), "seconds": seconds,
                      "baseline_rss": base_rss << 10, "peak_rss_delta": (status_kib("VmHWM") - base_rss) << 10,
                      "peak_anon_delta": (peak_anon - base_anon) << 10}))


def measure_rss(args: argparse.Namespace, phase: str, method: str, target: Path) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{phase}:{method}", "--ckpt", str(target),
           "--size-gib", str(args.size_gib), "--hidden", str(args.hidden)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"child {phase}:{method} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def rss_runs(args: argparse.Namespace, root: Path, save_methods: list[str],
             sources: dict[str, Path]) -> list[dict]:
    results = []
    work = root / "rss"
    work.mkdir()
    for method in save_methods:
        out = work / output_name(method)
        settle()
        results.append(measure_rss(args, "save", method, out))
        remove(out)
        print(f"  rss     save    {method:16s} +{results[-1]['peak_rss_delta'] / 2**20:8.1f} MiB", flush=True)
    for method, src in sources.items():
        settle()
        results.append(measure_rss(args, "restore", method, src))
        print(f"  rss     restore {method:16s} +{results[-1]['peak_rss_delta'] / 2**20:8.1f} MiB", flush=True)
    return results


# reporting -------------------------------------------------------------------
def throughput_table(times: dict[str, list[float]], nbytes: int, raw_key: str, title: str) -> str:
    raw = times[raw_key]
    rows = [f"| {title} | median s | GB/s | x raw (ratio of medians) | x raw (median of per-round ratios) "
            "| min-max s |", "|---|---:|---:|---:|---:|---:|"]
    for method, samples in times.items():
        med = statistics.median(samples)
        paired = statistics.median(a / b for a, b in zip(raw, samples))
        rows.append(f"| {method} | {med:.2f} | {nbytes / GB / med:.2f} | {statistics.median(raw) / med:.2f} "
                    f"| {paired:.2f} | {min(samples):.2f}-{max(samples):.2f} |")
    return "\n".join(rows)


def rss_table(results: list[dict]) -> str:
    rows = ["| phase | method | baseline RSS GiB | peak RSS above baseline MiB | peak anon above baseline MiB "
            "| as share of state |", "|---|---|---:|---:|---:|---:|"]
    for r in results:
        rows.append(f"| {r['phase']} | {r['method']} | {r['baseline_rss'] / 2**30:.2f} "
                    f"| {r['peak_rss_delta'] / 2**20:.0f} | {r['peak_anon_delta'] / 2**20:.0f} "
                    f"| {r['peak_rss_delta'] / r['state_bytes']:.2f} |")
    return "\n".join(rows)


def restore_groups(times: dict[str, list[float]]) -> dict[str, dict[str, list[float]]]:
    groups: dict[str, dict[str, list[float]]] = {}
    for key, samples in times.items():
        method, cache = key[:-1].rsplit(" (", 1)
        groups.setdefault(cache, {})[method] = samples
    return groups


def library_commit() -> str:
    """The trainstate checkout's commit, read-only (``git rev-parse``), or '?'."""
    here = Path(ts.__file__).resolve().parent
    done = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=False)
    dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no", "."],
                           capture_output=True, text=True, check=False)
    return (done.stdout.strip() or "?") + ("+modified" if dirty.stdout.strip() else "")


def machine() -> str:
    disk = next((line.split()[0] for line in open("/proc/mounts") if line.split()[1] == "/"), "?")
    return (f"{platform.node()} {platform.platform()}, {os.cpu_count()} CPUs, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, root fs on {disk}, "
            f"torch {torch.__version__}, safetensors {safetensors.__version__}, "
            f"trainstate {ts.__version__} at {library_commit()}")


# main --------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="minimum model+optimizer tensor bytes, in GiB")
    p.add_argument("--hidden", type=int, default=4096, help="width of each square Linear layer")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", help="where checkpoints are written (default: a temp dir under /tmp)")
    p.add_argument("--json", help="also write every sample here")
    p.add_argument("--save-methods", default=",".join(SAVE_METHODS))
    p.add_argument("--restore-methods", default=",".join(RESTORE_METHODS))
    p.add_argument("--skip-restore", action="store_true")
    p.add_argument("--skip-rss", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def check_space(root: Path, nbytes: int, files: int) -> None:
    need = int(nbytes * (files + 1) * 1.1)
    free = shutil.disk_usage(root).free
    if free < need:
        raise SystemExit(f"{root} has {free / 2**30:.1f} GiB free; this run needs about {need / 2**30:.1f} GiB. "
                         "Pass --dir on a larger filesystem or a smaller --size-gib.")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    save_methods = [m for m in args.save_methods.split(",") if m]
    restore_methods = [] if args.skip_restore else [m for m in args.restore_methods.split(",") if m]
    if "raw" not in save_methods or (restore_methods and "raw" not in restore_methods):
        raise SystemExit("the raw baseline must be among the methods: every ratio is to it")
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="trainstate-bench-", dir=base))
    try:
        bench = build(args.size_gib, args.hidden)
        nbytes = bench.nbytes()
        check_space(root, nbytes, len(restore_methods) + 1)
        cold = cold_cache_works(root)
        print(f"# {machine()}\n# state: {len(bench.model)} x Linear({args.hidden}, {args.hidden}) + AdamW, "
              f"{nbytes / 2**30:.3f} GiB of tensors; rounds={args.rounds}; dir={root}; "
              f"cold cache: {'yes' if cold else 'no (drop_caches unavailable)'}", flush=True)
        results: dict = {"machine": machine(), "state_bytes": nbytes, "rounds": args.rounds, "cold": cold}
        results["save"] = save_rounds(bench, root, save_methods, args.rounds)
        sources: dict[str, Path] = {}
        if restore_methods:
            sources = prepare_restore(bench, root, restore_methods)
            results["restore"] = restore_rounds(bench, sources, args.rounds, cold)
        if not args.skip_rss:
            results["rss"] = rss_runs(args, root, save_methods, sources)
        print("\n" + throughput_table(results["save"], nbytes, "raw", "save"))
        for cache, times in restore_groups(results.get("restore", {})).items():
            print("\n" + throughput_table(times, nbytes, "raw", f"restore, {cache} cache"))
        if "rss" in results:
            print("\n" + rss_table(results["rss"]))
        results["load"] = LOAD
        print(f"\n1-minute load average at round starts: {', '.join(f'{x:.1f}' for x in LOAD)} "
              f"on {os.cpu_count()} CPUs")
        if max(LOAD, default=0) > 0.5 * (os.cpu_count() or 1):
            print("WARNING: other processes were busy during this run; its ratios are not clean.")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
