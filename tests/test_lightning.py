"""Lightning: a fit SIGKILLed at random moments and resumed with ckpt_path="last" ends bitwise equal.

Everything that needs Lightning runs in one child process
(tests/lightning_child.py), which imports Lightning once and forks a real
process per start; each start is SIGKILLed at its planned point (the end of a
seeded training step, or a seeded fsync inside a save). The kill schedule
comes from TRAINSTATE_KILL_SEED (printed in every failure) or a fresh seed.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
SEED = int(os.environ.get("TRAINSTATE_KILL_SEED") or random.SystemRandom().randrange(2**31))
STEP18 = "gen-000000000018"


def plan(work: Path) -> dict:
    rng = random.Random(SEED)

    def start(run: str, i: int, callback: bool = True, **kill) -> dict:
        return {"dir": str(work / run), "out": str(work / f"{run}-{i}.pt"), "callback": callback, **kill}

    killed = [start("killed", 0, kill_step=rng.randint(4, 8)),  # after the first save, before this step's save
              start("killed", 1, kill_fsync=rng.randint(1, 14)),  # inside the first save of the resumed start
              start("killed", 2, kill_step=rng.randint(11, 17)),
              start("killed", 3)]
    return {"work": str(work), "runs": {
        "reference": [start("reference", 0)],
        "killed": killed,
        "no_callback": [start("no_callback", 0, callback=False, kill_step=rng.randint(4, 17)),
                        start("no_callback", 1, callback=False)]}}


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory) -> tuple[dict, dict]:
    pytest.importorskip("lightning")
    work = tmp_path_factory.mktemp("lightning")
    the_plan = plan(work)
    (work / "plan.json").write_text(json.dumps(the_plan))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(HERE / "lightning_child.py"), str(work / "plan.json"),
                           str(work / "results.json")], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"seed {SEED}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return the_plan, json.loads((work / "results.json").read_text())


def _final(start: dict) -> dict[str, torch.Tensor]:
    return torch.load(start["out"], weights_only=True)


def test_importing_trainstate_imports_no_framework(lightning_runs):
    assert lightning_runs[1]["frameworks_at_import"] == []


def test_killed_fit_resumed_from_last_is_bitwise_equal(lightning_runs):
    the_plan, results = lightning_runs
    starts = results["runs"]["killed"]
    context = f"seed {SEED}: plan {the_plan['runs']['killed']}, starts {starts}"
    assert [s["signal"] for s in starts] == [9, 9, 9, None], context
    assert starts[-1]["exit"] == 0, context
    assert starts[-1]["restored"] is not None, context  # the last start really resumed
    reference = _final(the_plan["runs"]["reference"][0])
    resumed = _final(the_plan["runs"]["killed"][-1])
    assert reference.keys() == resumed.keys()
    different = [k for k in reference if not torch.equal(reference[k], resumed[k])]
    assert not different, f"{context}: differ: {different}"


def test_without_the_callback_the_resume_diverges(lightning_runs):
    """Negative control: Lightning keeps no RNG state; without TrainStateCallback the resumed fit differs."""
    the_plan, results = lightning_runs
    starts = results["runs"]["no_callback"]
    assert [s["signal"] for s in starts] == [9, None] and starts[1]["restored"], f"seed {SEED}: {starts}"
    reference = _final(the_plan["runs"]["reference"][0])
    resumed = _final(the_plan["runs"]["no_callback"][-1])
    assert any(not torch.equal(reference[k], resumed[k]) for k in reference if k.startswith("model."))
    assert torch.equal(reference["loader"], resumed["loader"])  # the data position resumed all the same


def test_entries_name_one_generation_per_step_and_pruning_removed_the_rest(lightning_runs):
    """The top-k file and last.ckpt of a step are two entries naming one generation; save_top_k=1 pruned the rest.

    A kill between ModelCheckpoint writing the new top-k file and removing the
    previous one leaves that previous one behind, as Lightning itself does;
    its generation stays pinned, so the stray entry still loads.
    """
    _, results = lightning_runs
    assert sorted(results["entries"]["reference"]) == ["epoch=2-step=18.ckpt", "last.ckpt"]
    for run in ("reference", "killed"):
        entries = results["entries"][run]
        final = {name: e for name, e in entries.items() if name in ("epoch=2-step=18.ckpt", "last.ckpt")}
        assert len(final) == 2, (run, entries)
        assert {e["generation"] for e in final.values()} == {STEP18}
        assert len({e["manifest_digest"] for e in final.values()}) == 1
        assert all(e["format"] == "trainstate-lightning-checkpoint" and e["run"] == "." for e in entries.values())
        assert {e["generation"] for e in entries.values()} <= set(results["generations"][run]), (run, entries)
        assert not [p for p in results["hidden"][run] if "trainstate" in p], results["hidden"][run]
        # One link, to the newest generation: what lets ckpt_path="last" find the run at every moment of a save.
        assert results["bridges"][run] == {f"last.trainstate-{STEP18}.ckpt": STEP18}, results["bridges"][run]


def test_unencodable_value_is_refused_with_its_key_path(lightning_runs):
    check = lightning_runs[1]["checks"]["unencodable"]
    assert check["error"] == "UnsupportedValue" and "lightning.hyper_parameters.act" in check["message"]
    assert "ok" in lightning_runs[1]["checks"]["saved_after_refusal"]


def test_a_half_written_entry_is_removed_when_the_run_is_opened(lightning_runs):
    assert lightning_runs[1]["checks"]["stale_tmp"] == [".notes.trainstate-tmp-0badc0de"]


def test_a_changed_state_at_a_published_step_becomes_a_revision(lightning_runs):
    """trainer.save_checkpoint after fit saves another state at the last step: a revision, not a refusal."""
    check = lightning_runs[1]["checks"]["changed_state_same_step"]
    assert "ok" in check, check
    revision = lightning_runs[1]["checks"]["revision"]
    assert revision["entries"] == {"a.ckpt": "gen-000000000001", "b.ckpt": "gen-000000000001-r001"}
    assert revision["loaded"] == {"fit_loop": {"x": 1}}
    assert revision["latest"] == "gen-000000000001-r001"


def test_a_pickle_is_never_loaded_and_a_missing_path_is_file_not_found(lightning_runs):
    checks = lightning_runs[1]["checks"]
    assert checks["pickle_refused"]["error"] == "CorruptGeneration"
    assert "never unpickles" in checks["pickle_refused"]["message"]
    assert "FileNotFoundError" in checks["missing"]["bases"]


def test_a_damaged_generation_falls_back_to_the_newest_that_verifies(lightning_runs):
    fallback = lightning_runs[1]["checks"]["fallback"]
    assert fallback["rejected"] == [fallback["damaged"]]
    assert fallback["restored"] != fallback["damaged"]
    assert fallback["loaded_step"] < 18
    explicit = lightning_runs[1]["checks"]["fallback_explicit"]  # a top-k entry naming the damaged one
    assert explicit["rejected"][0] == fallback["damaged"] and explicit["restored"] == fallback["restored"]


def test_remove_checkpoint_drops_entry_and_pin_but_not_the_generation(lightning_runs):
    removed = lightning_runs[1]["checks"]["removed"]
    assert removed["entry_gone"] and removed["generation_kept"]
    assert removed["pin"] not in removed["pins"]
    assert any(name.startswith("lightning-last.ckpt") for name in removed["pins"])


def test_the_run_directory_resumes_when_no_entry_names_its_generation(lightning_runs):
    """No entry names the run's generation (removed by hand): a fresh start is refused, naming the fix, and the
    run directory itself loads its recovery point. (A kill between a publication and its entries leaves a
    last.trainstate-gen-….ckpt link instead: tests/test_lightning_kill_points.py.)"""
    checks = lightning_runs[1]["checks"]
    assert checks["fresh_into_existing_run"]["error"] == "ExistingRun"
    assert "ckpt_path=" in checks["fresh_into_existing_run"]["message"]
    assert checks["load_run_directory"] == {"ok": "1"}
    assert "ok" in checks["save_after_directory_load"]


def test_an_interrupted_removal_is_finished_when_the_run_is_opened(lightning_runs):
    interrupted = lightning_runs[1]["checks"]["interrupted_removal"]
    assert interrupted == {"pinned_before": True, "pinned_after": False, "aside_left": False}


def test_resuming_from_an_older_checkpoint_forks_and_publishes_its_steps_again(lightning_runs):
    """The newer entries' pins are dropped at the first save after the load; their generations are kept aside."""
    checks = lightning_runs[1]["checks"]
    assert checks["fork_load"] == {"ok": "1"}
    assert "ok" in checks["fork_save"], checks["fork_save"]
    assert checks["fork"]["abandoned"] == ["gen-000000000002", "gen-000000000003"]
    assert checks["fork"]["bridges"] == {"last.trainstate-gen-000000000003.ckpt": "gen-000000000003"}


def test_lightning_keeps_the_resumable_loader_position_and_a_plain_loader_is_named(lightning_runs):
    """ResumableLoader has state_dict/load_state_dict, so Lightning stores it in loops.fit_loop; a plain
    DataLoader keeps no position and the callback warns about it at train start."""
    checks = lightning_runs[1]["checks"]
    state = checks["loader_state"]  # from the generation of step 15: 15 batches of 8 in epochs of 8 batches
    assert [(s["epoch"], s["cursor"], s["samples_seen"]) for s in state] == [(1, 7, 120)]
    assert any("DataLoader" in m and "ResumableLoader" in m for m in checks["plain_loader_warnings"])
