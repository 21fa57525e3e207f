"""Acceptance: the kill drill with a real DataLoader (2 worker processes) resumes bitwise.

At least 10 trials, each SIGKILLed several times at random moments, including
inside saves, take every batch from a ``ts.ResumableLoader`` over a map-style
dataset (shuffled, 2 forked DataLoader workers, persistent, prefetch 2,
augmentation from ``ts.sample_generator``), registered in the TrainState as
component ``loader``. The final state equals the uninterrupted run's bitwise,
and so does the sequence of sample ids each update trained on: every worker
appends them to ``consumed_ids.log`` and the comparison resolves the entries
that kills cut or resumes redid (:func:`trainstate.drill.read_consumed_ids`).
No DataLoader worker outlives its SIGKILLed parent for long: torch's workers
poll their parent, and the test finds any left by the log they inherited open.

Negative controls: a resume that forgets the loader position, and a log
shifted by one update, both fail the id comparison. The kill schedule is
seeded: set TRAINSTATE_KILL_SEED to replay one (the seed is in every failure
message).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainstate.drill import (
    IDS_LOG,
    Comparison,
    DrillConfig,
    DrillReport,
    IdsLog,
    KillPlan,
    Timing,
    Zygote,
    compare_runs,
    dataset_size,
    read_consumed_ids,
    run_interrupted,
    run_reference,
    wait_for_exit,
)

pytestmark = pytest.mark.slow

CONFIG = DrillConfig(total=30, every=3, width=128, batch=32, loader_workers=2)
BATCHES_PER_EPOCH = -(-dataset_size(CONFIG) // CONFIG.batch)  # 5, the last one half full
TRIALS = 12
BASE_SEED = int(os.environ.get("TRAINSTATE_KILL_SEED") or random.SystemRandom().randrange(2**31))
# torch's DataLoader workers look for their parent every 5 s (MP_STATUS_CHECK_INTERVAL)
STRAY_TIMEOUT_S = 20.0


@dataclass
class Trial:
    name: str
    seed: int
    kills: int
    forget: str | None = None
    report: DrillReport | None = None
    comparison: Comparison | None = None
    error: str | None = None

    def context(self) -> str:
        lines = [f"{self.name}: kill schedule seed {self.seed} (TRAINSTATE_KILL_SEED={BASE_SEED})"]
        if self.error:
            lines.append(f"error: {self.error}")
        for start in self.report.starts if self.report else []:
            lines.append(f"  start {start.index}: restored {start.restored}, plan {start.plan}, "
                         f"killed {start.killed_after_s}, {start.landed}, exit {start.exit_code}")
        lines += [f"  problem: {p}" for p in (self.report.problems if self.report else [])]
        lines += [f"  differs: {d}" for d in (self.comparison.differences[:10] if self.comparison else [])]
        return "\n".join(lines)


@pytest.fixture(scope="module")
def zygote() -> Zygote:
    with Zygote() as launcher:
        yield launcher


@pytest.fixture(scope="module")
def reference(zygote: Zygote, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Timing]:
    directory = tmp_path_factory.mktemp("kill-data") / "reference"
    return directory, run_reference(CONFIG, directory, launcher=zygote)


def _run(trial: Trial, zygote: Zygote, reference: Path, timing: Timing, root: Path) -> Trial:
    # The negative control: one kill as the 7th of 10 saves begins, so it surely resumes mid-run.
    plans = [KillPlan("save", 0.6)] if trial.forget else None
    try:
        trial.report = run_interrupted(CONFIG, root / trial.name, kills=trial.kills, seed=trial.seed, timing=timing,
                                       plans=plans, forget=trial.forget, launcher=zygote)
        if trial.report.finished:
            trial.comparison = compare_runs(CONFIG, reference, root / trial.name)
    except Exception as exc:  # reported by the test that owns the trial, with its seed
        trial.error = f"{type(exc).__name__}: {exc}"
    if trial.error is None and trial.comparison is not None and trial.comparison.equal:
        shutil.rmtree(root / trial.name, ignore_errors=True)  # keep only evidence of failures
    return trial


@pytest.fixture(scope="module")
def trials(zygote: Zygote, reference: tuple[Path, Timing],
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trial]:
    ref_dir, timing = reference
    root = tmp_path_factory.mktemp("trials")
    specs = [Trial(f"trial-{i:02d}", BASE_SEED + i, kills=2 + i % 2) for i in range(TRIALS)]
    specs.append(Trial("forget-loader", BASE_SEED, kills=1, forget="loader"))
    began = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda t: _run(t, zygote, ref_dir, timing, root), specs))
    print(f"\n{len(specs)} runs with a 2-worker DataLoader in {time.monotonic() - began:.1f} s")
    return {t.name: t for t in done}


@pytest.mark.parametrize("index", range(TRIALS))
def test_trial_resumes_bitwise_with_the_same_sample_ids(trials: dict[str, Trial], index: int) -> None:
    trial = trials[f"trial-{index:02d}"]
    report = trial.report
    assert trial.error is None, trial.context()
    assert report.finished and not report.problems, trial.context()
    assert report.kills >= 2, trial.context()  # repeated kills, each followed by a resume
    assert trial.comparison is not None and trial.comparison.equal, trial.context()
    ids = trial.comparison.ids  # the id comparison really ran, on the whole run
    assert ids is not None and sorted(ids.updates) == list(range(1, CONFIG.total + 1)), trial.context()
    # each start that began training logged its resume (one killed just before its "training" line may, too)
    trained = sum(s.landed != "during start-up or restore" for s in report.starts)
    assert trained <= ids.resumes <= len(report.starts), trial.context()
    assert report.loader_workers >= 2, trial.context()  # at least the last start's; a kill may beat a fork


def test_kills_are_repeated_land_inside_saves_and_resume_mid_epoch(trials: dict[str, Trial]) -> None:
    reports = [t.report for t in trials.values() if t.forget is None and t.report is not None]
    assert len(reports) >= 10
    kills = sum(r.kills for r in reports)
    inside = sum(r.kills_during_save for r in reports)
    phases: dict[str, int] = {}
    for start in (s for r in reports for s in r.starts if s.killed_after_s is not None):
        phase = start.landed.split("(")[-1].rstrip(")") if start.during_save else start.landed
        phases[phase] = phases.get(phase, 0) + 1
    restored = [int(s.restored.split("-")[1]) for r in reports for s in r.starts if s.restored]
    mid_epoch = sum(u % BATCHES_PER_EPOCH != 0 for u in restored)
    print(f"\n{len(reports)} trials, {sum(len(r.starts) for r in reports)} worker starts, {kills} SIGKILLs, "
          f"{inside} inside a save, {len(restored)} resumes ({mid_epoch} mid-epoch), "
          f"{sum(r.loader_workers for r in reports)} DataLoader workers started (seed {BASE_SEED}); "
          f"kills by place: {phases}")
    assert kills >= 2 * len(reports), f"only {kills} kills (seed {BASE_SEED})"
    assert inside >= len(reports) // 2, f"only {inside} of {kills} kills landed inside a save (seed {BASE_SEED})"
    assert mid_epoch >= 1, f"no resume landed mid-epoch: {restored} (seed {BASE_SEED})"


def test_no_dataloader_worker_outlives_its_killed_parent(trials: dict[str, Trial],
                                                         reference: tuple[Path, Timing]) -> None:
    logs = {os.path.realpath(reference[0] / IDS_LOG)} | {t.report.ids_log for t in trials.values() if t.report}
    assert None not in logs and len(logs) == len(trials) + 1
    started = sum(t.report.loader_workers for t in trials.values())
    assert started >= 2 * len(trials), "the DataLoader workers did not run"
    # Right after a kill its DataLoader workers are typically still alive (torch's notice their parent
    # gone within about 5 s): seeing them shows that the search finds them.
    orphans = sum(t.report.loader_orphans for t in trials.values())
    assert orphans >= 1, "no DataLoader worker was found alive right after any kill: is the search blind?"
    left = wait_for_exit(logs, STRAY_TIMEOUT_S)
    print(f"\n{started} DataLoader workers started, {orphans} seen orphaned right after a kill, "
          f"{sum(map(len, left.values()))} alive now")
    assert not left, f"DataLoader workers still alive {STRAY_TIMEOUT_S:.0f} s after their runs: {left}"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="finds processes by their open files in /proc")
def test_stray_search_finds_a_process_holding_the_log(tmp_path: Path) -> None:
    """Negative control for the stray search: a live process holding a run's log is found, even after the
    log was deleted (passing trials delete their directory), until it ends."""
    log = tmp_path / IDS_LOG
    code = "import sys, time; f = open(sys.argv[1], 'a'); print('open', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(log)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "open"
        path = os.path.realpath(log)
        log.unlink()
        assert wait_for_exit({path}, 0.2) == {path: [proc.pid]}
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert wait_for_exit({path}, 5.0) == {}


def test_negative_control_forgotten_loader_position_is_detected(trials: dict[str, Trial]) -> None:
    trial = trials["forget-loader"]
    assert trial.error is None and trial.report.finished, trial.context()
    assert trial.report.resumes >= 1, trial.context()  # the forgetting really happened after a restore
    assert trial.comparison is not None and not trial.comparison.equal, trial.context()
    resumed_at = int(trial.report.starts[-1].restored.split("-")[1])
    first = [d for d in trial.comparison.differences if d.startswith("consumed ids: update ")]
    assert first and first[0].startswith(f"consumed ids: update {resumed_at + 1} "), trial.context()
    assert any("components.loader" in d for d in trial.comparison.differences), trial.context()


def test_negative_control_shifted_id_log_is_detected(reference: tuple[Path, Timing], tmp_path: Path) -> None:
    """Same final state, but the log says update 7 on trained what update 8 did: only the ids differ."""
    run = tmp_path / "run"
    shutil.copytree(reference[0], run)
    ids = read_consumed_ids(run / IDS_LOG).updates
    shifted = IdsLog(run / "shifted.log")
    shifted.resume(0)
    for update in range(1, CONFIG.total + 1):
        shifted.entry(update, ids[update + 1] if update == 7 else ids[update])
    shifted.close()
    os.replace(run / "shifted.log", run / IDS_LOG)
    comparison = compare_runs(CONFIG, reference[0], run)
    assert comparison.differences and all(d.startswith("consumed ids: update 7 ") for d in comparison.differences)
    assert compare_runs(CONFIG, reference[0], reference[0]).equal


def test_id_log_resolves_torn_lines_and_redone_updates(tmp_path: Path) -> None:
    """The reader keeps the surviving work: torn lines dropped, redone updates replaced, dead work ended."""
    path = tmp_path / IDS_LOG
    log = IdsLog(path)
    log.resume(0)
    for update in (1, 2, 3):  # saved at 2; 3 done but never saved
        log.entry(update, [update, 100 + update])
    log.close()
    with open(path, "ab") as f:
        f.write(b"4 4 10")  # killed mid-line: a torn line that parses as numbers
    log = IdsLog(path)  # the next start ends the torn line first
    log.resume(2)
    log.entry(3, [3, 203])
    log.entry(4, [4, 204])
    log.close()
    with open(path, "ab") as f:
        f.write(b"resume 1")  # a start killed while writing its first line
    log = IdsLog(path)
    log.resume(4)
    log.entry(5, [5, 205])
    log.close()
    got = read_consumed_ids(path)
    assert got.updates == {1: [1, 101], 2: [2, 102], 3: [3, 203], 4: [4, 204], 5: [5, 205]}
    assert (got.torn, got.resumes, got.superseded) == (2, 3, 1)
