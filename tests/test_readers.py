"""Issue 11, items 5 and 8: restore writes only into memory it owns, never half-loads because a writer
pruned under it, and never silently rolls back to an older generation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import trainstate as ts
import trainstate.restore as restore_mod
from trainer import assert_same, build, full_state, step
from trainstate.format.digest import digest_bytes
from trainstate.format.manifest import Pointer
from trainstate.storage.local import LocalStore
from trainstate.storage.posix import PosixOps


class Frozen:
    """A component whose state is a read-only NumPy array over ``bytes`` (an immutable object)."""

    def __init__(self, data: bytes):
        self.table = np.frombuffer(data, dtype=np.float32)
        self.source = data

    def state_dict(self):
        return {"table": self.table}

    def load_state_dict(self, state):
        self.table = state["table"]


# item 5 ---------------------------------------------------------------------------------------------------
def test_in_place_restore_never_writes_into_read_only_memory(tmp_path):
    """Before: the in-place pass wrote the checkpoint's values into the bytes object behind the array."""
    saved = Frozen(np.arange(8, dtype=np.float32).tobytes())
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(ts.TrainState(frozen=saved))
    immutable = np.full(8, 7, dtype=np.float32).tobytes()
    live = Frozen(immutable)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(ts.TrainState(frozen=live), in_place=True)
    assert immutable == np.full(8, 7, dtype=np.float32).tobytes()  # the immutable object is untouched
    assert np.array_equal(live.table, np.arange(8, dtype=np.float32))  # loaded by replacement


def test_the_in_place_pass_reads_the_files_the_first_pass_verified(tmp_path, monkeypatch):
    """Before: a prune between the passes made the second pass fail with StateMismatch after changing live tensors."""
    state = build()
    with ts.CheckpointManager(tmp_path, digest="blake3") as ckpt:  # two passes: format 2's whole-file digest
        step(state)
        ckpt.save(state)
    expected = full_state(state)
    real = restore_mod.load_in_place
    calls = []

    def pruned_between_passes(store, live, verified, *more):
        calls.append(verified.manifest.generation)
        os.rename(tmp_path / verified.manifest.generation, tmp_path / "elsewhere")
        import shutil
        shutil.rmtree(tmp_path / "elsewhere")  # as a concurrent prune does: the directory is gone
        return real(store, live, verified, *more)

    monkeypatch.setattr(restore_mod, "load_in_place", pruned_between_passes)
    live = build(seed=5)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(live, in_place=True)
    assert calls, "the second pass never ran: the test exercised nothing"
    assert_same(full_state(live), expected)


READER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import torch, trainstate as ts
    from trainer import build
    torch.set_num_threads(1)
    failures, restored = [], 0
    for attempt in range({attempts}):
        state = build(seed=attempt)
        try:  # a reader takes no lock: no `with`, no save
            info = ts.CheckpointManager({root!r}).restore(state, in_place=attempt % 2 == 0)
            restored += info is not None
        except Exception as exc:
            failures.append(f"{{type(exc).__name__}}: {{exc}}"[:300])
    print(json.dumps({{"failures": failures, "restored": restored}}))
