"""A save never passes damage on (issue 48, items 3 and 6): a part is linked or copied only from bytes proven intact.

A frozen ``Linear(512, 640)`` base (its 1.3 MB weight laid out by the first
save in a part file and its spare, the two linked crosswise from the second
save on: hard links on a local disk, references on an object store) and a
trainable head: the issue's LoRA-like state. One bit is flipped in the copy
the next save takes as its part (the newest's spare), the head changes, and
the next save must still publish the state it had in memory: a fresh restore
resumes it bitwise.

- On an object store the part is a server-side copy: the copy is proven to
  hold the recorded bytes (read back against the chunk digests, unless its
  source is a version this process proved; a replacement moves the ETag).
  Bytes read per save are counted on the wire, through a proxy to moto.
- With ``verify="full"``, a generation whose verification fails (damage the
  pre-link proof could not see) makes the retry write every file afresh.
- A mirror never copies a damaged remote part into the next remote
  generation, and ``status().mirror`` names a remote latest that verifies.
- On a local disk, a flipped bit with the file's modification time put back
  is found: a part is proven by its bytes at every save, not by its size and
  mtime.

(The preflight's count of what a save writes, not what it links, is tested
in ``tests/test_preflight.py``.)

Each test has a control that puts the old behaviour back and sees the damage
passed on (or the refusal).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import trainstate as ts
from trainstate import cli
from trainstate.lifecycle import incremental
from objectservers import FaultProxy, moto_server  # noqa: F401  (fixture)



def _state(seed: int = 0) -> ts.TrainState:
    torch.manual_seed(seed)
    base = torch.nn.Linear(512, 640)
    base.requires_grad_(False)
    model = torch.nn.Sequential(base, torch.nn.Linear(640, 4))
    return ts.TrainState(model=model, optimizer=torch.optim.SGD(model[1].parameters(), lr=0.1))


def _step(state: ts.TrainState) -> dict[str, torch.Tensor]:
    """Change the head (the base stays frozen); the state's values as a save at this update holds them."""
    with torch.no_grad():
        state["model"][1].weight.add_(0.01 * (state.next_update + 1))
    state.next_update += 1
    return {k: v.clone() for k, v in state["model"].state_dict().items()}


def _three_saves(ckpt: ts.CheckpointManager, state: ts.TrainState, after=lambda: None) -> None:
    """The first lays the base out in a part and its spare; the second and third link them crosswise."""
    for _ in range(3):
        _step(state)
        ckpt.save(state)
        after()


def _restored(source, **options) -> tuple[str, dict[str, torch.Tensor], list]:
    fresh = _state(seed=9)
    with ts.CheckpointManager(source, **options) as ckpt:
        info = ckpt.restore(fresh)
    return info.generation.name, dict(fresh["model"].state_dict()), [r.generation for r in info.rejected]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# object stores ---------------------------------------------------------------------------------------------
def _remote(store, generation: str, suffix: str = ".spare") -> tuple[str, dict]:
    """The object holding ``generation``'s spare (``suffix=".safetensors"``: its part) in ``store`` (an
    ObjectStore: the object those bytes were first uploaded as, which later generations reference), and the
    generation's manifest. The spare is the copy the next save takes as its part."""
    manifest = json.loads(store.open(generation, "manifest.json").read())
    part = next(f["name"] for f in manifest["files"] if f["name"].startswith("part-") and f["name"].endswith(suffix))
    return store.key(generation, part), manifest


def _flip(store, key: str) -> None:
    """Replace object ``key`` with its bytes, one bit flipped near the end (in a tensor's data)."""
    data = bytearray(store.client.get_small(key))
    data[-11] ^= 0x10
    store.client.put(key, bytes(data))


def _part_bytes_read(proxy: FaultProxy) -> int:
    """Body bytes of GETs of part objects since the proxy's log was last cleared."""
    return sum(t.bytes for t in proxy.traffic if t.method == "GET" and "/part-" in t.path)


def _trust_every_copy(monkeypatch) -> None:
    """The old behaviour: a server-side copy is taken as intact without a read (``intact`` passed remote files)."""
    from trainstate.storage.objects import ObjectStore

    monkeypatch.setattr(ObjectStore, "proven", lambda self, key, e_tag, record: True, raising=False)


