"""The ranks' side of ``benchmarks/bench_tiers.py``: one ``torchrun`` agent per simulated node (``tests/multinode.py``).

``tier_bench_worker.py OUT PHASE [PHASE ...]``; the configuration comes in ``$TS_BENCH`` (JSON, written by
``bench_tiers.py``), each node's directory in ``$TRAINSTATE_NODE_DIR``. Every phase writes
``OUT/<phase>/rank<r>.json``. Phases:

- ``save``: save stall (node-local tier, replicas in the background) against the same save straight to the
  object store and against ``wait_replicas=True``, plus blocks of training steps without a save and right after a
  tiered save (replication running in the background), all interleaved, rotated per repetition;
- ``setup_restore``: one generation in the node-local tier (replicas complete) and the same on the object store,
  and a digest of every rank's local tensors;
- ``restore_tier`` / ``restore_remote``: a fresh, differently seeded state restored from the node-local tiers or
  from the object store; the restored local tensors are compared with the saved digest;
- ``headline``: ``--updates`` updates, a ``save(blocking=False)`` after every update into a RAM-disk tier, against
  the same updates without checkpointing (interleaved), with timers around library functions.

State: a stack of square ``nn.Linear`` layers, each ``fully_shard``-ed, then the root (FSDP2), AdamW (parameters,
``exp_avg``, ``exp_avg_sq``: the size is their total bytes over all ranks). One torch thread per rank (gloo, CPU).
The library is not edited: the timers wrap module functions and methods while the phase runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import trainstate as ts
from trainstate.asyncsave import Writer
from trainstate.storage.fetched import Fetched
from trainstate.distributed import group as group_mod
from trainstate.distributed import load as load_mod
from trainstate.distributed import share as share_mod
from trainstate.distributed import session as session_mod
from trainstate.distributed import tierfetch, tierload, tiersave

warnings.filterwarnings("ignore", category=FutureWarning)
CONFIG = json.loads(os.environ.get("TS_BENCH", "{}"))
TIMEOUT_S = float(CONFIG.get("collective_timeout_s", 600))
T0 = time.perf_counter()
PHASES = {}


def phase(fn):
    PHASES[fn.__name__] = fn
    return fn


def now() -> float:
    return time.perf_counter() - T0


def node_dir() -> Path:
    return Path(os.environ["TRAINSTATE_NODE_DIR"])


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this rank, the writer thread included
    return usage.ru_utime + usage.ru_stime


# timers around library functions -----------------------------------------------------------------------------
class Timers:
    """Every call of the wrapped functions: (name, on the main thread?, start, end), relative to T0."""

    def __init__(self):
        self.events: list[tuple[str, bool, float, float]] = []
        self._lock = threading.Lock()
        self._undo: list = []
        self.missing: list[str] = []

    def wrap(self, owner, attr: str, name: str, static: bool = False) -> None:
        """Time every call of ``owner.attr`` as ``name``; a name the library no longer has is skipped (and listed
        in ``missing``: that part of the breakdown is then absent, the figures themselves are not affected)."""
        if attr not in (owner.__dict__ if isinstance(owner, type) else vars(owner)):
            self.missing.append(f"{getattr(owner, '__name__', owner)}.{attr}")
            return
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        fn = original.__func__ if isinstance(original, staticmethod) else original
        timers = self

        def timed(*args, **kwargs):
            start = now()
            try:
                return fn(*args, **kwargs)
            finally:
                end = now()
                with timers._lock:
                    timers.events.append((name, threading.current_thread() is threading.main_thread(), start, end))

        setattr(owner, attr, staticmethod(timed) if static else timed)
        self._undo.append((owner, attr, original))

    def install(self) -> Timers:
        self.wrap(tiersave, "publish", "local_commit")  # the local tier's commit (caller's thread, or the writer's)
        self.wrap(tiersave, "replicate", "replicate")  # the replicated tier (writer thread unless wait_replicas)
        self.wrap(tiersave, "prune", "prune")
        for step_ in ("_begin", "_stage", "_write", "_complete", "_verify", "_point", "_transfer"):
            self.wrap(tiersave, step_, f"tiersave.{step_[1:]}")  # the steps inside publish and replicate
        self.wrap(tierload, "_refill", "refill")  # after restore returns, on the writer thread
        # a restore's steps (tiered and object store alike: both fetch into memory, verified, then load)
        self.wrap(tierload, "holdings", "restore.report")  # a tiered restore: what each node holds
        self.wrap(load_mod, "fetch_share", "restore.fetch")  # the four collective fetch rounds
        self.wrap(load_mod, "_load", "restore.load")  # checks and DCP load from the verified bytes
        self.wrap(Fetched, "fetch_chunks", "restore.read")  # this rank's reads (its disk, or GETs), digests
        self.wrap(tierfetch, "_exchange", "restore.share")  # reads; chunks sent to the ranks lacking them
        self.wrap(share_mod, "_share", "restore.share")  # a restore's refill of a node that lost its holding
        self.wrap(tierload, "_shared_manifest", "restore.manifest")  # the steps of a restore, for its timeline
        for attr, label in (("_templates", "templates"), ("verify_generation", "verify"), ("_read", "decode"),
                            ("_load_checked", "dcp"), ("set_model_state_dict", "set_model"),
                            ("set_optimizer_state_dict", "set_optim")):
            self.wrap(load_mod, attr, f"restore.{label}")
        self.wrap(group_mod.Ranks, "all_gather", "restore.gather")
        self.wrap(group_mod.Ranks, "broadcast", "restore.gather")
        self.wrap(share_mod, "_planned_entries", "restore.plan")  # DCP's local plan, made once (reused by the load)
        self.wrap(share_mod, "metadata_from_json", "restore.metadata")  # DCP's metadata, decoded
        self.wrap(session_mod.Session, "prepare", "prepare")  # capture at the boundary (collective)
        self.wrap(session_mod.Session, "stage", "stage", static=True)  # the owned copy for a background save
        self.wrap(Writer, "reserve", "reserve")  # backpressure: a slot for the next background save
        self.wrap(session_mod, "capture", "prepare.capture")  # inside prepare: the state dicts, digests
        self.wrap(group_mod.Ranks, "join", "prepare.join")  # inside prepare: every rank entered the save
        return self

    def count_collectives(self) -> Timers:
        """``torch.distributed`` calls made off the main thread (the writer's: the library's and DCP's own), one
        event each (``dist.<name>``); the training thread's collectives are not recorded."""
        timers = self
        for attr in ("all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "gather_object",
                     "scatter_object_list", "barrier", "monitored_barrier", "send", "recv", "all_reduce", "gather",
                     "scatter", "reduce_scatter"):
            fn = getattr(dist, attr, None)
            if fn is None:
                continue

            def timed(*args, __fn=fn, __name=f"dist.{attr}", **kwargs):
                if threading.current_thread() is threading.main_thread():
                    return __fn(*args, **kwargs)
                start = now()
                try:
                    return __fn(*args, **kwargs)
                finally:
                    end = now()
                    with timers._lock:
                        timers.events.append((__name, False, start, end))

            setattr(dist, attr, timed)
            self._undo.append((dist, attr, fn))
        return self

    def uninstall(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()

    def take(self) -> list:
        with self._lock:
            out, self.events = self.events, []
        return [[n, main, round(s, 5), round(e, 5)] for n, main, s, e in out]


# the state and one update -------------------------------------------------------------------------------------
def build(seed: int) -> ts.TrainState:
    hidden = CONFIG["hidden"]
    torch.manual_seed(seed)
    per_layer = 3 * (hidden * hidden + hidden) * 4  # fp32 weight + bias, x (param, exp_avg, exp_avg_sq)
    layers = max(1, round(CONFIG["size"] / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = ts.TrainState(model=model, optimizer=opt)
    state.next_update = 0
    step(state, 1)  # AdamW's moments exist from here on
    return state


_inputs: dict[int, torch.Tensor] = {}


def step(state: ts.TrainState, batch: int) -> None:
    """One update: forward, backward (FSDP2's all-gathers and reduce-scatters), AdamW."""
    x = _inputs.get(batch)
    if x is None:
        g = torch.Generator().manual_seed(1234 + dist.get_rank())
        x = _inputs[batch] = torch.randn(batch, CONFIG["hidden"], generator=g)
    model, opt = state["model"], state["optimizer"]
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state.next_update += 1


def local_digest(state: ts.TrainState) -> str:
    """This rank's local bytes of the model and optimizer (DTensors' local shards), in a fixed order."""
    model, opt = state["model"], state["optimizer"]
    h = hashlib.sha256()
    for name, param in model.named_parameters():
        tensors = [param] + [v for _, v in sorted(opt.state.get(param, {}).items()) if isinstance(v, torch.Tensor)]
        for t in tensors:
            t = t.to_local() if isinstance(t, DTensor) else t
            h.update(name.encode())
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def broadcast(value):
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def tiered(sub: str, **kwargs) -> ts.CheckpointManager:
    return ts.CheckpointManager(node_dir() / sub, keep_last=2, replicas=2, collective_timeout_s=TIMEOUT_S, **kwargs)


def remote(url: str, options: dict, **kwargs) -> ts.CheckpointManager:
    return ts.CheckpointManager(url, storage_options=options, collective_timeout_s=TIMEOUT_S, **kwargs)


def timed_steps(state: ts.TrainState, n: int, batch: int, ckpt=None) -> list:
    """``n`` updates; each: [seconds, whether ckpt's writer had work in flight when the update began]."""
    out = []
    for _ in range(n):
        busy = bool(ckpt is not None and ckpt._writer.in_flight())  # private: the bench only reads it
        t = time.perf_counter()
        step(state, batch)
        out.append([round(time.perf_counter() - t, 5), busy])
    return out


# phases ---------------------------------------------------------------------------------------------------------
@phase
def save(out: Path) -> dict:
    """Parts 1 and 3: the save stall per method, and the training step beside background replication."""
    batch, reps = CONFIG["batch"], CONFIG["reps"]
    timers = Timers().install()
    state = build(seed=0)
    managers = {"tier": tiered("tier-bg"), "tier-wait": tiered("tier-wait", wait_replicas=True),
                "remote": remote(CONFIG["url"], CONFIG["storage_options"], keep_last=2)}
    result: dict = {"node": os.environ.get("TRAINSTATE_TEST_NODE"), "load": [], "reps": [],
                    "timers_missing": timers.missing}
    # warm-up: every manager saves once (directories, run identity, gloo groups, staging buffers)
    warm = {}
    for name, ckpt in managers.items():
        dist.barrier()
        t = time.perf_counter()
        info = ckpt.save(state)
        stall = time.perf_counter() - t
        ckpt.wait()
        warm[name] = [round(stall, 4), round(time.perf_counter() - t, 4)]
        result["size"] = info.size
    base = timed_steps(state, 5, batch)
    step_s = sorted(s for s, _ in base)[2]
    k = CONFIG.get("steps") or min(60, max(6, int(warm["tier"][1] / step_s) + 4))  # steps to cover replication
    k = broadcast(k)
    result.update(warm=warm, warm_step_s=step_s, steps_per_block=k)
    timers.take()
    methods = ["steps", "tier", "remote", "tier-wait"]
    for r in range(reps):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        rep: dict = {"order": order}
        result["load"].append(load())
        for method in order:
            if method == "steps":
                dist.barrier()
                rep["steps"] = timed_steps(state, k, batch)
                continue
            ckpt = managers[method]
            dist.barrier()
            t = time.perf_counter()
            info = ckpt.save(state)
            local = time.perf_counter() - t
            dist.barrier()
            rep[method] = {"stall_s": round(time.perf_counter() - t, 5), "rank_s": round(local, 5),
                           "generation": info.name}
            if method == "tier":  # replication runs on the writer thread: train beside it, then wait for the rest
                rep["tier_steps"] = timed_steps(state, k, batch, ckpt)
                t_wait = time.perf_counter()
                ckpt.wait()
                rep["tier"]["wait_after_steps_s"] = round(time.perf_counter() - t_wait, 5)
                dist.barrier()
            rep[method]["events"] = timers.take()
            rep[method]["saved_at"] = round(t - T0, 5)
        result["reps"].append(rep)
    result["load"].append(load())
    for ckpt in managers.values():
        ckpt.close()
    timers.uninstall()
    return result


@phase
def setup_restore(out: Path) -> dict:
    """One generation in the node-local tiers (replicas committed) and the same one on the object store."""
    state = build(seed=1)
    for _ in range(2):
        step(state, CONFIG["batch"])
    with tiered("recover", wait_replicas=True) as ckpt:
        info = ckpt.save(state)
        status = ckpt.status().tiers
    with remote(CONFIG["restore_url"], CONFIG["storage_options"], keep_last=1) as ckpt:
        remote_info = ckpt.save(state)
    return {"size": info.size, "remote_size": remote_info.size, "generation": info.name,
            "remote_generation": remote_info.name, "digest": local_digest(state), "tiers": status,
            "node": os.environ.get("TRAINSTATE_TEST_NODE")}


def _restore(make) -> dict:
    timers = Timers().install()
    state = build(seed=2)  # other values everywhere: a restore that loads nothing is caught by the digest
    dist.barrier()
    t = time.perf_counter()
    ckpt = make()
    built = time.perf_counter() - t
    dist.barrier()
    load0, cpu0 = load(), cpu_s()
    profile = CONFIG.get("profile_dir")
    if profile:  # --profile-dir: each rank's restore under cProfile (the figures then include its overhead)
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t = time.perf_counter()
    info = ckpt.restore(state)
    dist.barrier()
    seconds = time.perf_counter() - t
    if profile:
        profiler.disable()
        tag = f"{os.environ.get('TRAINSTATE_TEST_NODE')}-{dist.get_rank()}-{time.time_ns()}"
        profiler.dump_stats(str(Path(profile) / f"restore-{tag}.prof"))
    cpu = cpu_s() - cpu0
    ckpt.close()
    events = timers.take()
    timers.uninstall()
    return {"manager_s": round(built, 5), "restore_s": round(seconds, 5), "cpu_s": round(cpu, 4),
            "generation": info.generation.name, "sources": info.sources, "digest": local_digest(state),
            "events": events, "load": load0, "timers_missing": timers.missing, "node": os.environ.get("TRAINSTATE_TEST_NODE"),
            "held_before": sorted(p.name for p in (node_dir() / "recover").glob("gen-*"))}


@phase
def restore_tier(out: Path) -> dict:
    return _restore(lambda: tiered("recover"))


@phase
def restore_remote(out: Path) -> dict:
    return _restore(lambda: remote(CONFIG["restore_url"], CONFIG.get("restore_options") or CONFIG["storage_options"]))


@phase
def headline(out: Path) -> dict:
    """Part 4: a background save after every update into a RAM-disk tier, against no checkpointing."""
    batch, updates = CONFIG["headline_batch"], CONFIG["updates"]
    timers = Timers().install().count_collectives()
    state = build(seed=3)
    ckpt = tiered("headline")
    result: dict = {"node": os.environ.get("TRAINSTATE_TEST_NODE"), "node_dir": str(node_dir()), "runs": [],
                    "timers_missing": timers.missing}
    timed_steps(state, 3, batch)
    for _ in range(2):  # warm-up: the staging buffers, the directories, the writer thread
        handle = ckpt.save(state, blocking=False)
        step(state, batch)
    result["size"] = handle.wait().size
    ckpt.wait()
    timers.take()
    for r in range(CONFIG["headline_reps"]):
        for mode in (["none", "ckpt"] if r % 2 == 0 else ["ckpt", "none"]):
            dist.barrier()
            run: dict = {"mode": mode, "rep": r, "load_before": load()}
            steps, stalls = [], []
            cpu0, t0 = cpu_s(), time.perf_counter()
            for _ in range(updates):
                t = time.perf_counter()
                step(state, batch)
                steps.append(round(time.perf_counter() - t, 5))
                if mode == "ckpt":
                    t = time.perf_counter()
                    ckpt.save(state, blocking=False)
                    stalls.append(round(time.perf_counter() - t, 5))
            run["loop_s"] = round(time.perf_counter() - t0, 4)
            ckpt.wait()  # the last background save: part of the run's cost
            run["drained_s"] = round(time.perf_counter() - t0, 4)
            dist.barrier()
            run["barrier_s"] = round(time.perf_counter() - t0, 4)
            run.update(cpu_s=round(cpu_s() - cpu0, 3), steps=steps, stalls=stalls, events=timers.take(),
                       load_after=load(), started=round(t0 - T0, 4))
            result["runs"].append(run)
    result["tiers"] = ckpt.status().tiers
    ckpt.close()
    timers.uninstall()
    return result


def main() -> int:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    logging.basicConfig(level=logging.WARNING, format=f"[rank{dist.get_rank()}] %(levelname)s %(message)s")
    status = 0
    for name in names:
        where = out / name
        where.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        started = time.monotonic()
        try:
            result = {"ok": True, **PHASES[name](where)}
        except Exception as exc:  # the bench shows it with the agent's log
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            status = 1
        result["seconds"] = round(time.monotonic() - started, 2)
        result["rank"], result["world"] = dist.get_rank(), dist.get_world_size()
        (where / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, default=str))
        if status:
            break
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
