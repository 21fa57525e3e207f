"""Issue 20: each generation records the device kinds it was saved from and the wall time summed over its
lineage's updates (save stalls excluded); ``inspect`` and the model card of an export report them, and say
"not recorded" where a generation (an older format, or a lineage the manager could not time) lacks them."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

import trainstate as ts
from trainstate.cli.main import main

STEP_S = 0.05  # the known training time of one update
BOUND_S = 1.5  # generous: process-local overheads (restore, a tiny model's steps) are far below it
GAP_S = 3.0  # between the kill and the resume: more than the bound, so counting it would fail the test
LOST_S = 2.0  # trained after the last save, then killed: in no lineage

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    import trainstate as ts

    run, updates, kill_after = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ts.TrainState(model=model, optimizer=opt)
    with ts.CheckpointManager(run) as ckpt:
        time.sleep(0.5)  # before restore returns: not training time
        ckpt.restore(state)
        for _ in range(updates):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(%r)
            state.next_update += 1
        info = ckpt.save(state)
        print(info.name, flush=True)
        if kill_after:
            time.sleep(kill_after)  # work lost to the crash
            os.kill(os.getpid(), signal.SIGKILL)
""" % STEP_S)


def _leg(run: Path, updates: int, kill_after: float = 0.0) -> str:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(run), str(updates), str(kill_after)],
                          capture_output=True, text=True, timeout=120)
    if kill_after:
        assert proc.returncode == -signal.SIGKILL, proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()[0]


def _compute(run: Path, name: str) -> dict:
    return json.loads((run / name / "manifest.json").read_text()).get("compute")


