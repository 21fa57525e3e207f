"""Exact continuation in a new process, and the negative controls that prove the test can fail."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import trainstate as ts
from trainer import assert_same, build, differs, full_state, next_draws, step

TOTAL, SPLIT = 14, 6


@pytest.fixture(scope="module")
def reference():
    """N updates uninterrupted: the final state and the next draw of every RNG source."""
    torch.set_num_threads(1)
    _seed_globals()
    state = build()
    for _ in range(TOTAL):
        step(state)
    final = _clone(full_state(state))
    return final, next_draws(state)


def _seed_globals(seed: int = 7) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_clone(v) for v in tree)
    return tree


def _checkpoint_at_split(directory: Path) -> None:
    _seed_globals()
    state = build()
    for _ in range(SPLIT):
        step(state)
    with ts.CheckpointManager(directory) as ckpt:
        ckpt.save(state)


def test_new_process_continues_exactly(tmp_path, reference):
    final, draws = reference
    _checkpoint_at_split(tmp_path)
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "trainer.py"), str(tmp_path), str(TOTAL)],
                         capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == draws
    resumed = build(seed=999)
    with ts.CheckpointManager(tmp_path) as ckpt:
        info = ckpt.restore(resumed)
    assert info.generation.next_update == TOTAL
    assert_same(full_state(resumed), final)


def _resume_in_process(directory: Path, sabotage=None):
    _seed_globals(seed=4242)  # scramble globals: anything not restored will differ
    state = build(seed=31337)
    with ts.CheckpointManager(directory) as ckpt:
        ckpt.restore(state)
    if sabotage:
        state = sabotage(state) or state
    while state.next_update < TOTAL:
        step(state)
    return full_state(state), next_draws(state)


def test_in_process_resume_matches(tmp_path, reference):
    _checkpoint_at_split(tmp_path)
    got, draws = _resume_in_process(tmp_path)
    assert_same(got, reference[0])
    assert draws == reference[1]


def _weights_only(state):
    fresh = build(seed=31337)
    fresh["model"].load_state_dict(state["model"].state_dict())
    fresh.next_update = state.next_update
    fresh.tokens_seen, fresh.counters = state.tokens_seen, dict(state.counters)
    return fresh


def _fresh_optimizer(state):
    opt = torch.optim.AdamW(state["model"].parameters(), lr=0.01)
    opt.load_state_dict({"state": {}, "param_groups": state["optimizer"].state_dict()["param_groups"]})
    state["optimizer"].state.clear()
    state["optimizer"].load_state_dict(opt.state_dict())


SKIP_RNG = {
    "python": lambda s: random.seed(1),
    "numpy_global": lambda s: np.random.seed(1),
    "torch_cpu": lambda s: torch.manual_seed(1) and None,
    "torch_generator": lambda s: s.rngs["data"].manual_seed(1) and None,
    "numpy_generator": lambda s: setattr(s.rngs["noise"].bit_generator, "state",
                                         np.random.default_rng(1).bit_generator.state),
}


@pytest.mark.parametrize("control", ["weights_only", "fresh_optimizer", *SKIP_RNG])
def test_negative_controls_diverge(tmp_path, reference, control):
    """Each missing piece of restart state must change the result, or the test above proves nothing."""
    _checkpoint_at_split(tmp_path)
    sabotage = {"weights_only": _weights_only, "fresh_optimizer": _fresh_optimizer, **SKIP_RNG}[control]
    got, draws = _resume_in_process(tmp_path, sabotage)
    final, ref_draws = reference
    if control in ("weights_only", "fresh_optimizer"):
        assert differs(got["model"], final["model"]), f"{control} did not diverge"
    else:
        assert differs(got, final) or draws != ref_draws, f"skipping {control} did not diverge"
        assert differs(got["model"], final["model"]), f"skipping {control} left the weights identical"


def test_restore_on_empty_directory_returns_none(tmp_path):
    state = build()
    with ts.CheckpointManager(tmp_path / "fresh") as ckpt:
        assert ckpt.restore(state) is None
    assert state.next_update == 0


def test_globals_not_captured_when_disabled(tmp_path):
    state = build()
    state.capture_global_rngs = False
    step(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    payload = json.loads((tmp_path / "gen-000000000001" / "state.json").read_text())
    assert set(payload["rng"]) == {"named"}
