"""One rank fails inside ``with CheckpointManager(...)`` while the other waits in a training collective.

``python -m torch.distributed.run --nproc_per_node 2 tests/failing_rank_worker.py OUT CASE``

Two ranks train a DDP model (gloo) and save once. Then rank 1 fails in its
next update, as a bug in its training step would, while rank 0 waits in an
``all_reduce`` (as DDP's backward would). Rank 1 writes the wall time of the
failure to ``OUT/raised`` just before it happens; the test times how long the
launch takes to stop after it. CASE picks how rank 1 fails and how the
manager is held:

- ``plain``: no manager at all (the baseline: torchrun stops the job);
- ``value_error``: ``ValueError`` inside ``with``;
- ``background``: ``ValueError`` right after ``save(blocking=False)``, whose
  publication is slowed so that it is surely in flight;
- ``interrupt``: SIGINT (KeyboardInterrupt) with the manager closed in a ``finally``;
- ``system_exit``: ``sys.exit(3)`` inside ``with``;
- ``control``: ``value_error`` with the close of c81b50e put back (a barrier
  while the exception propagates): the job then waits out the collective timeout.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import trainstate as ts
from trainstate.distributed import commit

COLLECTIVE_TIMEOUT_S = 15.0  # what the control waits at its barrier before the job can stop
SLOW_PUBLISH_S = 30.0  # the background case's publication: surely still in flight when rank 1 fails


def old_close(self) -> None:
    """The close of c81b50e: every rank's background saves finished, then a barrier, exception or not."""
    self._writer.shutdown()
    if self._session is not None:
        self._session.barrier("close")
    self.store.unlock()


def slow(publish):
    def delayed(*args, **kwargs):
        time.sleep(SLOW_PUBLISH_S)
        return publish(*args, **kwargs)
    return delayed


def fail(case: str, out: Path) -> None:
    (out / "raised").write_text(repr(time.time()))
    if case == "interrupt":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the KeyboardInterrupt lands here
    if case == "system_exit":
        sys.exit(3)
    raise ValueError("a bug in rank 1's training step")


def main() -> None:
    out, case = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = ts.TrainState(model=model, optimizer=opt)

    def update() -> None:
        model(torch.randn(4, 8)).sum().backward()  # DDP's all_reduce of the gradients
        opt.step()
        opt.zero_grad()
        state.next_update += 1

    def train(ckpt) -> None:
        update()
        if ckpt is not None:
            ckpt.save(state)
            if case == "background":
                commit.publish = slow(commit.publish)
                update()
                ckpt.save(state, blocking=False)
        if rank == 1:
            fail(case, out)
        dist.all_reduce(torch.ones(1))  # rank 0 waits here for rank 1, as DDP's backward would
        update()

    if case == "plain":
        train(None)
        return
    if case == "control":
        ts.CheckpointManager.close = old_close
    ckpt = ts.CheckpointManager(out / "run", collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    if case == "interrupt":
        try:
            ckpt.restore(state)
            train(ckpt)
        finally:
            ckpt.close()
        return
    with ckpt:
        ckpt.restore(state)
        train(ckpt)


if __name__ == "__main__":
    main()
