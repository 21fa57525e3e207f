"""Mid-accumulation saves: refused by default, exact when gradients are saved on request."""

from __future__ import annotations

import pytest
import torch

import trainstate as ts
from trainer import assert_same, build, full_state


def _micro(state, i):
    x = torch.randn(4, 6, generator=state.rngs["data"])
    loss = state["model"](x).square().mean() / 2
    loss.backward()
    state.counters["micro"] = i + 1


def _finish(state):
    state["optimizer"].step()
    state["optimizer"].zero_grad(set_to_none=True)
    state.counters["micro"] = 0
    state.next_update += 1


def test_pending_gradients_refused(tmp_path):
    state = build()
    _micro(state, 0)
    assert state.pending_gradients
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.PendingGradients, match="include_grads=True"):
            ckpt.save(state)
    assert not any(p.name.startswith("gen-") for p in tmp_path.iterdir())


def test_consumed_gradients_allow_save(tmp_path):
    """After zero_grad -> backward -> step, .grad still holds consumed gradients: saving is fine."""
    state = build()
    state["optimizer"].zero_grad()
    _micro(state, 0)
    state["optimizer"].step()
    assert state["model"][0].weight.grad is not None and not state.pending_gradients
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)


def test_discarded_gradients_are_not_pending():
    state = build()
    _micro(state, 0)
    state["optimizer"].zero_grad(set_to_none=True)
    assert not state.pending_gradients


def test_opt_in_saves_gradients_and_resumes_bitwise(tmp_path):
    reference = build()
    for i in range(2):
        _micro(reference, i)
    _finish(reference)

    state = build()
    _micro(state, 0)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state, include_grads=True)
    resumed = build(seed=77)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(resumed)
    assert resumed.pending_gradients and resumed.counters["micro"] == 1
    _micro(resumed, resumed.counters["micro"])
    _finish(resumed)
    assert_same(full_state(resumed)["model"], full_state(reference)["model"])
    assert_same(full_state(resumed)["optimizer"], full_state(reference)["optimizer"])

    # negative control: resuming the accumulation without the saved gradients diverges
    dropped = build(seed=77)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(dropped)
    for p in dropped["model"].parameters():
        p.grad = None
    _micro(dropped, 1)
    _finish(dropped)
    assert not torch.equal(dropped["model"][0].weight, reference["model"][0].weight)


def test_grad_scaler_skipped_step_is_not_pending(tmp_path):
    """A GradScaler that finds inf skips optimizer.step(); those gradients are spent, saving is fine."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    state = ts.TrainState(model=model, optimizer=opt, scaler=scaler)
    before = model.weight.detach().clone()
    opt.zero_grad()
    scaler.scale(model(torch.full((1, 3), float("inf"))).sum()).backward()
    assert state.pending_gradients
    scaler.step(opt)  # skipped: grads are inf
    scaler.update()
    assert torch.equal(model.weight, before)
    assert not state.pending_gradients
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
