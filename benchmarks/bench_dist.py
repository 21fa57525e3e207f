"""Multi-rank save and restore: trainstate against stock DCP and a raw write, FSDP2, interleaved, on CPU (gloo).

Launch with torchrun (or let the script launch it: without ``WORLD_SIZE`` in
the environment it re-runs itself under ``torch.distributed.run --standalone``
with ``--nproc`` ranks)::

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_dist.py \
        --size 1G --reps 6 --profile 3 --out dist.json
    python benchmarks/bench_dist.py --size 64M --reps 1 --profile 1      # smoke, under a minute

State: a stack of square ``nn.Linear`` layers, each ``fully_shard``-ed, then the
root (FSDP2), AdamW stepped once (so ``exp_avg``/``exp_avg_sq`` exist), gradients
freed; parameters are a third of the tensor bytes. ``--size`` is the total over
all ranks (each rank holds 1/world of it). One torch thread per rank.

Every repetition ``r`` runs each save method once, in an order rotated by ``r``,
then each restore method (cold, then warm), rotated the same way. Each timed
region starts and ends with a barrier on every rank; the figure is rank 0's
wall time between the two barriers (so: until the slowest rank is done).

Save methods (each into a fresh directory, so no pruning is timed):

``trainstate``  ``CheckpointManager(dir, keep_last=1).save(state)``; building the
                manager (two gloo groups) and closing it are timed apart
                (``setup_s``/``close_s``), not in the save.
``dcp``         ``dcp.save({"model": get_model_state_dict(m), "optim":
                get_optimizer_state_dict(m, o)}, storage_writer=FileSystemWriter(dir,
                sync_files=True))``: stock DCP, which fsyncs its files but not the directory.
``raw``         each rank ``os.write``s the bytes of its local shards (the DTensors' local
                tensors: parameters, moments, step counters) from their own memory to one
                file, 64 MiB at a time, fsyncs it and the directory: the floor.

Restore methods, into a second, differently seeded FSDP2 model + AdamW whose
local tensors are zeroed (untimed) before every restore and compared bitwise
with the saved ones (untimed) after it:

``trainstate``  ``CheckpointManager(dir).restore(fresh)`` (manager built and closed untimed).
``dcp``         ``dcp.load`` of the fresh model's and optimizer's state dicts +
                ``set_model_state_dict``/``set_optimizer_state_dict``.
``raw``         ``readinto`` each local tensor's memory from the rank's raw file.

"cold": ``sync; echo 3 > /proc/sys/vm/drop_caches`` (rank 0, between barriers) right
before the restore, only if the page cache really shrinks (checked at start);
"warm": the files are read once just before.

``--profile N`` then runs N more trainstate saves and warm and cold restores (and
DCP's, for reference) with timers wrapped around library functions (the library
is not edited), and reports per rank where the time goes.

Ratios are throughput ratios, as in ``bench_suite.py``: ``other_time /
trainstate_time``, so above 1 trainstate is faster. The median of the
per-repetition ratios is given beside the ratio of the medians.
"""

from __future__ import annotations

import argparse
import hashlib
import json
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
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

if "WORLD_SIZE" not in os.environ and __name__ == "__main__":  # not under torchrun: launch it
    _nproc, _rest, _skip = "2", [], False
    for _i, _arg in enumerate(sys.argv[1:], 1):  # --nproc is torchrun's, not the ranks' (torchrun would read it)
        if _skip:
            _skip = False
        elif _arg == "--nproc" and _i + 1 < len(sys.argv):
            _nproc, _skip = sys.argv[_i + 1], True
        elif _arg.startswith("--nproc="):
            _nproc = _arg.split("=", 1)[1]
        else:
            _rest.append(_arg)
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc_per_node={_nproc}", os.path.abspath(__file__), *_rest])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import filesystem as dcp_fs  # noqa: E402
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,  # noqa: E402
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import trainstate as ts  # noqa: E402

CHUNK = 64 << 20
GB = 1e9
MiB = 1 << 20
METHODS = ("trainstate", "dcp", "raw")
DROP_CACHES = "/proc/sys/vm/drop_caches"
ROOT = Path(__file__).resolve().parent.parent

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
T0 = time.perf_counter()


def rank() -> int:
    return dist.get_rank()


