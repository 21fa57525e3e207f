"""A release bundle (issue 20): ``--include`` files, a release manifest written last, ``trainstate verify OUT``
naming a changed, missing or unlisted file, signatures, and the model card's compute and included files."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

import trainstate as ts
from trainstate.cli.main import main
from trainstate.storage.posix import PosixOps
from trainstate.tools.bundle import FileDigest, includes, manifest_bytes, parse_manifest

KEY = "k" * 32


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)


@pytest.fixture
def run(tmp_path):
    return _run(tmp_path / "run")


def _run(path, key=None):
    torch.manual_seed(0)
    with ts.CheckpointManager(path, signing_key=key) as ckpt:
        state = ts.TrainState(model=Small())
        state.next_update, state.tokens_seen = 7, 4096
        ckpt.save(state)
    return path


@pytest.fixture
def extras(tmp_path):
    tok = tmp_path / "tokenizer"
    (tok / "sub").mkdir(parents=True)
    (tok / "tokenizer.json").write_text('{"vocab": {"a": 0}}')
    (tok / "sub" / "merges.txt").write_text("a b\n")
    (tmp_path / "LICENSE").write_text("Apache-2.0\n")
    return [tok, tmp_path / "LICENSE"]


def _verify(out, capsys) -> tuple[int, dict]:
    rc = main(["verify", str(out), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_a_bundle_lists_every_file_and_verifies(run, extras, tmp_path, capsys):
    info = ts.export(run, tmp_path / "out", include=extras)
    out = tmp_path / "out"
    assert info.included == ("sub/merges.txt", "tokenizer.json", "LICENSE") and not info.signed
    assert (out / "sub" / "merges.txt").read_text() == "a b\n"
    manifest = json.loads((out / "release-manifest.json").read_text())
    listed = {f["name"]: f for f in manifest["files"]}
    on_disk = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert sorted([*listed, "release-manifest.json"]) == on_disk  # weights, card, included files: all of them
    for name, record in listed.items():
        data = (out / name).read_bytes()
        assert record["size"] == len(data) and record["digest"] == hashlib.sha256(data).hexdigest(), name
    rc, report = _verify(out, capsys)
    assert rc == 0 and report["failures"] == [] and sorted(report["verified"]) == sorted(listed)
    assert main(["verify", str(out)]) == 0 and "match the manifest" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["change", "delete", "add"])
def test_a_changed_missing_or_unlisted_file_fails_verify_by_name(run, extras, tmp_path, capsys, damage):
    ts.export(run, tmp_path / "out", include=extras)
    out = tmp_path / "out"
    target = out / "sub" / "merges.txt"
    if damage == "change":
        data = bytearray(target.read_bytes())
        data[0] ^= 0x01  # one byte
        target.write_bytes(bytes(data))
    elif damage == "delete":
        target.unlink()
    else:
        target = out / "sub" / "sneaked.txt"
        target.write_text("not from the export")
    rc, report = _verify(out, capsys)
    name = target.relative_to(out).as_posix()
    assert rc == 1 and [f["file"] for f in report["failures"]] == [name], report
    assert {"change": "digest", "delete": "missing", "add": "not listed"}[damage] in report["failures"][0]["error"]
    assert main(["verify", str(out)]) == 1 and f"FAILED  {name}" in capsys.readouterr().out


def test_a_signed_bundle_is_checked_and_a_wrong_key_is_refused(tmp_path, capsys, monkeypatch):
    info = ts.export(_run(tmp_path / "signed", KEY), tmp_path / "out", signing_key=KEY)  # the run's key
    assert info.signed
    monkeypatch.setenv("TRAINSTATE_SIGNING_KEY", KEY)
    rc, report = _verify(tmp_path / "out", capsys)
    assert rc == 0 and report["signed"] and report["signature_checked"]
    monkeypatch.setenv("TRAINSTATE_SIGNING_KEY", "w" * 32)
    rc, report = _verify(tmp_path / "out", capsys)
    assert rc == 1 and "signature does not match" in report["failures"][0]["error"]
    monkeypatch.delenv("TRAINSTATE_SIGNING_KEY")
    rc, report = _verify(tmp_path / "out", capsys)  # without a key the files are still checked
    assert rc == 0 and report["signed"] and not report["signature_checked"]


def test_an_unsigned_bundle_is_refused_when_a_key_is_configured(run, tmp_path, capsys, monkeypatch):
    ts.export(run, tmp_path / "out")
    monkeypatch.setenv("TRAINSTATE_SIGNING_KEY", KEY)
    rc, report = _verify(tmp_path / "out", capsys)
    assert rc == 1 and "not signed" in report["failures"][0]["error"]


def forge_card(out) -> None:
    """Swap a bundle's model card and rewrite its digest in the manifest: consistent, only a signature tells."""
    (out / "README.md").write_text("a different card\n")
    manifest = json.loads((out / "release-manifest.json").read_text())
    for record in manifest["files"]:
        if record["name"] == "README.md":
            record["size"], record["digest"] = 17, hashlib.sha256(b"a different card\n").hexdigest()
    (out / "release-manifest.json").write_text(json.dumps(manifest))


