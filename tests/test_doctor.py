"""``ts.doctor`` and ``trainstate doctor``: real runs, real fresh processes, the first differing stage named.

Each faulty run is a negative control for the other verdicts: the worker-RNG run must not be blamed on the LR,
the unregistered scheduler not on the batch, and the correctly registered run on nothing. The runs are written
in this process by ``tests/doctor_fixtures.py``; the doctor's processes import the same module.
"""

from __future__ import annotations

import json

import torch

import trainstate as ts
from trainstate.cli.main import main
from trainstate.tools.diff import Category, Entry
from trainstate.tools.doctor import diagnose, tensor_diff

import doctor_fixtures as fx

STEP = "doctor_fixtures:step"


def _stages(report: ts.DoctorReport) -> dict[str, bool]:
    return {c.name: c.identical for c in report.stages}


def test_a_global_rng_draw_in_a_data_worker_is_named_as_the_batch(tmp_path):
    fx.write_run(tmp_path / "run", fx.worker_rng, 4)  # mid-epoch: batch 4 of 6
    report = ts.doctor(tmp_path / "run", "doctor_fixtures:worker_rng", STEP)
    assert report.reproducible and not report.identical
    assert report.first == "batch", report.diagnosis
    assert _stages(report) == {"contract": True, "state": True, "batch": False, "rng": True, "lr": True,
                               "loss": False, "grads": False, "updated": False}
    batch = {e.path: e for e in report.stage("batch").entries}
    # the same samples (ids equal), other bytes: the noised inputs differ in every element, the targets not at all
    assert not [p for p in batch if p.endswith("/ids")]
    assert set(batch) == {"data/0/bytes.0", "input.model/args.0"}
    assert batch["data/0/bytes.0"].tensor.differing == fx.BATCH * 4
    assert "sample_generator" in report.diagnosis and "worker" in report.diagnosis
    assert any("DataLoader workers' global RNG" in n for n in report.notes["resumed"])


