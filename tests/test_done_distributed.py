"""Issue 16 under torch.distributed: ``finish`` is collective, rank 0 writes the DONE record, every rank
gets it, and ``RestoreInfo.done`` is rank 0's verdict on every rank (they stop or go on together)."""

from __future__ import annotations

from pathlib import Path

import pytest

from distlaunch import launch

pytestmark = pytest.mark.slow


def test_finish_and_restore_agree_on_every_rank(tmp_path):
    result = launch(tmp_path, ["finish_ddp"], worker=Path(__file__).resolve().parent / "done_dist_worker.py")
    ranks = result.ok("finish_ddp")
    assert ranks[0]["record"] == ranks[1]["record"] and ranks[0]["record"]["generation"] == "gen-000000000004"
    assert ranks[0]["record"]["metrics"] == {"loss": 1.0}
    assert all(r["restored_done"] == r["record"] for r in ranks)
    assert [r["verdict"] for r in ranks] == ["done", "done"]
