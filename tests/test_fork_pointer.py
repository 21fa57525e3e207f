"""A ``latest`` rolled back to a fork point resumes the timeline the run was on, never the one it abandoned.

A run saves on timeline A, then restores an older generation (``generation=``) and saves on: a new timeline
forks there, and A's newer generations stay in the directory. Both timelines descend from the fork point, so a
``latest`` put back there (a copied-back pointer, a restored backup of the directory's small files) has two
timelines ahead of it. Before (issue 48, item 6) restore rolled forward to the newest generation by update
number, which is often the abandoned timeline's (it ran further before the user went back). The timeline that
wins is the one the run saved to last (docs/concepts/restore.md, "A pointer left behind"). Each test has a
control that puts the old choice back (every descendant counts) and shows the test sees the difference.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import trainer

import trainstate as ts
from trainstate.lifecycle import candidates as candidates_mod
from trainstate.storage.local import LocalStore

KEY = "correct horse battery staple, 2026"


def gen(update: int) -> str:
    return f"gen-{update:012d}"


def _train_to(mgr: ts.CheckpointManager, state: ts.TrainState, updates, saved: dict) -> None:
    for update in updates:
        while state.next_update < update:
            trainer.step(state)
        mgr.save(state)
        saved[gen(update)] = copy.deepcopy(trainer.full_state(state))  # training goes on in place


def _forked(root: Path, key: str | None = None) -> tuple[bytes, dict]:
    """Timeline A saves 10, 20, 30, 40; the run goes back to 20 and saves 22, 25 (timeline B). Returns the
    ``latest`` bytes as the save at 20 wrote them, and every saved state."""
    saved: dict = {}
    state = trainer.build(seed=0)
    with ts.CheckpointManager(root, keep_last=10, signing_key=key) as mgr:
        _train_to(mgr, state, (10, 20), saved)
        at_fork = (root / "latest").read_bytes()
        _train_to(mgr, state, (30, 40), saved)
        back = trainer.build(seed=1)
        assert mgr.restore(back, generation=gen(20)).generation.name == gen(20)
        _train_to(mgr, back, (22, 25), saved)
    return at_fork, saved


def _every_descendant(descendants):
    """The old choice: every newer descendant of the pointer's generation counts, whichever timeline."""
    return descendants, []


@pytest.mark.parametrize("control", [False, True], ids=["fixed", "control-old-choice"])
def test_a_pointer_at_the_fork_point_resumes_the_current_timeline(tmp_path, monkeypatch, caplog, control):
    at_fork, saved = _forked(tmp_path)
    assert {gen(u) for u in (10, 20, 22, 25, 30, 40)} <= set(LocalStore(tmp_path).generations())
    (tmp_path / "latest").write_bytes(at_fork)  # latest put back at the fork point
    if control:
        monkeypatch.setattr(candidates_mod, "current_branch", _every_descendant)
    fresh = trainer.build(seed=7)
    with caplog.at_level(logging.ERROR, logger="trainstate"), ts.CheckpointManager(tmp_path) as mgr:
        assert mgr.status().recovery_point == (gen(40) if control else gen(25))  # `ls` and status agree with restore
        info = mgr.restore(fresh)
    if control:
        assert info.generation.name == gen(40)  # the abandoned timeline's newest: what the old code resumed
        return
    assert info.generation.name == gen(25)
    trainer.assert_same(trainer.full_state(fresh), saved[gen(25)])
    reason = info.rejected[0].reason
    assert info.rejected[0].generation == "latest" and "rolled back" in reason
    assert f"{gen(40)}, {gen(30)}, newer but on a timeline the run abandoned" in reason, reason
    assert any(gen(40) in r.getMessage() and "not resumed" in r.getMessage() for r in caplog.records)
    deliberate = trainer.build(seed=8)  # a deliberate return to the fork point names it
    with ts.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(deliberate, generation=gen(20)).generation.name == gen(20)
    trainer.assert_same(trainer.full_state(deliberate), saved[gen(20)])


