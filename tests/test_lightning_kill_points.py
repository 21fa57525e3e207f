"""Lightning: a kill at every point of a named save leaves a run that continues, bitwise (issue 48, item 4).

The drill: 24 steps, ModelCheckpoint every 3 steps with ``save_top_k=2``
(monitoring the loss) and ``save_last=True``, every start
``trainer.fit(..., ckpt_path="last")``. An uninterrupted reference traces the
fsyncs each save spans; then, for every fsync of the saves at steps 3 (the
run's first: the top-k file, then ``last.ckpt``) and 6 (``last.ckpt`` already
there), a real process is SIGKILLed just before that fsync and a fresh one
restarts. A SIGKILL loses nothing the kernel holds, so what it leaves depends
only on which of the save's steps ran; each step (a file or a link written,
renamed into place or removed) ends with an fsync, so a kill before every
fsync lands between every two steps. Everything runs in one child
interpreter (tests/lightning_child.py, ``kill_points`` mode) that imports
Lightning once and forks each start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def drill(tmp_path_factory) -> dict:
    pytest.importorskip("lightning")
    work = tmp_path_factory.mktemp("lightning-kill-points")
    (work / "plan.json").write_text(json.dumps({"work": str(work), "mode": "kill_points"}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(HERE / "lightning_child.py"), str(work / "plan.json"),
                           str(work / "results.json")], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads((work / "results.json").read_text())


def _weights(report: dict) -> dict[str, torch.Tensor]:
    return torch.load(report["out"], weights_only=True)


def _differing(reference: dict[str, torch.Tensor], report: dict) -> list[str]:
    resumed = _weights(report)
    return [k for k in reference if not torch.equal(reference[k], resumed[k])]


def _log(report: dict) -> str:
    log = Path(report["out"]).with_name(Path(report["out"]).name.rsplit("-", 1)[0] + ".log")
    return log.read_text()[-3000:] if log.exists() else "(no log)"


def _newest(generations: list[str]) -> str | None:
    return max(generations, default=None)  # gen-<12 digits>: the name orders by step


def test_the_kill_points_are_every_fsync_of_the_saves_at_steps_3_and_6(drill):
    saves = [(s["step"], s["file"]) for s in drill["trace"] if s["step"] in (3, 6)]
    assert saves == [(3, "epoch=0-step=3.ckpt"), (3, "last.ckpt"), (6, "epoch=0-step=6.ckpt"), (6, "last.ckpt")]
    first, last = drill["trace"][0]["fsyncs"][0], drill["trace"][3]["fsyncs"][1]
    assert drill["points"] == list(range(first, last + 1)) and len(drill["points"]) >= 20, drill["trace"][:4]
    assert drill["reference"]["exit"] == 0 and drill["reference"]["signal"] is None


def test_a_kill_at_every_point_of_a_named_save_continues_bitwise(drill):
    """Each restart resumes from the newest generation the kill left (the new one once committed, else the one
    before; none before the first commit) and ends equal to the uninterrupted fit: every parameter, optimizer
    moment, the loader position and the torch RNG state."""
    reference = _weights(drill["reference"])
    for n in drill["points"]:
        killed, restart = drill["runs"][f"fsync-{n}"]
        context = f"kill at fsync {n}: left {killed['generations']}, {killed['last_found']}; restart {restart}"
        assert killed["signal"] == 9, context
        assert restart["exit"] == 0, f"{context}\n{_log(restart)}"
        assert restart["global_step"] == 24, context
        assert restart["restored"] == _newest(killed["generations"]), context
        assert _differing(reference, restart) == [], context


def test_lightning_finds_a_last_checkpoint_whenever_a_generation_exists(drill):
    """The mechanism: at every kill point, Lightning's own ``ckpt_path="last"`` search finds a checkpoint exactly
    when the run holds a generation (before the first commit neither; from the commit on, both)."""
    states = {n: drill["runs"][f"fsync-{n}"][0] for n in drill["points"]}
    assert {n: bool(s["last_found"]) for n, s in states.items()} == {n: bool(s["generations"])
                                                                    for n, s in states.items()}
    assert any(not s["generations"] for s in states.values())  # some kills came before the first commit
    window = [n for n, s in states.items() if s["generations"] and "last.ckpt" not in s["last_found"]]
    assert window, "no kill landed between the first commit and last.ckpt: the drill misses the window"
    assert all(s["last_found"] == ["last.trainstate-gen-000000000003.ckpt"] for n, s in states.items()
               if n in window), {n: states[n] for n in window}


def test_the_old_order_is_a_crash_loop(drill):
    """Negative control: without the link written ahead of the commit, a kill after the first commit leaves a
    generation Lightning cannot find; every restart starts at step 0 and its first save raises ExistingRun."""
    killed, *restarts = drill["runs"]["control-old-order"]
    assert killed["signal"] == 9 and killed["generations"] == ["gen-000000000003"] and killed["last_found"] == []
    for restart in restarts:
        error = json.loads(Path(restart["out"] + ".json").read_text())
        assert restart["exit"] == 1 and restart["restored"] is None, restart
        assert error["error"] == "ExistingRun" and "this state was not restored from it" in error["message"]
        assert error["global_step"] == 3  # trained from step 0 again, refused at its first save


def test_a_fit_resumed_from_its_final_save_gets_its_name_and_its_rng_back(drill):
    """The kill lands after the final top-k generation's commit, before its entry: the restart resumes at step 24
    and trains nothing. The name the resumed state refers to (its best_k_models) is written again from what the
    generation records, so best_model_path loads; the RNG streams, which the callback applies at the first
    batch, are applied when the fit ends. Control (both put back as they were): the state names a missing file,
    and the torch RNG state is not the uninterrupted run's (the weights are)."""
    reference = _weights(drill["reference"])
    killed, restart = drill["runs"]["final-top-k"]
    assert killed["signal"] == 9 and restart["exit"] == 0 and restart["restored"] == "gen-000000000024", restart
    assert _differing(reference, restart) == []
    referenced = json.loads(Path(restart["out"] + ".json").read_text())["referenced"]
    assert referenced and all(referenced.values()), referenced
    _, control = drill["runs"]["control-final-top-k"]
    missing = [p for p, there in json.loads(Path(control["out"] + ".json").read_text())["referenced"].items()
               if not there]
    assert [os.path.basename(p) for p in missing] == ["epoch=2-step=24.ckpt"], missing
    assert _differing(reference, control) == ["rng.torch"]
