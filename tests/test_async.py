"""Background saves: ``save(state, blocking=False)``.

1. Consistency under mutation: the moment ``save`` returns, every live object
   may change (parameters, optimizer moments, scheduler, scaler, every RNG,
   counters, facts) and training may go on; the generation written later
   holds the state *at the call*, bitwise (the failure of pytorch #144657,
   asynchronous checkpoints writing already-updated tensors, is absent). A
   negative control stages nothing and shows the check catches it.
2. Backpressure: never more than ``max_in_flight`` saves in flight; a further
   save waits until an earlier one has finished (ordering, not wall clock);
   every generation is published, in order; the pointer ends on the last.
3. Failure propagation: a failure in each phase (staging directory, write,
   fsync, rename, verify, pointer) is raised exactly once, as
   ``AsyncSaveFailed`` chained to the original exception, by whichever comes
   first of the next ``save``, ``wait()``, ``close()`` or the handle's
   ``wait()``; nothing of the failed save is published and the next save works.
4. Shutdown: leaving a ``with`` block completes (or reports) the save; a
   process SIGKILLed inside a background write leaves the previous generation
   intact; a process that exits without ``close()`` still publishes, and one
   whose background save failed says so on stderr.

Writers are slowed by gates (a ``threading.Event`` the writer waits on when it
creates a generation's staging directory), so orderings are forced, not timed.
"""

from __future__ import annotations

import concurrent.futures
import copy
import errno
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from trainer import assert_same, build, full_state, step

import trainstate as ts
import trainstate.publish as publish_mod
from trainstate.state import rng as rng_mod
from trainstate.state.staging import StagingBuffers
from trainstate.format.codec import TensorTable, encode
from trainstate.errors import CorruptGeneration
from trainstate.storage.local import LocalStore, PosixOps
from trainstate.format.manifest import POINTER, RUN, generation_name, parse_pointer
from trainstate.storage.verify import verify_generation

TESTS = Path(__file__).resolve().parent
_STAGING_RE = re.compile(r"\.trainstate-staging-(gen-\d{12}(?:-weights)?)-[0-9a-f]{16}")


# state -----------------------------------------------------------------------------
def make(seed: int = 0) -> ts.TrainState:
    """The shared trainer's state (model with BatchNorm, AdamW, StepLR, GradScaler, torch and numpy
    generators) plus a named ``random.Random`` and a legacy ``RandomState``, counters and nested facts,
    trained two updates so every optimizer moment exists."""
    state = build(seed=seed)
    state.rngs["py"] = random.Random(seed + 3)
    state.rngs["legacy"] = np.random.RandomState(seed + 4)
    state.counters["micro"] = 3
    state.facts.update({"best": 0.5, "seen": [1, 2], "nested": {"tracker": "run-1", "patience": 2}})
    step(state)
    step(state)
    return state


