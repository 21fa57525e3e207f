"""Issue 29, item 5: `verify --require-signature`, an exit line that says when nothing was authenticated,
`trainstate discard` for the Hugging Face callback's set-aside folders, and the Accelerate snippet's `shuffle=`.

Through the real command line (``trainstate.cli.main`` and, once, ``python -m trainstate``), on bundles written
by ``ts.export`` and runs written by ``CheckpointManager``; the HF folders are set aside by the callback's own
function.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainstate as ts
from test_bundle import forge_card
from trainstate.cli.main import main

KEY = "k" * 32
ROOT = Path(__file__).resolve().parent.parent
NOTHING = "nothing was authenticated"


def _run(path: Path, key: str | None = None) -> Path:
    torch.manual_seed(0)
    with ts.CheckpointManager(path, signing_key=key) as ckpt:
        state = ts.TrainState(model=torch.nn.Linear(4, 3))
        state.next_update = 3
        ckpt.save(state)
    return path


@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> tuple[Path, Path]:
    """A signed run and the signed bundle exported from it."""
    root = tmp_path_factory.mktemp("signed")
    run = _run(root / "run", KEY)
    ts.export(run, root / "out", signing_key=KEY)
    return run, root / "out"


@pytest.fixture(scope="module")
def unsigned(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("unsigned")
    run = _run(root / "run")
    ts.export(run, root / "out")
    return run, root / "out"


@pytest.fixture(autouse=True)
def no_key(monkeypatch):
    monkeypatch.delenv("TRAINSTATE_SIGNING_KEY", raising=False)
    monkeypatch.delenv("TRAINSTATE_SIGNING_KEY_FILE", raising=False)


def _cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["verify", *map(str, argv)])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


@pytest.mark.parametrize("which", [0, 1], ids=["run", "bundle"])
def test_signed_without_a_key_exits_0_but_says_nothing_was_authenticated(signed, capsys, which):
    rc, out = _cli(capsys, signed[which])
    last = out.strip().splitlines()[-1]
    assert rc == 0 and last.startswith("ok") and "signature present but NOT checked (no key given)" in last, out
    assert NOTHING in last
    rc, out = _cli(capsys, signed[which], "--json")
    report = json.loads(out)
    assert report["signature"] == "present, not checked" and report["authenticated"] is False


@pytest.mark.parametrize("which", [0, 1], ids=["run", "bundle"])
def test_require_signature_refuses_a_signed_target_verified_without_a_key(signed, capsys, which):
    rc, out = _cli(capsys, signed[which], "--require-signature")
    assert rc == 1 and "no key was given" in out and "TRAINSTATE_SIGNING_KEY" in out, out
    rc, out = _cli(capsys, signed[which], "--require-signature", "--json")
    report = json.loads(out)
    assert rc == 1 and report["authenticated"] is False and "--require-signature" in out


@pytest.mark.parametrize("which", [0, 1], ids=["run", "bundle"])
def test_require_signature_passes_with_the_right_key(signed, capsys, monkeypatch, which):
    monkeypatch.setenv("TRAINSTATE_SIGNING_KEY", KEY)
    rc, out = _cli(capsys, signed[which], "--require-signature")
    last = out.strip().splitlines()[-1]
    assert rc == 0 and last.startswith("ok") and last.endswith("signature verified") and NOTHING not in out, out
    rc, out = _cli(capsys, signed[which], "--require-signature", "--json")
    assert rc == 0 and json.loads(out)["authenticated"] is True


@pytest.mark.parametrize("which", [0, 1], ids=["run", "bundle"])
def test_require_signature_refuses_an_unsigned_target(unsigned, capsys, which):
    rc, out = _cli(capsys, unsigned[which])  # without the flag: the exit line says nothing was authenticated
    assert rc == 0 and out.strip().splitlines()[-1].endswith(f"unsigned: {NOTHING}"), out
    rc, out = _cli(capsys, unsigned[which], "--require-signature")
    assert rc == 1 and "is not signed" in out and "--require-signature" in out, out


def test_a_forged_bundle_fails_with_the_key_and_passes_only_unauthenticated_without(tmp_path, signed, capsys,
                                                                                    monkeypatch):
    """A card swapped and its digest rewritten in the manifest: consistent, so only the signature catches it."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(signed[1], out)
    forge_card(out)
    rc, text = _cli(capsys, out)
    assert rc == 0 and NOTHING in text.strip().splitlines()[-1]  # the friction: it passes, but says so
    assert _cli(capsys, out, "--require-signature")[0] == 1  # the CI job that forgot the key fails
    monkeypatch.setenv("TRAINSTATE_SIGNING_KEY", KEY)
    rc, text = _cli(capsys, out, "--require-signature")
    assert rc == 1 and "signature does not match" in text, text


