"""Issue 16: ``trainstate supervise``, a bounded restart loop, judged with real child processes.

Children that train (tests/supervised_child.py) import torch and cost seconds each, so they run only where
the scenario needs real checkpoints being written: crash twice then finish, a ContractMismatch, preemption
restarts. The other scenarios use a finished run directory (copied) and children of a few lines of Python.
The supervisor runs in this process (``main([...])``) unless a test signals or kills it; backoffs are short.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import trainstate as ts
from trainstate.cli.main import main
from trainstate.lifecycle import supervise as policy

HERE = Path(__file__).resolve().parent
CHILD = [sys.executable, str(HERE / "supervised_child.py")]
WAIT_LIMIT_S = 60.0


def gen(update: int) -> str:
    return f"gen-{update:012d}"


def records(run: Path, event: str | None = None) -> list[dict]:
    out = [json.loads(line) for line in (run / "supervise.jsonl").read_text().splitlines()]
    return [r for r in out if event is None or r["event"] == event]


def supervise(run: Path, command: list[str], *extra: str, backoff: str = "0.2,0.4") -> int:
    return main(["supervise", "--run-dir", str(run), "--backoff", backoff, *extra, "--", *command])


def child(run: Path, markers: Path, *extra: str) -> list[str]:
    markers.mkdir(exist_ok=True)
    return [*CHILD, "--dir", str(run), "--markers", str(markers), *extra]


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def files_of(run: Path) -> dict[str, bytes]:
    """Every generation's files and the pointer, by relative path (what a supervisor must never touch)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and (p.name == "latest" or p.parent.name.startswith("gen-"))}


