"""`trainstate discard` chooses between a run directory and a Hugging Face output directory by what the directory
holds, and removes a set-aside entry that is not a directory without following it.

Before (issue 48, item 6): one stray ``checkpoint-N`` folder in a run directory switched the command to the
Hugging Face mode, which refused both ``--all`` and the exact name of a rejected generation; a set-aside name
that was a symbolic link failed with the raw "Cannot call rmtree on a symbolic link". Each test has a control
that puts the old behaviour back and shows the test sees it.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest
import torch

import trainstate as ts
from trainstate.cli import hfdiscard
from trainstate.cli.main import main
from trainstate.storage.local import LocalStore

cli_main = importlib.import_module("trainstate.cli.main")  # the module (trainstate.cli.main is also its function)


def _run(path: Path) -> tuple[Path, str]:
    """A run with three generations, the middle one set aside as rejected (as a save leaves a damaged one)."""
    torch.manual_seed(0)
    state = ts.TrainState(model=torch.nn.Linear(4, 3))
    with ts.CheckpointManager(path, keep_last=5) as ckpt:
        for update in (1, 2, 3):
            state.next_update = update
            ckpt.save(state)
    return path, LocalStore(path).set_aside("gen-000000000002", "rejected")


def _listing(root: Path) -> list[str]:
    return sorted(os.listdir(root))


def _old_choice(directory: str, names: list[str], forced: str | None = None) -> str:
    """The rule before the fix: any checkpoint-N, callback folder or seal pointer made it an output directory."""
    root = Path(directory)
    if "://" in directory or not root.is_dir():
        return "run"
    if names and all(hfdiscard.ASIDE_RE.fullmatch(n) for n in names):
        return "hf"
    return "hf" if any(hfdiscard.ASIDE_RE.fullmatch(n) or hfdiscard._CHECKPOINT_RE.fullmatch(n)
                       or n == "trainstate-latest" for n in os.listdir(root)) else "run"


@pytest.mark.parametrize("how", ["--all", "name"])
def test_a_stray_checkpoint_folder_leaves_a_run_directory_in_run_mode(tmp_path, capsys, how):
    run, aside = _run(tmp_path / "run")
    stray = run / "checkpoint-7"
    stray.mkdir()
    (stray / "model.safetensors").write_bytes(b"\x01" * 64)
    before = _listing(run)
    assert main(["discard", str(run)]) == 1  # no names: the run's own message, which points at `ls`
    assert "not set-aside entries" in capsys.readouterr().err
    assert main(["discard", str(run), "--all" if how == "--all" else aside]) == 0
    assert capsys.readouterr().out.strip() == f"discarded {aside}"
    assert _listing(run) == [n for n in before if n != aside]  # the stray folder and every generation stay
    assert (stray / "model.safetensors").read_bytes() == b"\x01" * 64
    with ts.CheckpointManager(run) as ckpt:
        assert ckpt.restore(ts.TrainState(model=torch.nn.Linear(4, 3))).generation.name == "gen-000000000003"


def test_control_the_old_choice_refuses_the_run_directory(tmp_path, capsys, monkeypatch):
    run, aside = _run(tmp_path / "run")
    (run / "checkpoint-7").mkdir()
    monkeypatch.setattr(hfdiscard, "choose_mode", _old_choice)
    for argv in (["--all"], [aside]):
        assert main(["discard", str(run), *argv]) == 1
        assert "not folders the Hugging Face callback set aside" in capsys.readouterr().err
    assert aside in os.listdir(run)


def _both(tmp_path: Path) -> tuple[Path, str, str]:
    """A run directory that also holds a folder the Hugging Face callback set aside (one directory used for
    both): genuinely ambiguous for ``--all``."""
    run, aside = _run(tmp_path / "both")
    folder = hfdiscard.aside_name("abandoned", "checkpoint-6")
    (run / folder).mkdir()
    (run / folder / "trainer_state.json").write_text("{}")
    return run, aside, folder


def test_a_directory_holding_both_is_refused_naming_both_and_how_to_choose(tmp_path, capsys):
    run, aside, folder = _both(tmp_path)
    before = _listing(run)
    assert main(["discard", str(run), "--all"]) == 1
    err = capsys.readouterr().err
    assert "trainstate run (" in err and "gen-000000000003" in err and folder in err, err
    assert "--mode run" in err and "--mode hf" in err and "nothing was discarded" in err, err
    assert main(["discard", str(run), "--all", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["type"] == "InvalidArgument"
    assert _listing(run) == before
    assert main(["discard", str(run), folder]) == 0  # a name in one mode's pattern chooses it
    assert capsys.readouterr().out.strip() == f"discarded {folder}"
    (run / folder).mkdir()
    assert main(["discard", str(run), "--all", "--mode", "run"]) == 0
    assert capsys.readouterr().out.strip() == f"discarded {aside}"
    assert main(["discard", str(run), "--all", "--mode", "hf", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"discarded": [folder]}
    assert _listing(run) == [n for n in before if n not in (aside, folder)]


def test_control_the_old_choice_takes_the_ambiguous_directory_silently(tmp_path, capsys, monkeypatch):
    run, aside, folder = _both(tmp_path)
    monkeypatch.setattr(hfdiscard, "choose_mode", _old_choice)
    assert main(["discard", str(run), "--all"]) == 0  # no word that a run's evidence is there too
    assert capsys.readouterr().out.strip() == f"discarded {folder}"
    assert aside in os.listdir(run)


def _linked_aside(run: Path, tmp_path: Path) -> tuple[str, Path]:
    """A set-aside name that is a symbolic link to a directory outside the run (the library never makes one)."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("not part of the run")
    link = f"gen-000000000009.rejected-{'a' * 16}"
    (run / link).symlink_to(target, target_is_directory=True)
    return link, target


def test_a_set_aside_symlink_is_unlinked_never_followed(tmp_path, capsys):
    run, aside = _run(tmp_path / "run")
    link, target = _linked_aside(run, tmp_path)
    stray_file = f"gen-000000000008.abandoned-{'b' * 16}"
    (run / stray_file).write_text("a file under a set-aside name")
    assert main(["discard", str(run), link]) == 0
    out = capsys.readouterr().out.strip()
    assert out == f"discarded {link} (a symbolic link: the link removed, its target {target} untouched)", out
    assert not os.path.lexists(run / link) and (target / "keep.txt").read_text() == "not part of the run"
    (run / link).symlink_to(target, target_is_directory=True)
    assert main(["discard", str(run), "--all", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"discarded": sorted([aside, link, stray_file])}
    assert not [n for n in os.listdir(run) if ".rejected-" in n or ".abandoned-" in n or "trash" in n]
    assert (target / "keep.txt").read_text() == "not part of the run"


def test_control_removing_through_the_store_fails_on_the_link(tmp_path, capsys, monkeypatch):
    run, _ = _run(tmp_path / "run")
    link, target = _linked_aside(run, tmp_path)
    monkeypatch.setattr(cli_main, "_discard_entry", lambda store, name: store.remove(name) or "")
    assert main(["discard", str(run), link]) == 1
    assert "Cannot call rmtree on a symbolic link" in capsys.readouterr().err
    assert (target / "keep.txt").read_text() == "not part of the run"
