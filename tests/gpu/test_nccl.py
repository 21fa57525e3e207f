"""Two GPUs over NCCL (skipped with fewer): ``python -m pytest tests/gpu -q -p no:xdist`` on a GPU machine.

Each scenario of ``nccl_worker.py`` under its own ``torchrun --nproc_per_node=2``: DDP and FSDP2 background and
blocking saves resume bitwise (the stall per save, the peak host RSS and the pinned bytes recorded against the
state's size, printed for the notes), tensor-parallel dropout resumes bitwise, one rank's refusal ends every
rank within seconds, and a SIGTERM one step apart saves on both ranks at the same boundary.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
WORKER = Path(__file__).resolve().parent / "nccl_worker.py"


def _launch(scenario: str, out: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--master_addr=127.0.0.1", f"--master_port={port}", str(WORKER), scenario, str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out / f"{scenario}-{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_background_and_blocking_saves_resume_bitwise_with_bounded_pinned_memory(tmp_path, kind):
    results = _launch(kind, tmp_path)
    print(json.dumps({kind: results}))  # the stall, RSS and pinned figures, for the record
    assert all(r["bitwise"] for r in results), results
    for r in results:  # a rank pins at most a copy of what it stages, not more (rounding included)
        assert r["pinned_bytes"] <= 2.5 * r["state_bytes"], r


def test_tensor_parallel_dropout_resumes_bitwise(tmp_path):
    assert all(r["bitwise"] for r in _launch("tp_dropout", tmp_path))


def test_one_ranks_refusal_ends_every_rank_within_seconds(tmp_path):
    results = _launch("one_rank_fails", tmp_path)
    assert [r["raised"] for r in results] == ["CheckpointFailed", "PendingGradients"], results
    assert all(r["seconds"] < 10 for r in results), results


def test_a_sigterm_one_step_apart_saves_on_every_rank_at_the_same_boundary(tmp_path):
    results = _launch("preempted", tmp_path)
    assert results[0]["saved"] == results[1]["saved"] == 4, results
