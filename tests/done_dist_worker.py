"""Multi-rank ``finish`` and ``RestoreInfo.done`` under a real ``torchrun`` (run by tests/test_done_distributed.py).

Reuses tests/dist_worker.py's training setup and runner; adds its scenarios to the same registry.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainstate as ts  # noqa: E402
from dist_worker import build, main, manager, scenario, train  # noqa: E402


@scenario
def finish_ddp(out: Path) -> dict:
    """Every rank finishes together and gets rank 0's record; a restore tells every rank it is done."""
    state = build("ddp")
    with manager(out / "run") as ckpt:
        train(state, 4)
        record = ckpt.finish(state, metrics={"loss": 1.0})
    fresh = build("ddp", seed=3)
    with manager(out / "run") as ckpt:
        info = ckpt.restore(fresh)
    return {"rank": dist.get_rank(), "record": record.to_json(), "restored_done": info.done and info.done.to_json(),
            "verdict": ts.done(str(out / "run")).status}


if __name__ == "__main__":
    sys.exit(main())