def _time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A child that crashes twice (SIGKILL at update 3, an exception at 7) and then finishes: the acceptance run."""
    base = tmp_path_factory.mktemp("finished")
    run = base / "run"
    assert supervise(run, child(run, base / "markers", "--crash-once-at", "3:kill", "--crash-once-at", "7:raise")) == 0
    return run


def copy(finished: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "supervise.jsonl").unlink()
    return run


# ---------------------------------------------------------------------------------------------------------------
def test_crashes_twice_then_finishes(finished):
    starts, ends = records(finished, "start"), records(finished, "end")
    assert len(starts) == 3 and [e["classification"] for e in ends] == ["transient", "transient", "done"]
    assert ends[0]["signal"] == "SIGKILL" and ends[1]["exit_code"] == 1 and ends[2]["exit_code"] == 0
    assert [e["wait_s"] for e in ends] == [0.2, 0.4, None]
    for end, next_start in zip(ends, starts[1:]):  # the waits really happened (a lower bound, not a speed)
        assert (_time(next_start["time"]) - _time(end["time"])).total_seconds() >= end["wait_s"]
    # the log names the generation each start resumed from; the child says it resumed from exactly that one
    assert [s["resumed_from"] for s in starts] == [None, gen(2), gen(6)]
    told = [json.loads(line) for line in (finished.parent / "markers" / "attempts.jsonl").read_text().splitlines()]
    assert [t["resumed"] for t in told] == [s["resumed_from"] for s in starts]
    assert [t["attempt"] for t in told] == ["1", "2", "3"]
    assert records(finished, "exit")[0]["exit_code"] == 0
    status = ts.done(str(finished), config={"lr": 0.1, "total": 10})
    assert status and status.record.generation == gen(10) and status.record.tokens_seen == 80


def test_the_crashed_run_ends_bitwise_where_an_uninterrupted_one_does(finished, tmp_path):
    import supervised_child

    straight = tmp_path / "straight"
    (tmp_path / "m").mkdir()
    assert supervised_child.main(["--dir", str(straight), "--markers", str(tmp_path / "m")]) == 0
    report = ts.diff(str(finished / gen(10)), str(straight / gen(10)))
    assert report.identical, [c.summary for c in report.categories]


def test_a_finished_run_restarted_exits_at_once_and_stays_done(finished, tmp_path):
    run = copy(finished, tmp_path)
    before = files_of(run)
    assert supervise(run, child(run, tmp_path / "m")) == 0
    told = json.loads((tmp_path / "m" / "attempts.jsonl").read_text())
    assert told == {"attempt": "1", "resumed": gen(10), "done": True}  # RestoreInfo.done told the script
    assert files_of(run) == before


def test_contract_mismatch_is_permanent(finished, tmp_path):
    run = copy(finished, tmp_path)
    assert supervise(run, child(run, tmp_path / "m", "--lr", "0.2"), backoff="30") == ts.EXIT_PERMANENT
    (end,) = records(run, "end")
    assert len(records(run, "start")) == 1
    assert end["exit_code"] == 78 and end["classification"] == "permanent" and end["wait_s"] is None


def test_a_child_that_always_crashes_uses_max_starts_and_keeps_every_generation(finished, tmp_path):
    run = copy(finished, tmp_path)
    before = files_of(run)
    code = ("import os, signal, sys\n"
            "if os.environ['TRAINSTATE_SUPERVISE_ATTEMPT'] == '2': os.kill(os.getpid(), signal.SIGKILL)\n"
            "sys.exit(3)")
    assert supervise(run, py(code), "--max-starts", "3") == 1
    ends = records(run, "end")
    assert [(e["exit_code"], e["signal"]) for e in ends] == [(3, None), (None, "SIGKILL"), (3, None)]
    assert [e["classification"] for e in ends] == ["transient"] * 3
    assert [e["wait_s"] for e in ends] == [0.2, 0.4, None]
    assert [s["resumed_from"] for s in records(run, "start")] == [gen(10)] * 3
    assert files_of(run) == before and len([p for p in run.iterdir() if p.name.startswith("gen-")]) == 5


@pytest.mark.parametrize("damage", ["missing", "other config", "tampered digest", "trained past"])
def test_exit_0_without_a_valid_done_record_is_a_failure(finished, tmp_path, damage):
    run = copy(finished, tmp_path)
    extra = ["--max-starts", "2"]
    if damage == "missing":
        (run / "DONE").unlink()
    elif damage == "other config":
        (tmp_path / "cfg.json").write_text(json.dumps({"lr": 0.2, "total": 10}))
        extra += ["--config", str(tmp_path / "cfg.json")]
    elif damage == "tampered digest":
        record = json.loads((run / "DONE").read_text())
        record["manifest_digest"] = "0" * len(record["manifest_digest"])
        (run / "DONE").write_text(json.dumps(record))
    else:  # trained on after finishing: the DONE record no longer names what a restart resumes from
        import supervised_child

        state = supervised_child.build(0.1, 10)
        with ts.CheckpointManager(run) as ckpt:
            ckpt.restore(state)
            supervised_child.step(state)
            ckpt.save(state)
    assert supervise(run, py("pass"), *extra) == 1
    ends = records(run, "end")
    assert [e["classification"] for e in ends] == ["incomplete", "incomplete"]
    assert ("no DONE record" if damage == "missing" else "stale") in ends[0]["detail"]


def test_exit_0_with_a_valid_done_record_is_done(finished, tmp_path):
    """Negative control for the test above: the same child, the same copy, the record intact."""
    run = copy(finished, tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps({"lr": 0.1, "total": 10}))
    assert supervise(run, py("pass"), "--config", str(tmp_path / "cfg.json")) == 0
    assert [e["classification"] for e in records(run, "end")] == ["done"]


def test_preemptions_restart_at_once_and_are_counted_apart(tmp_path):
    run = tmp_path / "run"
    command = child(run, tmp_path / "m", "--preempt-once-at", "3")
    assert supervise(run, command, "--max-starts", "1", backoff="30") == 0  # a failure would have ended it
    ends = records(run, "end")
    assert [e["classification"] for e in ends] == ["preempted", "done"]
    assert [e["exit_code"] for e in ends] == [ts.EXIT_PREEMPTED, 0]
    assert [e["wait_s"] for e in ends] == [0.0, None]
    assert [s["resumed_from"] for s in records(run, "start")] == [None, gen(3)]  # its preemption save
    assert records(run, "exit")[0]["preemptions"] == 1 and records(run, "exit")[0]["failures"] == 0


def test_preemptions_have_their_own_bound(tmp_path):
    run = tmp_path / "run"
    assert supervise(run, py("raise SystemExit(75)"), "--max-preemptions", "2") == ts.EXIT_PREEMPTED
    assert len(records(run, "start")) == 3


def test_preflight_failure_is_permanent_and_starts_nothing(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "started"
    assert supervise(run, py(f"open({str(marker)!r}, 'w')"), "--min-free", "1P") == ts.EXIT_PERMANENT
    assert not marker.exists() and not records(run, "start")
    assert "disk preflight" in records(run, "refused")[0]["detail"]


def test_no_restart_when_the_generations_no_longer_validate(finished, tmp_path):
    run = copy(finished, tmp_path)
    code = ("import glob, sys\n"
            f"for f in glob.glob({str(run)!r} + '/gen-*/tensors*'): open(f, 'r+b').truncate(1)\n"
            "sys.exit(1)")
    assert supervise(run, py(code)) == ts.EXIT_PERMANENT
    assert len(records(run, "start")) == 1
    assert "none validates" in records(run, "refused")[0]["detail"]
    assert len([p for p in run.iterdir() if p.name.startswith("gen-")]) == 5  # evidence kept


def test_one_supervisor_per_run(tmp_path):
    import fcntl

    run, marker = tmp_path / "run", tmp_path / "started"
    run.mkdir()
    fd = os.open(run / ".trainstate.supervise.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a live supervisor holds it
        assert supervise(run, py(f"open({str(marker)!r}, 'w')")) == ts.EXIT_PERMANENT
    finally:
        os.close(fd)
    assert not marker.exists()
    assert supervise(run, py(f"open({str(marker)!r}, 'w')"), "--max-starts", "1") == 1  # control: free again
    assert marker.exists()


def test_a_command_that_cannot_start_is_permanent(tmp_path):
    assert supervise(tmp_path / "run", [str(tmp_path / "no-such-program")]) == ts.EXIT_PERMANENT


# operator stops ---------------------------------------------------------------------------------------------------
SLEEPER = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
def on(signum, frame):
    out.with_name('got').write_text(str(signum))
    sys.exit(75)   # what a PreemptionHandler does after its save
signal.signal(signal.SIGTERM, on if sys.argv[2] != 'ignore' else signal.SIG_IGN)
signal.signal(signal.SIGINT, on)
out.write_text(str(os.getpid()))
if sys.argv[3:]:
    Path(sys.argv[3]).touch()   # the operator creates the stop file
time.sleep(60)
"""