def say(msg: str) -> None:
    if rank() == 0:
        print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# cross-rank helpers (JSON through uint8 tensors) ----------------------------------------------------
def gather_json(value: object) -> list:
    data = json.dumps(value).encode()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64))
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(out, mine)
    return [json.loads(bytes(t[:int(s)].numpy())) for t, s in zip(out, sizes)]


def broadcast_json(value: object) -> object:
    return gather_json(value if rank() == 0 else None)[0]


# the state --------------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def pick_hidden(nbytes: int) -> int:
    """The layer width bench_suite.py uses for the same size: at least ~6 layers, at most 4096, a multiple of 256."""
    return max(256, min(4096, int((nbytes / (12 * 6)) ** 0.5) // 256 * 256))


def build(nbytes: int, hidden: int, seed: int) -> ts.TrainState:
    torch.manual_seed(seed)
    per_layer = 3 * (hidden * hidden + hidden) * 4  # fp32 weight + bias, x (param, exp_avg, exp_avg_sq)
    layers = max(1, round(nbytes / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, hidden)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)  # gradients are not part of the saved state
    state = ts.TrainState(model=model, optimizer=opt)
    state.next_update = 1
    return state


def local_tensors(state: ts.TrainState) -> dict[str, torch.Tensor]:
    """This rank's bytes of the model and optimizer: DTensors' local shards, read live (restores replace objects)."""
    model, opt = state["model"], state["optimizer"]
    out = {}
    for name, param in model.named_parameters():
        out[f"model.{name}"] = param
        for slot, value in opt.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{name}.{slot}"] = value
    local = {k: (v.to_local() if isinstance(v, DTensor) else v).detach() for k, v in out.items()}
    bad = [k for k, v in local.items() if not v.is_contiguous() or v.device.type != "cpu"]
    if bad:
        raise RuntimeError(f"local tensors not contiguous CPU memory (raw I/O needs that): {bad[:5]}")
    return local


def byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")


def differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in sorted(set(a) | set(b)) if k not in a or k not in b or a[k].dtype != b[k].dtype
            or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


# filesystem helpers ---------------------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def cold_works(root: Path) -> tuple[bool, str]:
    """Whether writing drop_caches really empties the page cache (not just whether the write succeeds)."""
    probe = root / "drop-probe"
    with open(probe, "wb") as f:
        for _ in range(128):
            f.write(os.urandom(MiB))
    before = meminfo("Cached")
    try:
        if not drop_caches():
            return False, f"cannot write {DROP_CACHES}: cold restores skipped"
        if meminfo("Cached") > before - (100 << 20):
            return False, "drop_caches accepted but the page cache did not shrink: cold restores skipped"
        return True, "drop_caches empties this kernel's page cache"
    finally:
        probe.unlink()


def prewarm(path: Path) -> None:
    buf = memoryview(bytearray(CHUNK))
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        with open(file, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def on_rank0(fn: Callable[[], object]) -> None:
    """``fn`` on rank 0 while the others wait (between barriers)."""
    dist.barrier()
    if rank() == 0:
        fn()
    dist.barrier()


def settle() -> None:
    on_rank0(lambda: (os.sync(), time.sleep(0.1)))


def timed(fn: Callable[[], object]) -> dict:
    """Barrier, ``fn`` on every rank, barrier: this rank's own seconds and the wall seconds to the last barrier."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    own = time.perf_counter() - start
    dist.barrier()
    return {"wall": time.perf_counter() - start, "own": own}


def rotated(items: tuple[str, ...], r: int) -> list[str]:
    k = r % len(items)
    return list(items[k:] + items[:k])


# the methods ------------------------------------------------------------------------------------------------
class Methods:
    def __init__(self, live: ts.TrainState, fresh: ts.TrainState, timeout_s: float):
        self.live, self.fresh, self.timeout_s = live, fresh, timeout_s
        self.extra: dict[str, list[float]] = defaultdict(list)  # setup/close seconds of trainstate managers

    def manager(self, where: Path, **kwargs) -> ts.CheckpointManager:
        start = time.perf_counter()
        ckpt = ts.CheckpointManager(where, collective_timeout_s=self.timeout_s, **kwargs)
        ckpt.__enter__()
        self.extra["setup_s"].append(time.perf_counter() - start)
        return ckpt

    def close(self, ckpt: ts.CheckpointManager) -> None:
        start = time.perf_counter()
        ckpt.close()
        self.extra["close_s"].append(time.perf_counter() - start)

    # saves: each returns a timing dict
    def save(self, method: str, out: Path) -> dict:
        if method == "trainstate":
            self.live.next_update += 1
            ckpt = self.manager(out, keep_last=1)
            try:
                return timed(lambda: ckpt.save(self.live))
            finally:
                self.close(ckpt)
        if method == "dcp":
            return timed(lambda: self.dcp_save(out))
        return timed(lambda: self.raw_save(out))

    def dcp_save(self, out: Path) -> None:
        model, opt = self.live["model"], self.live["optimizer"]
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(out), sync_files=True))

    def raw_save(self, out: Path) -> None:
        path = out / f"rank-{rank()}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        start = time.perf_counter()
        try:
            for tensor in local_tensors(self.live).values():
                view = byte_view(tensor)
                for at in range(0, len(view), CHUNK):
                    chunk = view[at:at + CHUNK]
                    while chunk:
                        chunk = chunk[os.write(fd, chunk):]
            wrote = time.perf_counter()
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(out)
        # the two phases of the floor: the copy into the page cache is what varies on this VM
        self.extra["raw_write_s"].append(wrote - start)
        self.extra["raw_fsync_s"].append(time.perf_counter() - wrote)

    # restores
    def restore(self, method: str, src: Path) -> dict:
        if method == "trainstate":
            ckpt = self.manager(src)
            try:
                return timed(lambda: ckpt.restore(self.fresh))
            finally:
                self.close(ckpt)
        if method == "dcp":
            return timed(lambda: self.dcp_load(src))
        return timed(lambda: self.raw_load(src))

    def dcp_load(self, src: Path) -> None:
        model, opt = self.fresh["model"], self.fresh["optimizer"]
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, storage_reader=dcp.FileSystemReader(str(src)))
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])

    def raw_load(self, src: Path) -> None:
        path = src / f"rank-{rank()}.bin"
        with open(path, "rb", buffering=0) as f:
            for tensor in local_tensors(self.fresh).values():
                view = byte_view(tensor)
                got = 0
                while got < len(view):
                    n = f.readinto(view[got:got + CHUNK])
                    if not n:
                        raise RuntimeError(f"{path} is shorter than the state")
                    got += n

    def scramble(self) -> None:
        with torch.no_grad():
            for tensor in local_tensors(self.fresh).values():
                tensor.zero_()

    def check(self) -> list[str]:
        return differs(local_tensors(self.live), local_tensors(self.fresh))


def bytes_per_rank(where: Path, method: str, world: int) -> dict[str, int]:
    """Bytes in ``where`` by the rank that writes them (rank 0: global files, metadata, pointer)."""
    out = {str(r): 0 for r in range(world)}
    for path in where.rglob("*"):
        if not path.is_file():
            continue
        name, owner = path.name, 0
        if method == "trainstate" and name[:5] in ("shard", "rank-"):
            owner = int(name.split("-")[1].split(".")[0])
        elif method == "dcp" and name.startswith("__") and name.endswith(".distcp"):
            owner = int(name[2:].split("_")[0])
        elif method == "raw":
            owner = int(name.split("-")[1].split(".")[0])
        out[str(owner)] += path.stat().st_size
    return out


# profile: timers wrapped around library functions ------------------------------------------------------
class Profiler:
    """Seconds and calls per label, added by wrappers installed on library functions (inclusive times)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.undo: list[Callable[[], None]] = []
        self.missing: list[str] = []
        self.context = threading.local()

    def wrap(self, owner: object, name: str, label: str | Callable[..., str]) -> None:
        """Replace ``owner.name`` by a timer around it; ``label`` may compute the label from the call's arguments."""
        raw = vars(owner).get(name)
        if raw is None:
            self.missing.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            key = label(*args, **kwargs) if callable(label) else label
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start
                self.calls[key] += 1

        setattr(owner, name, staticmethod(wrapper) if isinstance(raw, staticmethod) else wrapper)
        self.undo.append(lambda: setattr(owner, name, raw))

    def file_kind(self) -> str:
        return getattr(self.context, "file", "other")

    def install(self) -> None:
        from trainstate.distributed import capture, commit, load, session, storage
        from trainstate.format import tensorfile
        from trainstate.publish import Publisher
        from trainstate.state import snapshot
        from trainstate.storage import local

        prof = self
        # save
        self.wrap(session.Session, "prepare", "save/prepare")
        self.wrap(session, "capture", "save/prepare/capture")
        self.wrap(capture, "sharded_state", "save/prepare/capture/sharded_state (get_*_state_dict)")
        self.wrap(capture, "_replica_digests", "save/prepare/capture/replica digests")
        self.wrap(capture, "_settings", "save/prepare/capture/settings digest")
        self.wrap(commit, "publish", "save/publish")
        self.wrap(commit, "_begin", "save/publish/1 begin")
        self.wrap(commit, "_stage", "save/publish/2 stage (per-rank records)")
        self.wrap(commit, "_write", "save/publish/3 write (dcp.save)")
        self.wrap(storage.Writer, "write_data", "save/publish/3 write/write_data (shard)")
        self.wrap(storage.Writer, "finish", "save/publish/3 write/finish (rank 0)")
        self.wrap(local.LocalStaging, "commit", "save/publish/3 write/finish/commit (dir fsyncs, rename)")
        self.wrap(commit, "_verify_and_publish", "save/publish/4+5 verify and publish")
        self.wrap(commit, "verify_generation", "save/publish/4+5/verify_generation (rank 0)")
        self.wrap(commit, "verify_share", "save/publish/4+5/verify_share (re-read + digest)")
        self.wrap(local.LocalStore, "write_pointer", "save/publish/4+5/write_pointer")
        self.wrap(Publisher, "prune", "save/publish/4+5/prune")
        original_write = local.LocalStaging.write

        def staging_write(staging, file, chunks, **kwargs):
            prof.context.file = "shard" if file.startswith("shard-") else "records"
            start = time.perf_counter()
            try:
                return original_write(staging, file, chunks, **kwargs)
            finally:
                prof.seconds[f"file/{prof.context.file}: staging.write"] += time.perf_counter() - start
                prof.calls[f"file/{prof.context.file}: staging.write"] += 1
                prof.context.file = "other"
        local.LocalStaging.write = staging_write
        self.undo.append(lambda: setattr(local.LocalStaging, "write", original_write))
        self.wrap(local, "_write_all", lambda *a, **k: f"file/{prof.file_kind()}: write()")
        self.wrap(local, "_fsync_beside", lambda *a, **k: f"file/{prof.file_kind()}: fsync beside digest (wall)")
        self.wrap(local, "_hash_while_writing", lambda *a, **k: f"file/{prof.file_kind()}: write beside digest")
        self.wrap(os, "fsync", "os.fsync (all threads)")
        original_hasher = local.new_hasher

        class TimedHasher:
            def __init__(self, inner):
                self.inner = inner

            def update(self, data):
                start = time.perf_counter()
                try:
                    return self.inner.update(data)
                finally:
                    prof.seconds["digest update() (staging, any thread)"] += time.perf_counter() - start

            def hexdigest(self):
                return self.inner.hexdigest()

            def __getattr__(self, name):  # a chunked hasher's chunk digests, and anything else it offers
                return getattr(self.inner, name)
        local.new_hasher = lambda algorithm: TimedHasher(original_hasher(algorithm))
        self.undo.append(lambda: setattr(local, "new_hasher", original_hasher))
        # the collectives of the protocol (JSON over gloo): time spent here is mostly waiting for the other rank
        from trainstate.distributed.group import Ranks
        self.wrap(Ranks, "all_gather", lambda _, value, phase: f"collective/{phase}")
        self.wrap(Ranks, "broadcast", lambda _, value, phase: f"collective/{phase}")
        self.wrap(Ranks, "check", lambda _, phase, error: f"collective/{phase} (check)")
        self.wrap(Ranks, "barrier", lambda _, phase: f"collective/{phase} (barrier)")
        # restore
        self.wrap(load, "_choose", "restore/1 choose")
        self.wrap(load, "verify_generation", "restore/1 choose/verify_generation (manifest, sizes)")
        self.wrap(load, "verify_share", "restore/1 choose/verify_share (re-read + digest)")
        self.wrap(load, "_read", "restore/1 choose/_read (small files)")
        self.wrap(load, "_load", "restore/2+3 check and load")
        self.wrap(load, "sharded_state", "restore/2+3/templates (get_*_state_dict)")
        self.wrap(storage.Reader, "read_data", "restore/2+3/dcp read_data")
        self.wrap(tensorfile, "read_tensor", "restore/2+3/dcp read_data/read_tensor (into new tensors)")
        self.wrap(storage.Reader, "_read_verified", "restore/2+3/dcp read_data/_read_verified (one pass)")
        self.wrap(storage.Reader, "_deliver", "restore/2+3/dcp read_data/_deliver (copy_ into target)")
        self.wrap(load, "set_model_state_dict", "restore/2+3/set_model_state_dict")
        self.wrap(load, "set_optimizer_state_dict", "restore/2+3/set_optimizer_state_dict")
        self.wrap(snapshot, "apply", "restore/2+3/snapshot.apply (rng, scalars)")
        # stock DCP, for reference
        self.wrap(dcp_fs._FileSystemWriter, "write_data", "dcp/FileSystemWriter.write_data")
        self.wrap(dcp_fs._FileSystemWriter, "finish", "dcp/FileSystemWriter.finish")
        self.wrap(dcp_fs.FileSystemReader, "read_data", "dcp/FileSystemReader.read_data")

    def uninstall(self) -> None:
        for undo in reversed(self.undo):
            undo()
        self.undo.clear()

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        self.calls.clear()
        return out


def run_background(m: Methods, root: Path, n: int) -> dict:
    """``n`` pairs in one trainstate manager (``keep_last=2``): a background save's blocking part (from the call
    until ``save(blocking=False)`` returned on every rank), its wait, then a blocking save; the first background
    save follows ``preallocate``. The figure a trainer feels is the blocking part against a blocking save."""
    out = root / "background"
    on_rank0(lambda: out.mkdir())
    # full_every=None: the state does not change between these saves, and an incremental save of it (the default)
    # would link every file, which is not the blocking save a background one is measured against
    ckpt = m.manager(out, keep_last=2, full_every=None)
    rows: dict[str, list[float]] = defaultdict(list)
    try:
        m.live.next_update += 1
        timed(lambda: ckpt.save(m.live))  # the directory's steady state: a generation to prune from
        start = time.perf_counter()
        rows["preallocated_bytes"].append(ckpt.preallocate(m.live))
        rows["preallocate_s"].append(time.perf_counter() - start)
        for i in range(n):
            m.live.next_update += 1
            settle()
            rows["first_background" if i == 0 else "background"].append(
                timed(lambda: ckpt.save(m.live, blocking=False))["wall"])
            rows["wait"].append(timed(ckpt.wait)["wall"])
            m.live.next_update += 1
            settle()
            rows["blocking"].append(timed(lambda: ckpt.save(m.live))["wall"])
            say(f"background pair {i}: background {rows['first_background' if i == 0 else 'background'][-1]:.3f} s "
                f"(+ wait {rows['wait'][-1]:.3f} s), blocking {rows['blocking'][-1]:.3f} s")
    finally:
        m.close(ckpt)
        on_rank0(lambda: shutil.rmtree(out))
    return {**rows, "load": list(os.getloadavg())}


def background_lines(b: dict) -> list[str]:
    blocking = med(b["blocking"])
    steady = med(b["background"]) if b["background"] else None
    lines = [f"  background saves ({len(b['blocking'])} pairs, load {b['load'][0]:.1f}): blocking save median "
             f"{blocking:.3f} s; first background after preallocate ({b['preallocated_bytes'][0] / MiB:.0f} MiB per "
             f"rank, {b['preallocate_s'][0]:.2f} s) blocks {b['first_background'][0]:.3f} s "
             f"({b['first_background'][0] / blocking:.3f}x)"]
    if steady is not None:
        lines.append(f"    steady background blocks {steady:.3f} s ({steady / blocking:.3f}x the blocking save; "
                     f"min {min(b['background']):.3f}), its wait {med(b['wait']):.3f} s")
    return lines


def run_profile(m: Methods, root: Path, n: int, cold_ok: bool) -> dict:
    """``n`` rounds of trainstate and DCP save, restore warm, restore cold, with the stage timers installed."""
    prof = Profiler()
    prof.install()
    rows: dict[str, list[dict]] = defaultdict(list)
    try:
        for i in range(n):
            for method in ("trainstate", "dcp"):
                out = root / f"profile-{i}-{method}"
                on_rank0(lambda o=out: o.mkdir())
                settle()
                prof.take()
                t = m.save(method, out)
                rows[f"{method} save"].append({"total": t["own"], "wall": t["wall"], **prof.take()})
                for cache in (("cold", "warm") if cold_ok else ("warm",)):
                    on_rank0(drop_caches if cache == "cold" else (lambda o=out: prewarm(o)))
                    m.scramble()
                    prof.take()
                    t = m.restore(method, out)
                    rows[f"{method} restore {cache}"].append({"total": t["own"], "wall": t["wall"], **prof.take()})
                on_rank0(lambda o=out: shutil.rmtree(o))
    finally:
        prof.uninstall()
    medians = {}
    for op, samples in rows.items():
        keys = sorted({k for s in samples for k in s})
        medians[op] = {k: statistics.median(s.get(k, 0.0) for s in samples) for k in keys}
    return {"medians": medians, "missing_hooks": prof.missing}


# reporting --------------------------------------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(times: dict[str, list[dict]], nbytes: int, title: str) -> list[str]:
    ts_wall = [t["wall"] for t in times["trainstate"]]
    lines = [f"  {title:12s} {'median s':>9s} {'min-max s':>13s} {'GB/s':>6s} {'dcp/ts':>7s} {'raw/ts':>7s} "
             f"{'per-rep dcp/ts':>15s} {'raw/ts':>7s}"]
    for method in METHODS:
        wall = [t["wall"] for t in times[method]]
        lines.append(f"  {method:12s} {med(wall):9.3f} {min(wall):6.2f}-{max(wall):<6.2f} {nbytes / GB / med(wall):6.2f}"
                     + ("" if method != "trainstate" else
                        f" {med([t['wall'] for t in times['dcp']]) / med(ts_wall):7.2f}"
                        f" {med([t['wall'] for t in times['raw']]) / med(ts_wall):7.2f}"
                        f" {med([d['wall'] / s for d, s in zip(times['dcp'], ts_wall)]):15.2f}"
                        f" {med([r['wall'] / s for r, s in zip(times['raw'], ts_wall)]):7.2f}"))
    return lines


def by_position(times: dict[str, list[dict]], reps: int) -> dict[str, list[float | None]]:
    """Median seconds of each method by its place in the repetition (1st, 2nd, 3rd): rotation balances these
    only when ``reps`` is a multiple of the number of methods."""
    out = {}
    for method in METHODS:
        places: dict[int, list[float]] = defaultdict(list)
        for r in range(reps):
            places[rotated(METHODS, r).index(method)].append(times[method][r]["wall"])
        out[method] = [med(places[i]) if places[i] else None for i in range(len(METHODS))]
    return out


def ratios(times: dict[str, list[dict]]) -> dict:
    ts_wall = [t["wall"] for t in times["trainstate"]]
    out = {}
    for other in ("dcp", "raw"):
        wall = [t["wall"] for t in times[other]]
        out[f"{other}_over_trainstate_medians"] = med(wall) / med(ts_wall)
        out[f"{other}_over_trainstate_per_rep_median"] = med([o / s for o, s in zip(wall, ts_wall)])
    return out


def profile_lines(prof_by_rank: list[dict]) -> list[str]:
    lines = []
    ops = list(prof_by_rank[0]["medians"])
    for op in ops:
        keys = sorted({k for p in prof_by_rank for k in p["medians"].get(op, {})}, key=lambda k: (k not in ("total", "wall"), k))
        lines.append(f"  {op}: " + "   ".join(f"rank {r}" for r in range(len(prof_by_rank))))
        for key in keys:
            vals = [p["medians"].get(op, {}).get(key) for p in prof_by_rank]
            if all(v is None or v < 0.0005 for v in vals):
                continue
            lines.append(f"    {key:70s} " + " ".join("      -" if v is None else f"{v:7.3f}" for v in vals))
    return lines


def tree_digest() -> str:
    h = hashlib.sha256()
    for path in sorted((ROOT / "trainstate").rglob("*.py")):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


# main --------------------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1G", help="total tensor bytes over all ranks (binary units: 256M, 1G)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--profile", type=int, default=2, help="profiled rounds after the timed ones (0: none)")
    parser.add_argument("--no-cold", action="store_true", help="warm restores only")
    parser.add_argument("--background", type=int, default=4,
                        help="pairs of background and blocking trainstate saves after the reps (0: none)")
    parser.add_argument("--dir", default=None, help="where to write (default: a fresh temp dir, removed at the end)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--timeout", type=float, default=600.0, help="collective_timeout_s of the managers")
    parser.add_argument("--nproc", default="2", help="ranks, when the script launches torchrun itself")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # one core per rank on this machine
    world = dist.get_world_size()
    nbytes = parse_size(args.size)
    hidden = pick_hidden(nbytes)

    chosen = None
    if rank() == 0:  # one directory for all ranks (they share this filesystem)
        chosen = str(Path(args.dir).resolve()) if args.dir else tempfile.mkdtemp(prefix="bench-dist-")
    root = Path(broadcast_json(chosen))
    on_rank0(lambda: root.mkdir(parents=True, exist_ok=True))
    checks = {"free": shutil.disk_usage(root).free, "mem": meminfo("MemAvailable")}
    if checks["free"] < 5 * nbytes or checks["mem"] < 3 * nbytes + (1 << 30):
        say(f"refused: {args.size} needs about {5 * nbytes / GB:.1f} GB free disk and {(3 * nbytes + (1 << 30)) / GB:.1f}"
            f" GB available memory; have {checks['free'] / GB:.1f} / {checks['mem'] / GB:.1f}")
        dist.destroy_process_group()
        return 2
    cold_ok, cold_note = broadcast_json(list(cold_works(root)) if rank() == 0 else None)
    if args.no_cold:
        cold_ok, cold_note = False, "--no-cold"
    say(f"{world} ranks, {args.size} total, hidden {hidden}; {cold_note}; trainstate {git('rev-parse', '--short', 'HEAD')}"
        f" + working tree {tree_digest()}; torch {torch.__version__}")

    live = build(nbytes, hidden, seed=0)
    fresh = build(nbytes, hidden, seed=1)
    m = Methods(live, fresh, args.timeout)
    mine = local_tensors(live)
    per_rank_bytes = gather_json(sum(t.nbytes for t in mine.values()))
    total = sum(per_rank_bytes)
    say(f"state: {len(live['model'])} x Linear({hidden}), {len(mine)} local tensors per rank, "
        f"{total:,} bytes in all ({', '.join(f'{b:,}' for b in per_rank_bytes)} per rank)")
    first_differs = bool(m.check())  # the target starts different, so a restore that loads nothing fails the check

    saves: dict[str, list[dict]] = {k: [] for k in METHODS}
    restores: dict[str, dict[str, list[dict]]] = {c: {k: [] for k in METHODS} for c in ("cold", "warm")}
    checks_failed: list[str] = []
    written: dict[str, dict] = {}
    loads: list[list[float]] = []
    for r in range(args.reps):
        loads.append(list(os.getloadavg()))
        work = root / f"rep{r}"
        on_rank0(lambda: [(work / k).mkdir(parents=True) for k in METHODS])
        for method in rotated(METHODS, r):
            settle()
            saves[method].append(m.save(method, work / method))
            say(f"save    rep {r} {method:10s} {saves[method][-1]['wall']:7.3f} s")
            if r == 0 and rank() == 0:
                written[method] = bytes_per_rank(work / method, method, world)
        loads[-1] += list(os.getloadavg())
        for method in rotated(METHODS, r):
            for cache in (("cold", "warm") if cold_ok else ("warm",)):
                m.scramble()
                on_rank0(drop_caches if cache == "cold" else (lambda p=work / method: prewarm(p)))
                restores[cache][method].append(m.restore(method, work / method))
                bad = gather_json(m.check())
                if any(bad):
                    checks_failed.append(f"rep {r} {method} {cache}: {bad}")
                say(f"restore rep {r} {method:10s} {cache} {restores[cache][method][-1]['wall']:7.3f} s"
                    + ("" if not any(bad) else "  NOT EQUAL"))
        on_rank0(lambda: shutil.rmtree(work))
        loads[-1] += list(os.getloadavg())

    background = run_background(m, root, args.background) if args.background else None
    profile = run_profile(m, root, args.profile, cold_ok) if args.profile else None
    prof_by_rank = gather_json(profile)
    extra_by_rank = gather_json(dict(m.extra))
    own = gather_json({"saves": saves, "restores": restores})
    if rank() == 0:
        cases = [("save", saves)] + [(f"restore {c}", restores[c]) for c in ("cold", "warm") if cold_ok or c == "warm"]
        lines = [f"\n{world} ranks, {total / 2**30:.3f} GiB of tensor bytes ({total / GB:.2f} GB), {args.reps} reps; "
                 f"load average (1-min) per rep at start/after saves/end: "
                 + "; ".join("/".join(f"{x[i]:.1f}" for i in (0, 3, 6)) for x in loads)]
        for title, times in cases:
            lines += table(times, total, title)
        lines.append("  (ratios: other method's seconds / trainstate's, so >1 = trainstate faster; rank 0 wall, "
                     "barrier to barrier)")
        places = by_position(saves, args.reps)
        lines.append("  save median s by place in the repetition (1st/2nd/3rd): " + "; ".join(
            f"{k} " + "/".join("-" if v is None else f"{v:.2f}" for v in vals) for k, vals in places.items()))
        lines.append("  raw save phases, median s per rank (write into the page cache / fsync): " + "; ".join(
            f"r{r} {med(e.get('raw_write_s', [])):.2f} ({min(e.get('raw_write_s', [0])):.2f}-"
            f"{max(e.get('raw_write_s', [0])):.2f}) / {med(e.get('raw_fsync_s', [])):.2f}"
            for r, e in enumerate(extra_by_rank)))
        lines.append("  bytes written per rank (rep 0): " + "; ".join(
            f"{k}: " + ", ".join(f"r{r} {v / MiB:.1f} MiB" for r, v in w.items()) for k, w in written.items()))
        lines.append("  trainstate manager setup / close, median s per rank: "
                     + "; ".join(f"r{r} {med(e.get('setup_s', [])):.3f} / {med(e.get('close_s', [])):.3f}"
                                 for r, e in enumerate(extra_by_rank)))
        lines.append(f"  restored state bitwise equal after every restore: {not checks_failed} "
                     f"(target differed before the first: {first_differs})")
        if checks_failed:
            lines += [f"    {c}" for c in checks_failed]
        if background:
            lines += background_lines(background)
        if profile:
            lines.append(f"\nprofile ({args.profile} rounds, medians, seconds, inclusive; per rank):")
            lines += profile_lines(prof_by_rank)
            if profile["missing_hooks"]:
                lines.append(f"  hooks not installed (renamed in the library?): {profile['missing_hooks']}")
        print("\n".join(lines), flush=True)
        if args.out:
            result = {
                "config": {"world_size": world, "size": args.size, "state_bytes": total, "per_rank_bytes": per_rank_bytes,
                           "hidden": hidden, "layers": len(live["model"]), "reps": args.reps, "cold": cold_ok,
                           "cold_note": cold_note, "torch_threads_per_rank": 1, "dir": str(root)},
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                            "torch": torch.__version__, "mem_total": meminfo("MemTotal")},
                "trainstate": {"commit": git("rev-parse", "HEAD"), "tree_digest": tree_digest(),
                               "dirty": git("status", "--short", "trainstate").splitlines()},
                "load_average_per_rep": loads,
                "save": {"times": saves, "ratios": ratios(saves), "by_position": by_position(saves, args.reps)},
                "restore": {c: {"times": restores[c], "ratios": ratios(restores[c])} for c in restores
                            if restores[c]["trainstate"]},
                "per_rank_times": own, "bytes_written_per_rank": written, "manager_setup_close": extra_by_rank,
                "bitwise_equal": not checks_failed, "check_failures": checks_failed,
                "target_differed_before_first_restore": first_differs, "profile_by_rank": prof_by_rank,
                "background": background,
            }
            Path(args.out).write_text(json.dumps(result, indent=1))
            print(f"wrote {args.out}", flush=True)
    dist.barrier()
    if not args.dir:
        on_rank0(lambda: shutil.rmtree(root, ignore_errors=True))
    dist.destroy_process_group()
    return 1 if checks_failed else 0


if __name__ == "__main__":
    sys.exit(main())
