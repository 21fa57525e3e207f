"""Hugging Face Trainer with DurableCheckpoints: SIGKILLed at seeded moments, resumed bitwise through the helper.

A tiny GPT-2 built from a config (no download) trains on synthetic tokens
for 12 steps, saving every 3 (``save_total_limit=2``). One run goes straight
through; another is SIGKILLed four times, once at each kind of moment (between
updates, inside Trainer's save, inside the seal, between the seal and the
pointer), in a seeded order at seeded steps, and resumed each time from
``last_verified_checkpoint``. Its final checkpoint must equal the straight
run's byte for byte. Negative controls: ``get_last_checkpoint`` picks the
interrupted folder the helper passes over, and resuming from it fails.
Every job is its own forked process (hf_child.py); set TRAINSTATE_KILL_SEED to
replay a schedule.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forkjobs import launch
from trainstate.format.seal import SEAL, SEAL_POINTER

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
TOTAL, EVERY = 12, 3
SEED = int(os.environ.get("TRAINSTATE_KILL_SEED") or random.SystemRandom().randrange(2**31))
KINDS = ("step", "hf-save", "seal", "pointer")


def kill_plan(seed: int) -> list[list]:
    """One kill of each kind in a seeded order, the i-th in steps (3i, 3i+3]: each is reached after the last resume."""
    rng = random.Random(seed)
    kinds = list(KINDS)
    rng.shuffle(kinds)
    return [[kind, 3 * i + 3 if kind != "step" else rng.randint(3 * i + 1, min(3 * i + 3, TOTAL - 1))]
            for i, kind in enumerate(kinds)]


def resumes_at(kind: str, step: int) -> int:
    """The step of the newest sealed checkpoint after a kill of ``kind`` at ``step``."""
    if kind == "step":
        return step // EVERY * EVERY
    return step if kind == "pointer" else step - EVERY


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    plan = kill_plan(SEED)

    def spec(name, directory, **kw):
        return {"name": name, "dir": str(root / directory), "log": str(root / f"{name}.log"), **kw}

    jobs = [spec("reference", "reference"),
            *[spec(f"kill-{i}", "killed", kill=kill) for i, kill in enumerate(plan)],
            spec("finish", "killed"),
            spec("bare-kill", "bare", kill=["hf-save", 6]),
            spec("bare-resume", "bare", resume="hf-last"),
            spec("limit-1", "limit", save_total_limit=1)]
    exits = launch(HERE / "hf_child.py", jobs, root, timeout=600)
    return root, plan, exits


def context(root: Path, plan) -> str:
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(root.glob("*.log")))
    return f"kill plan {plan} (TRAINSTATE_KILL_SEED={SEED}){logs}"


def choices(root: Path, name: str) -> dict:
    return json.loads((root / f"{name}.log.json").read_text())


def final_files(directory: Path) -> dict[str, bytes]:
    """The last checkpoint's files, but the seal (its time) and training_args.bin (a pickle naming output_dir)."""
    folder = directory / f"checkpoint-{TOTAL}"
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name not in (SEAL, "training_args.bin")}


def test_killed_at_every_kind_of_moment_resumes_bitwise(runs):
    root, plan, exits = runs
    where = context(root, plan)
    assert exits["reference"] == 0 and exits["finish"] == 0, where
    assert all(exits[f"kill-{i}"] == -9 for i in range(len(plan))), (exits, where)  # each died by SIGKILL
    reference, killed = final_files(root / "reference"), final_files(root / "killed")
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= set(
        reference)
    assert sorted(reference) == sorted(killed), where
    differing = [name for name in reference if reference[name] != killed[name]]
    assert not differing, f"{differing} differ; {where}"
    # one INFO line per seal and per resume
    assert re.search(r"sealed checkpoint-12: \d+ files, \d+ bytes in [\d.]+ s \([\d.]+ GB/s\)",
                     (root / "reference.log").read_text()), where
    assert "resuming from checkpoint-" in (root / "finish.log").read_text(), where  # the last kill is after step 9
    # every resume came from the checkpoint the kill left as the newest sealed one
    for i, (kind, step) in enumerate(plan):
        resumed = choices(root, f"kill-{i + 1}" if i + 1 < len(plan) else "finish")["verified"]
        at = resumes_at(kind, step)
        assert resumed == (str(root / "killed" / f"checkpoint-{at}") if at else None), (kind, step, where)


