"""Disk preflight before staging, pruning to make room, and the recovery point reported by status().

The real-disk tests mount a small tmpfs (root only) so that free space is what
the kernel says it is. The mid-write ENOSPC path (``preflight=False``) is
covered by tests/test_publish.py; here it appears only as the negative control
that shows the preflight's pruning is what made a save fit.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import trainstate as ts
from trainer import assert_same, build, full_state, step

KIB = 1 << 10


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _gens(directory: Path) -> list[str]:
    return [n for n in _names(directory) if n.startswith("gen-")]


def _hidden(directory: Path) -> list[str]:
    return [n for n in _names(directory) if n.startswith(".trainstate-") and not n.endswith(".lock")]


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(v) for v in tree)
    return tree


def _seed(seed: int = 7) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill(filler: Path, leave: int) -> None:
    """Write a file that leaves about ``leave`` bytes free on its filesystem."""
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, _free(filler.parent) - leave))
        f.flush()
        os.fsync(f.fileno())
    assert _free(filler.parent) <= leave


@pytest.fixture
def tiny_fs(tmpfs):
    """``mount(size)`` -> a fresh tmpfs of that size (root only; skips otherwise; see conftest.tmpfs)."""
    names = (f"tiny{i}" for i in range(100))
    return lambda size: tmpfs.mount(size, next(names))


# (a) refusal -------------------------------------------------------------------------------------------
def test_preflight_refuses_before_staging_and_training_continues(tiny_fs):
    mount = tiny_fs("1m")
    run = mount / "run"
    _seed()
    reference = build()
    for _ in range(3):
        step(reference)
    reference_final = _clone(full_state(reference))

    _seed()
    state = build()
    step(state)
    with ts.CheckpointManager(run, keep_last=3) as ckpt:
        ckpt.save(state)
        at_gen1 = _clone(full_state(state))
        pointer = (run / "latest").read_bytes()
        filler = mount / "filler"
        _fill(filler, leave=16 * KIB)  # less than any generation's estimate (which adds 64 KiB of slack)
        step(state)
        live = _clone(full_state(state))
        with pytest.raises(ts.InsufficientSpace) as caught:
            ckpt.save(state)
        err = caught.value
        assert isinstance(err, OSError) and err.errno == errno.ENOSPC
        assert err.generation == "gen-000000000002"
        assert err.needed > err.available
        assert err.available == _free(run)  # nothing was written after the measurement
        message = str(err)
        assert f"about {err.needed:,} bytes needed" in message
        assert f"{err.available:,} available" in message
        assert "gen-000000000002" in message and "Nothing was written" in message
        # nothing staged, nothing partial, pointer untouched, live objects untouched
        assert _gens(run) == ["gen-000000000001"]
        assert _hidden(run) == []
        assert (run / "latest").read_bytes() == pointer
        assert ckpt.latest() == "gen-000000000001"
        assert_same(full_state(state), live)
        # training goes on in the same process; once there is room, the next save succeeds
        step(state)
        filler.unlink()
        info = ckpt.save(state)
        assert info.name == "gen-000000000003" and ckpt.latest() == "gen-000000000003"
        assert_same(full_state(state), reference_final)  # the refused save did not perturb the run
        resumed = build(seed=99)
        assert ckpt.restore(resumed).generation.name == "gen-000000000003"
        assert_same(full_state(resumed), reference_final)
        earlier = build(seed=98)
        ckpt.restore(earlier, generation="gen-000000000001")
        assert_same(full_state(earlier), at_gen1)
    assert _gens(run) == ["gen-000000000001", "gen-000000000003"]


# (b) prune first -------------------------------------------------------------------------------------
def _big_state() -> ts.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 128)  # 66 KB of weights, about 200 KB with AdamW's moments
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return ts.TrainState(model=model, optimizer=opt)


def _big_step(state: ts.TrainState) -> None:
    model, opt = state["model"], state["optimizer"]
    opt.zero_grad(set_to_none=True)
    model(torch.randn(4, 128)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state.next_update += 1


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


@pytest.mark.parametrize("preflight", [True, False], ids=["preflight-prunes-first", "no-preflight-control"])
def test_preflight_prunes_what_policy_allows_then_fits(tiny_fs, preflight, caplog):
    mount = tiny_fs("2m")
    run = mount / "run"
    state = _big_state()
    with ts.CheckpointManager(run, keep_last=5) as ckpt:
        for _ in range(5):
            _big_step(state)
            ckpt.save(state)
    names = [f"gen-{u:012d}" for u in range(1, 6)]
    assert _gens(run) == names
    size = _dir_bytes(run / names[0])
    _fill(mount / "filler", leave=16 * KIB)
    # precondition: pruning four generations makes room for the estimate; without pruning nothing fits
    assert 4 * size > (size + 64 * KIB) * 1.05 + 16 * KIB and size > 16 * KIB
    _big_step(state)
    caplog.set_level(logging.WARNING, logger="trainstate")
    with ts.CheckpointManager(run, retention=ts.Retention(keep_last=1), preflight=preflight) as ckpt:
        if preflight:
            info = ckpt.save(state)
            assert info.name == "gen-000000000006" and ckpt.latest() == info.name
            pruned = [r.getMessage() for r in caplog.records if "to make room" in r.getMessage()]
            assert len(pruned) == 1 and pruned[0].endswith("before saving gen-000000000006 to make room")
            listed = pruned[0].removeprefix("pruned ").split(" before")[0].split(", ")
            assert sorted(listed) == names[:4]  # the policy (keep_last=1) kept gen 5, the recovery point
            assert _gens(run) == ["gen-000000000006"]  # the pre-save prune kept gen 5; the post-publish prune dropped it
            resumed = _big_state()
            ckpt.restore(resumed)
            assert_same(resumed["model"].state_dict(), state["model"].state_dict())
            assert_same(resumed["optimizer"].state_dict(), state["optimizer"].state_dict())
        else:
            with pytest.raises(OSError) as caught:
                ckpt.save(state)
            assert caught.value.errno == errno.ENOSPC and not isinstance(caught.value, ts.InsufficientSpace)
            assert _gens(run) == names  # pruning runs only after a publish, and nothing was published
            assert ckpt.latest() == "gen-000000000005"
    assert _hidden(run) == []


# (b2) an incremental save: what it links takes no space --------------------------------------------------
def _frozen_base() -> ts.TrainState:
    """Issue 48's state: a frozen ``Linear(512, 640)`` (a 1.3 MB part, written by the second save and linked from
    the third on) and a trainable head."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 640).requires_grad_(False), torch.nn.Linear(640, 4))
    return ts.TrainState(model=model, optimizer=torch.optim.SGD(model[1].parameters(), lr=0.1))