def _plain(value):
    """Comparable form of a snapshot: numpy arrays as (dtype, shape, bytes); everything else as is."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def snapshot(state: ts.TrainState) -> dict:
    """A deep copy of everything the restart state holds, RNG states included."""
    return copy.deepcopy(_plain({
        "state": full_state(state), "facts": state.facts, "history": state.history,
        "rng": rng_mod.capture(state.rngs)}))


def digest(snap: dict) -> str:
    table = TensorTable()
    skeleton = encode(_unplain(snap), "", table)
    h = hashlib.sha256(json.dumps(skeleton, sort_keys=True).encode())
    for name in sorted(table.tensors):
        h.update(name.encode() + table.tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _unplain(value):
    if isinstance(value, tuple) and len(value) == 4 and isinstance(value[0], str) and value[0] == "ndarray":
        return {"ndarray": [value[1], list(value[2]), value[3].hex()]}
    if isinstance(value, dict):
        return {k: _unplain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_unplain(v) for v in value]
    return value


def mutate_everything(state: ts.TrainState) -> None:
    """Change every part of the restart state, in place wherever the live object allows it."""
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(1.0)
        for name, buf in state["model"].named_buffers():
            buf.add_(3) if "num_batches" in name else buf.mul_(2.0).add_(0.5)
        for entry in state["optimizer"].state.values():
            for value in entry.values():
                if isinstance(value, torch.Tensor):
                    value.add_(7.0)  # exp_avg, exp_avg_sq and the step counter, in place
    state["optimizer"].param_groups[0]["weight_decay"] = 0.125
    for _ in range(3):
        state["scheduler"].step()
    state["scaler"].update(new_scale=12345.0)  # fills the scale tensor in place
    random.random(), np.random.rand(3), torch.rand(3)
    torch.rand(3, generator=state.rngs["data"]), state.rngs["noise"].random(3)
    state.rngs["py"].random(), state.rngs["legacy"].rand(2)
    state.next_update += 5
    state.tokens_seen += 100
    state.counters["epoch"] = state.counters.get("epoch", 0) + 10
    state.counters["micro"] = 0
    state.facts["seen"].append(3)
    state.facts["nested"]["patience"] = 0
    state.facts["best"] = 0.25
    for _ in range(2):
        step(state)  # and real updates: optimizer.step writes parameters and moments in place


PARTS = ("state.model", "state.optimizer", "state.scheduler", "state.scaler", "state.clocks", "facts",
         "rng.python", "rng.numpy_global", "rng.torch_cpu", "rng.named.data", "rng.named.noise", "rng.named.py",
         "rng.named.legacy")


def _part(snap: dict, path: str):
    for key in path.split("."):
        snap = snap[key]
    return snap


def assert_every_part_changed(before: dict, after: dict) -> None:
    for path in PARTS:
        try:
            assert_same(_part(before, path), _part(after, path), path)
        except AssertionError:
            continue
        pytest.fail(f"the mutation left {path} unchanged: the test could not see a capture bug there")


def restore_fresh(root: Path, generation: str | None = None) -> tuple[str, dict]:
    """Restore into freshly built objects (another seed: everything must come from the checkpoint)."""
    fresh = make(seed=77)
    info = ts.CheckpointManager(root).restore(fresh, generation=generation)  # reading takes no lock
    return info.generation.name, snapshot(fresh)


# filesystem operations -------------------------------------------------------------
def staging_generation(path: Path) -> str | None:
    match = _STAGING_RE.fullmatch(Path(path).name)
    return match.group(1) if match else None


class GateOps(PosixOps):
    """Real operations. A held generation's writer stops at the mkdir of its staging directory until
    released; pointer moves are logged, with the generation they name, in one ordered event list."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gates: dict[str, tuple[threading.Event, threading.Event]] = {}
        self.events: list[tuple[str, str]] = []

    def event(self, what: str, generation: str) -> None:
        with self._lock:
            self.events.append((what, generation))

    def hold(self, generation: str) -> None:
        with self._lock:
            self._gates[generation] = (threading.Event(), threading.Event())

    def release(self, generation: str) -> None:
        self._gates[generation][1].set()

    def reached(self, generation: str, timeout: float = 30.0) -> bool:
        return self._gates[generation][0].wait(timeout)

    def published(self) -> list[str]:
        with self._lock:
            return [g for what, g in self.events if what == "published"]

    def mkdir(self, path: Path) -> None:
        generation = staging_generation(path)
        with self._lock:
            gate = self._gates.get(generation)
        if gate is not None:
            gate[0].set()
            if not gate[1].wait(60):
                raise TimeoutError(f"the test never released {generation}")
        super().mkdir(path)

    def replace(self, src: Path, dst: Path) -> None:
        super().replace(src, dst)
        if Path(dst).name == POINTER:
            self.event("published", parse_pointer(Path(dst).read_bytes(), POINTER).generation)