def test_the_real_command_line_exits_1_for_a_signed_bundle_without_a_key(signed):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSTATE_SIGNING_KEY")}
    done = subprocess.run([sys.executable, "-m", "trainstate", "verify", str(signed[1]), "--require-signature"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1 and "TRAINSTATE_SIGNING_KEY" in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_verify_help_names_release_bundles_and_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    text = capsys.readouterr().out
    assert "release bundle" in text and "--require-signature" in text and "nothing was" in text


# --- discard: the Hugging Face callback's set-aside folders ----------------------------------------------------

def _hf_output(root: Path) -> dict[str, list[str]]:
    """An output directory as a killed, resumed run leaves it: checkpoint-3 sealed (resumed from), 6 sealed on
    the timeline the run left, 9 and 12 never sealed; the callback's own function sets 6, 9 and 12 aside."""
    pytest.importorskip("transformers")
    from trainstate.integrations.hf import _set_aside_newer
    from trainstate.storage.sealed import seal_folder

    for step in (3, 6, 9, 12):
        folder = root / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(bytes([step]) * 64)
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        if step <= 6:
            seal_folder(folder, meta={"global_step": step})
    seal_folder(root / "checkpoint-3", meta={"global_step": 3})  # the pointer names what was resumed from
    _set_aside_newer(root, 3)
    aside = sorted(n for n in os.listdir(root) if n.startswith(("incomplete-", "abandoned-")))
    assert [n.split("-")[0] + "-" + n.split("-")[2] for n in aside] == [
        "abandoned-6", "incomplete-12", "incomplete-9"]
    # negative controls: never deleted, whatever their names look like
    elsewhere = root.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not in the output directory")
    (root / f"incomplete-checkpoint-15-{'a' * 16}").symlink_to(elsewhere, target_is_directory=True)
    (root / "incomplete-checkpoint-18-notahex").mkdir()
    (root / f"incomplete-checkpoint-21-{'b' * 16}.bak").mkdir()
    (root / "notes.txt").write_text("review notes")
    keep = sorted(n for n in os.listdir(root) if n not in aside)
    return {"aside": aside, "keep": keep}


def test_discard_deletes_the_hf_callbacks_set_aside_folders_and_nothing_else(tmp_path, capsys):
    from trainstate.integrations.hf import last_verified_checkpoint

    root = tmp_path / "hf-out"
    made = _hf_output(root)
    assert main(["discard", str(root)]) == 1  # no names: lists what is set aside, deletes nothing
    err = capsys.readouterr().err
    assert all(name in err for name in made["aside"]) and "--all" in err, err
    assert sorted(os.listdir(root)) == sorted(made["aside"] + made["keep"])
    for refused in ("checkpoint-3", "trainstate-latest", f"incomplete-checkpoint-15-{'a' * 16}",
                    "incomplete-checkpoint-18-notahex"):
        assert main(["discard", str(root), refused]) == 1, refused
        assert "not folders the Hugging Face callback set aside" in capsys.readouterr().err
    assert sorted(os.listdir(root)) == sorted(made["aside"] + made["keep"])  # refused before anything went
    first = made["aside"][0]
    assert main(["discard", str(root), first]) == 0
    assert capsys.readouterr().out.strip() == f"discarded {first}"
    assert main(["discard", str(root), "--all", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"discarded": made["aside"][1:]}
    assert sorted(os.listdir(root)) == made["keep"]
    assert (tmp_path / "elsewhere" / "keep.txt").read_text() == "not in the output directory"
    assert last_verified_checkpoint(root) == str(root / "checkpoint-3")  # the resume point is untouched
    assert main(["discard", str(root), "--all"]) == 1  # nothing left to discard: said, not silently 0
    capsys.readouterr()


def test_discard_still_handles_a_run_directory(tmp_path, capsys):
    """Control: the run path is unchanged (names as `trainstate ls` lists them)."""
    run = _run(tmp_path / "run")
    from trainstate.storage.local import LocalStore

    aside = LocalStore(run).set_aside("gen-000000000003", "rejected")
    assert main(["discard", str(run), "--all"]) == 0 and capsys.readouterr().out.strip() == f"discarded {aside}"


def test_the_name_pattern_is_transformers_prefix():
    transformers = pytest.importorskip("transformers.trainer_utils")
    from trainstate.cli.hfdiscard import ASIDE_RE, PREFIX, aside_name

    assert PREFIX == transformers.PREFIX_CHECKPOINT_DIR
    assert ASIDE_RE.fullmatch(aside_name("incomplete", f"{PREFIX}-42"))


def test_the_docs_name_the_commands_and_show_shuffle():
    from docsite import blocks, page, section

    hf = section("guides/frameworks.md", "## Hugging Face Trainer")
    assert "trainstate discard runs/exp1 --all" in hf
    block = blocks(section("guides/frameworks.md", "## Accelerate"), "python")[0]
    assert "shuffle=True)" in block and "the default" in block
    import inspect

    assert inspect.signature(ts.ResumableLoader).parameters["shuffle"].default is True
    assert "--require-signature" in page("guides/export.md")
