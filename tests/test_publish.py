"""The publication protocol: ordering of durable steps, failure paths, leftovers, retention, collisions."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import trainstate as ts
from trainstate.storage.local import LocalStore
from trainer import assert_same, build, full_state, step


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_durable_steps_happen_in_protocol_order(tmp_path, monkeypatch):
    """Spy on the real syscalls (they still run) and check the order the protocol promises."""
    events: list[tuple[str, str]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(b))), real_rename(a, b))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    state = build()
    step(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    root, gen = str(tmp_path), str(tmp_path / "gen-000000000001")
    kinds = [(k, Path(p).name if p not in (root,) else "<run dir>") for k, p in events]
    rename_at = kinds.index(("rename", "gen-000000000001"))
    before = kinds[:rename_at]
    staged = [name for k, name in before if k == "fsync"]
    assert {"state.json", "tensors.safetensors", "manifest.json"} <= set(staged)
    assert before[-1][0] == "fsync" and before[-1][1].startswith(".trainstate-staging-gen-000000000001-")
    assert kinds[rename_at + 1] == ("fsync", "<run dir>")
    after = kinds[rename_at + 2:]
    assert after[:3] == [("fsync", after[0][1]), ("replace", "latest"), ("fsync", "<run dir>")]
    assert after[0][1].startswith(".trainstate-tmp-latest-")
    assert gen not in [p for _, p in events[rename_at + 1:]]  # nothing rewrites the published generation


class FailingStore(LocalStore):
    """The real local store with one step made to fail, as a full disk or a dying device would."""

    def __init__(self, root, fail_at: str):
        super().__init__(root)
        self.fail_at = fail_at

    def begin(self, generation):
        staging = super().begin(generation)
        fail_at, real_write, real_commit = self.fail_at, staging.write, staging.commit

        def write(file, chunks, **options):
            if fail_at == file:
                raise OSError(errno.EIO, "injected I/O error", file)
            return real_write(file, chunks, **options)

        def commit():
            if fail_at == "commit":
                raise OSError(errno.EIO, "injected I/O error at rename")
            return real_commit()

        staging.write, staging.commit = write, commit
        return staging

    def write_pointer(self, name, data):
        if self.fail_at == "pointer":
            raise OSError(errno.EIO, "injected I/O error at pointer")
        return super().write_pointer(name, data)


@pytest.mark.parametrize("fail_at", ["state.json", "tensors.safetensors", "manifest.json", "commit", "pointer"])
def test_failed_save_publishes_nothing_and_keeps_latest(tmp_path, fail_at):
    state = build()
    step(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(reference := build(seed=9))
    pointer_before = (tmp_path / "latest").read_bytes()
    step(state)
    with ts.CheckpointManager(tmp_path, store=FailingStore(tmp_path, fail_at)) as ckpt:
        with pytest.raises(OSError, match="injected"):
            ckpt.save(state)
    assert (tmp_path / "latest").read_bytes() == pointer_before
    visible = [n for n in _names(tmp_path) if n.startswith("gen-")]
    assert visible == ["gen-000000000001"]  # a failed pointer move withdraws the committed generation too
    assert not [n for n in _names(tmp_path) if n.startswith(".trainstate-staging")]
    with ts.CheckpointManager(tmp_path) as ckpt:
        info = ckpt.restore(again := build(seed=10))
        assert info.generation.name == "gen-000000000001" and info.rejected == ()
        assert_same(full_state(again), full_state(reference))
        ckpt.save(state if fail_at != "pointer" else (step(state), state)[1])  # the next save succeeds


def test_leftovers_invisible_and_cleaned_only_if_ours(tmp_path):
    state = build()
    step(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    ours = tmp_path / ".trainstate-staging-gen-000000000002-0123456789abcdef"
    ours.mkdir()
    (ours / "state.json").write_text("{partial")
    (tmp_path / ".trainstate-tmp-latest-00000000000000ff").write_text("x")
    foreign = [tmp_path / ".trainstate-staging-mine", tmp_path / "notes.txt", tmp_path / "gen-backup",
               tmp_path / "gen-1"]
    foreign[0].mkdir()
    foreign[1].write_text("keep me")
    foreign[2].mkdir()
    foreign[3].mkdir()
    with ts.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(build(seed=3)).generation.name == "gen-000000000001"
        step(state)
        ckpt.save(state)
    assert not ours.exists() and not (tmp_path / ".trainstate-tmp-latest-00000000000000ff").exists()
    assert all(p.exists() for p in foreign)


def test_keep_last_prunes_after_commit_and_spares_foreign_and_newer(tmp_path):
    state = build()
    (tmp_path / "gen-000000000099-notes").mkdir(parents=True)
    orphan = tmp_path / "gen-000000000500"  # e.g. from an abandoned timeline: never ours to judge
    with ts.CheckpointManager(tmp_path, keep_last=2) as ckpt:
        for _ in range(5):
            step(state)
            ckpt.save(state)
            if state.next_update == 2:
                shutil.copytree(tmp_path / "gen-000000000002", orphan)
    gens = [n for n in _names(tmp_path) if n.startswith("gen-")]
    assert gens == ["gen-000000000004", "gen-000000000005", "gen-000000000099-notes", "gen-000000000500"]
    assert json.loads((tmp_path / "latest").read_text())["generation"] == "gen-000000000005"


def test_same_update_twice_is_a_no_op_a_changed_state_is_a_revision_and_an_orphan_is_superseded(tmp_path):
    """Issue 22 item 5: a changed state (or new metrics) at the same update was refused (GenerationExists);
    it is now published as a revision that supersedes the earlier generation."""
    state = build()
    step(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        first = ckpt.save(state)
        before = {n: (tmp_path / n / "manifest.json").read_bytes() for n in _names(tmp_path) if n.startswith("gen-")}
        assert ckpt.save(state) == first  # a final save right after a periodic one: nothing written
        after = {n: (tmp_path / n / "manifest.json").read_bytes() for n in _names(tmp_path) if n.startswith("gen-")}
        assert after == before
        state.counters["epoch"] = 7  # the state changed, but next_update did not advance
        assert ckpt.save(state).name == "gen-000000000001-r001"
        assert ckpt.save(state).name == "gen-000000000001-r001"  # the same again: nothing written
        assert ckpt.save(state, metrics={"loss": 1.0}).name == "gen-000000000001-r002"  # never dropped
        step(state)
        ckpt.save(state)
    # simulate a crash after rename but before the pointer moved: pointer back at the last revision of gen 1
    (tmp_path / "latest").write_bytes(_pointer_for(tmp_path, "gen-000000000001-r002"))
    resumed = build(seed=4)
    with ts.CheckpointManager(tmp_path) as ckpt:
        info = ckpt.restore(resumed)  # gen 2 is complete and descends from it: rolled forward (issue 29)
        assert info.generation.name == "gen-000000000002" and info.identical_continuation
        step(resumed)
        ckpt.save(resumed)
        assert ckpt.latest() == "gen-000000000003"
    # the superseded gen-1 and gen-1-r001 take no keep_last slot: they stay while gen-1-r002 does
    assert [n for n in _names(tmp_path) if n.startswith("gen-")] == [
        "gen-000000000001", "gen-000000000001-r001", "gen-000000000001-r002", "gen-000000000002",
        "gen-000000000003"]


def _pointer_for(directory: Path, name: str) -> bytes:
    from trainstate.format.digest import digest_bytes
    from trainstate.format.manifest import Pointer

    data = (directory / name / "manifest.json").read_bytes()
    update = int(name.split("-")[1])
    algorithm = json.loads(data)["digest_algorithm"]
    return Pointer(name, digest_bytes(algorithm, data), len(data), algorithm, update).to_bytes()


def test_sha256_digest_option(tmp_path):
    state = build()
    step(state)
    with ts.CheckpointManager(tmp_path, digest="sha256") as ckpt:
        ckpt.save(state)
        assert ckpt.restore(build(seed=2)).generation.digest_algorithm == "sha256"


@pytest.fixture
def tiny_fs(tmpfs):
    return tmpfs.mount("3m", "tiny")  # a real ENOSPC (see conftest.tmpfs)


@pytest.mark.parametrize("preflight", [False, True], ids=["mid-write-enospc", "preflight-refusal"])
def test_real_enospc_keeps_previous_generation(tiny_fs, preflight):
    """Without the preflight the write itself hits ENOSPC; with it, the save is refused before staging."""
    model = torch.nn.Linear(300, 300)  # ~360 KB of weights, ~1 MB with AdamW moments
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 300)).sum().backward()
    opt.step()
    state = ts.TrainState(model=model, optimizer=opt)
    run = tiny_fs / "run"
    with ts.CheckpointManager(run, keep_last=5, preflight=preflight) as ckpt:
        state.next_update = 1
        ckpt.save(state)
        filler = tiny_fs / "filler"
        with open(filler, "wb") as f:
            try:
                f.write(b"\0" * (3 << 20))
            except OSError:
                pass
        state.next_update = 2
        with pytest.raises(OSError) as err:
            ckpt.save(state)
        assert err.value.errno == errno.ENOSPC
        assert isinstance(err.value, ts.InsufficientSpace) == preflight
        assert [n for n in _names(run) if n.startswith("gen-")] == ["gen-000000000001"]
        assert not [n for n in _names(run) if n.startswith(".trainstate-staging")]
        filler.unlink()
        ckpt.save(state)
        assert ckpt.latest() == "gen-000000000002"


def test_digest_written_beside_a_long_write_is_the_file_digest(tmp_path):
    """Many large chunks keep the digest thread behind the writer; every chunk must still be hashed."""
    from trainstate.format import tensorfile
    from trainstate.format.digest import digest_bytes, new_hasher
    from trainstate.storage.local import PosixOps, _hash_while_writing, coalesce

    tensors = {f"t{i}": torch.full((3 << 20,), float(i)) for i in range(12)}  # 12 x 12 MiB
    layout = tensorfile.plan(tensors)
    for algorithm in ("blake3", "sha256"):
        path = tmp_path / algorithm
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        hasher = new_hasher(algorithm)
        size = _hash_while_writing(PosixOps(), fd, coalesce(tensorfile.chunks(layout, tensors)), hasher)
        os.close(fd)
        data = path.read_bytes()
        assert size == len(data) == layout.size
        assert hasher.hexdigest() == digest_bytes(algorithm, data)