class SlowOps(GateOps):
    """Every fsync takes ``delay`` seconds longer: a slow disk."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay = delay

    def fsync(self, fd: int) -> None:
        time.sleep(self.delay)
        super().fsync(fd)


class FailOps(GateOps):
    """Real operations, except one, in one phase of the save of ``target``, which raises (once)."""

    def __init__(self, phase: str):
        super().__init__()
        self.phase = phase
        self.target: str | None = None
        self.armed = False  # between the target's staging mkdir and the injected failure
        self.injected: BaseException | None = None

    def fail(self, what: str) -> None:
        self.armed, self.target = False, None
        self.injected = OSError(errno.EIO, f"injected EIO in {what}")
        raise self.injected

    def mkdir(self, path: Path) -> None:
        if self.target is not None and staging_generation(path) == self.target:
            if self.phase == "mkdir":
                self.fail("mkdir of the staging directory")
            self.armed = True
        super().mkdir(path)

    def write(self, fd: int, data: memoryview) -> int:
        if self.armed and self.phase == "write":
            self.fail("write")
        return super().write(fd, data)

    def fsync(self, fd: int) -> None:
        if self.armed and self.phase == "fsync":
            self.fail("fsync")
        super().fsync(fd)

    def rename(self, src: Path, dst: Path) -> None:
        if self.armed and self.phase == "rename" and staging_generation(src) == self.target:
            self.fail("rename of the staging directory")
        super().rename(src, dst)

    def create(self, path: Path) -> int:
        if self.armed and self.phase == "pointer-create" and Path(path).name.startswith(f".trainstate-tmp-{POINTER}"):
            self.fail("create of the pointer's temp file")
        return super().create(path)

    def replace(self, src: Path, dst: Path) -> None:
        if self.armed and self.phase == "pointer-replace" and Path(dst).name == POINTER:
            self.fail("replace of the pointer")
        super().replace(src, dst)


def open_manager(root: Path, ops: PosixOps, **kwargs) -> ts.CheckpointManager:
    return ts.CheckpointManager(root, store=LocalStore(root, "blake3", ops=ops), **kwargs)


def pointer_of(root: Path) -> str | None:
    path = root / POINTER
    return parse_pointer(path.read_bytes(), POINTER).generation if path.exists() else None


def check_visible(root: Path, *, leftovers_allowed: bool) -> list[str]:
    """Every visible name is the library's: generations that verify in full, the pointer, the lock
    (and, until the next save cleans them, hidden leftovers). Returns the generations."""
    store = LocalStore(root, create=False)
    generations = store.generations()
    for name in generations:
        verify_generation(store, name, content=True)
    hidden = set(store.leftovers() if leftovers_allowed else [])
    others = sorted(n for n in set(os.listdir(root)) - set(generations) - {POINTER, RUN} - hidden
                    if not re.fullmatch(r"\.trainstate(\.[a-z]+)?\.lock", n))  # the library's lock files
    assert not others, f"unexpected names in the run directory: {others}"
    assert leftovers_allowed or store.leftovers() == [], store.leftovers()
    return generations


def wait_settled(ckpt: ts.CheckpointManager, timeout: float = 30.0) -> None:
    """Until no save is in flight (the writer has recorded how each one ended)."""
    deadline = time.monotonic() + timeout
    while ckpt.status().in_flight:
        assert time.monotonic() < deadline, "a background save never finished"
        time.sleep(0.005)


# 1. consistency under mutation -----------------------------------------------------
def test_generation_holds_the_state_at_the_call_not_after(tmp_path):
    root, ops, state = tmp_path / "run", GateOps(), make()
    expected, name = snapshot(state), generation_name(state.next_update)
    ops.hold(name)  # the writer writes nothing until everything below has changed
    with open_manager(root, ops) as ckpt:
        handle = ckpt.save(state, blocking=False)
        assert ckpt.status().last_staged == name and not handle.done()
        mutate_everything(state)
        assert_every_part_changed(expected, snapshot(state))
        ops.release(name)
        assert handle.wait().name == name
        assert ckpt.status().last_committed == name
    assert pointer_of(root) == name
    got_name, got = restore_fresh(root)
    assert got_name == name
    assert_same(got, expected, "restored")


def test_two_saves_in_flight_each_hold_their_own_state(tmp_path):
    """max_in_flight=2: each in-flight save owns its buffers; the second staging does not overwrite the first."""
    root, ops, state = tmp_path / "run", GateOps(), make()
    expected, names = [], []
    with open_manager(root, ops, max_in_flight=2, keep_last=5) as ckpt:
        handles = []
        for _ in range(2):
            expected.append(snapshot(state))
            names.append(generation_name(state.next_update))
            ops.hold(names[-1])
            handles.append(ckpt.save(state, blocking=False))
            mutate_everything(state)
        assert ckpt.status().in_flight == 2
        for name in names:
            ops.release(name)
        assert [h.wait().name for h in handles] == names
        # a third save reuses a slot's buffers; the generations already written are untouched
        expected.append(snapshot(state))
        names.append(generation_name(state.next_update))
        ckpt.save(state, blocking=False).wait()
    for name, want in zip(names, expected):
        got_name, got = restore_fresh(root, name)
        assert got_name == name
        assert_same(got, want, name)


def test_negative_control_without_staging_the_generation_holds_mutated_tensors(tmp_path, monkeypatch):
    """Stage nothing (hand the writer the live tensors): the check above must then fail."""
    monkeypatch.setattr(StagingBuffers, "stage", lambda self, tensors: dict(tensors))
    root, ops, state = tmp_path / "run", GateOps(), make()
    expected, name = snapshot(state), generation_name(state.next_update)
    ops.hold(name)
    with open_manager(root, ops) as ckpt:
        handle = ckpt.save(state, blocking=False)
        mutate_everything(state)
        ops.release(name)
        handle.wait()
    _, got = restore_fresh(root)
    with pytest.raises(AssertionError, match="differs"):
        assert_same(got["state"]["model"], expected["state"]["model"], "model")
    with pytest.raises(AssertionError, match="differs"):
        assert_same(got["state"]["optimizer"], expected["state"]["optimizer"], "optimizer")
    # what is not a tensor was captured by value before the call returned, staged or not
    assert_same(got["rng"], expected["rng"], "rng")
    assert_same(got["state"]["clocks"], expected["state"]["clocks"], "clocks")


def test_a_failure_while_copying_raises_at_the_call_and_frees_the_slot(tmp_path, monkeypatch):
    """The copy is made on the caller's thread: its failure is the call's, and the slot is not lost."""
    root, state = tmp_path / "run", make()
    real = StagingBuffers.stage
    calls = []

    def stage(self, tensors):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("injected: no memory for staging buffers")
        return real(self, tensors)

    monkeypatch.setattr(StagingBuffers, "stage", stage)
    with ts.CheckpointManager(root) as ckpt:
        with pytest.raises(MemoryError, match="injected"):
            ckpt.save(state, blocking=False)
        assert ckpt.status().in_flight == 0 and ckpt.status().unreported_failures == ()
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            done = pool.submit(lambda: ckpt.save(state, blocking=False).wait())
            assert done.result(timeout=30).name == generation_name(state.next_update)  # no deadlock on the slot
        finally:
            pool.shutdown(wait=False)
    assert pointer_of(root) == generation_name(state.next_update)


# 2. backpressure -------------------------------------------------------------------
class Sampler:
    """Samples ``status().in_flight`` (and the writer's own count) from another thread."""

    def __init__(self, ckpt: ts.CheckpointManager):
        self.ckpt, self.samples, self._stop = ckpt, [], threading.Event()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.ckpt.status().in_flight)
                self.samples.append(self.ckpt._writer.in_flight())
            except BaseException as exc:  # status() must work from any thread while saves run
                self.errors.append(exc)
            time.sleep(0.001)

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        assert not self.errors, self.errors
        return self.samples


