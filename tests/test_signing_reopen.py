"""A signed run reopened without its key: refused by name, unless going on unsigned is chosen (signing_key=False).

Before (issue 48, item 6) a manager opened without the key on a signed run restored it, saved unsigned
generations and moved ``latest`` to them, logging at INFO only; the next restart with the key refused those
(unsigned) and resumed the older signed generation, so the work saved without the key was lost. The controls
put the old behaviour back (the checks of :mod:`trainstate.lifecycle.keyless` made no-ops) and show that loss.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
from objectservers import moto_server  # noqa: F401  (fixture)
from trainer import assert_same, build, full_state, step

import trainstate as ts
from trainstate.cli.main import main
from trainstate.errors import EXIT_PERMANENT, SigningKeyRequired
from trainstate.lifecycle import keyless

KEY = "correct horse battery staple, 2026"
ENV = ("TRAINSTATE_SIGNING_KEY", "TRAINSTATE_SIGNING_KEY_FILE")


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def _signed_run(root: Path, **options) -> dict:
    """Updates 1 and 2 saved with the key; returns each saved state."""
    saved = {}
    state = build()
    with ts.CheckpointManager(root, keep_last=5, signing_key=KEY, **options) as ckpt:
        for update in (1, 2):
            step(state)
            ckpt.save(state)
            saved[update] = copy.deepcopy(full_state(state))
    return saved


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and ".lock" not in p.name}


def _old_behaviour(monkeypatch) -> None:
    """The code before the fix: no check at open, none at the save."""
    monkeypatch.setattr(keyless, "check", lambda lifecycle, signing_key: None)
    monkeypatch.setattr(keyless, "refuse", lambda lifecycle, doing="saving", command=False: None)


def _keyless_reopen_saves_update_3(root: Path) -> dict:
    state = build(seed=3)
    with ts.CheckpointManager(root, keep_last=5) as ckpt:
        assert ckpt.restore(state).generation.name == "gen-000000000002"
        step(state)
        ckpt.save(state)
    return copy.deepcopy(full_state(state))


@pytest.mark.parametrize("variable", [None, *ENV])
def test_a_keyless_reopen_of_a_signed_run_is_refused_before_anything_is_loaded(tmp_path, variable, monkeypatch):
    _signed_run(tmp_path)
    before = _snapshot(tmp_path)
    if variable is not None:  # set but empty: still no key
        monkeypatch.setenv(variable, "")
    with pytest.raises(SigningKeyRequired) as raised:
        ts.CheckpointManager(tmp_path, keep_last=5)
    message = str(raised.value)
    for named in (*ENV, "signing_key=...", "signing_key=False", "its latest carries a signature", str(tmp_path)):
        assert named in message, (named, message)
    assert ts.exit_code_for(raised.value) == EXIT_PERMANENT  # a restart without the key fails the same way
    assert _snapshot(tmp_path) == before


def test_control_the_old_keyless_reopen_loses_the_work_saved_without_the_key(tmp_path, monkeypatch):
    saved = _signed_run(tmp_path)
    _old_behaviour(monkeypatch)
    _keyless_reopen_saves_update_3(tmp_path)
    assert "signature" not in json.loads((tmp_path / "latest").read_text())  # latest moved to the unsigned one
    again = build(seed=4)
    with ts.CheckpointManager(tmp_path, signing_key=KEY) as ckpt:
        info = ckpt.restore(again)
    assert info.generation.name == "gen-000000000002" and "not signed" in info.rejected[0].reason
    assert_same(full_state(again), saved[2])  # update 3, saved without the key, is lost


def test_signing_key_false_goes_on_unsigned_deliberately_and_says_so(tmp_path, monkeypatch, caplog):
    saved = _signed_run(tmp_path)
    monkeypatch.setenv(ENV[0], KEY)  # False wins over the environment: the choice is explicit
    with caplog.at_level(logging.WARNING, logger="trainstate"):
        third = _reopen_unsigned(tmp_path, saved)
    assert any("signing_key=False" in r.getMessage() and "unsigned" in r.getMessage() for r in caplog.records)
    assert "signature" not in json.loads((tmp_path / "gen-000000000003" / "manifest.json").read_text())
    monkeypatch.delenv(ENV[0])
    with ts.CheckpointManager(tmp_path) as ckpt:  # the run is unsigned now: a keyless manager opens it
        fresh = build(seed=5)
        assert ckpt.restore(fresh).generation.name == "gen-000000000003"
    assert_same(full_state(fresh), third)
    with pytest.raises(ts.InvalidArgument, match="signing_key=True names no key"):
        ts.CheckpointManager(tmp_path, signing_key=True)


def _reopen_unsigned(root: Path, saved: dict) -> dict:
    state = build(seed=3)
    with ts.CheckpointManager(root, keep_last=5, signing_key=False) as ckpt:
        assert ckpt.restore(state).generation.name == "gen-000000000002"
        assert_same(full_state(state), saved[2])
        step(state)
        ckpt.save(state)
    return copy.deepcopy(full_state(state))


def test_the_key_reopens_and_signs_as_before(tmp_path):
    """The check passes a keyed manager, and a keyless one on an unsigned run (the default), untouched."""
    saved = _signed_run(tmp_path / "signed")
    with ts.CheckpointManager(tmp_path / "signed", signing_key=KEY) as ckpt:
        fresh = build(seed=3)
        assert ckpt.restore(fresh).generation.name == "gen-000000000002"
        assert_same(full_state(fresh), saved[2])
        step(fresh)
        ckpt.save(fresh)
    assert "signature" in json.loads((tmp_path / "signed" / "latest").read_text())
    state = build()
    with ts.CheckpointManager(tmp_path / "plain") as ckpt:
        step(state)
        ckpt.save(state)
    with ts.CheckpointManager(tmp_path / "plain") as ckpt:
        assert ckpt.restore(build(seed=3)).generation.name == "gen-000000000001"
        ckpt.save(state)


@pytest.mark.parametrize("control", [False, True], ids=["fixed", "control-old"])
def test_a_signed_mirror_pulled_into_an_empty_directory_refuses_the_keyless_save(tmp_path, moto_server, monkeypatch,
                                                                              control):
    """The open check sees an empty local directory; the restore then pulls the signed remote generations: the
    save is refused there (rank 0's same check is every rank's verdict under torch.distributed)."""
    url = moto_server.url(moto_server.make_bucket(), "run")
    options = moto_server.storage_options()
    saved = _signed_run(tmp_path / "first", mirror=url, mirror_options=options)
    if control:
        _old_behaviour(monkeypatch)
    state = build(seed=3)
    with ts.CheckpointManager(tmp_path / "second", keep_last=5, mirror=url, mirror_options=options) as ckpt:
        assert ckpt.restore(state).generation.name == "gen-000000000002"
        step(state)
        if not control:
            with pytest.raises(SigningKeyRequired, match="saving without the signing key"):
                ckpt.save(state)
            return
        ckpt.save(state)
    again = build(seed=4)
    with ts.CheckpointManager(tmp_path / "second", signing_key=KEY) as ckpt:
        assert ckpt.restore(again).generation.name == "gen-000000000002"  # update 3 lost, as before the fix
    assert_same(full_state(again), saved[2])


@pytest.mark.parametrize("control", [False, True], ids=["fixed", "control-old"])
def test_pin_from_the_command_line_without_the_key_is_refused(tmp_path, monkeypatch, capsys, control):
    _signed_run(tmp_path)
    before = _snapshot(tmp_path)
    if control:
        _old_behaviour(monkeypatch)
        assert main(["pin", str(tmp_path), "final", "gen-000000000001"]) == 0  # an unsigned pins file
        with ts.CheckpointManager(tmp_path, signing_key=KEY) as ckpt, pytest.raises(ts.CorruptGeneration,
                                                                                     match="not signed"):
            ckpt.pins()
        return
    assert main(["pin", str(tmp_path), "final", "gen-000000000001", "--json"]) == 1
    error = json.loads(capsys.readouterr().out)
    assert error["type"] == "SigningKeyRequired" and ENV[0] in error["error"] and "pins" in error["error"]
    assert _snapshot(tmp_path) == before
    monkeypatch.setenv(ENV[0], KEY)
    assert main(["pin", str(tmp_path), "final", "gen-000000000001"]) == 0
    with ts.CheckpointManager(tmp_path, signing_key=KEY) as ckpt:
        assert ckpt.pins() == {"final": "gen-000000000001"}