""")


def test_a_reader_beside_a_saving_and_pruning_writer_never_fails(tmp_path):
    """A second process restores (copying and in place, alternately) while the writer saves with keep_last=1.

    Before: NoValidGeneration on a healthy directory, and StateMismatch after live tensors were partly
    overwritten, in a few percent of attempts.
    """
    root = tmp_path / "run"
    state = build()
    writer = ts.CheckpointManager(root, keep_last=1).__enter__()
    step(state)
    writer.save(state)
    reader = subprocess.Popen(
        [sys.executable, "-c", READER.format(tests=str(Path(__file__).parent), root=str(root), attempts=120)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    saves = 0
    try:
        while reader.poll() is None:
            step(state)
            writer.save(state)
            saves += 1
        out, err = reader.communicate(timeout=60)
    finally:
        writer.close()
    assert reader.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["failures"] == [] and result["restored"] == 120, result
    assert saves > 20, f"only {saves} saves ran beside the reader: the race was not exercised"


# item 8 ---------------------------------------------------------------------------------------------------
def _pointer(root: Path, name: str, key: ts.SigningKey | None = None) -> bytes:
    data = (root / name / "manifest.json").read_bytes()
    return Pointer(name, digest_bytes("blake3", data), len(data), "blake3", int(name.split("-")[1])).to_bytes(key)


def _run(root: Path, updates: int, key=None) -> ts.TrainState:
    state = build()
    with ts.CheckpointManager(root, keep_last=10, signing_key=key) as ckpt:
        for _ in range(updates):
            step(state)
            ckpt.save(state)
    return state


def test_a_signed_pointer_copied_back_is_refused(tmp_path):
    """Before: restore loaded generation 1 while validly signed generations 2 and 3 of its timeline verified."""
    key = ts.SigningKey(b"k" * 32)
    old = _pointer_after(tmp_path, 1, key)
    _run_more(tmp_path, 2, key)
    (tmp_path / "latest").write_bytes(old)  # an older, validly signed latest copied back into place
    with ts.CheckpointManager(tmp_path, signing_key=key) as ckpt:
        with pytest.raises(ts.PointerRollback, match="gen-000000000001.*gen-000000000003"):
            ckpt.restore(build(seed=9))
        info = ckpt.restore(chosen := build(seed=9), generation="gen-000000000001")  # the deliberate way
        assert info.generation.name == "gen-000000000001" and chosen.next_update == 1


def test_an_unsigned_rolled_back_pointer_is_reported_and_the_newest_restored(tmp_path, caplog):
    old = _pointer_after(tmp_path, 1, None)
    final = _run_more(tmp_path, 2, None)
    (tmp_path / "latest").write_bytes(old)
    with ts.CheckpointManager(tmp_path) as ckpt:
        info = ckpt.restore(got := build(seed=9))
    assert info.generation.name == "gen-000000000003"
    assert any("rolled back" in r.reason for r in info.rejected)
    assert "rolled back" in caplog.text
    assert_same(full_state(got), final)


class _LatestAtCommit(PosixOps):
    """Records what ``latest`` names each time a staging directory is renamed into a generation (a commit)."""

    def __init__(self, root: Path):
        self.root, self.seen = root, []

    def rename(self, src, dst):
        super().rename(src, dst)
        if Path(src).name.startswith(".trainstate-staging-"):
            self.seen.append(json.loads((self.root / "latest").read_bytes())["generation"])


@pytest.mark.parametrize("signed", [True, False])
def test_a_new_save_after_rolling_forward_moves_latest_first(tmp_path, signed):
    """Found by the async kill drill: a crash between gen 6's commit and its pointer move, a restart that rolls
    forward to gen 6, then a crash between gen 9's commit and its pointer move left latest two steps behind, which
    restore takes for a rolled-back pointer (in a signed run it refuses: PointerRollback). A save descending from a
    rolled-forward generation now moves latest to it before committing its own, so a crash in it leaves latest
    one step behind at most. The control: the pointer named gen 1 at the commit before the fix."""
    key = ts.SigningKey(b"k" * 32) if signed else None
    state = _run(tmp_path, 2, key)
    (tmp_path / "latest").write_bytes(_pointer(tmp_path, "gen-000000000001", key))  # gen 2's move was cut
    ops = _LatestAtCommit(tmp_path)
    with ts.CheckpointManager(tmp_path, signing_key=key, store=LocalStore(tmp_path, "blake3-chunked", ops=ops)) as ckpt:
        ckpt.restore(got := build(seed=9))
        assert got.next_update == state.next_update
        step(got)
        ckpt.save(got)
    assert ops.seen == ["gen-000000000002"]  # at gen 3's commit, latest already named its parent
    (tmp_path / "latest").write_bytes(_pointer(tmp_path, "gen-000000000002", key))  # gen 3's move cut: one step
    with ts.CheckpointManager(tmp_path, signing_key=key) as ckpt:
        info = ckpt.restore(build(seed=9))
    assert info.generation.name == "gen-000000000003" and "rolling forward" in info.rejected[0].reason


@pytest.mark.parametrize("signed", [True, False])
def test_one_step_behind_rolls_forward_and_says_so(tmp_path, caplog, signed):
    """Issue 29 item 5: a crash between a commit and the pointer move, or a signed latest replayed one step back,
    leaves the pointer one step behind a complete generation that descends from it. Before, restore followed the
    pointer silently (a replay gained an attacker one step); now it restores the newer one, bitwise, and reports
    the pointer."""
    key = ts.SigningKey(b"k" * 32) if signed else None
    state = _run(tmp_path, 2, key)
    (tmp_path / "latest").write_bytes(_pointer(tmp_path, "gen-000000000001", key))
    with ts.CheckpointManager(tmp_path, signing_key=key) as ckpt:
        info = ckpt.restore(got := build(seed=9))
    assert info.generation.name == "gen-000000000002"
    assert [r.generation for r in info.rejected] == ["latest"] and "rolling forward" in info.rejected[0].reason
    assert "rolling forward to gen-000000000002" in caplog.text
    assert_same(full_state(got), full_state(state))
    # restore writes nothing (latest still names gen 1); a save at the restored update writes no generation but
    # completes the cut publication: latest names gen 2 (found by the mirror kill drill: a run killed in its final
    # save, restored at its final update and saving again, ended with latest one step behind)
    assert ts.CheckpointManager(tmp_path, signing_key=key).latest() == "gen-000000000001"
    with ts.CheckpointManager(tmp_path, signing_key=key) as ckpt:
        info = ckpt.save(got)
        assert info.name == "gen-000000000002" and ckpt.latest() == "gen-000000000002"
        assert sorted(p.name for p in tmp_path.glob("gen-*")) == ["gen-000000000001", "gen-000000000002"]
    with ts.CheckpointManager(tmp_path, signing_key=key) as ckpt:
        again = ckpt.restore(build(seed=9))
    assert again.generation.name == "gen-000000000002" and again.rejected == ()


def test_a_no_op_save_where_latest_already_names_it_writes_nothing(tmp_path):
    state = _run(tmp_path, 2)
    pointer = (tmp_path / "latest").stat()
    with ts.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.save(state).name == "gen-000000000002"
    after = (tmp_path / "latest").stat()
    assert (after.st_ino, after.st_mtime_ns) == (pointer.st_ino, pointer.st_mtime_ns)


def test_one_step_ahead_but_damaged_falls_back_to_the_pointer(tmp_path):
    """The control: the newer generation is preferred only when it verifies; damaged, the pointer's is restored."""
    key = ts.SigningKey(b"k" * 32)
    _run(tmp_path, 2, key)
    (tmp_path / "latest").write_bytes(_pointer(tmp_path, "gen-000000000001", key))
    tensors = tmp_path / "gen-000000000002" / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 1
    tensors.write_bytes(bytes(data))
    with ts.CheckpointManager(tmp_path, signing_key=key) as ckpt:
        info = ckpt.restore(build(seed=9))
    assert info.generation.name == "gen-000000000001"
    assert "gen-000000000002" in [r.generation for r in info.rejected]