@pytest.mark.parametrize("bound", [1, 2])
def test_a_save_beyond_the_bound_waits_for_an_earlier_one(tmp_path, bound):
    root, ops, state = tmp_path / "run", GateOps(), make()
    names = []
    with open_manager(root, ops, max_in_flight=bound, keep_last=10) as ckpt:
        sampler = Sampler(ckpt)
        for _ in range(bound):  # fill every slot; each call returns at once
            step(state)
            names.append(generation_name(state.next_update))
            ops.hold(names[-1])
            ckpt.save(state, blocking=False)
        assert ckpt.status().in_flight == bound
        step(state)
        names.append(generation_name(state.next_update))
        ops.hold(names[-1])  # so that it cannot be published before the checks below
        returned = threading.Event()

        def one_more():
            ckpt.save(state, blocking=False)
            ops.event("returned", names[-1])
            returned.set()

        extra = threading.Thread(target=one_more)
        extra.start()
        # It must wait, not queue: had it queued it would return in milliseconds.
        assert not returned.wait(0.5), f"save {bound + 1} returned with {bound} saves in flight"
        assert ckpt.status().in_flight == bound
        assert ckpt.status().last_started == names[bound - 1]  # it waits before capturing anything
        assert ops.published() == []
        ops.release(names[0])
        assert returned.wait(30)
        extra.join()
        events = ops.events
        assert events.index(("published", names[0])) < events.index(("returned", names[-1])), events
        assert ops.published() == [names[0]], "only the first had finished when the extra save returned"
        for name in names[1:]:
            ops.release(name)
        ckpt.wait()
        samples = sampler.stop()
        assert ckpt._writer.high_water == bound
        assert max(samples) <= bound and bound in samples, sorted(set(samples))
        status = ckpt.status()
        assert (status.in_flight, status.last_committed, status.recovery_point) == (0, names[-1], names[-1])
    assert ops.published() == names  # every one, in save order
    assert pointer_of(root) == names[-1]
    assert check_visible(root, leftovers_allowed=False) == sorted(names, reverse=True)


