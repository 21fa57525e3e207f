"""Issue 13's kill drills for a mirrored run (``CheckpointManager(local_dir, mirror="s3://...")``).

1. The process that uploads is SIGKILLed at random moments, most kills aimed
   at a background upload (a chosen time after a ``saved`` line, while the
   manager's uploader copies that generation, commits it, moves the remote
   ``latest`` and prunes the remote). After every kill: every remote
   generation and the one the remote ``latest`` names verify in full, the
   local directory shows nothing partial, and the next start restores what
   the drill predicts. Once the run finishes, the remote ``latest`` names
   its final generation, and the final state is bitwise the reference's.
2. The whole instance is lost: after chosen kills the local directory is
   deleted, and the next start (a fresh, empty directory with the same
   mirror URL) restores from the remote alone. The remote is often behind
   the deleted local generations; the resumed run redoes those updates and
   must still end bitwise equal to the uninterrupted reference.

Real worker processes (forked from a zygote that imported torch once) are
SIGKILLed for real, and upload over HTTP to a real moto S3 server on
loopback through the real obstore client; nothing is mocked. The kill
schedule is seeded: TRAINSTATE_KILL_SEED replays one (the seed is in every
failure message).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

import trainstate as ts
from objectservers import moto_server  # noqa: F401  (fixture)
from trainstate.drill import (MIRROR_OPTIONS_ENV, Comparison, DrillConfig, DrillReport, KillPlan, Timing, Zygote,
                              check_remote, compare_runs, plan_kills, run_interrupted, run_reference)
from trainstate.format.manifest import POINTER, RUN, generation_name, parse_generation_name, parse_pointer, run_to_bytes
from trainstate.storage.objects import ObjectStore

pytest.importorskip("obstore")
pytestmark = pytest.mark.slow

CONFIG = DrillConfig(total=40, every=4, width=256, batch=64)
UPLOAD_TRIALS = 3  # drill 1: three kills each
LOSS_TRIALS = 2  # drill 2: four kills each, the local directory lost after the second and the last
BASE_SEED = int(os.environ.get("TRAINSTATE_KILL_SEED") or random.SystemRandom().randrange(2**31))


@dataclass
class Trial:
    name: str
    seed: int
    kills: int
    lose_local_after: frozenset[int] = frozenset()
    plans: list[KillPlan] | None = None  # None: the drill's seeded schedule
    url: str = ""
    report: DrillReport | None = None
    comparison: Comparison | None = None
    error: str | None = None

    def context(self) -> str:
        lines = [f"{self.name}: kill schedule seed {self.seed} (TRAINSTATE_KILL_SEED={BASE_SEED}), mirror {self.url}, "
                 f"local directory lost after kills {sorted(self.lose_local_after)}"]
        if self.error:
            lines.append(f"error: {self.error}")
        for start in self.report.starts if self.report else []:
            lines.append(f"  start {start.index}: restored {start.restored}, plan {start.plan}, killed "
                         f"{start.killed_after_s}, {start.landed}, local lost: {start.lost_local}, "
                         f"exit {start.exit_code}")
        lines += [f"  problem: {p}" for p in (self.report.problems if self.report else [])]
        lines += [f"  differs: {d}" for d in (self.comparison.differences[:10] if self.comparison else [])]
        return "\n".join(lines)


@pytest.fixture(scope="module")
def bucket(moto_server) -> str:
    return moto_server.make_bucket()


@pytest.fixture(scope="module")
def zygote(moto_server) -> Zygote:
    """Workers read the mirror's storage options from the environment, which the zygote hands to each fork."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(MIRROR_OPTIONS_ENV, json.dumps(moto_server.storage_options()))
        with Zygote() as launcher:
            yield launcher


@pytest.fixture(scope="module")
def reference(zygote: Zygote, moto_server, bucket: str, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, Timing]:
    """One uninterrupted run, mirrored too (its pace, uploads included, places the kills)."""
    directory = tmp_path_factory.mktemp("kill-mirror") / "reference"
    cfg = replace(CONFIG, mirror=moto_server.url(bucket, "reference"))
    return directory, run_reference(cfg, directory, launcher=zygote)


