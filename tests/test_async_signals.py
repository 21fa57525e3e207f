"""Background saves survive a real Ctrl-C and a fork.

1. A SIGINT at any point where CPython can deliver one in
   ``save(blocking=False)``, from before it claims an in-flight slot until the
   writer owns the job (the hand-off itself included), leaves nothing behind: the slot is free again, the state
   descends from what was actually published (an abandoned save is not its
   parent), and the next ``save``, ``wait()`` and ``close()`` complete. Swept
   twice: with the writer idle (the hand-off starts it) and with another save
   in flight (the hand-off queues behind it).
2. The same for a blocking save (everywhere in the manager's own code and at
   every storage operation of the publication), for ``wait()``, for a
   handle's ``wait()`` and for ``close()``. An interrupted ``close()`` keeps
   the directory locked while a save of this process is still being written,
   and a second ``close()`` finishes and releases it.
3. A process that forks while a background save is in flight: the child
   starts with nothing in flight and none of the parent's failures; its
   saves, ``wait()`` and normal interpreter exit finish (the parent's handle
   says it is the parent's); the parent's save still publishes and its own
   failure is still raised, once, in the parent; no process is left behind.

The signals are real (``signal.raise_signal`` or ``os.kill``, handled by
Python's own SIGINT handler); only their placement is controlled, by profile
and trace hooks in the child process (see :class:`Interrupt`). Every process
runs under a watchdog that prints every thread's stack and exits, and the
whole under a subprocess timeout, so a regression fails instead of hanging.

Run as a script (``python tests/test_async_signals.py DIR``) this file is the
child: a zygote that imports once, then forks one process per scenario.
"""

from __future__ import annotations

import concurrent.futures
import errno
import faulthandler
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch

import trainstate as ts
from trainstate import asyncsave, manager, publish
from trainstate.state import staging
from trainstate.format.manifest import generation_name
from trainstate.storage.local import LocalStore, PosixOps
from trainstate.storage.verify import verify_generation

TESTS = Path(__file__).resolve().parent
WATCHDOG_S = 20  # per placement, in the child: far beyond any save here
_STAGING_RE = re.compile(r"\.trainstate-staging-(gen-\d{12}(?:-weights)?)-[0-9a-f]{16}")


# the child's training state -------------------------------------------------------
def make_state(seed: int = 0) -> ts.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    return ts.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def advance(state: ts.TrainState) -> str:
    """One real update; returns the name its save will have."""
    model, optimizer = state["model"], state["optimizer"]
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(2, 8)).square().sum().backward()
    optimizer.step()
    state.next_update += 1
    return generation_name(state.next_update)


def weights(state: ts.TrainState) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state["model"].state_dict().items()}