def test_negative_control_an_unbounded_writer_is_caught(tmp_path):
    """With the bound removed (slots enough for all), the extra save returns at once: the check above fails."""
    root, ops, state = tmp_path / "run", GateOps(), make()
    names = []
    with open_manager(root, ops, max_in_flight=1, keep_last=10) as ckpt:
        ckpt._writer._slots = threading.Semaphore(10)
        ckpt._writer._pool = [StagingBuffers() for _ in range(10)]
        for _ in range(2):
            step(state)
            names.append(generation_name(state.next_update))
            ops.hold(names[-1])
            returned = threading.Event()
            threading.Thread(target=lambda done=returned: (ckpt.save(state, blocking=False), done.set())).start()
            assert returned.wait(30)
        assert ckpt.status().in_flight == 2 and ckpt._writer.high_water == 2  # what the bound forbids
        assert ops.published() == []
        for name in names:
            ops.release(name)
        ckpt.wait()


@pytest.mark.parametrize("bound", [1, 2])
def test_backpressure_with_a_slow_disk(tmp_path, bound):
    """A save every update on a disk slower than training: saves pile up to the bound, never beyond;
    save i returns only after save i - bound has been published."""
    root, ops, state = tmp_path / "run", SlowOps(0.01), make()
    names = []
    with open_manager(root, ops, max_in_flight=bound, keep_last=10) as ckpt:
        sampler = Sampler(ckpt)
        for _ in range(6):
            step(state)
            names.append(generation_name(state.next_update))
            ckpt.save(state, blocking=False)
            ops.event("returned", names[-1])
        ckpt.wait()
        samples = sampler.stop()
        assert ckpt._writer.high_water == bound
        assert max(samples) <= bound
    events = ops.events
    for i in range(bound, len(names)):
        assert events.index(("published", names[i - bound])) < events.index(("returned", names[i])), events
    assert ops.published() == names
    assert pointer_of(root) == names[-1]
    check_visible(root, leftovers_allowed=False)


# 3. failure propagation ------------------------------------------------------------
PHASES = ("mkdir", "write", "fsync", "rename", "verify", "pointer-create", "pointer-replace")
ENTRIES = ("save", "save-blocking", "wait", "close", "handle")


def _expect_async_failure(call: Callable[[], object], ops: FailOps, generation: str) -> None:
    with pytest.raises(ts.AsyncSaveFailed) as info:
        call()
    cause = ops.injected
    assert cause is not None and info.value.__cause__ is cause, f"chained {info.value.__cause__!r}, injected {cause!r}"
    assert generation in str(info.value)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("phase", PHASES)
def test_a_background_failure_is_raised_exactly_once(tmp_path, monkeypatch, phase, entry):
    root, ops, state = tmp_path / "run", FailOps(phase), make()
    ckpt = open_manager(root, ops).__enter__()
    try:
        previous = generation_name(state.next_update)
        ckpt.save(state)
        before, pointer_before = snapshot(state), (root / POINTER).read_bytes()
        step(state)
        target = generation_name(state.next_update)
        if phase == "verify":
            real = publish_mod.verify_generation

            def verify(store, name, *args, **kwargs):
                if name == target and ops.injected is None:
                    ops.injected = CorruptGeneration(name, "injected: verification failed")
                    raise ops.injected
                return real(store, name, *args, **kwargs)

            monkeypatch.setattr(publish_mod, "verify_generation", verify)
        else:
            ops.target = target
        handle = ckpt.save(state, blocking=False)
        wait_settled(ckpt)
        assert ops.injected is not None, "the fault was not injected"
        assert handle.done() and ckpt.status().unreported_failures == (target,)

        # nothing of it was published; nothing partial is visible
        assert (root / POINTER).read_bytes() == pointer_before
        visible = check_visible(root, leftovers_allowed=True)
        assert visible == [previous]  # a failed pointer move withdraws the committed generation too
        if entry == "wait":  # (depends on the phase only: once per phase)
            got_name, got = restore_fresh(root)
            assert got_name == previous
            assert_same(got, before, "restored after the failure")

        step(state)
        if entry == "save":
            _expect_async_failure(lambda: ckpt.save(state, blocking=False), ops, target)
        elif entry == "save-blocking":
            _expect_async_failure(lambda: ckpt.save(state), ops, target)
        elif entry == "wait":
            _expect_async_failure(ckpt.wait, ops, target)
        elif entry == "handle":
            _expect_async_failure(handle.wait, ops, target)
        else:
            _expect_async_failure(ckpt.close, ops, target)
            ckpt.close()  # a second close does not raise it again
            ckpt = open_manager(root, ops).__enter__()
        assert ckpt.status().unreported_failures == ()
        ckpt.wait()  # reported once: no entry point raises it again

        expected, name = snapshot(state), generation_name(state.next_update)
        assert ckpt.save(state, blocking=False).wait().name == name
        ckpt.wait()
        ckpt.close()  # raises nothing more
    finally:
        ckpt._writer.shutdown()  # after a failed assertion: release the directory without raising
        ckpt.store.unlock()
    assert pointer_of(root) == name
    visible = check_visible(root, leftovers_allowed=False)  # the next save swept every leftover
    assert name in visible
    got_name, got = restore_fresh(root)
    assert got_name == name
    assert_same(got, expected, "restored after the next save")