def test_wall_time_sums_both_legs_and_excludes_the_crash_gap_and_lost_work(tmp_path, capsys):
    run = tmp_path / "run"
    first = _leg(run, 4, kill_after=LOST_S)  # killed by SIGKILL after training on past its save
    time.sleep(GAP_S)  # between processes: no lineage's training
    second = _leg(run, 3)
    one, two = _compute(run, first), _compute(run, second)
    assert one["devices"] == two["devices"] == ["cpu"]
    assert 4 * STEP_S <= one["wall_s"] < 4 * STEP_S + BOUND_S
    assert 7 * STEP_S <= two["wall_s"] < 7 * STEP_S + BOUND_S  # GAP_S, LOST_S and the pre-restore sleeps excluded
    assert 3 * STEP_S <= two["wall_s"] - one["wall_s"] < 3 * STEP_S + BOUND_S

    assert main(["inspect", str(run / second)]) == 0
    assert f"compute: device cpu; wall time {two['wall_s']:.3f} s" in capsys.readouterr().out

    ts.export(run, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "- Device kind: cpu\n" in card
    assert f"- Wall time summed over updates: {two['wall_s']:.3f} s" in card


def _state() -> ts.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    return ts.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _first_save_then_train(ckpt: ts.CheckpointManager, state: ts.TrainState) -> ts.GenerationInfo:
    """A fresh run's first save at update 1, then 0.2 s of training time; returns the first generation."""
    ckpt.restore(state)
    state.next_update = 1
    first = ckpt.save(state)
    time.sleep(0.2)  # training time
    return first


def test_the_stall_inside_a_blocking_save_is_not_training_time(tmp_path):
    def slow_rehearsal():  # runs inside save(), before its pointer moves: part of the stall
        time.sleep(1.5)
        return _state()

    state = _state()
    with ts.CheckpointManager(tmp_path / "run", rehearse=slow_rehearsal) as ckpt:
        first = _first_save_then_train(ckpt, state)
        state.next_update = 2
        second = ckpt.save(state)
    assert 0.2 <= second.wall_s - first.wall_s < 0.2 + 1.0  # counting the 1.5 s stall would exceed this


def test_a_background_write_overlapping_training_is_training_time(tmp_path):
    state = _state()
    with ts.CheckpointManager(tmp_path / "run") as ckpt:
        ckpt.restore(state)
        state.next_update = 1
        first = ckpt.save(state)
        time.sleep(0.3)  # training time
        state.next_update = 2
        handle = ckpt.save(state, blocking=False)
        time.sleep(0.3)  # training overlapping the background write: training time
        handle.wait()
        state.next_update = 3
        third = ckpt.save(state)
    walls = [_compute(tmp_path / "run", g)["wall_s"] for g in (first.name, "gen-000000000002", third.name)]
    assert walls[0] < BOUND_S
    assert 0.3 <= walls[1] - walls[0] < 0.3 + BOUND_S
    assert 0.3 <= walls[2] - walls[1] < 0.3 + BOUND_S
    assert first.wall_s == walls[0] and third.devices == ("cpu",)


def test_a_manager_that_did_not_restore_the_lineage_records_no_partial_sum(tmp_path):
    run = tmp_path / "run"
    state = _state()
    with ts.CheckpointManager(run) as ckpt:
        ckpt.restore(state)
        state.next_update = 1
        ckpt.save(state)
    with ts.CheckpointManager(run) as late:  # built mid-run: it never saw where the state's interval began
        state.next_update = 2
        info = late.save(state)
    compute = _compute(run, info.name)
    assert compute == {"devices": ["cpu"]} and info.wall_s is None
    with ts.CheckpointManager(run) as ckpt:  # restoring it: a lineage with a gap stays unrecorded
        ckpt.restore(state)
        state.next_update = 3
        assert ckpt.save(state).wall_s is None  # its parent recorded none, so neither does it
    assert main(["inspect", str(run / info.name)]) == 0


def test_an_old_format_generation_exports_with_both_not_recorded(tmp_path, capsys):
    run = tmp_path / "v1-run"
    shutil.copytree(Path(__file__).parent / "golden" / "v1-run", run)
    ts.export(run, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "- Device kind: not recorded\n" in card
    assert "- Wall time summed over updates: not recorded\n" in card
    assert main(["inspect", str(run / "gen-000000000007")]) == 0
    assert "compute: device not recorded; wall time not recorded" in capsys.readouterr().out


def test_the_reader_refuses_a_malformed_compute_record():
    import pytest

    from trainstate.errors import CorruptGeneration
    from trainstate.format.manifest import FileRecord, Manifest, parse_manifest

    def manifest(compute):
        return Manifest("gen-000000000001", "full", 1, "sha256", (FileRecord("state.json", 1, "ab" * 32),),
                        "2026-01-01T00:00:00+00:00", "ab" * 32, compute=compute).to_bytes()

    assert parse_manifest(manifest({"devices": ["cpu"], "wall_s": 1.5}), "m").compute["wall_s"] == 1.5
    assert parse_manifest(manifest({}), "m").compute == {}  # omitted: not recorded
    for bad in ({"wall_s": -1.0}, {"wall_s": 1}, {"devices": []}, {"devices": [3]}, {"gpu_hours": 1.0}):
        with pytest.raises(CorruptGeneration):
            parse_manifest(manifest(bad), "m")


def test_after_a_failed_save_the_lineage_continues_from_the_published_parent(tmp_path):
    fail = []

    def rehearsal():  # the second save's rehearsal stalls, then fails: that generation is never published
        if fail:
            fail.clear()
            time.sleep(1.5)
            raise RuntimeError("rehearsal failed")
        return _state()

    state = _state()
    with ts.CheckpointManager(tmp_path / "run", rehearse=rehearsal) as ckpt:
        first = _first_save_then_train(ckpt, state)  # kept: the state rolls back to descend from `first`
        state.next_update, fail[:] = 2, [True]
        try:
            ckpt.save(state)
        except RuntimeError:
            pass
        assert state.parent == first.name
        time.sleep(0.2)
        state.next_update = 3
        third = ckpt.save(state)
    assert 0.4 <= third.wall_s - first.wall_s < 0.4 + 1.0  # both intervals; the failed save's 1.5 s stall is not
