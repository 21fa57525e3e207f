"""RNG capture: each source is separate, validated before anything changes, CUDA topology enforced."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import trainstate as ts
from trainstate.state import rng


def test_numpy_global_state_does_not_cover_a_default_rng():
    gen = np.random.default_rng(5)
    saved = rng.capture({}, include_globals=True)
    expected = gen.random()
    rng.restore(saved, {})
    assert gen.random() != expected  # the Generator moved on: the global capture did not include it


def test_all_kinds_of_named_generator_round_trip():
    named = {"np": np.random.default_rng(1), "legacy": np.random.RandomState(2),
             "torch": torch.Generator().manual_seed(3), "py": random.Random(4)}
    saved = rng.capture(named, include_globals=False)
    first = [named["np"].random(), named["legacy"].rand(), torch.rand(1, generator=named["torch"]).item(),
             named["py"].random()]
    rng.restore(saved, named)
    again = [named["np"].random(), named["legacy"].rand(), torch.rand(1, generator=named["torch"]).item(),
             named["py"].random()]
    assert first == again


def test_mismatched_sources_fail_before_any_restore():
    named = {"a": np.random.default_rng(1), "b": torch.Generator().manual_seed(1)}
    saved = rng.capture(named)
    live = {"a": np.random.default_rng(9), "b": np.random.default_rng(9)}
    before = live["a"].bit_generator.state
    with pytest.raises(ts.StateMismatch, match="rngs\\['b'\\]"):
        rng.restore(saved, live)
    assert live["a"].bit_generator.state == before
    with pytest.raises(ts.StateMismatch, match="PCG64"):
        rng.restore(rng.capture({"a": np.random.Generator(np.random.PCG64(1))}),
                    {"a": np.random.Generator(np.random.MT19937(1))})
    with pytest.raises(ts.StateMismatch, match="rngs="):
        rng.restore(saved, {"a": live["a"]})


def test_malformed_state_fails_validation_without_touching_globals():
    saved = rng.capture({})
    saved["torch_cpu"] = torch.zeros(3, dtype=torch.uint8)
    state = random.getstate()
    with pytest.raises(ts.StateMismatch, match="malformed"):
        rng.restore(saved, {})
    assert random.getstate() == state


def test_cuda_device_count_change_is_refused_unless_statistical(tmp_path, monkeypatch):
    """No GPU here: pretend the saving machine had two devices by patching what torch.cuda reports."""
    state = ts.TrainState(model=torch.nn.Linear(2, 2))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.zeros(16, dtype=torch.uint8)] * 2)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    monkeypatch.undo()
    with ts.CheckpointManager(tmp_path) as ckpt:
        live = ts.TrainState(model=torch.nn.Linear(2, 2))
        before = live["model"].weight.detach().clone()
        with pytest.raises(ts.TopologyMismatch, match="2 CUDA device"):
            ckpt.restore(live)
        assert torch.equal(live["model"].weight, before)  # refused before anything was loaded
        info = ckpt.restore(live, rng_statistical_cuda=True)
    assert not info.identical_continuation and "statistically" in info.warnings[0]


def test_a_generator_state_that_is_a_view_into_a_larger_buffer_restores_exactly():
    """torch's set_state reads a byte tensor's storage from its start: a state handed over as a view into a larger
    buffer (a heal's received body) is given a storage of its own first (the raw view crashed the process)."""
    from trainstate.state import rng as rng_mod

    g = torch.Generator().manual_seed(7)
    torch.randn(3, generator=g)
    state = g.get_state()
    buffer = torch.cat([torch.zeros(64, dtype=torch.uint8), state])
    view = buffer[64:]
    want = torch.Generator().manual_seed(0)
    want.set_state(state)
    restored = torch.Generator()
    restored.set_state(rng_mod._own(view))
    assert torch.equal(torch.randn(5, generator=restored), torch.randn(5, generator=want))
    assert view.storage_offset() == 64 and rng_mod._own(state) is state
