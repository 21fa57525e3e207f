"""The drill worker: a small run with every kind of restart state, resumed from disk.

Run as ``python -m trainstate.drill worker --dir D --total N --every K``; see
the package docstring for the lines it prints.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
import numpy as np
import torch
from torch import nn
from .. import snapshot
from ..errors import TrainStateError
from ..manager import CheckpointManager
from ..manifest import generation_name
from ..state import TrainState


DRAWS_FILE = "next_draws.json"


IN_FEATURES, OUT_FEATURES = 64, 32


FORGET_CHOICES = ("python", "numpy_global", "torch_cpu", "data", "noise", "optimizer", "scheduler", "scaler",
                  "weights-only")


class DrillError(TrainStateError):
    """The drill itself could not run (a worker crashed or hung, a directory was not empty)."""


@dataclass(frozen=True)
class DrillConfig:
    """What the worker trains; the reference and the interrupted run must share it."""

    total: int
    every: int
    seed: int = 0
    width: int = 384
    batch: int = 128

    def __post_init__(self) -> None:
        for name in ("total", "every", "width", "batch"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"DrillConfig.{name} must be a positive int, got {getattr(self, name)!r}")

    def argv(self) -> list[str]:
        return ["--total", str(self.total), "--every", str(self.every), "--seed", str(self.seed),
                "--width", str(self.width), "--batch", str(self.batch)]


# worker ------------------------------------------------------------------------
def build_model(cfg: DrillConfig) -> nn.Module:
    w = cfg.width
    return nn.Sequential(nn.Linear(IN_FEATURES, w), nn.BatchNorm1d(w), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(w, w), nn.LayerNorm(w), nn.ReLU(), nn.Linear(w, OUT_FEATURES))


def build(cfg: DrillConfig) -> TrainState:
    """A freshly seeded TrainState; identical in every process given ``cfg``."""
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.total, eta_min=1e-4)
    # A short growth interval and injected overflows (see train_step) keep the
    # scaler's scale and growth tracker moving, so a lost scaler state shows.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
    rngs = {"data": torch.Generator().manual_seed(cfg.seed + 1), "noise": np.random.default_rng(cfg.seed + 2)}
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, rngs=rngs,
                      contract={"config": asdict(cfg)})


def train_step(state: TrainState, cfg: DrillConfig) -> float:
    """One update that draws from every random source, so any stream restored wrong changes the weights."""
    model, optimizer, scaler = state["model"], state["optimizer"], state["scaler"]
    x = torch.randn(cfg.batch, IN_FEATURES, generator=state.rngs["data"])
    noise = state.rngs["noise"].normal(0.0, 0.1, (cfg.batch, OUT_FEATURES)).astype(np.float32)
    y = torch.tanh(2 * x[:, :OUT_FEATURES]) + torch.from_numpy(noise)
    weights = torch.from_numpy(np.random.uniform(0.5, 1.5, cfg.batch).astype(np.float32))
    overflow = random.random() < 0.05 and state.next_update > 0  # the first step must be a real one
    model.train()  # dropout draws from torch's global CPU generator
    loss = (((model(x) - y) ** 2).mean(dim=1) * weights).mean()
    scaler.scale(loss * math.inf if overflow else loss).backward()
    scaler.step(optimizer)  # skipped on overflow; the scaler then backs off
    scaler.update()
    state["scheduler"].step()
    optimizer.zero_grad(set_to_none=True)
    state.tokens_seen += cfg.batch
    state.counters["overflows"] = state.counters.get("overflows", 0) + int(overflow)
    value = loss.item()
    if value < state.facts.get("best_loss", math.inf):
        state.facts["best_loss"] = value
    return value


def next_draws(state: TrainState) -> dict[str, list[int]]:
    """The next values of every random stream: equal only if every stream was restored exactly."""
    return {
        "python": [random.getrandbits(64) for _ in range(4)],
        "numpy_global": np.random.randint(0, 2**62, 4, dtype=np.int64).tolist(),
        "numpy_generator:noise": state.rngs["noise"].integers(0, 2**62, 4).tolist(),
        "torch_cpu": torch.randint(0, 2**62, (4,)).tolist(),
        "torch_generator:data": torch.randint(0, 2**62, (4,), generator=state.rngs["data"]).tolist(),
    }


def probe(state: TrainState, cfg: DrillConfig) -> dict[str, str]:
    """One more update in memory, then a digest of the whole state.

    The final generation may have been written by an earlier process; this
    checks what the last process actually holds in its live objects.
    """
    loss = train_step(state, cfg)
    skeleton, tensors = snapshot.capture(state)
    digest = hashlib.sha256(snapshot.state_json(skeleton))
    for name in sorted(tensors):
        digest.update(tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"loss": float.hex(loss), "state_sha256": digest.hexdigest()}


def _fresh_states(state: TrainState) -> dict[str, Any]:
    """Copies of everything as built, for the negative control (``--forget``)."""
    return {"components": {n: copy.deepcopy(c.state_dict()) for n, c in state.components.items()},
            "python": random.getstate(), "numpy_global": np.random.get_state(),
            "torch_cpu": torch.get_rng_state(), "data": state.rngs["data"].get_state(),
            "noise": copy.deepcopy(state.rngs["noise"].bit_generator.state)}


def _forget(state: TrainState, what: str, fresh: dict[str, Any]) -> None:
    """Undo part of a restore, as a buggy resume would, so the comparison must fail."""
    names = FORGET_CHOICES[:-1] if what == "weights-only" else (what,)
    for name in names:
        if name in fresh["components"]:
            state[name].load_state_dict(copy.deepcopy(fresh["components"][name]))
        elif name == "python":
            random.setstate(fresh["python"])
        elif name == "numpy_global":
            np.random.set_state(fresh["numpy_global"])
        elif name == "torch_cpu":
            torch.set_rng_state(fresh["torch_cpu"])
        elif name == "data":
            state.rngs["data"].set_state(fresh["data"])
        else:
            state.rngs["noise"].bit_generator.state = copy.deepcopy(fresh["noise"])


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()  # the parent times its kills by these lines


def _save(ckpt: CheckpointManager, state: TrainState) -> None:
    _say(f"saving {state.next_update}")
    ckpt.save(state)
    _say(f"saved {state.next_update}")


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(tmp, path)  # a kill mid-write must not leave a truncated file behind


def worker_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    cfg = DrillConfig(args.total, args.every, args.seed, args.width, args.batch)
    state = build(cfg)
    fresh = _fresh_states(state) if args.forget else None
    if args.wait_for_go:
        # Imports and build (AdamW's first param group imports torch._dynamo) take
        # seconds; the parent starts the next worker early and lets it go only
        # after the previous one is dead and the directory has been checked.
        _say("ready")
        if sys.stdin.readline().strip() != "go":
            return 3
    with CheckpointManager(args.dir, keep_last=args.keep_last) as ckpt:
        info = ckpt.restore(state)
        if info is None:
            _say("fresh")
        else:
            rejected = ",".join(r.generation for r in info.rejected) or "-"
            _say(f"restored {info.generation.name} next_update={state.next_update} rejected={rejected} "
                 f"identical={int(info.identical_continuation)}")
            if fresh is not None:
                _forget(state, args.forget, fresh)
        _say(f"training {state.next_update}")
        while state.next_update < cfg.total:
            train_step(state, cfg)
            state.next_update += 1
            _say(f"step {state.next_update}")
            if state.next_update % cfg.every == 0:
                _save(ckpt, state)
        if state.parent != generation_name(state.next_update):
            _save(ckpt, state)
    draws = next_draws(state)
    _write_json(Path(args.dir) / DRAWS_FILE, {"next_update": state.next_update, "draws": draws,
                                              "probe": probe(state, cfg)})
    _say(f"done {state.next_update}")
    return 0