def check_directory(root: Path, expected: dict[str, torch.Tensor], name: str) -> None:
    """Every generation verifies in full, nothing is left over, and a fresh state restores ``name``."""
    store = LocalStore(root, create=False)
    for generation in store.generations():
        verify_generation(store, generation, content=True)
    assert store.leftovers() == [], store.leftovers()
    fresh = make_state(seed=99)
    with ts.CheckpointManager(root) as ckpt:
        info = ckpt.restore(fresh)
    assert info is not None and info.generation.name == name, (info, name)
    got = fresh["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items()), "restored weights differ"


class Ops(PosixOps):
    """Real operations, minus the fsyncs (a sweep publishes hundreds of generations). ``hold()``
    stops the writer at its next staging directory until the event it returns is set."""

    def __init__(self) -> None:
        self.gate: threading.Event | None = None

    def hold(self) -> threading.Event:
        self.gate = threading.Event()
        return self.gate

    def mkdir(self, path: Path) -> None:
        gate = self.gate
        if gate is not None and _STAGING_RE.fullmatch(Path(path).name):
            self.gate = None
            if not gate.wait(60):
                raise TimeoutError("the test never released the held save")
        super().mkdir(path)

    def fsync(self, fd: int) -> None:
        pass

    def fsync_dir(self, path: Path) -> None:
        pass


def open_manager(root: Path, ops: PosixOps, **kwargs) -> ts.CheckpointManager:
    return ts.CheckpointManager(root, store=LocalStore(root, "blake3", ops=ops), **kwargs).__enter__()


# placement ----------------------------------------------------------------------------
def _source(module) -> str:
    return os.path.realpath(module.__file__)


# Whose code a sweep interrupts: the hand-off's own code and its staging copy, the part of publish that changes
# the state before the hand-off, and the standard library's synchronisation code, should any run on the way.
OWN = {_source(asyncsave): None, _source(staging): None, _source(manager): None,
       _source(publish): {"prepare", "roll_back"}}
STDLIB = (os.path.realpath(threading.__file__), os.path.dirname(os.path.realpath(concurrent.futures.__file__)))


class Interrupt:
    """Delivers a real SIGINT at the ``at``-th point where CPython can deliver one, in watched code.

    CPython runs a Python signal handler (here: raising KeyboardInterrupt) only where its eval loop
    checks for pending work: on entering a function, when a call returns (the exception is then the
    call's), and on a loop's backward jump; never, say, between the last statement of a ``with``
    block and its ``__exit__``. Those are the placements, in every watched frame on this thread: the
    entry of a watched function or of any function a watched one calls (that call raises at once),
    the return of every call a watched frame makes, Python or C (profile ``return`` and ``c_return``
    events, so the exception belongs to the call, as a real one would), and every backward jump
    taken (an opcode tracer). ``where`` says where it landed (None: the call ran out of placements
    first, so every one has been tried).
    """

    def __init__(self, at: int, *, stdlib: bool = True):
        self.at, self.count, self.where, self.stdlib = at, 0, None, stdlib
        self._watched: dict[str, bool | set] = {}
        self._active: set = set()  # watched frames entered since __enter__
        self._previous: dict = {}  # watched frame -> offset of the instruction it executed last

    def __enter__(self) -> Interrupt:
        sys.setprofile(self._profile)
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)
        sys.setprofile(None)
        self._active.clear()
        self._previous.clear()

    def _watch(self, code) -> bool:
        filename = code.co_filename
        scope = self._watched.get(filename)
        if scope is None:
            path = os.path.realpath(filename)
            if path in OWN:
                scope = OWN[path] if OWN[path] is not None else True
            else:
                scope = self.stdlib and (path == STDLIB[0] or path.startswith(STDLIB[1] + os.sep))
            self._watched[filename] = scope
        return scope if isinstance(scope, bool) else code.co_name in scope

    def _point(self, frame, what: str) -> None:
        self.count += 1
        if self.count == self.at:
            self.where = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}:{frame.f_lineno} {what}"
            signal.raise_signal(signal.SIGINT)  # Python's handler raises KeyboardInterrupt, here

    def _profile(self, frame, event, arg):
        if event == "call":
            watched = self._watch(frame.f_code)
            if watched:
                self._active.add(frame)
            if watched or frame.f_back in self._active:
                self._point(frame, "entry")
        elif event == "return" and frame.f_back in self._active:
            self._point(frame.f_back, f"after {frame.f_code.co_name}() returned")
        elif event == "c_return" and frame in self._active:
            self._point(frame, f"after {getattr(arg, '__qualname__', arg)}() returned")

    def _trace(self, frame, event, arg):
        if not self._watch(frame.f_code):
            return None
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        return self._opcode

    def _opcode(self, frame, event, arg):
        if event == "opcode":
            here, previous = frame.f_lasti, self._previous.get(frame)
            self._previous[frame] = here
            if previous is not None and here < previous:  # a backward jump was taken
                self._point(frame, "loop")
        return self._opcode


def interrupted(call, at: int, *, stdlib: bool = True) -> str | None:
    """Run ``call`` with a SIGINT at its ``at``-th placement; where it landed, or None (no such placement)."""
    with Interrupt(at, stdlib=stdlib) as tracer:
        try:
            call()
        except KeyboardInterrupt:
            assert tracer.where is not None, "a KeyboardInterrupt nobody sent"
            print(f"placement {at} in {call}: {tracer.where}", file=sys.stderr, flush=True)  # names a failure
            return tracer.where
    assert tracer.where is None, f"the SIGINT at {tracer.where} was swallowed"
    return None


