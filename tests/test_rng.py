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
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
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


def test_a_process_that_never_initialized_cuda_saves_no_cuda_stream(monkeypatch):
    """On a GPU host, a job that never touched the GPU: the save creates no CUDA context and records no stream,
    so the generation restores on a machine without a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("asked for the CUDA streams"))
    saved = rng.capture({})
    assert saved["torch_cuda"] == [] and saved["torch_cuda_current"] is None


@pytest.mark.parametrize("saved, live, plan, warns", [
    # (count, the saving process's device) -> (count, this process's device)
    ((8, 3), (1, 0), {0: 3}, False),      # eight visible at save, one per task at restore: rank 3's own stream
    ((8, 3), (8, 5), {**{i: i for i in range(8)}, 5: 3}, False),  # another rank-to-device mapping
    ((8, 3), (8, 3), {i: i for i in range(8)}, False),  # the same devices: every stream by index
    ((1, 0), (4, 2), {2: 0}, True),       # more devices here: this process's gets the stream, the others none
    ((2, None), (2, 0), {0: 0, 1: 1}, False),  # a record from before the device was kept: by index
])
def test_cuda_streams_are_restored_by_role_onto_the_device_this_process_draws_on(saved, live, plan, warns):
    got, warnings, refusal = rng.cuda_plan(*saved, *live)
    assert (got, bool(warnings), refusal) == (plan, warns, None)


@pytest.mark.parametrize("saved, live", [((2, 0), (0, None)), ((2, None), (1, 0))])
def test_cuda_streams_with_no_device_to_go_to_are_refused(saved, live):
    """No CUDA here, or an old record (by index only) and another device count: no exact continuation."""
    _, _, refusal = rng.cuda_plan(*saved, *live)
    assert refusal and "CUDA device" in refusal


def test_a_cuda_generator_restores_onto_another_index_of_the_same_type():
    """A registered generator's record names its device; only the type must match (a CUDA generator's state is
    a seed and an offset, the same on any index). Recorded on "cuda:3", checked against a CPU generator here:
    refused by type; the same record with "cpu:0"-style spelling of the same type passes."""
    g = torch.Generator().manual_seed(4)
    record = rng.capture({"g": g}, include_globals=False)
    rng.validate(record, {"g": g})
    record["named"]["g"]["device"] = "cuda:3"
    with pytest.raises(ts.StateMismatch, match="saved on device 'cuda:3'"):
        rng.validate(record, {"g": g})
    record["named"]["g"]["device"] = "cpu:0"  # (before: refused, "cpu:0" is not "cpu")
    rng.validate(record, {"g": g})


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