def test_a_rewritten_manifest_is_caught_by_the_signature(tmp_path, capsys, monkeypatch):
    # whoever swaps a file and rewrites the manifest's digest to match cannot re-sign it
    ts.export(_run(tmp_path / "signed", KEY), tmp_path / "out", signing_key=KEY)
    out = tmp_path / "out"
    forge_card(out)
    monkeypatch.delenv("TRAINSTATE_SIGNING_KEY", raising=False)
    assert _verify(out, capsys)[0] == 0  # control: without the key, a consistent forgery passes
    monkeypatch.setenv("TRAINSTATE_SIGNING_KEY", KEY)
    assert _verify(out, capsys)[0] == 1


def test_the_card_records_compute_and_included_files_and_marks_the_rest(run, extras, tmp_path):
    ts.export(run, tmp_path / "out", include=extras)
    card = (tmp_path / "out" / "README.md").read_text()
    digest = hashlib.sha256(b"Apache-2.0\n").hexdigest()
    for needle in ("- Updates: 7", "- Tokens seen: 4096", "- World size: 1", "- Device kind: cpu",
                   "- Wall time summed over updates: ", f"`LICENSE`: 11 bytes, sha256 `{digest}`",
                   "`sub/merges.txt`", "- License: not recorded"):
        assert needle in card, needle
    assert "- Wall time summed over updates: not recorded" not in card  # the run measured it


def test_include_refuses_clashes_links_and_missing_paths_before_writing(run, extras, tmp_path):
    (tmp_path / "README.md").write_text("mine")
    (tmp_path / "link").symlink_to(extras[1])
    for bad, match in (([tmp_path / "README.md"], "already in the bundle"), ([extras[1], extras[1]], "twice"),
                       ([tmp_path / "link"], "symbolic"), ([tmp_path / "nope"], "not a regular file")):
        with pytest.raises(ts.InvalidArgument, match=match):
            ts.export(run, tmp_path / "out", include=bad)
        assert not (tmp_path / "out").exists()
    assert not [p for p in os.listdir(tmp_path) if "staging" in p]


def test_the_cli_includes_files(run, extras, tmp_path, capsys):
    rc = main(["export", str(run), str(tmp_path / "out"), "--include", str(extras[0]), "--include",
               str(extras[1]), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["included"] == ["sub/merges.txt", "tokenizer.json", "LICENSE"]


class FailOnManifest(PosixOps):
    def create(self, path):
        if path.name == "release-manifest.json":
            raise OSError(28, "No space left on device")
        return super().create(path)


def test_a_failure_writing_the_manifest_publishes_nothing(run, extras, tmp_path):
    with pytest.raises(OSError, match="No space"):
        ts.export(run, tmp_path / "out", include=extras, ops=FailOnManifest())
    assert not (tmp_path / "out").exists() and not [p for p in os.listdir(tmp_path) if "staging" in p]


def test_the_manifest_format_is_pure_and_strict(tmp_path):
    files = [FileDigest("b.txt", 1, "00"), FileDigest("a/c.txt", 2, "11")]
    data = manifest_bytes(files, {"generation": "gen-1"}, None)
    listed, signed = parse_manifest(data, "m", None)
    assert list(listed) == ["a/c.txt", "b.txt"] and not signed
    body = json.loads(data)
    body["files"][0]["name"] = "../escape"
    with pytest.raises(ts.CorruptGeneration, match="malformed"):
        parse_manifest(json.dumps(body).encode(), "m", None)
    assert includes([], ["x"]) == {}
