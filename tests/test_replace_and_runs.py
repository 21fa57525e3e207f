"""Issue 11, items 2 and 3: nothing is removed before its replacement is published, and a state never
saves over a run it was not restored from.

Each test below failed on the code before the fix (noted in its docstring).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

import trainstate as ts
from trainer import assert_same, build, full_state, step
from trainstate.storage.local import LocalStore

BEST = ts.Retention(keep_last=5, keep_last_weights=1, best=("val", "min"))


def _names(root: Path) -> list[str]:
    return sorted(os.listdir(root))


class FailingCommit(LocalStore):
    """A disk that fails the next commit (after every file of the replacement was written)."""

    fail = True

    def begin(self, generation):
        staging = super().begin(generation)
        real = staging.commit

        def commit():
            if FailingCommit.fail:
                raise OSError(5, "injected I/O error at commit")
            real()

        staging.commit = commit
        return staging


# item 2 -------------------------------------------------------------------------------------------------
def test_a_failed_weights_only_replacement_keeps_the_old_one_and_the_best(tmp_path):
    """Before: the existing weights-only generation (the best) was removed first; a failed write left nothing."""
    state = build()
    with ts.CheckpointManager(tmp_path, retention=BEST) as ckpt:
        for _ in range(2):
            step(state)
            ckpt.save(state)
        ckpt.save(state, weights_only=True, metrics={"val": 0.1})
        for _ in range(2):
            step(state)
            ckpt.save(state)
    weights = "gen-000000000002-weights"
    before = (tmp_path / weights / "manifest.json").read_bytes()
    resumed = build(seed=3)
    with ts.CheckpointManager(tmp_path, store=FailingCommit(tmp_path), retention=BEST) as ckpt:
        ckpt.restore(resumed, generation="gen-000000000002")  # the run reaches update 2 again
        with pytest.raises(OSError, match="injected"):
            ckpt.save(resumed, weights_only=True, metrics={"val": 0.2})
        assert ckpt.best() == weights
    assert (tmp_path / weights / "manifest.json").read_bytes() == before
    assert not [n for n in _names(tmp_path) if ".superseded-" in n]
    FailingCommit.fail = False
    try:
        with ts.CheckpointManager(tmp_path, store=FailingCommit(tmp_path), retention=BEST) as ckpt:
            ckpt.restore(again := build(seed=4), generation="gen-000000000002")
            info = ckpt.save(again, weights_only=True, metrics={"val": 0.2})  # replaced once the new one is in
            assert info.name == weights and ckpt.best() == weights
    finally:
        FailingCommit.fail = True
    assert (tmp_path / weights / "manifest.json").read_bytes() != before
    assert not [n for n in _names(tmp_path) if ".superseded-" in n]


def test_a_crash_in_the_middle_of_a_replacement_is_finished_by_the_next_save(tmp_path):
    """The old generation set aside as superseded, the process dies: the next save puts it back, loses nothing."""
    state = build()
    with ts.CheckpointManager(tmp_path) as ckpt:
        step(state)
        ckpt.save(state, weights_only=True)
        step(state)
        ckpt.save(state)
    store = LocalStore(tmp_path)
    aside = store.set_aside("gen-000000000001-weights", "superseded")  # as a replacement does, then: SIGKILL
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(resumed := build(seed=1))
        step(resumed)
        ckpt.save(resumed)
    assert "gen-000000000001-weights" in _names(tmp_path) and aside not in _names(tmp_path)
    ts.warm_start(tmp_path / "gen-000000000001-weights", build(seed=9)["model"])  # intact


def test_reopening_without_the_policy_keeps_what_the_recorded_policy_keeps(tmp_path, caplog):
    """Before: CheckpointManager(dir, keep_last=2) without retention= pruned the best at the next save."""
    state = build()
    with ts.CheckpointManager(tmp_path, retention=ts.Retention(keep_last=2, best=("val", "min"))) as ckpt:
        for update in range(1, 5):
            step(state)
            ckpt.save(state, metrics={"val": 1.0 if update != 1 else 0.1})
        assert ckpt.best() == "gen-000000000001"
    with ts.CheckpointManager(tmp_path, keep_last=2) as ckpt:
        assert ckpt.retention.best == ("val", "min")
        ckpt.restore(state := build(seed=2))
        step(state)
        ckpt.save(state, metrics={"val": 1.0})
        assert ckpt.best() == "gen-000000000001"
    assert "gen-000000000001" in _names(tmp_path)
    # keep_last below the recorded one is not a silent policy change either
    caplog.set_level(logging.WARNING, logger="trainstate")
    with ts.CheckpointManager(tmp_path, keep_last=1) as ckpt:
        assert ckpt.retention.keep_last == 2
    assert "keeping the last 2 generations" in caplog.text


def test_an_explicit_different_policy_is_logged_and_shown_by_plan_before_it_prunes(tmp_path, caplog):
    state = build()
    with ts.CheckpointManager(tmp_path, retention=ts.Retention(keep_last=3, best=("val", "min"))) as ckpt:
        for update in range(1, 5):
            step(state)
            ckpt.save(state, metrics={"val": 0.1 if update == 1 else 1.0})
    caplog.set_level(logging.WARNING, logger="trainstate")
    with ts.CheckpointManager(tmp_path, retention=ts.Retention(keep_last=1)) as ckpt:
        assert "differs from the one gen-000000000004 recorded" in caplog.text
        plan = ckpt.plan()
        assert "gen-000000000001" in plan.note and "which the recorded policy keeps" in plan.note
        assert "note:" in plan.describe()
        assert "gen-000000000001" in _names(tmp_path)  # planning deletes nothing


# item 3 -------------------------------------------------------------------------------------------------
def _run_to(root: Path, updates: int) -> ts.TrainState:
    state = build()
    with ts.CheckpointManager(root, keep_last=10) as ckpt:
        for _ in range(updates):
            step(state)
            ckpt.save(state)
    return state


def test_a_fresh_state_never_saves_over_an_existing_run(tmp_path):
    """Before: latest moved back to update 1 and the run's generation 1 was set aside as "abandoned"."""
    _run_to(tmp_path, 3)
    before = _names(tmp_path)
    forgot = build(seed=7)  # a script that forgot ckpt.restore(state)
    step(forgot)
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.ExistingRun, match=r"gen-000000000003.*restore\(state\).*new directory.*start_new_timeline"):
            ckpt.save(forgot)
        with pytest.raises(ts.ExistingRun):
            ckpt.save(forgot, blocking=False)
        assert ckpt.latest() == "gen-000000000003"
    assert _names(tmp_path) == before
    assert isinstance(ts.ExistingRun("x"), FileExistsError)