def sleeper(tmp_path: Path, mode: str = "handle", stop_file: Path | None = None) -> list[str]:
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    return [sys.executable, str(tmp_path / "sleeper.py"), str(tmp_path / "ready"), mode,
            *([str(stop_file)] if stop_file else [])]


def wait_for(path: Path) -> str:
    deadline = time.monotonic() + WAIT_LIMIT_S
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return path.read_text()


def test_the_stop_file_stops_the_child_and_nothing_restarts(tmp_path):
    run, stop = tmp_path / "run", tmp_path / "STOP"
    assert supervise(run, sleeper(tmp_path, stop_file=stop), "--stop-file", str(stop)) == 128 + signal.SIGTERM
    assert (tmp_path / "got").read_text() == str(int(signal.SIGTERM))
    (end,) = records(run, "end")
    assert end["classification"] == "stopped" and end["exit_code"] == 75 and end["decision"] == "stop"
    # while the stop file exists, a new supervisor starts nothing
    assert supervise(run, sleeper(tmp_path), "--stop-file", str(stop)) == 128 + signal.SIGTERM
    assert len(records(run, "start")) == 1


WATCHER = """
import pathlib, sys, time
log, stop = map(pathlib.Path, sys.argv[1:])
deadline = time.monotonic() + 60
while '"event": "end"' not in (log.read_text() if log.exists() else '') and time.monotonic() < deadline:
    time.sleep(0.02)
stop.touch()   # the operator, once the supervisor has logged the failure and is waiting
"""


def test_the_stop_file_during_a_backoff_prevents_the_next_start(tmp_path):
    run, stop = tmp_path / "run", tmp_path / "STOP"
    (tmp_path / "watcher.py").write_text(WATCHER)
    code = (f"import subprocess, sys\n"
            f"subprocess.Popen([sys.executable, {str(tmp_path / 'watcher.py')!r}, {str(run / 'supervise.jsonl')!r}, "
            f"{str(stop)!r}], start_new_session=True)\n"
            "raise SystemExit(1)")
    assert supervise(run, py(code), "--stop-file", str(stop),
                     backoff="600") == 128 + signal.SIGTERM  # a 600 s wait, cut short by the stop file
    assert [e["wait_s"] for e in records(run, "end")] == [600.0]
    assert len(records(run, "start")) == 1 and records(run, "refused")[0]["classification"] == "stopped"