def _head_step(state: ts.TrainState) -> None:
    with torch.no_grad():
        state["model"][1].weight.add_(0.01)
    state.next_update += 1


@pytest.mark.parametrize("control", [False, True], ids=["counts-written", "control-counts-linked"])
def test_the_preflight_counts_what_a_save_writes_not_what_it_links(tiny_fs, monkeypatch, control):
    """Issue 48: on a 6 MiB tmpfs, three saves, then about 600 KiB left free. The next save links the 1.3 MB
    part and writes about 20 KB, so it is not refused. With 40 KiB free it is: the refusal names what the save
    writes plus headroom and the bytes it links, and what is free; nothing is written, and once there is room
    the save goes through and restores bitwise. Control: the estimate counts every tensor (the old preflight),
    and the save that fits is refused for about 1.4 MB."""
    from trainstate.publish import Pending

    if control:
        monkeypatch.setattr(Pending, "estimate", lambda self, plan: self.estimated_bytes, raising=False)
    mount = tiny_fs("6m")
    run, filler = mount / "run", mount / "filler"
    state = _frozen_base()
    with ts.CheckpointManager(run, keep_last=10) as ckpt:  # the policy allows no pruning
        for _ in range(3):
            _head_step(state)
            ckpt.save(state)
        part = next((run / ckpt.latest()).glob("part-*")).stat().st_size
        _fill(filler, leave=600 * KIB)
        _head_step(state)
        if control:
            with pytest.raises(ts.InsufficientSpace) as caught:
                ckpt.save(state)
            assert caught.value.needed > part > caught.value.available
            return
        info = ckpt.save(state)
        assert "shares" in json.loads((run / info.name / "manifest.json").read_bytes())
        _fill(filler, leave=40 * KIB)
        _head_step(state)
        with pytest.raises(ts.InsufficientSpace) as caught:
            ckpt.save(state)
        err = caught.value
        assert isinstance(err, OSError) and err.errno == errno.ENOSPC
        assert err.available == _free(run) < err.needed < 200 * KIB < part  # the part is linked, not counted
        assert f"about {err.needed:,} bytes needed (what the save writes plus headroom; the {2 * part:,} bytes of " \
            "unchanged files it links take none)" in str(err) and f"{err.available:,} available" in str(err)
        assert ckpt.latest() == info.name and _gens(run)[-1] == info.name and _hidden(run) == []
        filler.unlink()
        assert ckpt.save(state).name == "gen-000000000005"  # the refused save, once there is room
    resumed = _frozen_base()
    with ts.CheckpointManager(run) as ckpt:
        assert ckpt.restore(resumed).generation.name == "gen-000000000005"
    assert_same(resumed["model"].state_dict(), state["model"].state_dict())


