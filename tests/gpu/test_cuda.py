"""On one CUDA device (skipped without one): what a read of the code said could break on a GPU (issue 54).

Run on a GPU machine with ``python -m pytest tests/gpu -q -p no:xdist``. Every test here is skipped on CPU-only
machines (CI has none); ``test_nccl.py`` beside it needs two GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainstate as ts
from trainstate.state.staging import StagingBuffers
from trainstate.state import rng

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
RUN = Path(__file__).resolve().parent / "cuda_run.py"


def _run(run: Path, mode: str, out: Path, env: dict | None = None, updates: int = 8, save_at: int = 4) -> dict:
    done = subprocess.run([sys.executable, str(RUN), str(run), mode, str(updates), str(save_at), str(out)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_a_killed_cuda_run_resumes_bitwise_with_dropout_a_cuda_generator_and_a_grad_scaler(tmp_path):
    """Dropout on the device's default generator, a registered ``torch.Generator(device="cuda")``, bf16
    autocast, fused AdamW and ``GradScaler("cuda")``: a restart from update 4 equals the uninterrupted run."""
    whole = _run(tmp_path / "run", "train", tmp_path / "whole.json")
    resumed = _run(tmp_path / "run", "resume", tmp_path / "resumed.json")
    assert {k: whole["losses"][k] for k in resumed["losses"]} == resumed["losses"]
    assert (whole["digest"], whole["cuda_state"], whole["noise"]) == \
        (resumed["digest"], resumed["cuda_state"], resumed["noise"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_resume_with_fewer_visible_devices_continues_the_stream_of_the_device_it_used(tmp_path):
    """Saved with two devices visible, drawing on cuda:1; restored with only that GPU visible (cuda:0 there):
    the stream of the device the run used continues there (it was refused before, or dropped)."""
    whole = _run(tmp_path / "run", "train", tmp_path / "whole.json", {"CUDA_VISIBLE_DEVICES": "0,1", "TS_DEVICE": "1"})
    resumed = _run(tmp_path / "run", "resume", tmp_path / "resumed.json", {"CUDA_VISIBLE_DEVICES": "1", "TS_DEVICE": "0"})
    assert {k: whole["losses"][k] for k in resumed["losses"]} == resumed["losses"]
    assert whole["cuda_state"] == resumed["cuda_state"] and whole["digest"] == resumed["digest"]


def test_a_background_save_raced_by_in_place_updates_holds_the_synchronized_snapshot(tmp_path):
    """The step after ``save(blocking=False)`` changes every tensor in place at once (fused and capturable
    AdamW, bf16 parameters, a float8 buffer, a non-contiguous view): the generation holds what a synchronized
    copy taken at the boundary holds."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)).cuda()
    model[1].to(torch.bfloat16)
    model.register_buffer("scale8", torch.randn(64, 64, device="cuda").to(torch.float8_e4m3fn))
    base = torch.randn(128, 64, device="cuda")
    model.register_buffer("view", base.t())  # non-contiguous
    fused = torch.optim.AdamW(model[0].parameters(), lr=1e-2, fused=True)
    capturable = torch.optim.AdamW(model[1].parameters(), lr=1e-2, capturable=True)
    state = ts.TrainState(model=model, optimizer=fused, optimizer2=capturable)

    def update() -> None:
        x = torch.randn(16, 512, device="cuda")
        model[1](model[0](x).to(torch.bfloat16)).float().square().mean().backward()
        fused.step()
        capturable.step()
        fused.zero_grad(set_to_none=True)
        capturable.zero_grad(set_to_none=True)
        with torch.no_grad():
            model.scale8.copy_((model.scale8.float() * 1.5).to(torch.float8_e4m3fn))
            base.mul_(1.5)
        state.next_update += 1

    update()
    torch.cuda.synchronize()
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with ts.CheckpointManager(tmp_path, keep_last=2) as ckpt:
        ckpt.save(state, blocking=False)
        for _ in range(3):
            update()  # at once, on the current stream, while the writer works
        ckpt.wait()
        assert ckpt.status().staging_pinned_bytes > 0  # a CUDA state stages into pinned memory
        writer = ckpt._writer
    assert writer.held() == (0, 0)  # and lets it go at close
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)).cuda()
    fresh[1].to(torch.bfloat16)
    fresh.register_buffer("scale8", torch.zeros(64, 64, device="cuda").to(torch.float8_e4m3fn))
    fresh.register_buffer("view", torch.zeros(128, 64, device="cuda").t())
    restored = ts.TrainState(model=fresh, optimizer=torch.optim.AdamW(fresh[0].parameters(), fused=True),
                             optimizer2=torch.optim.AdamW(fresh[1].parameters(), capturable=True))
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(restored)
    got = fresh.state_dict()
    differ = [k for k in expected if not torch.equal(expected[k].view(torch.uint8) if expected[k].dtype ==
                                                     torch.float8_e4m3fn else expected[k],
                                                     got[k].view(torch.uint8) if got[k].dtype == torch.float8_e4m3fn
                                                     else got[k])]
    assert differ == []


def test_a_cpu_job_on_a_gpu_host_creates_no_cuda_context_and_restores_without_one(tmp_path):
    script = (
        "import sys, torch, trainstate as ts\n"
        "m = torch.nn.Linear(4, 4); s = ts.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))\n"
        "with ts.CheckpointManager(sys.argv[1]) as c: c.save(s)\n"
        "print(torch.cuda.is_initialized())\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]
    name = sorted(p.name for p in tmp_path.glob("gen-*"))[-1]
    assert json.loads((tmp_path / name / "state.json").read_text())["rng"]["torch_cuda"] == []
    restore = ("import sys, torch, trainstate as ts\n"
               "m = torch.nn.Linear(4, 4); s = ts.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))\n"
               "with ts.CheckpointManager(sys.argv[1]) as c: c.restore(s)\n")
    done = subprocess.run([sys.executable, "-c", restore, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-2000:]


def test_rng_states_moved_to_the_gpu_restore_as_they_were():
    """Lightning's ``map_location="cuda"`` moves the callback's RNG byte tensors to the GPU: they restore."""
    torch.cuda.init()
    g = torch.Generator(device="cuda").manual_seed(3)
    saved = rng.capture({"g": g})

    def to_cuda(node):
        if isinstance(node, torch.Tensor):
            return node.cuda()
        if isinstance(node, dict):
            return {k: to_cuda(v) for k, v in node.items()}
        if isinstance(node, list):
            return [to_cuda(v) for v in node]
        return node

    expected_cpu = torch.rand(4)
    torch.manual_seed(99)
    rng.validate(to_cuda(saved), {"g": g})
    rng.apply_validated(to_cuda(saved), {"g": g})
    assert torch.equal(torch.rand(4), expected_cpu)


def test_a_staging_buffer_made_for_a_cpu_source_is_pinned_for_a_cuda_one():
    buffers = StagingBuffers()
    buffers.stage({"w": torch.ones(1024)})
    assert not buffers.held()[1]
    buffers.stage({"w": torch.ones(1024, device="cuda")})
    assert buffers.held() == (4096, 4096)