@pytest.mark.parametrize("control", [False, True], ids=["proven", "control-copy-unproven"])
def test_an_object_store_never_copies_a_damaged_part(moto_server, monkeypatch, caplog, control):
    """The issue's scenario straight on S3: three saves, one bit flipped in the object holding the newest
    generation's spare (the copy the next save takes as its part), the head changed, a save at update 4. The
    object is read back against its digests, found damaged and the part uploaded afresh from the live tensors:
    a fresh restore resumes gen-4 bitwise. The cost, counted on the wire: an object is read back once per
    version this process has not proven (the two copies at the first link of a process, a replaced object, one
    uploaded afresh), and a steady save reads no part bytes at all. Control: an object taken as intact without
    a read (the old ``intact``); gen-4 and gen-6 then read the damaged copy and are rejected, though each
    save's state was whole in memory."""
    pytest.importorskip("obstore")
    if control:
        _trust_every_copy(monkeypatch)
    with FaultProxy(moto_server.endpoint) as proxy:
        options = moto_server.storage_options(endpoint=proxy.endpoint)
        url = moto_server.url(moto_server.make_bucket(), "run")
        state, read, saved = _state(), [], {}
        with ts.CheckpointManager(url, keep_last=10, storage_options=options) as ckpt:
            for _ in range(3):
                values = _step(state)
                proxy.clear()
                saved[ckpt.save(state).name] = values
                read.append(_part_bytes_read(proxy))
            key, manifest = _remote(ckpt.store, ckpt.latest())
            part_size = next(f["size"] for f in manifest["files"] if key.endswith(f["name"]))
            _flip(ckpt.store, key)
            values = _step(state)
            proxy.clear()
            with caplog.at_level("WARNING", logger="trainstate"):
                fourth = ckpt.save(state).name
            saved[fourth] = values
            read.append(_part_bytes_read(proxy))
            for _ in range(2):  # after the fresh upload: proven once, then steady
                values = _step(state)
                proxy.clear()
                saved[ckpt.save(state).name] = values
                read.append(_part_bytes_read(proxy))
    name, values, rejected = _restored(url, storage_options=moto_server.storage_options())
    if control:  # every second generation from gen-4 on reads the damaged bytes
        assert "not linking" not in caplog.text
        assert (name, rejected) == ("gen-000000000005", ["gen-000000000006"])
        return
    assert (name, rejected) == ("gen-000000000006", []) and _equal(values, saved[name])
    assert "not linking" in caplog.text and "does not hold what was recorded" in caplog.text
    assert read == [0, 2 * part_size, 0, part_size, part_size, 0], read
    fresh = _state(seed=9)
    with ts.CheckpointManager(url, storage_options=moto_server.storage_options()) as ckpt:
        assert ckpt.restore(fresh, generation=fourth).generation.name == fourth
    assert _equal(dict(fresh["model"].state_dict()), saved[fourth])


@pytest.mark.parametrize("control", [False, True], ids=["retry-writes-afresh", "control-retry-links-again"])
def test_a_failed_verification_makes_the_retry_write_every_file_afresh(moto_server, monkeypatch, control):
    """``verify="full"`` on S3, with damage the pre-link proof cannot see (the store takes the damaged object as
    proven, as bit rot under an unchanged ETag would have it): the post-commit verification fails the save at
    update 4 and removes what it committed; the retry links nothing, writes every file from the live tensors,
    and a fresh restore resumes it bitwise. Control: the failure is not remembered (the old behaviour); every
    retry copies the same damaged object again and fails the same way."""
    pytest.importorskip("obstore")
    from trainstate.publish import Publisher

    _trust_every_copy(monkeypatch)
    if control:
        monkeypatch.setattr(Publisher, "distrust", lambda self: None, raising=False)
    url = moto_server.url(moto_server.make_bucket(), "run")
    options = moto_server.storage_options()
    state = _state()
    with ts.CheckpointManager(url, keep_last=10, verify="full", storage_options=options) as ckpt:
        _three_saves(ckpt, state)
        _flip(ckpt.store, _remote(ckpt.store, ckpt.latest())[0])
        values = _step(state)
        with pytest.raises(ts.CorruptGeneration, match="digest mismatch"):
            ckpt.save(state)
        assert ckpt.latest() == "gen-000000000003" and "gen-000000000004" not in ckpt.store.generations()
        if control:
            for _ in range(2):
                with pytest.raises(ts.CorruptGeneration, match="digest mismatch"):
                    ckpt.save(state)
            return
        info = ckpt.save(state)
        assert info.name == ckpt.latest() == "gen-000000000004"
        assert "shares" not in _remote(ckpt.store, info.name)[1]  # every file written afresh
        _step(state)
        assert "shares" in _remote(ckpt.store, ckpt.save(state).name)[1]  # and the next save links again
    fresh = _state(seed=9)
    with ts.CheckpointManager(url, storage_options=options) as ckpt:
        assert ckpt.restore(fresh, generation="gen-000000000004").generation.name == "gen-000000000004"
    assert _equal(dict(fresh["model"].state_dict()), values)


def _mirrored(ckpt, update: int) -> None:
    deadline = time.monotonic() + 60
    while ckpt.status().mirror.remote_update != update and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ckpt.status().mirror.remote_update == update, ckpt.status().mirror


