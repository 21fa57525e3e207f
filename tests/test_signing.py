"""Opt-in authentication: a digest bundled with a checkpoint proves nothing; an HMAC key does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import trainstate as ts
from trainer import build, full_state, step, assert_same
from trainstate.format.digest import digest_bytes, new_hasher
from trainstate.format.manifest import FileRecord, Manifest

KEY = "correct horse battery staple, 2026"
OTHER = "another key entirely, not ours!!"


def _signed_run(tmp_path: Path, updates=(1, 2)) -> ts.TrainState:
    state = build()
    with ts.CheckpointManager(tmp_path, keep_last=5, signing_key=KEY) as ckpt:
        for target in updates:
            while state.next_update < target:
                step(state)
            ckpt.save(state)
    return state


def _forge(run: Path, generation: str, edit) -> None:
    """What an attacker with write access does: change data, recompute every digest, keep it consistent."""
    gen = run / generation
    state = json.loads((gen / "state.json").read_text())
    edit(state)
    data = json.dumps(state).encode()
    (gen / "state.json").write_bytes(data)
    manifest = json.loads((gen / "manifest.json").read_text())
    for record in manifest["files"]:
        if record["name"] == "state.json":
            hasher = new_hasher(manifest["digest_algorithm"])
            hasher.update(data)
            record["size"], record["digest"] = len(data), hasher.hexdigest()
            if "chunks" in record:  # a chunked digest: the chunk digests too
                record["chunks"] = list(hasher.chunks)
    manifest.pop("self_digest")
    manifest.pop("signature", None)
    forged = Manifest(**{k: v for k, v in manifest.items() if k != "format"} | {
        "files": tuple(FileRecord(**{**f, "chunks": tuple(f.get("chunks", ()))}) for f in manifest["files"])})
    mbytes = forged.to_bytes()  # the attacker uses our own serialiser: unsigned, self-digest correct
    (gen / "manifest.json").write_bytes(mbytes)
    pointer = json.loads((run / "latest").read_text())
    if pointer["generation"] == generation:
        pointer.pop("signature", None)
        pointer["manifest_digest"] = digest_bytes(pointer["digest_algorithm"], mbytes)
        pointer["manifest_size"] = len(mbytes)
        (run / "latest").write_text(json.dumps(pointer))


def _bump_clock(state):
    state["counters"]["epoch"] = 999


def test_without_a_key_a_consistent_forgery_is_accepted(tmp_path):
    """The negative control: digests alone do not authenticate, exactly as documented."""
    _signed_run(tmp_path)
    _forge(tmp_path, "gen-000000000002", _bump_clock)
    state = build(seed=3)
    with ts.CheckpointManager(tmp_path) as ckpt:
        info = ckpt.restore(state)
    assert info.generation.name == "gen-000000000002" and state.counters["epoch"] == 999


def test_signed_generations_restore_with_the_key(tmp_path):
    saved = _signed_run(tmp_path)
    manifest = json.loads((tmp_path / "gen-000000000002" / "manifest.json").read_text())
    assert len(manifest["signature"]) == 64 and "signature" in json.loads((tmp_path / "latest").read_text())
    assert KEY not in "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file())
    state = build(seed=3)
    with ts.CheckpointManager(tmp_path, signing_key=KEY) as ckpt:
        info = ckpt.restore(state)
    assert info.generation.name == "gen-000000000002" and not info.rejected
    assert_same(full_state(state), full_state(saved))


def test_forged_generation_is_refused_and_restore_falls_back(tmp_path):
    _signed_run(tmp_path)
    _forge(tmp_path, "gen-000000000002", _bump_clock)
    state = build(seed=3)
    with ts.CheckpointManager(tmp_path, signing_key=KEY) as ckpt:
        info = ckpt.restore(state)
    assert info.generation.name == "gen-000000000001"
    reasons = " ".join(r.reason for r in info.rejected)
    assert "not signed" in reasons and state.counters.get("epoch") != 999


def test_other_key_and_unsigned_runs_are_refused(tmp_path):
    _signed_run(tmp_path / "signed")
    with ts.CheckpointManager(tmp_path / "signed", signing_key=OTHER) as ckpt:
        with pytest.raises(ts.NoValidGeneration, match="signature does not match"):
            ckpt.restore(build(seed=3))
    state = build()
    step(state)
    with ts.CheckpointManager(tmp_path / "plain") as ckpt:
        ckpt.save(state)
    with ts.CheckpointManager(tmp_path / "plain", signing_key=KEY) as ckpt:
        with pytest.raises(ts.NoValidGeneration, match="not signed"):
            ckpt.restore(build(seed=3))


def test_key_from_environment_and_cli_verify(tmp_path, monkeypatch):
    key_file = tmp_path / "secret.key"
    key_file.write_text(KEY)
    run = tmp_path / "run"
    monkeypatch.setenv("TRAINSTATE_SIGNING_KEY_FILE", str(key_file))
    state = build()
    step(state)
    with ts.CheckpointManager(run) as ckpt:
        ckpt.save(state)
    assert "signature" in json.loads((run / "gen-000000000001" / "manifest.json").read_text())
    env = {"TRAINSTATE_SIGNING_KEY_FILE": str(key_file), "PATH": "/usr/bin:/bin"}
    ok = subprocess.run([sys.executable, "-m", "trainstate", "verify", str(run)], capture_output=True, text=True,
                        env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    _forge(run, "gen-000000000001", _bump_clock)
    bad = subprocess.run([sys.executable, "-m", "trainstate", "verify", str(run)], capture_output=True, text=True,
                         env=env)
    assert bad.returncode == 1 and "not signed" in bad.stdout
    inside = run / "key"
    inside.write_text(KEY)
    monkeypatch.setenv("TRAINSTATE_SIGNING_KEY_FILE", str(inside))
    with pytest.raises(ts.TrainStateError, match="inside the run directory"):
        ts.CheckpointManager(run)


def test_short_keys_are_refused_and_never_shown():
    from trainstate.format.signing import SigningKey

    with pytest.raises(ts.TrainStateError, match="at least 16 bytes"):
        SigningKey("short")
    assert KEY not in repr(SigningKey(KEY))


def test_a_signed_run_digests_with_blake3_and_an_unsigned_one_with_xxh3(tmp_path, monkeypatch):
    """The default digest follows the key: a signature stands only on a collision-resistant hash."""
    _signed_run(tmp_path / "signed", updates=(1,))
    state = build()
    step(state)
    with ts.CheckpointManager(tmp_path / "plain") as ckpt:
        ckpt.save(state)
    key_file = tmp_path / "secret.key"
    key_file.write_text(KEY)
    monkeypatch.setenv("TRAINSTATE_SIGNING_KEY_FILE", str(key_file))
    with ts.CheckpointManager(tmp_path / "env") as ckpt:
        ckpt.save(state)
    algorithm = {name: json.loads((tmp_path / name / "gen-000000000001" / "manifest.json").read_text())[
        "digest_algorithm"] for name in ("signed", "plain", "env")}
    assert algorithm == {"signed": "blake3-chunked", "plain": "xxh3-chunked", "env": "blake3-chunked"}


def test_signing_over_a_non_cryptographic_digest_is_refused(tmp_path):
    from trainstate.storage.local import LocalStore

    with pytest.raises(ts.InvalidArgument, match="cannot back a signature"):
        ts.CheckpointManager(tmp_path / "a", digest="xxh3-chunked", signing_key=KEY)
    with pytest.raises(ts.InvalidArgument, match="cannot back a signature"):
        ts.CheckpointManager(tmp_path / "b", store=LocalStore(tmp_path / "b", "xxh3-chunked"), signing_key=KEY)
    ts.CheckpointManager(tmp_path / "c", digest="blake3", signing_key=KEY).close()  # the control: a cryptographic one


@pytest.mark.parametrize("algorithm", ["xxh3-chunked", "blake3-chunked"])
def test_a_reader_with_a_key_refuses_a_signature_over_xxh3_digests(algorithm):
    """A valid signature over digests anyone can match authenticates nothing: refused whatever signed it
    (trainstate never writes one). The control: the same manifest over BLAKE3 digests is accepted."""
    from trainstate.format.digest import CHUNK_BYTES, chunk_digest, chunked_top
    from trainstate.format.manifest import parse_manifest
    from trainstate.format.signing import SigningKey

    chunks = (chunk_digest(b"x" * 10, algorithm),)
    manifest = Manifest("gen-000000000001", "full", 1, algorithm,
                        (FileRecord("state.json", 10, chunked_top(10, chunks, algorithm), chunks),),
                        "2026-01-01T00:00:00.000000+00:00", "ef" * 32, {"torch": "x"}, None)
    data = manifest.to_bytes(SigningKey(KEY))
    assert CHUNK_BYTES > 10
    if algorithm == "blake3-chunked":
        assert parse_manifest(data, "m", SigningKey(KEY)).digest_algorithm == algorithm
        return
    parse_manifest(data, "m")  # without a key: a digest, for corruption, as documented
    with pytest.raises(ts.CorruptGeneration, match="do not authenticate"):
        parse_manifest(data, "m", SigningKey(KEY))
