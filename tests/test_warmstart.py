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
    with pytest.raises(RuntimeError, match="Missing key"):
        ts.warm_start(tmp_path / "gen-000000000001", bigger)
    ts.warm_start(tmp_path / "gen-000000000001", bigger, strict=False)
    assert torch.equal(bigger[0].weight, state["model"][0].weight)