@pytest.mark.parametrize("control", [False, True], ids=["proven", "control-copy-unproven"])
def test_a_mirror_never_copies_a_damaged_remote_part(tmp_path, moto_server, monkeypatch, capsys, control):
    """A local incremental run mirrored to S3; one bit flipped in the remote copy of the newest generation's part
    (the local one is whole). The next upload does not copy that object: the server's copy is read back, found
    damaged, and the part comes from an intact remote copy or the local verified bytes. ``status().mirror``
    names gen-4 as the remote latest, ``trainstate verify`` passes on it, and a machine with an empty directory
    resumes it bitwise from the remote alone. Control: a copy taken as intact without a read (the old
    behaviour): the status names gen-4 while ``trainstate verify`` fails it."""
    pytest.importorskip("obstore")
    from trainstate.storage.objects import ObjectStore

    if control:
        _trust_every_copy(monkeypatch)
    options = moto_server.storage_options()
    mirror = moto_server.url(moto_server.make_bucket(), "mirror")
    remote = ObjectStore(mirror, storage_options=options)
    state = _state()
    with ts.CheckpointManager(tmp_path / "local", keep_last=10, mirror=mirror, mirror_options=options) as ckpt:
        _three_saves(ckpt, state, after=lambda: _mirrored(ckpt, state.next_update))
        _flip(remote, _remote(remote, "gen-000000000003", ".safetensors")[0])  # (the copy gen 3 reads)
        values = _step(state)
        ckpt.save(state)
        _mirrored(ckpt, 4)
        status = ckpt.status().mirror
    assert "shares" in _remote(remote, "gen-000000000004")[1]  # an incremental generation on the remote too
    assert (status.remote_latest, status.last_error) == ("gen-000000000004", None)
    verified = _verify_cli(moto_server, monkeypatch, capsys, f"{mirror}/{status.remote_latest}")
    if control:
        assert verified == (1, True)
        return
    assert verified == (0, False)
    name, restored, _ = _restored(tmp_path / "fresh", mirror=mirror, mirror_options=options)
    assert name == "gen-000000000004" and _equal(restored, values)


def _verify_cli(server, monkeypatch, capsys, target: str) -> tuple[int, bool]:
    """``trainstate verify target`` with the server's credentials in the environment: its exit status, and
    whether it reported a digest mismatch."""
    for name, value in (("AWS_ENDPOINT_URL", server.endpoint), ("AWS_ACCESS_KEY_ID", server.access_key),
                        ("AWS_SECRET_ACCESS_KEY", server.secret_key), ("AWS_REGION", server.region),
                        ("AWS_ALLOW_HTTP", "true")):
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    status = cli.main(["verify", target])
    return status, "digest mismatch" in capsys.readouterr().out


@pytest.mark.parametrize("control", [False, True], ids=["verified", "control-sizes-only"])
def test_a_mirror_verifies_a_remote_generation_it_finds_committed_before_naming_it(
        tmp_path, moto_server, monkeypatch, capsys, control):
    """An upload that committed gen-3 on the remote but was cut off before the remote ``latest`` moved (the
    pointer is put back at gen-2); the remote gen-3's part is then damaged. A restart that restores gen-3 has
    the mirror upload it again: it finds gen-3 committed, reads it whole, sets the damaged one aside and uploads
    it afresh, so the remote latest it reports verifies. Control: the sizes alone checked (the old behaviour):
    the status names the damaged gen-3 as the remote latest."""
    pytest.importorskip("obstore")
    from trainstate.format.manifest import POINTER
    from trainstate.lifecycle.mirror import Mirror
    from trainstate.storage.objects import ObjectStore
    from trainstate.storage.verify import verify_generation

    if control:
        monkeypatch.setattr(Mirror, "_held_remotely", lambda self, name: verify_generation(
            self.remote, name, content=False, key=self.key), raising=False)
    options = moto_server.storage_options()
    mirror = moto_server.url(moto_server.make_bucket(), "mirror")
    remote = ObjectStore(mirror, storage_options=options)
    local, state, behind = tmp_path / "local", _state(), []
    with ts.CheckpointManager(local, keep_last=10, mirror=mirror, mirror_options=options) as ckpt:
        _three_saves(ckpt, state, after=lambda: (_mirrored(ckpt, state.next_update),
                                                 behind.append(remote.read_pointer(POINTER))))
    remote.client.put(POINTER, behind[1])  # as if the upload of gen-3 stopped after its commit
    _flip(remote, _remote(remote, "gen-000000000003", ".safetensors")[0])  # (the copy gen 3 reads)
    resumed = _state(seed=9)
    with ts.CheckpointManager(local, keep_last=10, mirror=mirror, mirror_options=options) as ckpt:
        assert ckpt.restore(resumed).generation.name == "gen-000000000003"
        _mirrored(ckpt, 3)
        status = ckpt.status().mirror
    assert status.remote_latest == "gen-000000000003"
    verified = _verify_cli(moto_server, monkeypatch, capsys, f"{mirror}/{status.remote_latest}")
    assert verified == ((1, True) if control else (0, False))
    if not control:
        assert any(name.startswith("gen-000000000003.rejected-") for name in remote.aside())


