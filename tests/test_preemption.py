"""Preemption: a signal mid-update becomes a save at the next update boundary and exit status 75.

Every run here is its own process (see preempt_run.py: forked from a process
that imported torch once, then building and restoring everything itself).
The test waits until the child is in the middle of update 6 (gradients
pending, no consistent state to save), signals it, and checks what is on disk
afterwards. Resumed runs must end bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import trainstate as ts
from preempt_run import fresh_state, step
from trainer import assert_same, build, full_state, next_draws

HERE = Path(__file__).parent
TOTAL, EVERY, WAIT_AT = 12, 4, 6  # saves at 4, 8, 12; the signal arrives during update 6 (6 -> 7)


def gen(update: int) -> str:
    return f"gen-{update:012d}"


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(v) for v in tree)
    return tree


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted run: full state after every update, and the next draw of every RNG source at the end."""
    torch.set_num_threads(1)
    state = fresh_state()
    snapshots = {0: _clone(full_state(state))}
    while state.next_update < TOTAL:
        step(state)
        snapshots[state.next_update] = _clone(full_state(state))
    return snapshots, next_draws(state)


class Zygote:
    """Starts training processes by asking ``preempt_run.py zygote`` to fork (torch is imported once)."""

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, str(HERE / "preempt_run.py"), "zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        assert json.loads(self.proc.stdout.readline() or "{}").get("ready"), "the zygote did not start"

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the zygote died (exit {self.proc.poll()})"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


class Child:
    def __init__(self, zygote: Zygote, log: Path, args: list[str]):
        self.zygote, self.log = zygote, log
        self.pid = zygote.ask({"op": "start", "args": args, "log": str(log)})["pid"]
        self.code: int | None = None

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def wait_for(self, line: str, timeout: float = 60.0) -> float:
        deadline = time.monotonic() + timeout
        while line not in self.lines():
            assert time.monotonic() < deadline, f"no {line!r} within {timeout} s:\n" + "\n".join(self.lines()[-20:])
            time.sleep(0.002)
        return time.monotonic()

    def signal(self, sig: int) -> None:
        assert self.code is None  # not reaped yet, so the pid is still this child's
        os.kill(self.pid, sig)

    def wait(self, timeout: float = 60.0) -> int:
        if self.code is None:
            answer = self.zygote.ask({"op": "wait", "pid": self.pid, "timeout": timeout})
            assert not answer["timed_out"], "the child did not exit in time:\n" + "\n".join(self.lines()[-20:])
            self.code = answer["code"]
        return self.code


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def start(zygote: Zygote, run: Path, *extra: str, name: str = "child") -> Child:
    log = run.parent / f"{run.name}-{name}.log"
    return Child(zygote, log, ["--dir", str(run), "--total", str(TOTAL), "--every", str(EVERY), *extra])


def _gens(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name.startswith("gen-"))


def _latest(run: Path) -> str:
    return json.loads((run / "latest").read_text())["generation"]


def _restored(run: Path, generation: str | None = None) -> tuple[str, dict]:
    state = build(seed=999)  # other initial values: everything must come from the generation
    with ts.CheckpointManager(run) as ckpt:
        info = ckpt.restore(state, generation=generation)
    return info.generation.name, state


