"""The multi-rank drill worker: every rank of one ``torchrun`` launch trains the same small run, resumed from disk.

::

    python -m torch.distributed.run --standalone --nproc_per_node 2 --monitor-interval 1 \\
        -m trainstate.drill.ranks_worker --dir D --total T --every E [--mode fsdp|ddp] [--seed S] \\
        [--async-save] [--forget rng|loader] [--replicas R]

Every rank builds the same model (FSDP2 through ``fully_shard``, or DDP) with
dropout, AdamW, a cosine schedule, a per-rank ``torch.Generator`` (``noise``)
and a :class:`~trainstate.ResumableLoader` (which shards by rank itself);
``init_process_group("gloo")``, one thread, deterministic kernels. It opens
``CheckpointManager(D, keep_last=2)``, restores, trains to ``T`` saving every
``E`` updates (and at ``T``), all ranks together. Rank 0 reports progress,
one flushed line each (the parent times its kills by them)::

    restoring             the manager is open; restore starts
    fresh | restored <generation> next_update=<n> identical=<0|1>
    training <n>
    step <n>              after each update
    saving <n>            right before ckpt.save
    staged <n>            with --async-save: save(blocking=False) returned
    saved <n>             the generation is published
    done <n>              the final files are written

At the end rank 0 writes ``D/final.safetensors`` (every parameter and
optimizer moment as a full tensor, the scheduler's ``last_epoch``, the
clock) and each rank ``D/rank-<r>.safetensors`` (the next draws of its
generator, its global torch RNG state, its loader position and next sample
ids). safetensors only: nothing here pickles.

With ``--replicas R`` (node-local tiers, :mod:`trainstate.drill.nodes`: several
torchrun agents, each a node) the manager opens this node's own directory,
``$TRAINSTATE_DRILL_NODE_DIR`` (set per agent by the launcher), as
``CheckpointManager(node_dir, keep_last=2, replicas=R)``; ``D`` then only
receives the final files. ``restored`` adds ``local=<bytes> peer=<bytes>``:
what the ranks read from their own nodes' disks and received from other
nodes (the replicas of a lost node's files).

``--forget`` is the negative control: after restoring, put back the fresh
state of the per-rank RNG streams (``rng``) or of the loader position
(``loader``), as a resume that forgot them would; the run must then end
different from the reference.
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import os
import signal
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ..asyncsave import SaveHandle
from ..data.loader import ResumableLoader
from ..data.samplerng import sample_generator
from ..errors import InvalidArgument
from ..format.manifest import generation_name
from ..manager import CheckpointManager
from ..state.train_state import TrainState

FINAL_FILE = "final.safetensors"
MODES = ("fsdp", "ddp")
FORGET = ("rng", "loader")
IN, OUT = 16, 8
LAUNCH_ENV = "TRAINSTATE_DRILL_LAUNCH"  # set by the driver on each launch; marks every process of it
AGENT_ENV = "TRAINSTATE_DRILL_AGENT"  # set by the driver's shim: the pid of the launch's torchrun agent
NODE_DIR_ENV = "TRAINSTATE_DRILL_NODE_DIR"  # with --replicas: this node's own directory, set per agent


# FSDP2, DTensor and DCP are imported inside the functions that run in the ranks: DTensor pulls in sympy
# (seconds of CPU), which the driver and `trainstate demo`, importing RanksConfig from here, need not pay.


def rank_file(rank: int) -> str:
    return f"rank-{rank}.safetensors"


@dataclass(frozen=True)
class RanksConfig:
    """What every rank trains; the reference and the interrupted run must share it."""

    total: int = 40
    every: int = 4
    mode: str = "fsdp"
    seed: int = 0
    width: int = 64
    batch: int = 4  # per rank
    async_save: bool = False  # how it saves, not what it trains: not part of the contract
    full_every: int | None = None  # incremental generations (full_every=); adds a frozen 4 MiB table to link

    def __post_init__(self) -> None:
        for name in ("total", "every", "width", "batch"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"RanksConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.mode not in MODES:
            raise ValueError(f"RanksConfig.mode must be one of {MODES}, got {self.mode!r}")
        if self.full_every is not None and (type(self.full_every) is not int or self.full_every < 1):
            raise ValueError(f"RanksConfig.full_every must be None or an int >= 1, got {self.full_every!r}")

    def argv(self) -> list[str]:
        return ["--total", str(self.total), "--every", str(self.every), "--mode", self.mode, "--seed",
                str(self.seed), "--width", str(self.width), "--batch", str(self.batch)] + (
                    ["--async-save"] if self.async_save else []) + (
                    ["--full-every", str(self.full_every)] if self.full_every else [])

    def contract(self) -> dict[str, Any]:
        config = {"mode": self.mode, "seed": self.seed, "width": self.width, "batch": self.batch,
                  "total": self.total}
        return {"config": {**config, **({"full_every": self.full_every} if self.full_every else {})}}


class Noisy(torch.utils.data.Dataset):
    """A fixed table, augmented per sample from ``sample_generator`` (the same after any resume)."""

    def __init__(self, seed: int, n: int = 120):
        g = torch.Generator().manual_seed(seed + 7)
        self.x, self.y = torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + 0.05 * torch.randn(IN, generator=sample_generator(index)), self.y[index]


def build(cfg: RanksConfig) -> TrainState:
    """The same state on every rank; the global torch stream (dropout) and ``noise`` differ per rank."""
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    w = cfg.width
    model = torch.nn.Sequential(torch.nn.Linear(IN, w), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, OUT))
    layers = list(model)
    if cfg.full_every:
        model = WithFrozen(model)
    if cfg.mode == "fsdp":
        for layer in layers:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    torch.manual_seed(cfg.seed + 1 + rank)  # each rank's dropout masks are its own
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.total, eta_min=1e-4)
    loader = ResumableLoader(Noisy(cfg.seed), batch_size=cfg.batch, seed=cfg.seed + 11)
    return TrainState(model=model, optimizer=opt, scheduler=sched, data=loader,
                      rngs={"noise": torch.Generator().manual_seed(1000 * cfg.seed + 17 + rank)},
                      contract=cfg.contract())


class WithFrozen(torch.nn.Module):
    """The drill's model beside a frozen table that no update changes (a frozen base): an incremental run
    links each rank's part of it from save to save."""

    def __init__(self, body: torch.nn.Module):
        super().__init__()
        self.body = body
        self.table = torch.nn.Parameter(torch.randn(1024, 1024), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def endless(loader: ResumableLoader) -> Any:
    """Batches across epochs, each pass continuing from the loader's position."""
    while True:
        yield from loader


def train_step(state: TrainState, batches: Any) -> None:
    """One update that draws from the loader, the rank's generator and (dropout) its global torch stream."""
    model, opt = state["model"], state["optimizer"]
    model.train()
    x, y = next(batches)
    x = x + 0.01 * torch.randn(x.shape, generator=state.rngs["noise"])
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state["scheduler"].step()
    state.next_update += 1


def full_state(state: TrainState) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer value as a full tensor (a collective), plus the schedule and the clock."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    model, opt = state["model"], state["optimizer"]
    out = {}
    for key, value in get_model_state_dict(model).items():
        out[f"model.{key}"] = value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()
    for key, entry in get_optimizer_state_dict(model, opt)["state"].items():
        for name, value in entry.items():
            value = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"optim.{key}.{name}"] = value.detach().clone() if isinstance(value, torch.Tensor) else \
                torch.tensor(value)
    out["sched.last_epoch"] = torch.tensor(state["scheduler"].last_epoch)
    out["sched.lr"] = torch.tensor(state["scheduler"].get_last_lr(), dtype=torch.float64)
    out["clock"] = torch.tensor(state.next_update)
    return {k: v.contiguous() for k, v in out.items()}