class _SlowCallbacks:
    """Delays a finished future's done-callbacks (the writer's bookkeeping), as a preempted writer thread would.

    ``Future.set_exception`` wakes ``result()`` waiters first and runs done-callbacks after, on the writer
    thread: any schedule may run the waiter in between. This widens that gap so the test sees it every time.
    """

    def __init__(self, monkeypatch, delay: float = 0.3):
        real = concurrent.futures.Future._invoke_callbacks

        def invoke(future):
            if future._done_callbacks:
                time.sleep(delay)
            real(future)

        monkeypatch.setattr(concurrent.futures.Future, "_invoke_callbacks", invoke)


def _failing_save(tmp_path) -> tuple[ts.CheckpointManager, FailOps, ts.SaveHandle, str]:
    root, ops, state = tmp_path / "run", FailOps("fsync"), make()
    ckpt = open_manager(root, ops).__enter__()
    ops.target = generation_name(state.next_update)
    return ckpt, ops, ckpt.save(state, blocking=False), ops.target


def test_a_failure_the_handle_reported_is_not_raised_again_even_if_it_wakes_first(tmp_path, monkeypatch):
    _SlowCallbacks(monkeypatch)
    ckpt, ops, handle, target = _failing_save(tmp_path)
    try:
        _expect_async_failure(handle.wait, ops, target)  # called at once, while it is in flight
        wait_settled(ckpt)  # the writer is done with it
        assert ckpt.status().unreported_failures == ()
        ckpt.wait()  # the manager must not raise it a second time
    finally:
        ckpt._writer.shutdown()
        ckpt.store.unlock()


def test_manager_wait_raises_a_failure_it_waited_for(tmp_path, monkeypatch):
    _SlowCallbacks(monkeypatch)
    ckpt, ops, _, target = _failing_save(tmp_path)
    try:
        _expect_async_failure(ckpt.wait, ops, target)  # called at once, while it is in flight
        assert ckpt.status().in_flight == 0
    finally:
        ckpt._writer.shutdown()
        ckpt.store.unlock()


# 4. shutdown -----------------------------------------------------------------------
def test_leaving_the_block_completes_the_background_save(tmp_path):
    root, ops, state = tmp_path / "run", GateOps(), make()
    expected, name = snapshot(state), generation_name(state.next_update)
    ops.hold(name)
    with open_manager(root, ops) as ckpt:
        handle = ckpt.save(state, blocking=False)
        mutate_everything(state)
        assert not handle.done()  # held: still in flight as the block ends
        threading.Timer(0.2, ops.release, (name,)).start()
    ops.event("left the block", name)
    assert ops.events == [("published", name), ("left the block", name)]
    assert handle.done() and pointer_of(root) == name
    assert_same(restore_fresh(root)[1], expected, "restored")


def test_leaving_the_block_raises_a_background_failure(tmp_path):
    root, ops, state = tmp_path / "run", FailOps("write"), make()
    with ts.CheckpointManager(root) as ckpt:
        ckpt.save(state)
    previous = generation_name(state.next_update)
    step(state)
    ops.target = generation_name(state.next_update)
    with pytest.raises(ts.AsyncSaveFailed) as info, open_manager(root, ops) as ckpt:
        ckpt.save(state, blocking=False)
    assert info.value.__cause__ is ops.injected
    assert pointer_of(root) == previous
    with ts.CheckpointManager(root):  # the directory was released
        pass
    assert check_visible(root, leftovers_allowed=True) == [previous]


