"""Acceptance: the kill drill with background saves (``save(blocking=False)``).

The drill worker runs with ``--async-save``: every save returns once an owned
copy of the state exists, training goes on while the generation is written
(``--slow-fsync`` makes each save span several updates, as on a slow disk,
so kills land inside background writes and saves queue behind each other),
and the final generation is waited for before the final probe. The runs are
SIGKILLed at random moments, several times each; after every kill every
visible generation must verify and the next start must restore the one the
pointer names. Each finished run must end bitwise equal to an uninterrupted
run that saved with *blocking* saves: saving in the background changes
nothing about what is saved.

Seeded like tests/test_kill.py: set TRAINSTATE_KILL_SEED to replay a schedule.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainstate.drill import (
    Comparison,
    DrillConfig,
    DrillReport,
    KillPlan,
    Timing,
    Zygote,
    compare_runs,
    run_interrupted,
    run_reference,
)

pytestmark = pytest.mark.slow

SYNC = DrillConfig(total=24, every=3, width=256, batch=64)
ASYNC = dataclasses.replace(SYNC, async_save=True, slow_fsync_ms=15)
TRIALS = 12
BASE_SEED = int(os.environ.get("TRAINSTATE_KILL_SEED") or random.SystemRandom().randrange(2**31))
BACKGROUND_PHASES = ("writing staged files", "committed, verifying; pointer not yet moved",
                     "staged in memory, not yet writing")


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
        lines = [f"{self.name}: kill schedule seed {self.seed} (TRAINSTATE_KILL_SEED={BASE_SEED}), async saves"]
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
def references(zygote: Zygote, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Timing]:
    """The blocking reference (what every run must end equal to) and an uninterrupted async run (its pace)."""
    root = tmp_path_factory.mktemp("kill-async")
    with ThreadPoolExecutor(max_workers=2) as pool:
        sync = pool.submit(run_reference, SYNC, root / "sync", launcher=zygote)
        background = pool.submit(run_reference, ASYNC, root / "async", launcher=zygote)
        sync.result()
        timing = background.result()
    return root / "sync", root / "async", timing


def _run(trial: Trial, zygote: Zygote, reference: Path, timing: Timing, root: Path) -> Trial:
    # The negative control: one kill inside the 5th of 8 background saves, then a resume that forgets.
    plans = [KillPlan("save", 0.6, 0.5)] if trial.forget else None
    try:
        trial.report = run_interrupted(ASYNC, root / trial.name, kills=trial.kills, seed=trial.seed, timing=timing,
                                       plans=plans, forget=trial.forget, launcher=zygote)
        if trial.report.finished:
            trial.comparison = compare_runs(SYNC, reference, root / trial.name)
    except Exception as exc:  # reported by the test that owns the trial, with its seed
        trial.error = f"{type(exc).__name__}: {exc}"
    if trial.error is None and trial.comparison is not None and trial.comparison.equal:
        shutil.rmtree(root / trial.name, ignore_errors=True)
    return trial


@pytest.fixture(scope="module")
def trials(zygote: Zygote, references: tuple[Path, Path, Timing],
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trial]:
    sync_dir, _, timing = references
    root = tmp_path_factory.mktemp("async-trials")
    specs = [Trial(f"trial-{i:02d}", BASE_SEED + i, kills=2 + i % 2) for i in range(TRIALS)]
    specs.append(Trial("forget-optimizer", BASE_SEED, kills=1, forget="optimizer"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda t: _run(t, zygote, sync_dir, timing, root), specs))
    return {t.name: t for t in done}


def test_uninterrupted_async_run_equals_the_blocking_one(references: tuple[Path, Path, Timing]) -> None:
    sync_dir, async_dir, timing = references
    comparison = compare_runs(SYNC, sync_dir, async_dir)
    assert comparison.equal, comparison.differences[:10]
    # Saves really overlapped training: one took longer than an update (the slow disk), and
    # training did not stop for it (otherwise an update would cost the whole save).
    assert timing.save_s > timing.per_update_s, timing


@pytest.mark.parametrize("index", range(TRIALS))
def test_trial_resumes_bitwise(trials: dict[str, Trial], index: int) -> None:
    trial = trials[f"trial-{index:02d}"]
    assert trial.error is None, trial.context()
    assert trial.report.finished and not trial.report.problems, trial.context()
    assert trial.report.kills >= 2, trial.context()
    assert trial.comparison is not None and trial.comparison.equal, trial.context()


def _phase(landed: str) -> str:
    """The phase a kill landed in, without which save waited behind it."""
    phase = landed.split("(", 1)[-1].rstrip(")") if "(" in landed else landed
    return re.sub(r"; the save of update \d+ waiting for it$", "", phase)


def test_kills_land_inside_background_writes(trials: dict[str, Trial]) -> None:
    reports = [t.report for t in trials.values() if t.forget is None and t.report is not None]
    assert len(reports) == TRIALS
    killed = [s for r in reports for s in r.starts if s.killed_after_s is not None]
    background = [s for s in killed if s.during_save and "in the background" in s.landed]
    writing = [s for s in background if _phase(s.landed).startswith(BACKGROUND_PHASES[:2])]
    phases: dict[str, int] = {}
    for start in killed:
        phases[_phase(start.landed)] = phases.get(_phase(start.landed), 0) + 1
    print(f"\n{len(reports)} async trials, {sum(len(r.starts) for r in reports)} worker starts, {len(killed)} "
          f"SIGKILLs, {sum(s.during_save for s in killed)} inside a save, {len(background)} while a save ran in "
          f"the background ({len(writing)} of them writing or committing its files), "
          f"{sum(r.resumes for r in reports)} resumes (seed {BASE_SEED}); kills by place: {phases}")
    assert len(killed) >= 2 * TRIALS
    assert len(background) >= 4, f"only {len(background)} kills landed during a background save (seed {BASE_SEED})"
    assert len(writing) >= 2, f"only {len(writing)} kills landed while files were written (seed {BASE_SEED})"


def test_every_visible_generation_verifies_after_every_kill(trials: dict[str, Trial]) -> None:
    checked = 0
    for trial in trials.values():
        assert trial.report is not None, trial.context()
        assert not [p for p in trial.report.problems if "partial" in p or "pointer" in p], trial.context()
        assert not [p for p in trial.report.problems if "restored" in p or "fresh" in p], trial.context()
        checked += trial.report.verified_after_kills
    assert checked >= TRIALS


def test_negative_control_forgetting_the_optimizer_is_detected(trials: dict[str, Trial]) -> None:
    trial = trials["forget-optimizer"]
    assert trial.error is None and trial.report.finished, trial.context()
    assert trial.report.resumes >= 1, trial.context()
    assert trial.comparison is not None and not trial.comparison.equal, trial.context()
    assert any("components.optimizer" in d for d in trial.comparison.differences), trial.context()