def test_a_child_that_ignores_the_stop_is_killed_after_the_grace(tmp_path):
    run, stop = tmp_path / "run", tmp_path / "STOP"
    command = sleeper(tmp_path, "ignore", stop_file=stop)
    assert supervise(run, command, "--stop-file", str(stop), "--stop-grace", "0.5") == 128 + signal.SIGTERM
    (end,) = records(run, "end")
    assert end["signal"] == "SIGKILL" and end["classification"] == "stopped"


def _supervisor_process(run: Path, command: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainstate", "supervise", "--run-dir", str(run),
                             "--backoff", "0.2", "--", *command], cwd=HERE.parent)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_supervisor_reaches_the_child_and_nothing_restarts(tmp_path, sig):
    run = tmp_path / "run"
    supervisor = _supervisor_process(run, sleeper(tmp_path))
    try:
        wait_for(tmp_path / "ready")
        supervisor.send_signal(sig)
        assert supervisor.wait(WAIT_LIMIT_S) == 128 + sig
    finally:
        supervisor.kill()
    assert (tmp_path / "got").read_text() == str(int(sig))  # forwarded once, as the same signal
    assert len(records(run, "start")) == 1 and records(run, "end")[0]["classification"] == "stopped"
    assert records(run, "exit")[0]["exit_code"] == 128 + sig


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_child_does_not_outlive_a_killed_supervisor(tmp_path):
    run = tmp_path / "run"
    supervisor = _supervisor_process(run, sleeper(tmp_path))
    try:
        wait_for(tmp_path / "ready")
        supervisor.kill()
        supervisor.wait(WAIT_LIMIT_S)
        assert wait_for(tmp_path / "got") == str(int(signal.SIGTERM))
    finally:
        supervisor.kill()
    summary = policy.summary(policy.sessions(records(run))[-1])
    assert summary["running_or_killed"] and summary["exit_code"] is None


# --status, and the pure policy --------------------------------------------------------------------------------
def test_status_summarises_the_log(finished, capsys):
    assert main(["supervise", "--status", str(finished)]) == 0
    text = capsys.readouterr().out
    assert "3 start(s): 2 failure(s), 0 preemption(s)" in text
    assert f"resumed from {gen(6)}" in text and "killed by SIGKILL" in text and "DONE: done" in text
    assert main(["supervise", "--status", str(finished), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sessions"][-1]["starts"] == 3 and report["done"]["status"] == "done"


def test_policy_decisions():
    p = policy.Policy(max_starts=3, backoff=(1.0, 2.0), max_preemptions=1)
    counts = policy.Counts()
    transient = policy.Outcome("transient", "exit 1")
    assert policy.decide(transient, counts, p).wait_s == 1.0
    assert policy.decide(policy.Outcome("preempted", ""), counts, p).wait_s == 0.0
    assert policy.decide(transient, counts, p).wait_s == 2.0  # the preemption did not count as a failure
    stop = policy.decide(transient, counts, p)
    assert not stop.restart and stop.exit_code == 1
    assert policy.decide(policy.Outcome("preempted", ""), counts, p).exit_code == 75  # its own bound
    assert policy.Policy(backoff=(5.0,)).wait_after(4) == 5.0  # the last wait repeats
    assert policy.classify(0, stopped_by=None).kind == "incomplete"
    assert policy.classify(-9, stopped_by=None).detail == "killed by SIGKILL"
    assert policy.classify(78, stopped_by=None).kind == "permanent"
    assert policy.classify(1, stopped_by=signal.SIGTERM).kind == "stopped"
    assert policy.start_problem(first=True, recovery_point=None, full_generations=3, seen_generation=True) == ""
    assert policy.start_problem(first=False, recovery_point=None, full_generations=0, seen_generation=False) == ""
    assert "gone" in policy.start_problem(first=False, recovery_point=None, full_generations=0, seen_generation=True)
    assert policy.parse_size("20G") == 20 << 30 and policy.parse_backoff("10,20,40") == (10.0, 20.0, 40.0)
    for bad in ("", "1,-2", "x", "nan"):
        with pytest.raises(ts.InvalidArgument):
            policy.parse_backoff(bad)
