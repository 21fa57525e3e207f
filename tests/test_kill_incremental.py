"""Kill drill on an incremental run (issue 32): SIGKILLs inside saves and prunes, bitwise at the end.

The drill's run with ``full_every=3`` and a frozen component: most saves link
the frozen component's part file from their parent, every third links
nothing, and ``keep_last=3`` prunes generations whose files later ones still
name. Workers are SIGKILLed at random moments (most aimed inside a save,
which ends with its prune); after every kill every generation the directory
names verifies in full (``check_visible``) and the next start restores the
one the drill predicts. The finished run equals the uninterrupted reference
bitwise. Seeded like tests/test_kill.py: TRAINSTATE_KILL_SEED replays one.
"""

from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trainstate.drill import DrillConfig, Zygote, compare_runs, run_interrupted, run_reference

pytestmark = pytest.mark.slow

CONFIG = DrillConfig(total=36, every=3, width=128, batch=32, full_every=3)
TRIALS = 6
BASE_SEED = int(os.environ.get("TRAINSTATE_KILL_SEED") or random.SystemRandom().randrange(2**31))


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("kill-incremental")
    with Zygote() as zygote:
        timing = run_reference(CONFIG, root / "reference", launcher=zygote)

        def one(i: int):
            directory = root / f"trial-{i}"
            report = run_interrupted(CONFIG, directory, kills=2 + i % 2, seed=BASE_SEED + i, timing=timing,
                                     launcher=zygote)
            comparison = compare_runs(CONFIG, root / "reference", directory) if report.finished else None
            return report, comparison

        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(one, range(TRIALS)))
    return root, results


def _shares(run: Path) -> list[bool]:
    return ["shares" in json.loads((g / "manifest.json").read_bytes()) for g in sorted(run.glob("gen-*"))]


def test_the_reference_links_files_and_writes_a_whole_generation_every_third(drill):
    root, _ = drill
    linking = _shares(root / "reference")
    assert any(linking) and not all(linking), linking  # (keep_last=3: the last three generations)


def test_every_trial_resumes_bitwise_with_nothing_partial_visible(drill):
    _, results = drill
    kills = inside = verified = 0
    for i, (report, comparison) in enumerate(results):
        context = f"trial {i}, seed {BASE_SEED + i} (TRAINSTATE_KILL_SEED={BASE_SEED}): {report.problems}"
        assert report.finished and not report.problems, context
        assert comparison is not None and comparison.equal, (context, comparison and comparison.differences[:5])
        kills += report.kills
        inside += report.kills_during_save
        verified += report.verified_after_kills
    print(f"\n{TRIALS} incremental trials: {kills} SIGKILLs, {inside} inside a save, {verified} generations "
          f"verified in full after kills (seed {BASE_SEED})")
    assert kills >= 2 * TRIALS and inside >= TRIALS // 2 and verified >= TRIALS