def _resume_to_the_end(zygote: Zygote, run: Path, reference, resumed_from: str) -> None:
    child = start(zygote, run, name="resume")
    code = child.wait()
    lines = child.lines()
    assert code == 0, "\n".join(lines)
    assert lines[0] == f"resumed {resumed_from} at {int(resumed_from[4:])}"
    assert lines[-1] == f"done at {TOTAL}"
    name, state = _restored(run)
    assert name == gen(TOTAL)
    assert_same(full_state(state), reference[0][TOTAL])
    assert next_draws(state) == reference[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_mid_update_saves_at_next_boundary_and_resumes_exactly(zygote, tmp_path, reference, sig):
    run = tmp_path / "run"
    child = start(zygote, run, "--wait-at", str(WAIT_AT))
    child.wait_for(f"update {WAIT_AT} waiting")  # mid-update: after backward, before the optimizer step
    child.signal(sig)
    code = child.wait()
    lines = child.lines()
    assert code == ts.EXIT_PREEMPTED == 75, "\n".join(lines)
    assert f"saving {gen(WAIT_AT + 1)} on preemption" in lines
    assert lines[-1] == f"preempted by {signal.Signals(sig).name} at {WAIT_AT + 1}"
    assert f"update {WAIT_AT + 1} started" not in lines  # it stopped at the first boundary after the signal
    assert _gens(run) == [gen(EVERY), gen(WAIT_AT + 1)]
    assert _latest(run) == gen(WAIT_AT + 1)
    name, state = _restored(run)
    assert name == gen(WAIT_AT + 1)
    assert_same(full_state(state), reference[0][WAIT_AT + 1])  # the update in flight was completed, then saved
    _resume_to_the_end(zygote, run, reference, gen(WAIT_AT + 1))


def test_second_signal_during_the_preemption_save_kills_at_once(zygote, tmp_path, reference):
    run = tmp_path / "run"
    child = start(zygote, run, "--wait-at", str(WAIT_AT), "--slow-save")
    child.wait_for(f"update {WAIT_AT} waiting")
    child.signal(signal.SIGTERM)
    child.wait_for(f"saving {gen(WAIT_AT + 1)}: writing tensors.safetensors")  # state.json is already staged
    child.signal(signal.SIGTERM)
    code = child.wait(timeout=20)  # the save would otherwise stall for 30 s
    lines = child.lines()
    assert code == -signal.SIGTERM, "\n".join(lines)
    assert not any(line.startswith("preempted") for line in lines)
    assert _gens(run) == [gen(EVERY)]  # no partial generation is visible
    assert _latest(run) == gen(EVERY)
    staged = [p.name for p in run.iterdir() if p.name.startswith(f".trainstate-staging-{gen(WAIT_AT + 1)}-")]
    assert len(staged) == 1  # what the kill cut short is an invisible staging directory
    with ts.CheckpointManager(run) as ckpt:
        assert ckpt.generations() == [gen(EVERY)]
    name, state = _restored(run)
    assert name == gen(EVERY)
    assert_same(full_state(state), reference[0][EVERY])
    _resume_to_the_end(zygote, run, reference, gen(EVERY))
    assert not [p for p in run.iterdir() if p.name.startswith(".trainstate-staging")]  # cleaned by the next save


def test_grace_deadline_without_a_boundary_dies_by_the_default_action(zygote, tmp_path):
    """grace_s=0.5, and update 6 does not finish for 5 s: the process must die by SIGTERM after ~0.5 s,
    without saving. (If the deadline does nothing, the update finishes at 5 s and a save follows.)"""
    run = tmp_path / "run"
    child = start(zygote, run, "--wait-at", str(WAIT_AT), "--stuck", "--grace", "0.5")
    child.wait_for(f"update {WAIT_AT} waiting")
    child.signal(signal.SIGTERM)
    sent = time.monotonic()
    code = child.wait(timeout=20)
    elapsed = time.monotonic() - sent
    lines = child.lines()
    assert code == -signal.SIGTERM, f"exit {code} after {elapsed:.1f} s:\n" + "\n".join(lines)
    assert f"update {WAIT_AT} resumed" not in lines
    assert not any(line.startswith("saving") for line in lines)
    assert _gens(run) == [gen(EVERY)] and _latest(run) == gen(EVERY)


def test_without_the_handler_sigterm_kills_with_no_preemption_save(zygote, tmp_path, reference):
    """Negative control: the same run and signal, no PreemptionHandler."""
    run = tmp_path / "run"
    child = start(zygote, run, "--wait-at", str(WAIT_AT), "--handler", "no")
    child.wait_for(f"update {WAIT_AT} waiting")
    child.signal(signal.SIGTERM)
    code = child.wait(timeout=20)
    lines = child.lines()
    assert code == -signal.SIGTERM, "\n".join(lines)
    assert not any(line.startswith("saving") for line in lines)
    assert _gens(run) == [gen(EVERY)]
    assert _latest(run) == gen(EVERY)  # older than the preempted run's gen 7: the work since update 4 is lost
    name, state = _restored(run)
    assert_same(full_state(state), reference[0][EVERY])


# in-process: the handler's own contract ---------------------------------------------------------------
def test_handlers_are_restored_on_exit():
    got = []

    def custom(signum, frame):
        got.append(signum)

    previous_term = signal.signal(signal.SIGTERM, custom)
    previous_usr1 = signal.getsignal(signal.SIGUSR1)
    try:
        with ts.PreemptionHandler() as preempt:
            assert signal.getsignal(signal.SIGTERM) not in (custom, previous_term)
            assert not preempt.requested and preempt.received is None
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.01)
            assert preempt.requested and preempt.received == signal.SIGUSR1
            assert preempt.received_at is not None
        assert signal.getsignal(signal.SIGTERM) is custom
        assert signal.getsignal(signal.SIGUSR1) == previous_usr1

        with pytest.raises(SystemExit) as exited:
            with ts.PreemptionHandler(signals=(signal.SIGTERM,)) as preempt:
                assert signal.getsignal(signal.SIGUSR1) == previous_usr1  # only the signals asked for
                preempt.exit()
        assert exited.value.code == ts.EXIT_PREEMPTED == 75
        assert signal.getsignal(signal.SIGTERM) is custom

        with ts.PreemptionHandler(grace_s=0.2) as preempt:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
            assert preempt.requested
        time.sleep(0.4)  # past the grace period: leaving the block cancelled the deadline
        assert got == []
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert got == [signal.SIGTERM]  # the previous handler is back in charge
    finally:
        signal.signal(signal.SIGTERM, previous_term)


def test_invalid_grace():
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="grace_s"):
            ts.PreemptionHandler(grace_s=bad)