def test_an_exception_leaving_the_block_surfaces_with_the_background_failure_as_a_note(tmp_path):
    """The training loop's own exception is the one raised from ``with``; a background failure found as the block
    closes is logged and added to it as a note, not raised over it (which would hide the loop's error and its
    exit code). The save still finished first: single-process closes wait for no peer. Control: without an
    exception in flight, the same close raises the failure."""
    root, ops, state = tmp_path / "run", FailOps("write"), make()
    with ts.CheckpointManager(root) as ckpt:
        ckpt.save(state)
    previous = generation_name(state.next_update)
    step(state)
    ops.target = failing = generation_name(state.next_update)
    with pytest.raises(KeyError) as info, open_manager(root, ops) as ckpt:
        ckpt.save(state, blocking=False)
        raise KeyError("the loop's own bug")
    notes = getattr(info.value, "__notes__", [])
    if sys.version_info >= (3, 11):
        assert len(notes) == 1 and f"background save of {failing} had failed too" in notes[0], notes
    assert pointer_of(root) == previous and ckpt.status().unreported_failures == ()
    with ts.CheckpointManager(root):  # the directory was released
        pass


# subprocesses: started when the module starts, so that their imports overlap the tests above.
# "kill": a slow background save is SIGKILLed mid-write. "exit": three managers, none closed, the
# interpreter exits normally while their saves are in flight: one must publish, one failed
# before the exit, one fails during it.
CHILD = r"""
import errno, json, sys, time
sys.path[:0] = [sys.argv[3]]
from pathlib import Path
import trainstate as ts
from trainstate.storage.local import LocalStore, PosixOps
from trainstate.format.manifest import generation_name
from test_async import make, snapshot, digest, staging_generation, mutate_everything
from trainer import step

mode, base = sys.argv[1], Path(sys.argv[2])


class ChildOps(PosixOps):
    def __init__(self, behaviour):
        self.behaviour, self.target, self.armed = behaviour, None, False

    def mkdir(self, path):
        mine = self.target is not None and staging_generation(path) == self.target
        if mine and self.behaviour in ("publish", "fail-late"):
            time.sleep(1.0)  # the main thread has finished by now: this runs during interpreter exit
        if mine and self.behaviour == "fail-late":
            raise OSError(errno.EIO, "injected EIO in mkdir during exit")
        self.armed = mine
        super().mkdir(path)

    def fsync(self, fd):
        if self.behaviour == "fail" and self.armed:
            raise OSError(errno.EIO, "injected EIO in fsync")
        super().fsync(fd)

    def write(self, fd, data):
        if self.behaviour == "kill" and self.armed:
            super().write(fd, data[: len(data) // 2])  # a torn file in the staging directory
            print("writing", flush=True)
            time.sleep(300)  # SIGKILLed here
        return super().write(fd, data)


def start(behaviour, state):
    ops = ChildOps(behaviour)
    root = base / behaviour
    ckpt = ts.CheckpointManager(root, store=LocalStore(root, "blake3", ops=ops))
    if behaviour == "kill":
        ckpt.save(state)
        print(json.dumps({"generation": generation_name(state.next_update), "digest": digest(snapshot(state))}),
              flush=True)
        step(state)
    ops.target = generation_name(state.next_update)
    print(json.dumps({"dir": behaviour, "generation": ops.target, "digest": digest(snapshot(state))}), flush=True)
    ckpt.save(state, blocking=False)
    mutate_everything(state)
    return ckpt


if mode == "kill":
    state = make()
    start("kill", state)
    while True:  # training goes on while the background write hangs
        step(state)
        time.sleep(0.01)
managers = {}
for offset, behaviour in enumerate(("publish", "fail", "fail-late")):
    state = make()
    state.next_update += 100 * offset  # a generation name of its own in each directory
    managers[behaviour] = start(behaviour, state)
while managers["fail"].status().in_flight:
    time.sleep(0.01)
print("exiting", flush=True)  # without wait() or close()
"""


