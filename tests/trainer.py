"""A small, fully stochastic training setup shared by the tests.

Every update draws from each RNG source the product promises to capture,
so leaving any one out of a restore changes the trajectory.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import torch

import trainstate as ts

CONFIG = {"lr": 0.01, "width": 16, "optim": {"betas": [0.9, 0.999]}}
CLASSES = ["cat", "dog"]


def build(seed: int = 0, contract: dict | None = None) -> ts.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, CONFIG["width"]), torch.nn.BatchNorm1d(CONFIG["width"]), torch.nn.ReLU(),
        torch.nn.Dropout(0.3), torch.nn.Linear(CONFIG["width"], 2))
    opt = torch.optim.AdamW(model.parameters(), lr=CONFIG["lr"])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    data = torch.Generator().manual_seed(seed + 1)
    noise = np.random.default_rng(seed + 2)
    if contract is None:
        contract = {"config": CONFIG, "class_names": CLASSES, "data_manifest": "manifest-v1"}
    return ts.TrainState(model=model, optimizer=opt, scheduler=sched, scaler=scaler,
                         rngs={"data": data, "noise": noise}, contract=contract)


def step(state: ts.TrainState) -> float:
    """One update drawing from: torch Generator, numpy Generator, Python random,
    numpy global, and torch CPU global (dropout)."""
    model, opt, scaler = state["model"], state["optimizer"], state["scaler"]
    x = torch.randn(8, 6, generator=state.rngs["data"])
    x = x + torch.from_numpy(state.rngs["noise"].normal(size=(8, 6)).astype(np.float32)) * 0.1
    y = (torch.arange(8) + random.randrange(2)) % 2
    x = x * float(1.0 + 0.1 * np.random.rand())
    model.train()
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    state["scheduler"].step()
    state.next_update += 1
    state.tokens_seen += x.numel()
    state.counters["epoch"] = state.next_update // 5
    return float(loss.detach())


def next_draws(state: ts.TrainState) -> dict:
    """The next value of every RNG source (consumes them)."""
    return {
        "python": random.random(),
        "numpy_global": float(np.random.rand()),
        "torch_cpu": torch.rand(3).tolist(),
        "data": torch.rand(3, generator=state.rngs["data"]).tolist(),
        "noise": state.rngs["noise"].random(3).tolist(),
    }


def full_state(state: ts.TrainState) -> dict:
    """Everything comparable: component state dicts, clocks and counters."""
    return {
        "model": state["model"].state_dict(),
        "optimizer": state["optimizer"].state_dict(),
        "scheduler": state["scheduler"].state_dict(),
        "scaler": state["scaler"].state_dict(),
        "clocks": (state.next_update, state.tokens_seen, dict(state.counters)),
    }


def assert_same(a, b, path="state") -> None:
    """Exact equality of nested state: tensors by torch.equal with identical dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} vs {b!r}"


def differs(a, b) -> bool:
    try:
        assert_same(a, b)
    except AssertionError:
        return True
    return False


if __name__ == "__main__":
    # Child-process half of the exact-continuation test: fresh objects, restore, finish, save.
    directory, total = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    state = build(seed=12345)  # a different seed: everything must come from the checkpoint
    with ts.CheckpointManager(directory) as ckpt:
        info = ckpt.restore(state)
        assert info is not None and info.identical_continuation
        while state.next_update < total:
            step(state)
        ckpt.save(state)
        draws = next_draws(state)
    import json

    print(json.dumps(draws))