def test_a_state_from_another_run_is_refused_and_a_restored_one_is_not(tmp_path):
    other = _run_to(tmp_path / "other", 2)
    _run_to(tmp_path / "run", 3)
    with ts.CheckpointManager(tmp_path / "run") as ckpt:
        step(other)
        with pytest.raises(ts.ExistingRun):
            ckpt.save(other)
        ckpt.restore(mine := build(seed=1))
        step(mine)
        assert ckpt.save(mine).name == "gen-000000000004"


def test_start_new_timeline_is_the_explicit_opt_in(tmp_path):
    _run_to(tmp_path, 3)
    fresh = build(seed=7)
    step(fresh)
    with ts.CheckpointManager(tmp_path, keep_last=10) as ckpt:
        ckpt.start_new_timeline(fresh)
        assert ckpt.save(fresh).name == "gen-000000000001"
        assert ckpt.latest() == "gen-000000000001"
    names = _names(tmp_path)
    assert [n for n in names if n.startswith("gen-000000000001.abandoned-")]  # evidence, not deleted
    assert {"gen-000000000002", "gen-000000000003"} <= set(names)  # the old timeline is left alone
    with ts.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(again := build(seed=2)).generation.name == "gen-000000000001"
    assert_same(full_state(again), full_state(fresh))


def test_saving_twice_at_one_update_returns_the_first_and_writes_nothing(tmp_path, caplog):
    """Before: a final save right after a periodic one raised GenerationExists and crashed the end of training."""
    state = build()
    step(state)
    caplog.set_level(logging.INFO, logger="trainstate")
    with ts.CheckpointManager(tmp_path) as ckpt:
        first = ckpt.save(state)
        mtime = (tmp_path / first.name / "manifest.json").stat().st_mtime_ns
        assert ckpt.save(state) == first
        handle = ckpt.save(state, blocking=False)
        assert handle.wait() == first
    assert "already holds this state" in caplog.text
    assert (tmp_path / first.name / "manifest.json").stat().st_mtime_ns == mtime
    assert [n for n in _names(tmp_path) if n.startswith("gen-")] == [first.name]


def test_a_changed_state_at_the_same_update_is_published_as_a_revision(tmp_path):
    """Issue 22 item 5 replaced the refusal (GenerationExists ended the run) with a superseding revision."""
    state = build()
    step(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        first = ckpt.save(state)
        with torch.no_grad():
            state["optimizer"].param_groups[0]["lr"] = 0.5  # an annealed lr, next_update did not advance
        second = ckpt.save(state)
        assert (first.name, second.name) == ("gen-000000000001", "gen-000000000001-r001")
        assert ckpt.latest() == second.name and state.parent == second.name
    resumed = build(seed=3)
    with ts.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(resumed).generation.name == second.name
    assert resumed["optimizer"].param_groups[0]["lr"] == 0.5