@pytest.mark.parametrize("control", [False, True], ids=["fixed", "control-old-choice"])
def test_three_timelines_the_one_written_last_wins_not_the_highest_update(tmp_path, monkeypatch, control):
    """B runs on past A's last update (45); then the user goes back to A's gen-30 and saves 33 (timeline C,
    which takes gen-30 back as an ancestor). The newest by update, 45, is on a timeline the run left."""
    saved: dict = {}
    state = trainer.build(seed=0)
    with ts.CheckpointManager(tmp_path, keep_last=10) as mgr:
        _train_to(mgr, state, (10, 20), saved)
        at_fork = (tmp_path / "latest").read_bytes()
        _train_to(mgr, state, (30, 40), saved)
        b = trainer.build(seed=1)
        mgr.restore(b, generation=gen(20))
        _train_to(mgr, b, (22, 25, 45), saved)
        c = trainer.build(seed=2)
        mgr.restore(c, generation=gen(30))
        _train_to(mgr, c, (33,), saved)
    (tmp_path / "latest").write_bytes(at_fork)
    if control:
        monkeypatch.setattr(candidates_mod, "current_branch", _every_descendant)
    fresh = trainer.build(seed=7)
    with ts.CheckpointManager(tmp_path) as mgr:
        info = mgr.restore(fresh)
    if control:
        assert info.generation.name == gen(45)
        return
    assert info.generation.name == gen(33)
    trainer.assert_same(trainer.full_state(fresh), saved[gen(33)])
    assert f"{gen(45)}, {gen(40)}, {gen(25)}, {gen(22)}, newer but on a timeline" in info.rejected[0].reason


@pytest.mark.parametrize("control", [False, True], ids=["fixed", "control-old-choice"])
def test_signed_run_names_the_current_timeline_in_the_rollback_error(tmp_path, monkeypatch, control):
    at_fork, saved = _forked(tmp_path, KEY)
    (tmp_path / "latest").write_bytes(at_fork)
    if control:
        monkeypatch.setattr(candidates_mod, "current_branch", _every_descendant)
    with ts.CheckpointManager(tmp_path, signing_key=KEY) as mgr:
        with pytest.raises(ts.PointerRollback) as raised:
            mgr.restore(trainer.build(seed=7))
        message = str(raised.value)
        if control:
            assert f"but {gen(40)}, a newer validly signed" in message
            return
        assert f"but {gen(25)}, a newer validly signed" in message and "(2 newer in all; " in message, message
        assert f"{gen(40)}, {gen(30)}, newer but on a timeline the run abandoned" in message
        fresh = trainer.build(seed=8)
        assert mgr.restore(fresh, generation=gen(25)).generation.name == gen(25)
    trainer.assert_same(trainer.full_state(fresh), saved[gen(25)])


def _flip_a_tensor_bit(generation: Path) -> None:
    """One flipped bit in the generation's largest tensor file: its manifest still reads, its bytes do not verify."""
    target = max((p for p in generation.iterdir() if p.suffix == ".safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[-1] ^= 0x01
    target.write_bytes(bytes(data))


@pytest.mark.parametrize("control", [False, True], ids=["fixed", "control-newest-first"])
def test_a_damaged_latest_after_a_fork_falls_back_along_its_own_timeline(tmp_path, monkeypatch, control):
    """latest names gen 25 (timeline B, forked from 20); its bytes are damaged. The fallback resumes gen 22, its
    parent, not gen 40, the newest generation by update, on the timeline the run left at the fork. Control: every
    newer generation tried in update order, as before, resumes gen 40."""
    _, saved = _forked(tmp_path)
    _flip_a_tensor_bit(tmp_path / gen(25))
    if control:
        ahead = candidates_mod._descendants_ahead
        monkeypatch.setattr(candidates_mod, "_descendants_ahead", lambda *a: (*ahead(*a)[:2], []))
    fresh = trainer.build(seed=7)
    with ts.CheckpointManager(tmp_path) as mgr:
        info = mgr.restore(fresh)
    assert info.rejected[0].generation == gen(25)
    if control:
        assert info.generation.name == gen(40)
        return
    assert info.generation.name == gen(22)
    trainer.assert_same(trainer.full_state(fresh), saved[gen(22)])
