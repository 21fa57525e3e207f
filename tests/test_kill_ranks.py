"""Acceptance (issue 12): ``torchrun`` launches SIGKILLed at random moments resume bitwise identically.

The trial is ``trainstate demo --ranks 2`` itself, run as a user would: two
ranks (FSDP2 over gloo, dropout, AdamW, a schedule, a per-rank generator, a
sharded ResumableLoader), at least three SIGKILLs of the whole launch
(torchrun and every rank) with at least one inside a save, restarted until a
launch finishes; after every kill every visible generation verifies in full;
the final full state and every rank's streams equal the uninterrupted run's
bit for bit. The negative control reuses its reference: a resume that forgets
the per-rank RNG streams must end different. Each torchrun launch costs
seconds here, so the file holds few of them (seven).

The kill schedule is seeded: set TRAINSTATE_KILL_SEED to replay one.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trainstate.cli.demo import RANKS_CONFIG
from trainstate.drill import KillPlan, Timing
from trainstate.drill.launch import _TIMEOUT
from trainstate.drill.ranks import (KILL_MODES, _missed_save, compare_ranks, kill_launch, marked_processes,
                                    plan_rank_kills, run_ranks_drill)
from trainstate.drill.ranks_worker import FINAL_FILE, LAUNCH_ENV, RanksConfig, rank_file

SEED = int(os.environ.get("TRAINSTATE_KILL_SEED") or random.SystemRandom().randrange(2**31))
TOKEN_ENV = "TRAINSTATE_TEST_KILL_RANKS"  # inherited by the demo, its torchruns and their ranks
ROOT = Path(__file__).resolve().parents[1]


def _env(token: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **{TOKEN_ENV: token})


def _reap_strays(token: str, env: str = TOKEN_ENV) -> list[int]:
    """Kill whatever still carries ``token`` in ``env`` (nothing, if the drill cleaned up); the pids found."""
    strays: list[int] = []
    deadline = time.monotonic() + 30
    while (alive := marked_processes(token, env)) and time.monotonic() < deadline:
        strays += [pid for pid in alive if pid not in strays]
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return strays


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, float]:
    """``trainstate demo --ranks 2 --kills 3``, kept in a directory; its JSON report and wall time."""
    root = tmp_path_factory.mktemp("ranks") / "demo"
    token = f"demo-{os.getpid()}-{SEED}"
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "trainstate", "demo", "--ranks", "2", "--kills", "3", "--seed",
                             str(SEED), "--dir", str(root), "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(token), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:  # a timeout, or an interrupt: the demo's group first, then any launch of it still alive
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        strays = _reap_strays(token)
    elapsed = time.monotonic() - began
    assert not strays, f"processes {strays} outlived the demo"
    assert proc.returncode == 0, f"seed {SEED}: exit {proc.returncode}\n{out[-4000:]}\n{err[-4000:]}"
    return root, json.loads(out), elapsed


@pytest.mark.slow
def test_demo_ranks_survives_sigkills_of_the_whole_launch_bitwise(demo):
    root, report, elapsed = demo
    context = f"seed {SEED} (TRAINSTATE_KILL_SEED), {elapsed:.0f} s: {json.dumps(report, indent=1)[:3000]}"
    assert report["ok"] and not report["problems"] and report["differences"] == [], context
    assert report["kills"] >= 3 and report["kills_during_save"] >= 1, context
    assert report["resumes"] >= 1 and report["verified_after_kills"] >= 1, context
    assert report["launches"] == len(report["starts"]) + 1 == report["kills"] + 2, context
    assert set(report["compared"]) == {"model", "optimizer", "scheduler", "rank-0", "rank-1"}, context
    for start in report["starts"][:-1]:
        assert start["exit_code"] == -signal.SIGKILL and start["landed"], context
    assert report["starts"][-1]["exit_code"] == 0, context
    logs = sorted(p.name for p in root.glob("interrupted-launch-*.log"))
    assert len(logs) == len(report["starts"]), logs


@pytest.mark.slow
@pytest.mark.parametrize("forget", ["rng"])  # "loader" fails the same way; each costs two launches
def test_negative_control_a_resume_that_forgets_ends_different(demo, tmp_path, forget):
    """The same comparison fails when the resume forgets one rank-local part of the state (the per-rank
    generator and the rank's global torch stream, which draws its dropout masks)."""
    root, report, _ = demo
    timing = Timing(**report["timing"])
    plan = [KillPlan("save", 0.6, 0.0)]  # the 7th of 10 saves: the next launch resumes from a generation
    drill = run_ranks_drill(RANKS_CONFIG, tmp_path, kills=1, seed=SEED, plans=plan, forget=forget,
                            reference=(root / "reference", timing))
    r = drill.report
    assert r.finished and not r.problems and r.kills == 1 and r.resumes == 1, r
    differing = {d.split(":")[0] + ":" + d.split(":")[1].split()[0] for d in drill.comparison.differences}
    streams = {"rng": "noise.next", "loader": "loader.position"}[forget]
    assert {f"rank-0.safetensors:{streams}", f"rank-1.safetensors:{streams}"} <= differing, differing
    assert any(d.startswith(f"{FINAL_FILE}: model.") for d in drill.comparison.differences), differing


@pytest.mark.slow
def test_an_incremental_multi_rank_run_survives_sigkills_bitwise(tmp_path):
    """Issue 32: the same drill with ``full_every=3`` and a frozen 4 MiB table (each rank's part and its spare
    linked crosswise from save to save, every third generation whole), keep_last=2 pruning after every save: three SIGKILLs of the whole
    launch (one aimed inside a save), every visible generation verified in full after each, bitwise at the end."""
    from trainstate.storage.verify import read_manifest
    from trainstate.storage.local import LocalStore

    drill = run_ranks_drill(RanksConfig(total=40, every=4, full_every=3), tmp_path, kills=3, seed=SEED)
    r = drill.report
    context = f"seed {SEED} (TRAINSTATE_KILL_SEED): {json.dumps(drill.as_json(), indent=1, default=str)[:3000]}"
    assert drill.ok and r.finished and not r.problems and r.kills == 3 and r.kills_during_save >= 1, context
    assert r.verified_after_kills >= 1 and drill.comparison.differences == [], context
    store = LocalStore(tmp_path / "interrupted")
    manifests = [read_manifest(store, name, None, None)[0] for name in store.generations()]
    assert all(m.format_version == 5 and m.fingerprints for m in manifests), context  # each part with a spare
    linked = [m for m in manifests if m.shares]
    assert linked and all(any(f.startswith(("shard-00000-part-", "shard-00001-part-")) for f in m.shares)
                          for m in linked), context


# without torchrun --------------------------------------------------------------------------------------------
def test_kill_schedule_is_seeded_and_aims_at_every_phase():
    assert plan_rank_kills(random.Random(5), 6) == plan_rank_kills(random.Random(5), 6)
    for seed in range(40):
        for kills in range(1, 6):
            plans = plan_rank_kills(random.Random(seed), kills)
            modes = [p.mode for p in plans]
            assert len(plans) == kills and "save" in modes and set(modes) <= set(KILL_MODES)
            if kills >= 3:
                assert {"time", "startup"} <= set(modes)
            assert all(0 <= p.fraction < 0.9 and 0 <= p.delay < (0.8 if p.mode == "save" else 1.0) for p in plans)


class _Printed:
    """What a launch has printed so far, as the driver reads it (no process behind it)."""

    def __init__(self, lines: list[str], queued: list[str]):
        self.lines, self._queued = list(lines), list(queued)

    def next_line(self, deadline: float):
        if not self._queued:
            return _TIMEOUT
        self.lines.append(self._queued.pop(0))
        return self.lines[-1]


def test_a_save_kill_that_would_land_after_its_save_is_re_aimed_at_the_next_one():
    """The driver aims from when it reads ``saving``; a save over by the time the kill is due, with another to
    come, re-aims (after reading what the launch printed meanwhile) rather than land a save kill in training."""
    cfg = RanksConfig(total=40, every=4)
    assert _missed_save(_Printed(["training 0", "saving 4"], ["saved 4"]), cfg)
    assert not _missed_save(_Printed(["training 0", "saving 4"], []), cfg)  # still saving: kill now
    assert not _missed_save(_Printed(["training 0", "saving 4"], ["saved 4", "saving 8"]), cfg)  # the next began
    assert not _missed_save(_Printed(["training 0", "saving 40"], ["saved 40"]), cfg)  # no save left to aim at


def _files(directory: Path, final: dict, ranks: list[dict]) -> Path:
    directory.mkdir()
    save_file(final, str(directory / FINAL_FILE))
    for r, tensors in enumerate(ranks):
        save_file(tensors, str(directory / rank_file(r)))
    return directory


def test_comparison_is_bitwise_and_catches_each_kind_of_difference(tmp_path):
    final = {"model.w": torch.zeros(3), "optim.0.step": torch.tensor(4.0), "clock": torch.tensor(40)}
    rank = {"noise.next": torch.arange(4.0), "loader.position": torch.tensor([1, 2, 0, 96])}
    ref = _files(tmp_path / "ref", final, [rank, rank])
    assert compare_ranks(ref, _files(tmp_path / "same", dict(final), [dict(rank), dict(rank)]), 2).equal
    # -0.0 == 0.0 for ==, not bitwise; a changed rank stream; a missing key; a wider dtype
    changed = {**final, "model.w": torch.tensor([0.0, -0.0, 0.0]), "clock": torch.tensor(40.0)}
    other = _files(tmp_path / "other", changed, [rank, {"noise.next": torch.arange(4.0) + 1}])
    got = compare_ranks(ref, other, 2).differences
    assert any(d.startswith(f"{FINAL_FILE}: model.w: 1 of 3") for d in got), got
    assert any(d.startswith(f"{FINAL_FILE}: clock") for d in got), got
    assert any(d.startswith("rank-1.safetensors: noise.next") for d in got), got
    assert any("rank-1.safetensors: loader.position only in the reference" in d for d in got), got
    assert not any(d.startswith("rank-0") for d in got), got
    missing = compare_ranks(ref, tmp_path / "absent", 2)
    assert len(missing.differences) == 3 and "did not finish" in missing.differences[0]


_TREE = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_kill_launch_takes_down_processes_in_other_sessions(tmp_path):
    """As torchrun does, the parent starts its child in a session of its own: killpg of the parent's group
    alone would leave the child running; kill_launch finds it by the marker and kills its group too."""
    marker = f"t{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, **{LAUNCH_ENV: marker}), start_new_session=True)
    try:
        child = int(proc.stdout.readline())
        assert os.getpgid(child) != os.getpgid(proc.pid)
        deadline = time.monotonic() + 10  # a child between fork and exec may not show its environment yet
        while sorted(marked_processes(marker)) != sorted([proc.pid, child]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(marked_processes(marker)) == sorted([proc.pid, child])
        assert kill_launch(proc, marker) == 2
        assert proc.wait(10) == -signal.SIGKILL
        assert marked_processes(marker) == []
    finally:
        for pid in marked_processes(marker):
            os.kill(pid, signal.SIGKILL)
        proc.stdout.close()


_DRIVER = """
import subprocess, sys
from trainstate.drill.ranks import dying_with_this_process
launch = subprocess.Popen(dying_with_this_process([sys.executable, "-c", "import time; time.sleep(600)"]),
                          start_new_session=True)
print(launch.pid, flush=True)
launch.wait()
"""


def test_a_launch_dies_with_its_driver_however_it_dies():
    """The driver SIGKILLed (a test timeout that kills it outright): the launch it started, in a session of
    its own, goes too, killed by the kernel; nothing is left for anyone to clean up."""
    token = f"driver-{os.getpid()}"
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER], stdout=subprocess.PIPE, text=True, env=_env(token))
    try:
        launch = int(driver.stdout.readline())
        assert os.getpgid(launch) != os.getpgid(driver.pid) and marked_processes(token, TOKEN_ENV)
        driver.kill()
        driver.wait(10)
        deadline = time.monotonic() + 10
        while marked_processes(token, TOKEN_ENV) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marked_processes(token, TOKEN_ENV) == []
    finally:
        _reap_strays(token)
        driver.stdout.close()