# a local disk ----------------------------------------------------------------------------------------------
def _rot(part: Path) -> None:
    """Flip one bit of ``part`` in place (same inode, same size) and put its modification time back exactly."""
    before = part.stat()
    os.chmod(part, 0o644)
    with open(part, "r+b") as f:
        f.seek(before.st_size - 11)
        byte = f.read(1)[0]
        f.seek(before.st_size - 11)
        f.write(bytes([byte ^ 0x10]))
    os.chmod(part, before.st_mode)
    os.utime(part, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = part.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


@pytest.mark.parametrize("control", [False, True], ids=["proven-by-bytes", "control-trusted"])
def test_bit_rot_under_an_unchanged_size_and_mtime_is_not_linked(tmp_path, monkeypatch, caplog, control):
    """Three saves in one process (the second and third link the copies, so the process has checked each once);
    then one bit of the newest's spare (the next save's part) flips in place with its size and modification
    time unchanged, as bit rot leaves a file. The next save proves the copy by its bytes, writes the part
    afresh, and a fresh restore resumes it bitwise. Control: the copy trusted without reading it (as a memo of
    size and mtime did): the save links the damaged copy as its part, and the restore falls back past it."""
    if control:
        monkeypatch.setattr(incremental, "intact", lambda *args, **kwargs: True)
    run = tmp_path / "run"
    state = _state()
    with ts.CheckpointManager(run, keep_last=10) as ckpt:
        _three_saves(ckpt, state)
        part = next((run / ckpt.latest()).glob("part-*.spare"))
        _rot(part)
        values = _step(state)
        with caplog.at_level("WARNING", logger="trainstate"):
            info = ckpt.save(state)
    name, restored, rejected = _restored(run)
    twin = part.name.replace(".spare", ".safetensors")
    if control:
        assert os.stat(run / info.name / twin).st_ino == part.stat().st_ino  # the damaged copy, linked
        assert (name, rejected) == ("gen-000000000003", ["gen-000000000004"])  # the other copy
        return
    assert "not linking" in caplog.text and os.stat(run / info.name / twin).st_ino != part.stat().st_ino
    assert (name, rejected) == (info.name, []) and _equal(restored, values)



@pytest.mark.parametrize("control", [False, True], ids=["reported", "control-unreported"])
def test_a_mirror_pull_reports_the_remote_generations_it_passed_over(tmp_path, moto_server, monkeypatch, control):
    """A fresh machine restores from the mirror; the remote's newest generation is damaged (one bit in its part).
    The pull passes over it to the one before, and ``RestoreInfo.rejected`` names it with the reason, as a local
    restore names what it passes over. Control: the report of c81b50e (the pull's rejections dropped): rejected
    is empty though a newer generation was skipped."""
    pytest.importorskip("obstore")
    from trainstate.lifecycle.mirror import Mirror
    from trainstate.storage.objects import ObjectStore

    options = moto_server.storage_options()
    mirror = moto_server.url(moto_server.make_bucket(), "mirror")
    state = _state()
    with ts.CheckpointManager(tmp_path / "local", keep_last=10, mirror=mirror, mirror_options=options) as ckpt:
        saved = {}

        def mirrored():
            saved[state.next_update] = {k: v.clone() for k, v in state["model"].state_dict().items()}
            _mirrored(ckpt, state.next_update)

        _three_saves(ckpt, state, after=mirrored)
    remote = ObjectStore(mirror, storage_options=options)
    _flip(remote, _remote(remote, "gen-000000000003", ".safetensors")[0])  # (the copy gen 3 reads)
    if control:
        restored = Mirror.restored
        monkeypatch.setattr(Mirror, "restored", lambda self, info: (restored(self, info), info)[1])
    fresh = _state(seed=9)
    with ts.CheckpointManager(tmp_path / "fresh", mirror=mirror, mirror_options=options) as ckpt:
        info = ckpt.restore(fresh)
    assert info.generation.name == "gen-000000000002" and _equal(dict(fresh["model"].state_dict()), saved[2])
    if control:
        assert info.rejected == ()
        return
    assert [r.generation for r in info.rejected] == ["gen-000000000003"], info.rejected
    assert "the mirror's copy" in info.rejected[0].reason and "does not verify" in info.rejected[0].reason