def watchdog() -> None:
    """(Re)arm: a child stuck for WATCHDOG_S prints every thread's stack and exits 1."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)


# scenario 1: background saves ------------------------------------------------------
def scenario_background(root: Path) -> dict:
    """Sweep a SIGINT over every placement in a background save, idle writer, then busy writer."""
    result = {}
    for busy in (False, True):
        run = root / ("busy" if busy else "idle")
        ops, state = Ops(), make_state()
        ckpt = open_manager(run, ops, max_in_flight=2 if busy else 1)
        advance(state)
        ckpt.save(state)  # a latest to fall back to
        outcomes, landed, at = Counter(), set(), 1
        while True:
            watchdog()
            gate, before = None, ckpt.latest()
            if busy:  # another save in flight, held at its staging directory: the hand-off queues behind it
                before = advance(state)
                gate = ops.hold()
                ckpt.save(state, blocking=False)
            name = advance(state)
            where = interrupted(lambda: ckpt.save(state, blocking=False), at)
            if gate is not None:
                gate.set()
            ckpt.wait()  # completes, and raises nothing: no save failed
            if where is None:
                break
            landed.add(where.split(" ")[0].rsplit(":", 1)[0])
            published = ckpt.latest() == name
            outcomes["published" if published else "abandoned"] += 1
            assert published or ckpt.latest() == before  # (busy: the save in flight published)
            # an abandoned save is nobody's parent, and the cadence does not count it
            assert state.parent == ckpt.latest(), (where, state.parent, ckpt.latest())
            assert ckpt._last_full_update == int(ckpt.latest()[4:]), (where, ckpt._last_full_update)
            assert ckpt.status().in_flight == 0
            # every slot is free: this returns at once (a leaked slot would block it forever), and the
            # update is published (again: a no-op if the interrupted save had published it)
            assert ckpt.save(state, blocking=False).wait().name == name
            ckpt.close()  # and close() completes
            ckpt.__enter__()
            at += 1
        expected = weights(state)
        ckpt.close()
        check_directory(run, expected, ckpt.latest())
        result["busy" if busy else "idle"] = {"placements": at - 1, **outcomes, "landed": sorted(landed)}
    return result


# scenario 2: blocking saves, wait(), a handle's wait(), close() ---------------------------
class InterruptingOps(Ops):
    """Delivers a real SIGINT at the ``at``-th storage operation (on a helper thread, Python runs the
    handler on the main thread at its next check)."""

    at: int | None = None
    calls = 0
    where: str | None = None


def _interrupting(name: str):
    def op(self, *args):
        if threading.current_thread() is not threading.main_thread():
            # The deletion of a pruned generation runs on the store's own thread after the save returned: it is
            # not part of the save, and a real Ctrl-C is only ever raised in the main thread.
            return getattr(Ops, name)(self, *args)
        self.calls += 1
        if self.calls == self.at:
            self.where = name
            signal.raise_signal(signal.SIGINT)
        return getattr(Ops, name)(self, *args)
    return op


for _name in [n for n in vars(PosixOps) if not n.startswith("_")]:
    setattr(InterruptingOps, _name, _interrupting(_name))


def _check_blocking_outcome(ckpt, state: ts.TrainState, name: str, where: str, outcomes: Counter) -> None:
    """An interrupted blocking save either published or not; if not, it is nobody's parent.

    One interrupted after its pointer moved is rolled back all the same by ``_publish_or_roll_back``
    (which cannot tell): counted as ``published_rolled_back``, not failed here.
    """
    if ckpt.latest() != name:
        outcomes["abandoned"] += 1
        assert state.parent == ckpt.latest(), (where, state.parent, ckpt.latest())
        assert ckpt._last_full_update == int(ckpt.latest()[4:]), (where, ckpt._last_full_update)
    elif state.parent == name:
        outcomes["published"] += 1
    else:
        outcomes["published_rolled_back"] += 1
        outcomes.setdefault("rolled_back_at", []).append(where)


def scenario_blocking(root: Path) -> dict:
    result = {}
    # a: every placement in the manager's own code in a blocking save
    ops, state = Ops(), make_state()
    ckpt = open_manager(root / "code", ops)
    advance(state)
    ckpt.save(state)  # a latest to fall back to
    at, outcomes = 1, Counter()
    while True:
        watchdog()
        name = advance(state)
        where = interrupted(lambda: ckpt.save(state), at, stdlib=False)
        if where is None:
            break
        _check_blocking_outcome(ckpt, state, name, where, outcomes)
        assert ckpt.save(state).name == name  # the next blocking save works (the same update: again, or a no-op)
        at += 1
    expected = weights(state)
    ckpt.close()
    check_directory(root / "code", expected, ckpt.latest())
    result["blocking_code"] = {"placements": at - 1, **outcomes}

    # b: every storage operation of a blocking save
    ops, state = InterruptingOps(), make_state()
    ckpt = open_manager(root / "storage", ops)
    advance(state)
    ckpt.save(state)  # a latest to fall back to
    at, outcomes = 1, Counter()
    while True:
        watchdog()
        name = advance(state)
        ops.at, ops.calls, ops.where = at, 0, None
        try:
            ckpt.save(state)
        except KeyboardInterrupt:
            assert ops.where is not None
            print(f"storage placement {at}: {ops.where}", file=sys.stderr, flush=True)
        ops.at = None
        if ops.where is None:
            break
        _check_blocking_outcome(ckpt, state, name, f"{ops.where} #{at}", outcomes)
        assert ckpt.save(state).name == name
        assert ckpt.save(state, blocking=False).wait().name == name  # and a background one (a no-op here)
        at += 1
    expected = weights(state)
    ckpt.close()
    check_directory(root / "storage", expected, ckpt.latest())
    result["blocking_storage"] = {"placements": at - 1, **outcomes}

    # c: every placement in wait(), in a handle's wait() and in close(), with a save held in flight
    for entry in ("wait", "handle", "close"):
        ops, state = Ops(), make_state()
        ckpt = open_manager(root / entry, ops)
        at = 1
        while True:
            watchdog()
            name = advance(state)
            gate = ops.hold()
            handle = ckpt.save(state, blocking=False)
            call = {"wait": ckpt.wait, "handle": handle.wait, "close": ckpt.close}[entry]
            threading.Timer(0.01, gate.set).start()  # lets it finish while interrupted, or after
            where = interrupted(call, at)
            if where is not None and entry == "close" and ckpt.status().in_flight:
                # still writing: the directory stays locked by this process
                with pytest.raises(ts.DirectoryLocked):
                    LocalStore(root / entry, create=False).lock()
            gate.set()
            ckpt.wait()
            assert handle.wait().name == name and ckpt.latest() == name
            ckpt.close()  # finishes and releases the directory
            probe = LocalStore(root / entry, create=False)
            probe.lock()
            probe.unlock()
            if where is None:
                break
            ckpt.__enter__()  # open again (a closed manager takes the directory only when it next publishes)
            at += 1
        result[entry] = {"placements": at - 1}
        check_directory(root / entry, weights(state), name)

    # d: a real Ctrl-C, on a timer, while wait() and close() block on a slow save
    ops, state = Ops(), make_state()
    ckpt = open_manager(root / "timer", ops)
    for call in ("wait", "close"):
        watchdog()
        name = advance(state)
        gate = ops.hold()
        ckpt.save(state, blocking=False)
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            getattr(ckpt, call)()
        assert ckpt.status().in_flight == 1
        with pytest.raises(ts.DirectoryLocked):  # a second writer is still kept out
            LocalStore(root / "timer", create=False).lock()
        gate.set()
        getattr(ckpt, call)()
        assert ckpt.latest() == name
    expected = weights(state)
    ckpt.close()
    check_directory(root / "timer", expected, name)
    return result


# scenario 3: fork ----------------------------------------------------------------------
class ForkOps(PosixOps):
    """Real operations. The save of ``failing`` fails at its fsync; the save of ``slow`` stops in its
    fsync (``writing`` is set) until ``go`` is set; ``gates`` hold a save at its staging directory."""

    def __init__(self) -> None:
        self.current: str | None = None  # the writer's generation (one writer thread)
        self.failing = self.slow = None
        self.gates: dict[str, threading.Event] = {}
        self.writing, self.go = threading.Event(), threading.Event()

    def mkdir(self, path: Path) -> None:
        match = _STAGING_RE.fullmatch(Path(path).name)
        if match:
            self.current = match.group(1)
            gate = self.gates.get(self.current)
            if gate is not None and not gate.wait(30):
                raise TimeoutError("never released")
        super().mkdir(path)

    def fsync(self, fd: int) -> None:
        if self.current is not None and self.current == self.failing:
            raise OSError(errno.EIO, "injected EIO in fsync")
        if self.current is not None and self.current == self.slow:
            self.writing.set()
            if not self.go.wait(30):
                raise TimeoutError("never released")
        super().fsync(fd)


def _on_alarm(signum, frame) -> None:
    faulthandler.dump_traceback(all_threads=True)
    os._exit(3)


def _alarm(seconds: int) -> None:
    """A watchdog that survives fork (faulthandler's thread does not): re-armed in each process."""
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(seconds)


def _grandchild(log: Path, work) -> None:
    """Run ``work`` in a forked child, then exit the normal way (interpreter shutdown, atexit, finalizers)."""
    _alarm(20)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 0
    try:
        work()
    except BaseException:
        traceback.print_exc()
        code = 4
    sys.stdout.flush()
    sys.exit(code)  # not os._exit: the exit hooks must not wait for the parent's save


def scenario_fork(root: Path) -> dict:
    _alarm(60)
    run = root / "run"
    ops, state = ForkOps(), make_state()
    ckpt = open_manager(run, ops, max_in_flight=2)
    failing = ops.failing = advance(state)
    ops.gates[failing] = threading.Event()
    ckpt.save(state, blocking=False)  # fails at its fsync, once released
    slow = ops.slow = advance(state)
    expected = weights(state)
    slow_handle = ckpt.save(state, blocking=False)  # handed off behind it, before it fails
    ops.gates[failing].set()
    assert ops.writing.wait(30)
    deadline = time.monotonic() + 30
    while ckpt.status().unreported_failures != (failing,):
        assert time.monotonic() < deadline, ckpt.status()
        time.sleep(0.01)

    def uses_the_manager() -> None:
        status = ckpt.status()
        assert (status.in_flight, status.unreported_failures) == (0, ()), status
        started = time.monotonic()
        with pytest.raises(ts.AsyncSaveFailed, match="forked"):  # the parent's save: not ours to wait for
            slow_handle.wait()
        assert slow_handle.done() and time.monotonic() - started < 1
        for _ in range(3):  # more than max_in_flight: every slot is free, and each comes back
            advance(state)
            with pytest.raises(ts.DirectoryLocked):  # the parent's directory, refused before anything is staged
                ckpt.save(state, blocking=False)
        advance(state)
        with pytest.raises(ts.DirectoryLocked):
            ckpt.save(state)
        ckpt.wait()
        with ts.CheckpointManager(root / f"child-{os.getpid()}") as own:  # a directory of its own: saves publish
            assert own.save(state, blocking=False).wait().name == generation_name(state.next_update)
        print("child done", flush=True)

    logs = {what: root / f"{what}.log" for what in ("uses", "exits", "locked")}
    pids = {}
    pid = os.fork()
    if pid == 0:
        _grandchild(logs["uses"], uses_the_manager)
    pids["uses"] = pid
    pid = os.fork()
    if pid == 0:
        _grandchild(logs["exits"], lambda: None)  # touches nothing, just exits
    pids["exits"] = pid
    # The writer thread may hold the writer's lock at the moment of a fork: the child must not inherit it.
    with ckpt._writer._lock:
        pid = os.fork()
        if pid == 0:
            _grandchild(logs["locked"], uses_the_manager)
    pids["locked"] = pid

    deadline = time.monotonic() + 30
    exits = {what: _reap(pid, deadline) for what, pid in pids.items()}
    ops.go.set()
    # in the parent: its save publishes, and its failure is raised here, once
    assert slow_handle.wait().name == slow
    with pytest.raises(ts.AsyncSaveFailed, match=failing):
        ckpt.wait()
    ckpt.close()
    check_directory(run, expected, slow)
    return {"exits": exits, "logs": {what: log.read_text() for what, log in logs.items()}, "failing": failing}


# the processes ------------------------------------------------------------------------
SCENARIOS = {"background": scenario_background, "blocking": scenario_blocking, "fork": scenario_fork}
SCENARIO_TIMEOUT_S = 120


def zygote(root: Path) -> dict:
    """Import once and build one optimizer (torch's first costs seconds: it imports torch._dynamo),
    then run every scenario at once, each in a process forked from here. One stuck past the timeout
    is killed; each reports its exit status, its result and the tail of its output."""
    started = time.monotonic()
    make_state()
    sys.stdout.flush()
    warm_s = round(time.monotonic() - started, 2)
    pids = {}
    for mode, scenario in SCENARIOS.items():
        (root / mode).mkdir()
        pid = os.fork()
        if pid == 0:
            _run_scenario(mode, scenario, root)  # exits
        pids[mode] = pid
    deadline = time.monotonic() + SCENARIO_TIMEOUT_S
    report = {}
    for mode, pid in pids.items():
        code = _reap(pid, deadline)
        result = root / f"{mode}.json"
        report[mode] = {"exit": code, "log": (root / f"{mode}.log").read_text()[-8000:],
                        "result": json.loads(result.read_text()) if result.exists() else None}
    report["first_optimizer_s"] = warm_s
    return report


def _run_scenario(mode: str, scenario, root: Path) -> None:
    fd = os.open(root / f"{mode}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        if mode != "fork":  # (the fork scenario has its own watchdog: faulthandler's does not survive a fork)
            watchdog()
        started = time.monotonic()
        result = scenario(root / mode)
        faulthandler.cancel_dump_traceback_later()
        result["seconds"] = round(time.monotonic() - started, 2)
        (root / f"{mode}.json").write_text(json.dumps(result))
        code = 0
    except SystemExit:  # a process the scenario forked, leaving the normal way
        raise
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.exit(code)  # the normal way: exit hooks run, and must not hang


def _reap(pid: int, deadline: float) -> int | str:
    """The exit status of ``pid``; killed (and reaped) if it has not exited by ``deadline``."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hung (killed)"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict:
    """Runs the zygote once for the module (its scenarios run concurrently)."""
    root = tmp_path_factory.mktemp("signals")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, __file__, str(root)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=SCENARIO_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    try:  # nothing of it may remain: not the zygote, not anything it or its scenarios forked
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        left = False
    else:
        left = True
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"zygote exited {proc.returncode}:\n{err[-6000:]}"
    assert not left, "processes were left behind"
    return json.loads(out.strip().splitlines()[-1])


def outcome(scenarios: dict, mode: str) -> dict:
    got = scenarios[mode]
    assert got["exit"] == 0 and got["result"] is not None, f"{mode} scenario exited {got['exit']}:\n{got['log']}"
    print(json.dumps(got["result"], indent=1))
    return got["result"]


# the tests --------------------------------------------------------------------------
def test_sigint_anywhere_in_a_background_save_leaks_nothing(scenarios):
    result = outcome(scenarios, "background")
    for writer in ("idle", "busy"):
        sweep = result[writer]
        # both sides of the hand-off were hit, up to the end of save()
        assert sweep["placements"] > 50 and sweep["abandoned"] > 40 and sweep["published"] >= 3, sweep
        reached = {"manager.py:save", "asyncsave.py:reserve", "publish.py:prepare", "staging.py:stage",
                   "asyncsave.py:hand_off"} | ({"asyncsave.py:_start_writer"} if writer == "idle" else set())
        assert reached <= set(sweep["landed"]), sweep


def test_sigint_in_a_blocking_save_wait_or_close_never_deadlocks_a_later_call(scenarios):
    result = outcome(scenarios, "blocking")
    assert result["blocking_code"]["placements"] > 30 and result["blocking_code"]["abandoned"] > 20, result
    assert result["blocking_storage"]["placements"] > 15 and result["blocking_storage"]["abandoned"] > 10, result
    for entry in ("wait", "handle", "close"):
        assert result[entry]["placements"] > 5, result


def test_a_forked_child_does_not_wait_for_the_parents_save(scenarios):
    result = outcome(scenarios, "fork")
    logs = result["logs"]
    shown = "\n".join(f"--- {what} (exit {result['exits'][what]}) ---\n{log[-3000:]}" for what, log in logs.items())
    assert result["exits"] == {"uses": 0, "exits": 0, "locked": 0}, shown
    assert "child done" in logs["uses"] and "child done" in logs["locked"], shown
    for log in logs.values():  # the parent's unreported failure is the parent's: no child prints it
        assert result["failing"] not in log, shown


if __name__ == "__main__":
    # A shell starts a background job (`.ci/run &`) with SIGINT ignored, and exec keeps that: Python then installs
    # no KeyboardInterrupt handler, and every SIGINT this test sends would be dropped. Ctrl-C is what it tests.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(json.dumps(zygote(Path(sys.argv[1]))), flush=True)