def _run(trial: Trial, zygote: Zygote, reference: Path, timing: Timing, root: Path) -> Trial:
    try:
        trial.report = run_interrupted(replace(CONFIG, mirror=trial.url), root / trial.name, kills=trial.kills,
                                       seed=trial.seed, timing=timing, plans=trial.plans, launcher=zygote,
                                       lose_local_after=trial.lose_local_after)
        if trial.report.finished:
            trial.comparison = compare_runs(CONFIG, reference, root / trial.name)
    except Exception as exc:  # reported by the test that owns the trial, with its seed
        trial.error = f"{type(exc).__name__}: {exc}"
    if trial.error is None and trial.comparison is not None and trial.comparison.equal:
        shutil.rmtree(root / trial.name, ignore_errors=True)  # keep only evidence of failures
    return trial


@pytest.fixture(scope="module")
def trials(zygote: Zygote, reference: tuple[Path, Timing], moto_server, bucket: str,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trial]:
    ref_dir, timing = reference
    root = tmp_path_factory.mktemp("mirror-trials")
    specs = [Trial(f"upload-{i}", BASE_SEED + i, kills=3) for i in range(UPLOAD_TRIALS)]
    for i in range(LOSS_TRIALS):
        seed = BASE_SEED + 100 + i
        rng = random.Random(seed)
        # The last kill comes late, while the upload of one of the last saves is in flight: the instance is lost
        # with the remote (most likely) holding an older generation. The one after kill 2 may find it empty.
        plans = plan_kills(rng, 3, upload=True) + [KillPlan("upload", 0.9, rng.random())]
        specs.append(Trial(f"lost-{i}", seed, kills=4, lose_local_after=frozenset({2, 4}), plans=plans))
    for t in specs:
        t.url = moto_server.url(bucket, t.name)
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda t: _run(t, zygote, ref_dir, timing, root), specs))
    return {t.name: t for t in done}


def _check(trial: Trial) -> None:
    report = trial.report
    assert trial.error is None, trial.context()
    assert report.finished and not report.problems, trial.context()
    assert report.kills >= 2, trial.context()
    assert trial.comparison is not None and trial.comparison.equal, trial.context()


@pytest.mark.parametrize("index", range(UPLOAD_TRIALS))
def test_killing_the_uploader_never_exposes_a_partial_remote_generation(trials: dict[str, Trial], index: int):
    _check(trials[f"upload-{index}"])


def test_kills_land_during_uploads(trials: dict[str, Trial]):
    reports = [t.report for t in trials.values() if t.report is not None]
    kills = sum(r.kills for r in reports)
    during = sum(r.kills_during_upload for r in reports)
    places = [s.landed for r in reports for s in r.starts if s.during_upload]
    print(f"\n{len(reports)} mirrored runs (seed {BASE_SEED}): {kills} SIGKILLs, {during} while an upload was queued "
          f"or running, {sum(r.kills_during_save for r in reports)} inside a local save, "
          f"{sum(r.remote_verified_after_kills for r in reports)} remote generations verified in full after kills, "
          f"{sum(r.wall_s for r in reports):.1f} s of drill; where the upload kills landed: {places}")
    assert kills >= 2 * len(reports), f"only {kills} kills (seed {BASE_SEED})"
    # the remote check after each kill ran on real generations (early kills may find the remote still empty)
    assert sum(r.remote_verified_after_kills for r in reports) >= len(reports), f"seed {BASE_SEED}"
    assert during >= kills // 3, f"only {during} of {kills} kills caught an upload (seed {BASE_SEED})"


@pytest.mark.parametrize("index", range(LOSS_TRIALS))
def test_a_lost_instance_resumes_from_the_remote_alone_bitwise(trials: dict[str, Trial], index: int):
    trial = trials[f"lost-{index}"]
    _check(trial)  # each start after a loss restored the remote's newest generation (fresh while it had none)
    # a late kill can miss when the run finishes first (a loaded machine): then there is no loss after it
    landed = {s.index for s in trial.report.starts if s.killed_after_s is not None}
    expected = sorted(trial.lose_local_after & landed)
    assert 2 in expected and [s.index for s in trial.report.starts if s.lost_local] == expected, trial.context()