def test_get_last_checkpoint_takes_the_interrupted_folder_the_helper_passes_over(runs):
    root, plan, exits = runs
    for i, (kind, step) in enumerate(plan):
        if kind not in ("hf-save", "seal"):
            continue
        picked = choices(root, f"kill-{i + 1}" if i + 1 < len(plan) else "finish")
        assert picked["hf-last"] == str(root / "killed" / f"checkpoint-{step}"), (kind, step, picked)
        older = str(root / "killed" / f"checkpoint-{step - EVERY}") if step > EVERY else None
        assert picked["verified"] == older, (kind, step, picked)
    # what the resumed runs left: interrupted folders out of Trainer's sight, every visible one sealed
    killed = root / "killed"
    visible = sorted((p.name for p in killed.glob("checkpoint-*")), key=lambda name: int(name.split("-")[1]))
    assert visible == [f"checkpoint-{TOTAL - EVERY}", f"checkpoint-{TOTAL}"]  # save_total_limit=2
    assert all((killed / name / SEAL).is_file() for name in visible)
    assert (killed / SEAL_POINTER).is_file()


def test_negative_control_resuming_from_get_last_checkpoint_fails(runs):
    root, plan, exits = runs
    assert exits["bare-kill"] == -9, context(root, plan)
    picked = choices(root, "bare-resume")
    assert picked["hf-last"] == str(root / "bare" / "checkpoint-6")  # killed inside the save: no RNG or trainer state
    assert picked["verified"] == str(root / "bare" / "checkpoint-3")
    assert exits["bare-resume"] == 1  # Trainer loaded its weights, then failed on the missing trainer state
    assert "checkpoint-6/trainer_state.json" in (root / "bare-resume.log").read_text()


def test_truncated_newest_checkpoint_is_skipped(runs, tmp_path, caplog):
    from transformers.trainer_utils import get_last_checkpoint

    from trainstate.integrations.hf import last_verified_checkpoint

    root, plan, exits = runs
    run = tmp_path / "run"
    shutil.copytree(root / "reference", run)
    assert last_verified_checkpoint(run) == str(run / "checkpoint-12")
    optimizer = run / "checkpoint-12" / "optimizer.pt"
    os.truncate(optimizer, optimizer.stat().st_size // 2)
    with caplog.at_level(logging.INFO, logger="trainstate"):
        assert last_verified_checkpoint(run) == str(run / "checkpoint-9")
    assert get_last_checkpoint(str(run)) == str(run / "checkpoint-12")  # negative control: Trainer's own pick
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("checkpoint-12" in w and "optimizer.pt" in w for w in warnings), warnings
    assert any("resuming from checkpoint-9, not checkpoint-12" in w for w in warnings), warnings


def test_save_total_limit_1_is_refused(runs):
    root, plan, exits = runs
    assert exits["limit-1"] == 1
    assert "save_total_limit=1 lets Trainer delete the previous checkpoint" in (root / "limit-1.log").read_text()


def test_import_trainstate_imports_no_framework():
    code = ("import sys, trainstate, trainstate.integrations; "
            "print(sorted({'transformers', 'accelerate', 'lightning'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_docs_example_is_the_two_lines_the_tests_run():
    from docsite import blocks, section
    from trainstate.integrations import hf

    block = blocks(section("guides/frameworks.md", "## Hugging Face Trainer"), "python")[0]
    compile(block, "docs/guides/frameworks.md", "exec")
    assert "callbacks=[DurableCheckpoints()]" in block
    assert "trainer.train(resume_from_checkpoint=last_verified_checkpoint(args.output_dir))" in block
    assert {"DurableCheckpoints", "last_verified_checkpoint"} <= set(hf.__all__)