def rank_state(state: TrainState) -> dict[str, torch.Tensor]:
    """This rank's own streams: the next draws of its generator and global stream, its data position."""
    loader: ResumableLoader = state["data"]
    out = {"noise.next": torch.randn(8, generator=torch.Generator().set_state(state.rngs["noise"].get_state())),
            "torch_global.state": torch.get_rng_state(),
            "loader.position": torch.tensor([loader.epoch, loader.cursor, loader.start, loader.samples_seen]),
            "loader.next_ids": torch.as_tensor(loader.epoch_batches(loader.epoch)[loader.cursor]).to(torch.int64)}
    return {k: v.contiguous() for k, v in out.items()}


def write_atomic(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """safetensors to a temporary name, then rename: a kill never leaves a truncated file under ``path``."""
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


# the worker --------------------------------------------------------------------------------------------------
class Reporter:
    """Progress lines from rank 0, flushed at once; other ranks stay quiet."""

    def __init__(self, rank: int):
        self.rank = rank

    def __call__(self, line: str) -> None:
        if self.rank == 0:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()


class Saver:
    """Blocking saves, or with ``--async-save`` ``save(blocking=False)`` reporting each once published."""

    def __init__(self, ckpt: CheckpointManager, say: Reporter, background: bool):
        self.ckpt, self.say, self.background = ckpt, say, background
        self.pending: deque[tuple[int, SaveHandle]] = deque()

    def save(self, state: TrainState) -> None:
        self.say(f"saving {state.next_update}")
        if not self.background:
            self.ckpt.save(state)
            self.say(f"saved {state.next_update}")
            return
        handle = self.ckpt.save(state, blocking=False)
        self.say(f"staged {state.next_update}")
        self.pending.append((state.next_update, handle))
        self.poll()

    def poll(self, block: bool = False) -> None:
        while self.pending and (block or self.pending[0][1].done()):
            update, handle = self.pending.popleft()
            handle.wait()
            self.say(f"saved {update}")


def forget(state: TrainState, what: str, fresh: dict[str, Any]) -> None:
    """The negative control: undo part of the restore, as a resume that forgot it would."""
    if what == "rng":
        state.rngs["noise"].set_state(fresh["noise"])
        torch.set_rng_state(fresh["torch_global"])
    else:
        state["data"].load_state_dict(copy.deepcopy(fresh["data"]))


def die_with_parent() -> None:
    """SIGKILL this rank when its torchrun agent dies: a launch is lost as a whole, as a node is.

    Under the driver, ``AGENT_ENV`` holds the agent's pid: if it died before
    the request took effect (while this rank was importing torch, say), the
    rank has been reparented, and exits now.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the driver kills every process of the launch itself
    if os.environ.get(AGENT_ENV, str(os.getppid())) != str(os.getppid()):
        os._exit(1)


def open_manager(directory: Path, args: argparse.Namespace) -> CheckpointManager:
    """``directory`` itself, or with ``--replicas`` this node's own directory as a node-local tier."""
    if args.replicas is None:
        return CheckpointManager(directory, keep_last=2, collective_timeout_s=args.timeout, full_every=args.full_every)
    node_dir = os.environ.get(NODE_DIR_ENV)
    if not node_dir:
        raise InvalidArgument(f"--replicas needs ${NODE_DIR_ENV}, this node's own directory, set for each torchrun "
                              "agent (trainstate.drill.nodes sets it)")
    return CheckpointManager(node_dir, keep_last=2, replicas=args.replicas, collective_timeout_s=args.timeout,
                             full_every=args.full_every)


def run(args: argparse.Namespace) -> int:
    cfg = RanksConfig(args.total, args.every, args.mode, args.seed, args.width, args.batch, args.async_save,
                      args.full_every)
    directory = Path(args.dir)
    say = Reporter(dist.get_rank())
    state = build(cfg)
    fresh = {"noise": state.rngs["noise"].get_state(), "torch_global": torch.get_rng_state(),
             "data": copy.deepcopy(state["data"].state_dict())}
    with open_manager(directory, args) as ckpt:
        say("restoring")
        info = ckpt.restore(state)
        if info is None:
            say("fresh")
        else:
            sources = "".join(f" {k}={v}" for k, v in info.sources.items() if k in ("local", "peer")) \
                if info.sources is not None else ""
            say(f"restored {info.generation.name} next_update={state.next_update} "
                f"identical={int(info.identical_continuation)}{sources}")
            if args.forget:
                forget(state, args.forget, fresh)
        saver = Saver(ckpt, say, cfg.async_save)
        batches = endless(state["data"])
        say(f"training {state.next_update}")
        while state.next_update < cfg.total:
            train_step(state, batches)
            say(f"step {state.next_update}")
            saver.poll()
            if state.next_update % cfg.every == 0:
                saver.save(state)
        if state.parent != generation_name(state.next_update):
            saver.save(state)
        saver.poll(block=True)
    full = full_state(state)  # collective: every rank takes part
    if dist.get_rank() == 0:
        write_atomic(directory / FINAL_FILE, full)
    write_atomic(directory / rank_file(dist.get_rank()), rank_state(state))
    dist.barrier()
    say(f"done {state.next_update}")
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainstate.drill.ranks_worker",
                                description="One rank of the multi-rank kill drill (run under torchrun).")
    p.add_argument("--dir", required=True)
    p.add_argument("--total", type=int, required=True)
    p.add_argument("--every", type=int, required=True)
    p.add_argument("--mode", choices=MODES, default="fsdp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=RanksConfig.width)
    p.add_argument("--batch", type=int, default=RanksConfig.batch, help="samples per rank per update")
    p.add_argument("--async-save", action="store_true", help="save(blocking=False); 'staged' then 'saved'")
    p.add_argument("--full-every", type=int, default=None, metavar="N",
                   help="incremental generations (CheckpointManager(full_every=N)), with a frozen table to link")
    p.add_argument("--forget", choices=FORGET, default=None,
                   help="negative control: after restoring, reset this part to its fresh state")
    p.add_argument("--replicas", type=int, default=None, metavar="R",
                   help=f"node-local tiers: save into ${NODE_DIR_ENV} with replicas=R (one directory per node)")
    # generous: on a busy machine one rank's fsync can stall for many seconds while the others wait
    p.add_argument("--timeout", type=float, default=300.0, help="collective_timeout_s of the manager")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    die_with_parent()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    try:
        return run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written, closed and the process group destroyed; the interpreter's teardown of torch
    # would add seconds to every launch here (3 of the 4 s between "done" and torchrun's exit).
    os._exit(status)
