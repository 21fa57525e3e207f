"""Issue 11, item 10: messages a newcomer can act on, and a command line that behaves like one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import trainstate as ts
from trainer import build, step
from trainstate.cli import main
from trainstate.drill.driver import Start, _describe_start
from trainstate.drill.driver import KillPlan
from trainstate.storage.local import LocalStore
from test_replace_and_runs import _run_to as _run


def test_the_recovery_point_is_what_restore_would_pick(tmp_path, capsys):
    """Before: `ls` and status() said "none" when only the newest generation was damaged."""
    _run(tmp_path, 3)
    os.truncate(tmp_path / "gen-000000000003" / "tensors.safetensors", 10)
    assert main(["ls", str(tmp_path)]) == 0
    assert "recovery point: gen-000000000002 (a restart resumes here; latest names gen-000000000003" \
        in capsys.readouterr().out
    with ts.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.status().recovery_point == "gen-000000000002"
        assert ckpt.restore(build(seed=1)).generation.name == "gen-000000000002"


def test_set_aside_entries_are_listed_and_can_be_discarded_after_review(tmp_path, capsys):
    """Before: `ls` did not show .rejected-*/.abandoned-* directories and nothing could remove them."""
    _run(tmp_path, 3)
    aside = LocalStore(tmp_path).set_aside("gen-000000000001", "rejected")
    assert main(["ls", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["set_aside"] == [{"name": aside, "reason": "rejected"}]
    main(["ls", str(tmp_path)])
    assert f"trainstate discard {tmp_path} {aside}" in capsys.readouterr().out
    assert main(["discard", str(tmp_path), "gen-000000000002"]) == 1  # a live generation is never discarded
    assert "not set-aside entries" in capsys.readouterr().err
    assert main(["discard", str(tmp_path), aside]) == 0
    assert not (tmp_path / aside).exists() and (tmp_path / "gen-000000000002").is_dir()


def test_inspect_into_head_ends_quietly(tmp_path):
    """Before: `trainstate inspect DIR | head` ended with a BrokenPipeError traceback and exit 1."""
    wide = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(400)])
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(ts.TrainState(model=wide))
    inspect = subprocess.Popen([sys.executable, "-m", "trainstate", "inspect", str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    inspect.stdout.readline()
    inspect.stdout.close()  # the reader stops early, as head does
    _, err = inspect.communicate(timeout=60)
    assert inspect.returncode == 0 and b"BrokenPipe" not in err and b"Traceback" not in err, err


def test_verify_fails_on_a_directory_with_no_generations(tmp_path, capsys):
    """Before: exit 0 on an empty (or wrong) directory."""
    assert main(["verify", str(tmp_path)]) == 1
    assert "holds no generations" in capsys.readouterr().out


def test_demo_lines_say_what_happened_in_words():
    """Before: "restored nothing, SIGKILL 0.062 s after go [restore]"."""
    killed = Start(index=3, restored=None, plan=KillPlan("restore", 0.4), killed_after_s=0.062,
                   landed="during start-up or restore")
    line = _describe_start(killed)
    assert "was still starting up or restoring" in line and "aimed at its restore" in line
    assert "[restore]" not in line and "after go" not in line
    resumed = Start(index=4, restored="gen-000000000040", plan=KillPlan("save", 0.5), killed_after_s=1.2,
                    landed="in the save of update 50 (writing staged files)")
    assert "resumed from gen-000000000040" in _describe_start(resumed)
    assert "aimed inside a save" in _describe_start(resumed)


def test_plan_names_the_extra_term_of_its_bound(tmp_path, capsys):
    """Before: with a best metric the bound printed as (K+M+1)*S included one more S than it named."""
    state = build()
    with ts.CheckpointManager(tmp_path, retention=ts.Retention(keep_last=2, best=("val", "min"))) as ckpt:
        step(state)
        ckpt.save(state, metrics={"val": 1.0})
    assert main(["plan", str(tmp_path), "--total-updates", "10", "--every", "1"]) == 0
    assert "(K+M+1)*S + S (the best" in capsys.readouterr().out