def test_a_correctly_registered_run_shows_no_difference(tmp_path, capsys):
    fx.write_run(tmp_path / "run", fx.good, 4)
    code = main(["doctor", str(tmp_path / "run"), "--factory", "doctor_fixtures:good", "--step", STEP, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out["diagnosis"]
    assert out["identical"] and out["first"] is None and out["reproducible"]
    stages = {c["name"]: c for c in out["stages"]}
    assert list(stages) == ["contract", "state", "batch", "rng", "lr", "loss", "grads", "updated"]
    assert all(not c["entries"] for c in out["stages"] + out["repeat"])
    # not vacuous: every stage compared something
    assert stages["batch"]["tensors"] == 4 and stages["grads"]["tensors"] == 4 and stages["lr"]["tensors"] == 2
    assert stages["state"]["tensors"] >= 8 and stages["updated"]["tensors"] >= 8


def test_an_unregistered_scheduler_is_named_as_the_lr(tmp_path):
    fx.write_run(tmp_path / "run", fx.unregistered_scheduler, 4)
    report = ts.doctor(tmp_path / "run", "doctor_fixtures:unregistered_scheduler", STEP, repeat=False)
    assert report.reproducible is None and report.first == "lr", report.diagnosis
    assert _stages(report) == {"contract": True, "state": True, "batch": True, "rng": True, "lr": False,
                               "loss": True, "grads": True, "updated": False}
    (entry,) = report.stage("lr").entries
    # the LR used by update 4 was restored with the optimizer; the schedule after it restarted at step 0
    assert entry.path == "optimizer/after"
    assert f"{0.1 * 0.8 ** 1!r}" in entry.message and f"{0.1 * 0.8 ** 5!r}" in entry.message
    assert "Register it: TrainState(scheduler=...)" in report.diagnosis
    assert "after the update" in report.diagnosis
    assert any("driven by an LR scheduler" in n for n in report.notes["resumed"])


def test_against_compares_a_resumed_run_with_the_uninterrupted_one(tmp_path, capsys):
    fx.write_run(tmp_path / "straight", fx.worker_rng, 6, save_at=(4,))
    fx.write_run(tmp_path / "resumed", fx.worker_rng, 4)
    state = fx.worker_rng()  # a restart at update 4 (a fresh state, in this process), then 2 more updates
    with ts.CheckpointManager(tmp_path / "resumed") as ckpt:
        ckpt.restore(state)
        for _ in range(2):
            fx.step(state)
            state.next_update += 1
        ckpt.save(state)
    code = main(["doctor", str(tmp_path / "resumed"), "--factory", "doctor_fixtures:worker_rng", "--step", STEP,
                 "--against", str(tmp_path / "straight"), "--no-repeat", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["first"] == "state" and out["reproducible"] is None and out["repeat"] == [], out
    assert "gen-000000000006" in out["reference"]
    state_stage = next(c for c in out["stages"] if c["name"] == "state")
    assert "first in model" in state_stage["summary"]  # the weights drifted in updates 4 and 5
    assert "the drift started earlier" in out["diagnosis"]


def test_bad_arguments_exit_2_without_starting_a_process(tmp_path, capsys):
    fx.write_run(tmp_path / "run", fx.good, 1)
    assert main(["doctor", str(tmp_path / "missing"), "--factory", "a:b", "--step", STEP]) == 2
    assert main(["doctor", str(tmp_path / "run"), "--factory", "no_colon", "--step", STEP]) == 2
    assert "must look like 'module:function'" in capsys.readouterr().err
    assert main(["doctor", str(tmp_path / "run"), "--factory", "a:b", "--step", STEP, "--from", "7", "--json"]) == 2
    assert "after update 1" in json.loads(capsys.readouterr().out)["error"]


def _category(name: str, differs: bool) -> Category:
    return Category(name, "", [Entry("x", "differs")] if differs else [], 1)


def test_a_difference_between_two_fresh_restores_is_reported_as_not_reproducible():
    """Pure verdict logic: nondeterminism outranks any comparison with the reference (negative control for
    `reproducible`, without processes)."""
    names = ("contract", "state", "batch", "rng", "lr", "loss", "grads", "updated")
    reference = [_category(n, n == "lr") for n in names]
    same = [_category(n, False) for n in names]
    assert diagnose(reference, same)[:2] == ("lr", True)
    first, reproducible, text = diagnose(reference, [_category(n, n in ("grads", "updated")) for n in names])
    assert (first, reproducible) == ("grads", False) and "nondeterministic kernel" in text
    assert diagnose(same, same) == (None, True, diagnose(same, same)[2])


def test_tensors_are_compared_by_their_bits():
    assert tensor_diff(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])).differing == 1
    assert tensor_diff(torch.tensor([float("nan")]), torch.tensor([float("nan")])).differing == 0
    got = tensor_diff(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.5, 3.0]))
    assert (got.differing, got.first_index, got.max_abs) == (1, 1, 0.5)
    assert tensor_diff(torch.zeros(2), torch.zeros(3)).mismatch


def test_launch_is_either_or_and_a_job_that_ignores_it_is_named(tmp_path, capsys):
    """``--launch`` (a multi-rank job's own command) replaces --factory/--step; a command whose checkpointer does
    not act on the doctor's job exits 0 with no record, and the doctor says so instead of comparing nothing.
    (The launched doctor at work: tests/test_torchtitan.py.)"""
    import sys

    import pytest

    fx.write_run(tmp_path / "run", fx.good, 2)
    with pytest.raises(ts.InvalidArgument, match="not both"):
        ts.doctor(tmp_path / "run", "doctor_fixtures:good", STEP, launch="python -c pass")
    with pytest.raises(ts.InvalidArgument, match="launch is empty"):
        ts.doctor(tmp_path / "run", launch="  ")
    with pytest.raises(ts.InvalidArgument, match="without a record"):
        ts.doctor(tmp_path / "run", launch=[sys.executable, "-c", "print('trained')"], repeat=False)
    with pytest.raises(SystemExit):
        main(["doctor", str(tmp_path / "run")])  # neither: argparse's usage error
    assert "--launch CMD" in capsys.readouterr().err