# _check_space logic, without a tmpfs ------------------------------------------------------------------
class FakeFree:
    """Stands in for the store's statvfs: returns ``value`` (or ``value(store)``)."""

    def __init__(self, store, value):
        self.store, self.value, self.calls = store, value, 0

    def __call__(self):
        self.calls += 1
        return self.value(self.store) if callable(self.value) else self.value


def _fake(monkeypatch, ckpt, value) -> FakeFree:
    fake = FakeFree(ckpt.store, value)
    monkeypatch.setattr(ckpt.store, "free_bytes", fake)
    return fake


def _needed(state, tmp_path, monkeypatch, headroom: float) -> int:
    with ts.CheckpointManager(tmp_path / f"probe-{headroom}", headroom=headroom) as ckpt:
        _fake(monkeypatch, ckpt, 0)
        with pytest.raises(ts.InsufficientSpace) as caught:
            ckpt.save(state)
    assert caught.value.available == 0
    return caught.value.needed


def test_estimate_covers_the_tensors_plus_slack_and_scales_with_headroom(tmp_path, monkeypatch):
    state = build()
    step(state)
    tensor_bytes = sum(t.nbytes for c in full_state(state).values() if isinstance(c, dict)
                       for t in _tensors(c))
    # the same state each time (the estimate includes the JSON, whose length follows the RNG states)
    base = _needed(state, tmp_path, monkeypatch, 0.0)
    assert base > tensor_bytes + 64 * KIB
    assert _needed(state, tmp_path, monkeypatch, 1.0) == 2 * base
    assert _needed(state, tmp_path, monkeypatch, 0.5) == int(base * 1.5)
    assert _needed(state, tmp_path, monkeypatch, 0.05) == int(base * 1.05)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def test_exactly_enough_space_passes_one_byte_less_is_refused(tmp_path, monkeypatch):
    state = build()
    step(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        fake = _fake(monkeypatch, ckpt, 0)
        with pytest.raises(ts.InsufficientSpace) as caught:
            ckpt.save(state)
        needed = caught.value.needed
        fake.value = needed - 1
        with pytest.raises(ts.InsufficientSpace) as caught:
            ckpt.save(state)
        assert (caught.value.needed, caught.value.available) == (needed, needed - 1)
        assert _gens(tmp_path) == [] and _hidden(tmp_path) == []
        fake.value = needed
        assert ckpt.save(state).name == "gen-000000000001"


def test_unknown_free_space_or_preflight_off_does_not_block(tmp_path, monkeypatch):
    state = build()
    step(state)
    with ts.CheckpointManager(tmp_path / "unknown") as ckpt:
        _fake(monkeypatch, ckpt, None)  # statvfs unavailable: no preflight verdict
        ckpt.save(state)
    with ts.CheckpointManager(tmp_path / "off", preflight=False) as ckpt:
        fake = _fake(monkeypatch, ckpt, 0)
        ckpt.save(state)
        assert fake.calls == 0


def test_preflight_prunes_by_policy_before_staging(tmp_path, monkeypatch):
    state = build()
    with ts.CheckpointManager(tmp_path, keep_last=5) as ckpt:
        for _ in range(3):
            step(state)
            ckpt.save(state)
    step(state)
    with ts.CheckpointManager(tmp_path, retention=ts.Retention(keep_last=1)) as ckpt:
        # room only once the directory holds a single generation
        _fake(monkeypatch, ckpt, lambda store: 10 ** 9 if len(store.generations()) <= 1 else 0)
        seen_at_staging = []
        real_begin = ckpt.store.begin
        monkeypatch.setattr(ckpt.store, "begin",
                            lambda name: (seen_at_staging.append(ckpt.store.generations()), real_begin(name))[1])
        ckpt.save(state)
        assert seen_at_staging == [["gen-000000000003"]]  # pruned before anything was staged
        assert ckpt.latest() == "gen-000000000004"
    assert _gens(tmp_path) == ["gen-000000000004"]


def test_refusal_after_pruning_keeps_the_latest(tmp_path, monkeypatch):
    state = build()
    with ts.CheckpointManager(tmp_path, keep_last=5) as ckpt:
        for _ in range(3):
            step(state)
            ckpt.save(state)
    saved = _clone(full_state(state))
    step(state)
    with ts.CheckpointManager(tmp_path, retention=ts.Retention(keep_last=2)) as ckpt:
        _fake(monkeypatch, ckpt, 0)
        with pytest.raises(ts.InsufficientSpace, match="after pruning what the retention policy allows"):
            ckpt.save(state)
        assert ckpt.latest() == "gen-000000000003"
    assert _gens(tmp_path) == ["gen-000000000002", "gen-000000000003"]  # policy allowed dropping gen 1 only
    assert _hidden(tmp_path) == []
    resumed = build(seed=5)
    with ts.CheckpointManager(tmp_path, retention=ts.Retention(keep_last=2)) as ckpt:
        assert ckpt.restore(resumed).generation.name == "gen-000000000003"
    assert_same(full_state(resumed), saved)


def test_weights_only_saves_are_preflighted_too(tmp_path, monkeypatch):
    state = build()
    step(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        _fake(monkeypatch, ckpt, 0)
        with pytest.raises(ts.InsufficientSpace, match="gen-000000000001-weights"):
            ckpt.save(state, weights_only=True)
    assert _gens(tmp_path) == []


# (d) status ------------------------------------------------------------------------------------------
def test_status_recovery_point_is_the_newest_full_generation(tmp_path):
    state = build()
    with ts.CheckpointManager(tmp_path, retention=ts.Retention(keep_last=3, keep_last_weights=3)) as ckpt:
        s = ckpt.status()
        assert (s.recovery_point, s.recovery_update, s.latest_weights, s.generations) == (None, None, None, 0)
        assert s.last_save_s is None and s.mean_save_s is None and s.interval_updates is None
        for _ in range(2):
            step(state)
            ckpt.save(state)
        s = ckpt.status()
        assert (s.recovery_point, s.recovery_update, s.latest_weights) == ("gen-000000000002", 2, None)
        assert s.directory == str(tmp_path) and s.generations == 2
        for _ in range(2):
            step(state)
            ckpt.save(state, weights_only=True)
        s = ckpt.status()
        assert (s.recovery_point, s.recovery_update) == ("gen-000000000002", 2)  # weights never protect a restart
        assert s.latest_weights == "gen-000000000004-weights"
        assert s.generations == 4
        assert ckpt.latest() == "gen-000000000002"
        assert s.last_save_s > 0 and s.mean_save_s > 0
        step(state)
        ckpt.save(state)
        s = ckpt.status()
        assert (s.recovery_point, s.recovery_update, s.latest_weights) == (
            "gen-000000000005", 5, "gen-000000000004-weights")
    resumed = build(seed=3)
    with ts.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(resumed).generation.name == ckpt.status().recovery_point == "gen-000000000005"


def test_refused_save_leaves_the_state_descending_from_the_latest(tmp_path, monkeypatch):
    """state.parent is "the generation this state was last restored from or saved as": a save refused by the
    preflight saved nothing, so the next generation's parent must still be the latest published one."""
    state = build()
    step(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
        assert state.parent == "gen-000000000001"
        step(state)
        fake = _fake(monkeypatch, ckpt, 0)
        with pytest.raises(ts.InsufficientSpace):
            ckpt.save(state)
        assert state.parent == "gen-000000000001"
        fake.value = None
        step(state)
        ckpt.save(state)
    manifest = json.loads((tmp_path / "gen-000000000003" / "manifest.json").read_text())
    assert manifest["parent"] == "gen-000000000001"  # not gen 2, which never existed