def _start_child(mode: str, root: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(TESTS.parent), os.environ.get("PYTHONPATH")) if p))
    return subprocess.Popen([sys.executable, "-c", CHILD, mode, str(root), str(TESTS)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _kill_when_writing(proc: subprocess.Popen) -> tuple[list[str], str, int]:
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if lines[-1] == "writing":
            proc.send_signal(signal.SIGKILL)
            break
    rest, err = proc.communicate(timeout=120)
    return lines + rest.splitlines(), err, proc.returncode


def _until_exit(proc: subprocess.Popen) -> tuple[list[str], str, int]:
    out, err = proc.communicate(timeout=180)
    return out.splitlines(), err, proc.returncode


@pytest.fixture(scope="module", autouse=True)
def children(tmp_path_factory) -> dict[str, tuple[Path, concurrent.futures.Future]]:
    root = tmp_path_factory.mktemp("children")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        yield {mode: (root / mode, pool.submit(run, _start_child(mode, root / mode)))
               for mode, run in (("kill", _kill_when_writing), ("exit", _until_exit))}


def _child(children, mode: str) -> tuple[Path, list[str], str, int]:
    root, future = children[mode]
    lines, err, code = future.result(timeout=240)
    return root, lines, err, code


def _records(lines: list[str]) -> dict[str, dict]:
    records = [json.loads(line) for line in lines if line.startswith("{")]
    return {r.get("dir", "previous"): r for r in records}


def test_sigkill_inside_a_background_write_leaves_the_previous_generation(children):
    base, lines, err, code = _child(children, "kill")
    assert code == -signal.SIGKILL and "writing" in lines, (code, lines, err[-2000:])
    root, records = base / "kill", _records(lines)
    previous, attempted = records["previous"], records["kill"]
    assert pointer_of(root) == previous["generation"]
    store = LocalStore(root, create=False)
    assert any(staging_generation(n) == attempted["generation"] for n in store.leftovers())  # it was mid-write
    assert check_visible(root, leftovers_allowed=True) == [previous["generation"]]
    got_name, got = restore_fresh(root)
    assert (got_name, digest(got)) == (previous["generation"], previous["digest"])
    state = make(seed=5)
    with ts.CheckpointManager(root) as ckpt:
        ckpt.restore(state)  # the run continues
        state.next_update = 1000
        ckpt.save(state, blocking=False)
    check_visible(root, leftovers_allowed=False)  # the next save swept the torn staging directory


def test_exit_without_close_still_publishes_the_save_in_flight(children):
    base, lines, err, code = _child(children, "exit")
    assert code == 0 and lines[-1] == "exiting", (code, lines, err[-2000:])
    root, record = base / "publish", _records(lines)["publish"]
    assert not [line for line in err.splitlines() if record["generation"] in line], err[-2000:]
    assert pointer_of(root) == record["generation"], err[-2000:]
    got_name, got = restore_fresh(root)
    assert (got_name, digest(got)) == (record["generation"], record["digest"])


@pytest.mark.parametrize("behaviour", ["fail", "fail-late"])
def test_an_unreported_background_failure_is_printed_at_exit(children, behaviour):
    """``fail``: failed before the interpreter exits; ``fail-late``: fails while it exits."""
    base, lines, err, code = _child(children, "exit")
    assert lines and lines[-1] == "exiting", (code, lines, err[-2000:])
    root, generation = base / behaviour, _records(lines)[behaviour]["generation"]
    # a line that names the generation and the run directory, printed with nobody left to raise it to
    assert any(generation in line and str(root) in line and "failed" in line for line in err.splitlines()), err[-2000:]
    assert f"injected EIO in {'fsync' if behaviour == 'fail' else 'mkdir'}" in err, err[-2000:]  # and why
    assert pointer_of(root) is None
    assert check_visible(root, leftovers_allowed=True) == []


def test_status_counts_the_staging_buffers_and_close_lets_them_go(tmp_path):
    """The buffers a background save copies into are reused from save to save; status() says how much host
    memory they hold (and how much of it is pinned: none on a CPU state), and a closed manager holds none."""
    state = build(seed=0)
    ckpt = ts.CheckpointManager(tmp_path, keep_last=2)
    assert (ckpt.status().staging_bytes, ckpt.status().staging_pinned_bytes) == (0, 0)
    step(state)
    ckpt.save(state, blocking=False)
    ckpt.wait()
    held = ckpt.status().staging_bytes
    tensors = sum(t.nbytes for t in full_state(state).values() if isinstance(t, torch.Tensor))
    assert held >= tensors // 2 and ckpt.status().staging_pinned_bytes == 0, (held, tensors)
    writer = ckpt._writer
    ckpt.close()
    assert writer.held() == (0, 0)  # the control is the held > 0 above: the same writer, before close