def test_lost_instances_resume_remote_generations_and_redo_what_the_remote_lacked(trials: dict[str, Trial]):
    """The subtle case: the lost directory held newer generations than the remote; the resume redid those updates
    (and still ended bitwise equal, above)."""
    losses = []  # (the newest local generation deleted, the generation the next start restored)
    for trial in (t for t in trials.values() if t.lose_local_after and t.report is not None):
        starts = trial.report.starts
        losses += [(s.lost_local, starts[s.index].restored) for s in starts if s.lost_local and s.index < len(starts)]
    redone = [parse_generation_name(local)[0] - parse_generation_name(resumed)[0]
              for local, resumed in losses if resumed and local != "nothing"]
    print(f"\nlost instances (seed {BASE_SEED}): (deleted local newest, restored from the remote) {losses}; "
          f"updates redone: {redone}")
    assert any(resumed for _, resumed in losses), f"no loss resumed from a remote generation (seed {BASE_SEED})"
    assert any(n > 0 for n in redone), f"no loss found the remote behind the local directory (seed {BASE_SEED})"


def test_negative_control_a_damaged_remote_latest_is_reported(trials: dict[str, Trial], moto_server):
    """The remote check can fail: one flipped bit (same size) in the generation the remote latest names."""
    trial = trials["upload-0"]
    assert trial.error is None, trial.context()
    remote = ObjectStore(trial.url, storage_options=moto_server.storage_options())
    assert check_remote(remote) == [], trial.context()
    latest = parse_pointer(remote.read_pointer(POINTER), POINTER).generation
    key = f"attempts/{remote._attempt(latest)}/tensors.safetensors"
    data = bytearray(remote.client.get_small(key))
    data[len(data) // 2] ^= 0x01
    remote.client.put(key, bytes(data))
    problems = check_remote(remote)
    assert any(p.startswith("remote: partial or corrupt generation visible") for p in problems), problems
    assert latest in " ".join(problems), problems


# what the drill found, replayed directly --------------------------------------------------------------------
def _small() -> ts.TrainState:
    return ts.TrainState(model=torch.nn.Linear(4, 4))


def test_a_restored_generation_the_remote_lacks_is_uploaded(moto_server, bucket, tmp_path):
    """Killed after its last local save, before that upload finished: the next manager restores it and, saving
    nothing more, must still upload it (found by drill 1: the remote latest stayed behind the finished run)."""
    url = moto_server.url(bucket, "restored-not-remote")
    with ts.CheckpointManager(tmp_path / "run") as ckpt:  # stands for the process killed before its upload
        state = _small()
        state.next_update = 1
        ckpt.save(state)
    with ts.CheckpointManager(tmp_path / "run", mirror=url, mirror_options=moto_server.storage_options(),
                              mirror_timeout_s=60) as ckpt:
        assert ckpt.restore(_small()).generation.name == generation_name(1)
    remote = ObjectStore(url, storage_options=moto_server.storage_options())
    assert parse_pointer(remote.read_pointer(POINTER), POINTER).generation == generation_name(1)


def test_a_fresh_machine_continues_a_mirror_whose_first_upload_never_committed(moto_server, bucket, tmp_path):
    """The first upload wrote the run identity, then the instance was lost before any commit: a fresh local
    directory starts over and must be able to upload (found by drill 2: every upload was refused as another run)."""
    url = moto_server.url(bucket, "identity-only")
    remote = ObjectStore(url, storage_options=moto_server.storage_options())
    remote.write_pointer(RUN, run_to_bytes("ab" * 16))
    with ts.CheckpointManager(tmp_path / "run", mirror=url, mirror_options=moto_server.storage_options(),
                              mirror_timeout_s=10) as ckpt:
        state = _small()
        assert ckpt.restore(state) is None
        state.next_update = 1
        ckpt.save(state)
    assert ckpt.status().mirror.last_error is None
    assert parse_pointer(remote.read_pointer(POINTER), POINTER).generation == generation_name(1)