def _pointer_after(root: Path, updates: int, key) -> bytes:
    global _STATE
    _STATE = build()
    with ts.CheckpointManager(root, keep_last=10, signing_key=key) as ckpt:
        for _ in range(updates):
            step(_STATE)
            ckpt.save(_STATE)
    return (root / "latest").read_bytes()


def _run_more(root: Path, updates: int, key) -> dict:
    with ts.CheckpointManager(root, keep_last=10, signing_key=key) as ckpt:
        for _ in range(updates):
            step(_STATE)
            ckpt.save(_STATE)
    return full_state(_STATE)


_STATE: ts.TrainState | None = None


def test_a_generation_and_pointer_transplanted_from_another_run_are_refused(tmp_path):
    """Before: with a shared key, run A restored run B's signed generation and pointer without a word."""
    key = ts.SigningKey(b"k" * 32)
    mine = _run(tmp_path / "a", 2, key)
    _run(tmp_path / "b", 5, key)
    import shutil
    shutil.copytree(tmp_path / "b" / "gen-000000000005", tmp_path / "a" / "gen-000000000005")
    shutil.copy(tmp_path / "b" / "latest", tmp_path / "a" / "latest")
    with ts.CheckpointManager(tmp_path / "a", signing_key=key) as ckpt:
        info = ckpt.restore(got := build(seed=9))
    assert info.generation.name == "gen-000000000002"
    assert any("copied in from another run directory" in r.reason for r in info.rejected)
    assert_same(full_state(got), full_state(mine))
    from trainstate.cli import main
    assert main(["verify", str(tmp_path / "a")]) == 1  # verify names the stranger too
