"""Child half of tests/test_supervise.py: a tiny training script, written as a user would write one.

``python supervised_child.py --dir D --total T --every E --markers M [--lr X] [--crash-once-at K:kill|raise]
[--preempt-once-at K]`` restores, trains to T saving every E updates, and finishes (DONE record). Each
``--crash-once-at`` / ``--preempt-once-at`` fires the first time the run reaches that update (a marker file
in M remembers it), so a restarted child gets past it. Every start appends what it resumed from to
``M/attempts.jsonl``. Errors end the process with ``ts.exit_code_for(exc)``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainstate as ts  # noqa: E402


def build(lr: float, total: int) -> ts.TrainState:
    random.seed(0)  # every global stream is captured: seeded, a fresh process and this one start alike
    np.random.seed(0)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return ts.TrainState(model=model, optimizer=opt, rngs={"data": torch.Generator().manual_seed(1)},
                         contract={"config": {"lr": lr, "total": total}})


def step(state: ts.TrainState) -> None:
    model, opt = state["model"], state["optimizer"]
    x = torch.randn(8, 4, generator=state.rngs["data"])
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    state.next_update += 1
    state.tokens_seen += 8


def once(markers: Path, what: str, update: int) -> bool:
    """True the first time ``what`` happens at ``update`` in this run (across restarts)."""
    marker = markers / f"{what}-{update}"
    if marker.exists():
        return False
    marker.touch()
    return True


def train(args: argparse.Namespace) -> int:
    markers = Path(args.markers)
    crashes = dict(item.split(":") for item in args.crash_once_at)
    state = build(args.lr, args.total)
    with ts.CheckpointManager(args.dir, keep_last=10) as ckpt:
        info = ckpt.restore(state)
        with open(markers / "attempts.jsonl", "a") as log:
            log.write(json.dumps({"attempt": os.environ.get("TRAINSTATE_SUPERVISE_ATTEMPT"),
                                  "resumed": info.generation.name if info else None,
                                  "done": bool(info and info.done)}) + "\n")
        if info is not None and info.done:
            return 0  # finished already: nothing to train
        with ts.PreemptionHandler() as preempt:
            while state.next_update < args.total:
                step(state)
                k = state.next_update
                if k % args.every == 0:
                    ckpt.save(state)
                if str(k) in crashes and once(markers, "crash", k):
                    if crashes[str(k)] == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    raise RuntimeError(f"simulated crash at update {k}")
                if k in args.preempt_once_at and once(markers, "preempt", k):
                    os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice; the handler sets a flag
                if preempt.requested:
                    ckpt.save(state)
                    preempt.exit()
        ckpt.finish(state, metrics={"loss": float(state["model"].weight.detach().square().sum())})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--total", type=int, default=10)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--markers", required=True)
    p.add_argument("--crash-once-at", action="append", default=[], help="UPDATE:kill or UPDATE:raise")
    p.add_argument("--preempt-once-at", action="append", type=int, default=[])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    try:
        return train(args)
    except Exception as exc:
        traceback.print_exc()
        return ts.exit_code_for(exc)


if __name__ == "__main__":
    sys.exit(main())
