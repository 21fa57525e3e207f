"""Warm start loads weights only; weights-only generations never act as a resume."""

from __future__ import annotations

import random

import pytest
import torch

import trainstate as ts
from trainer import build, step


def test_weights_only_generation_and_warm_start(tmp_path):
    state = build()
    for _ in range(4):
        step(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        info = ckpt.save(state, weights_only=True)
        assert info.kind == "weights" and info.name == "gen-000000000004-weights"
        # a weights-only generation is not a restart point
        assert ckpt.restore(build()) is None
        with pytest.raises(ts.WeightsOnlyGeneration, match="warm_start"):
            ckpt.restore(build(), generation=info.name)

    fresh = build(seed=3)
    rng_before = random.getstate()
    ts.warm_start(tmp_path, fresh["model"])
    for key, value in state["model"].state_dict().items():
        assert torch.equal(fresh["model"].state_dict()[key], value)
    assert fresh.next_update == 0 and fresh["optimizer"].state_dict()["state"] == {}
    assert random.getstate() == rng_before


def test_warm_start_from_full_generation_strict_control(tmp_path):
    state = build()
    step(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    bigger = torch.nn.Sequential(*build()["model"], torch.nn.Linear(2, 2))
    with pytest.raises(ts.StateMismatch, match="missing from the checkpoint: 5.weight, 5.bias"):
        ts.warm_start(tmp_path / "gen-000000000001", bigger)
    info = ts.warm_start(tmp_path / "gen-000000000001", bigger, strict=False)
    assert info.missing == ("5.weight", "5.bias") and not info.complete
    assert torch.equal(bigger[0].weight, state["model"][0].weight)


def test_fine_tuning_with_a_new_head_checks_every_shape_before_loading(tmp_path):
    """A new head size: strict refuses before touching a weight; non-strict loads the body and names the head."""
    body = torch.nn.Linear(4, 8)
    source = torch.nn.Sequential(body, torch.nn.ReLU(), torch.nn.Linear(8, 10))
    state = ts.TrainState(model=source)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state, weights_only=True)
    target = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ts.StateMismatch, match=r"2\.weight \(checkpoint \(10, 8\), module \(3, 8\)\)"):
        ts.warm_start(tmp_path, target)
    for key, value in target.state_dict().items():  # strict: nothing at all was loaded
        assert torch.equal(value, before[key]), key
    info = ts.warm_start(tmp_path, target, strict=False)
    assert info.loaded == ("0.weight", "0.bias")
    assert info.mismatched == (("2.weight", (10, 8), (3, 8)), ("2.bias", (10,), (3,)))
    assert info.missing == () and info.unexpected == ()
    assert torch.equal(target[0].weight, body.weight) and torch.equal(target[0].bias, body.bias)
    assert torch.equal(target[2].weight, before["2.weight"])  # the new head is untouched


def test_plain_load_state_dict_would_half_load_the_same_checkpoint(tmp_path):
    """Control: torch's own strict=False load raises only after copying the body, the defect fixed above."""
    source = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 10))
    target = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    before = target[0].weight.clone()
    with pytest.raises(RuntimeError, match="size mismatch"):
        target.load_state_dict(source.state_dict(), strict=False)
    assert torch.equal(target[0].weight, source[0].weight) and not torch.equal(target[0].weight, before)
