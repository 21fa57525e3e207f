"""Background saving: owned staging buffers, a bounded writer, failures reported once.

``save(blocking=False)`` copies every tensor of the restart state into
buffers the manager owns (the rest of the state is already a fresh JSON-like
tree), then hands the copy to one writer thread and returns. The training
loop may change every live object at once: the generation is written from
the copy. Buffers are allocated once per layout and reused, so a steady-state
save costs one memcpy per byte (pinned host memory and a side stream on CUDA).

At most ``max_in_flight`` saves are staged or writing at a time; a further
``save`` waits for a slot (backpressure) rather than queueing without bound.
The writer publishes in order, so pointers move in save order. A failed
background save is reported exactly once: by its handle's ``wait()`` if the
caller asks, otherwise by the manager's next ``save``, ``wait`` or ``close``.

Ctrl-C. CPython raises a KeyboardInterrupt wherever it checks for signals:
on entering a function, after any call returns, on a loop's backward jump.
So the two steps that move a slot between owners are single operations that
record themselves in the writer's state (the claim is one dict store, the
hand-off one append to the queue), and the cleanup after an interrupt reads
the owner from there (:meth:`Writer.settle`), not from a local variable the
interrupt may have skipped. The writer synchronises with C-level locks only:
``threading.Condition``, ``Semaphore``, ``Future`` and ``Thread.start`` run
Python code while holding their own locks, where an interrupt can leave a
lock held for good.

Fork. A forked child starts with no save in flight and none of the parent's
failures, as it starts with none of its directory locks: the parent's writer
thread does not exist in the child, so the parent's saves are the parent's
to publish and report.
"""

from __future__ import annotations

import _thread
import concurrent.futures.thread  # noqa: F401  (registers its exit hook now, so that ours runs before it)
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from .errors import InvalidArgument, TrainStateError
from .state.staging import StagingBuffers

log = logging.getLogger("trainstate")
_WRITERS: weakref.WeakSet = weakref.WeakSet()  # every live Writer


def _drain_at_exit() -> None:
    """Finish every background save before interpreter shutdown stops thread pools from taking work.

    Registered after ``concurrent.futures`` registers its own exit hook, so it
    runs first: a save in flight at a normal exit is published, not failed.
    """
    for writer in list(_WRITERS):
        if writer.abandoned:  # left by a close that an exception interrupted: as a crash would leave it
            continue
        writer.drain()
        writer.wait_for_threads(10.0)  # the thread itself gone too: none may run on while torch finalizes


def _forget_parent_saves() -> None:
    """In a forked child, every writer starts empty (see :meth:`Writer._forget_parent`)."""
    parent = os.getppid()
    for writer in list(_WRITERS):
        writer._forget_parent(parent)


threading._register_atexit(_drain_at_exit)  # private, but the only hook that runs early enough
os.register_at_fork(after_in_child=_forget_parent_saves)


def _waiter() -> Any:
    """A held lock that one waiter blocks on until someone releases it (a C lock: no Python code inside)."""
    lock = _thread.allocate_lock()
    lock.acquire()
    return lock


class AsyncSaveFailed(TrainStateError):
    """A background save failed; its original exception is chained as ``__cause__``.

    Nothing of it was published: the pointer did not move and no partial
    generation is visible. The next save may proceed.
    """


class SaveHandle:
    """One background save: ``done()``, ``wait()`` / ``result()`` (the GenerationInfo or the failure)."""

    def __init__(self, generation: str, writer: Writer):
        self.generation = generation
        self._writer = writer
        self._finished = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._waiters: list[Any] = []  # locks released when it finishes (guarded by the writer's lock)
        self._forked_from: int | None = None  # in a forked child: the process it is in flight in

    def done(self) -> bool:
        """Whether the save has finished: published, or failed (``wait`` then raises)."""
        return self._finished

    def wait(self, timeout: float | None = None) -> Any:
        """Block until published; return its GenerationInfo, or raise :class:`AsyncSaveFailed`.

        A failure raised here is not raised again by the manager. Raises
        ``TimeoutError`` if ``timeout`` seconds pass first.
        """
        if not self._writer._wait_for(self, timeout):
            raise TimeoutError(f"background save of {self.generation} still in flight after {timeout} s")
        if self._forked_from is not None:
            raise AsyncSaveFailed(
                f"background save of {self.generation} was in flight in process {self._forked_from} when this "
                "process was forked from it; that process publishes or reports it, and this one cannot wait for "
                "it. To see it here, wait for background saves before forking.")
        if self._error is not None:
            self._writer._mark_reported(self)
            raise AsyncSaveFailed(f"background save of {self.generation} failed: {type(self._error).__name__}: "
                                  f"{self._error}. Nothing of it was published; the previous latest stands."
                                  ) from self._error
        return self._result

    result = wait

    def __repr__(self) -> str:
        state = ("running" if not self._finished else "forked away" if self._forked_from is not None
                 else "failed" if self._error is not None else "published")
        return f"SaveHandle({self.generation!r}, {state})"


class Ticket:
    """One background save on its way from a slot claim to the writer; ``handle`` once handed off."""

    __slots__ = ("handle", "job")

    def __init__(self) -> None:
        self.handle: SaveHandle | None = None
        self.job: Callable[[], Any] | None = None


class Writer:
    """One writer thread, a bounded number of saves in flight, and unreported failures.

    A background save, on the caller's thread: a :class:`Ticket`, then
    :meth:`reserve` (waits for a free slot, claims it), staging into the
    slot's buffers, :meth:`hand_off` (from then on the writer owns slot and
    job); if anything raises on the way, :meth:`settle` frees the slot unless
    the hand-off happened. A writer thread runs from a hand-off until the
    queue is empty, publishing in hand-off order.
    """

    def __init__(self, max_in_flight: int):
        if type(max_in_flight) is not int or max_in_flight < 1:
            raise InvalidArgument(f"max_in_flight must be a positive int, got {max_in_flight!r}")
        self.max_in_flight = max_in_flight
        self._pool = [StagingBuffers() for _ in range(max_in_flight)]  # slot i stages into _pool[i]
        self.high_water = 0  # most saves ever in flight at once (for tests and status)
        self._reset()
        _WRITERS.add(self)

    def _reset(self) -> None:
        """No slot claimed, nothing queued, no writer thread, no failures."""
        self._lock = threading.Lock()  # C-level: `with` takes and releases it with no Python code between
        self._claims: dict[int, Ticket] = {}  # slot -> the save holding it
        self._queue: deque[Ticket] = deque()  # handed off, in order; the head is being written
        self._slot_waiters: list[Any] = []  # released whenever a slot is freed
        self._serving: object | None = None  # the running writer thread's token
        self._threads = 0  # writer threads started and not yet returned
        self._unreported: list[SaveHandle] = []
        self.abandoned: list[str] = []  # saves left in flight by abandon(); never waited for again

    def in_flight(self) -> int:
        with self._lock:
            return len(self._queue)

    def preallocate(self, tensors: dict[str, torch.Tensor]) -> int:
        """Every slot's buffers for ``tensors``, allocated and faulted in (see :meth:`StagingBuffers.preallocate`)."""
        return sum(buffers.preallocate(tensors) for buffers in self.free_buffers())

    def free_buffers(self) -> list[StagingBuffers]:
        """The buffers of every slot no save holds now."""
        with self._lock:
            return [buffers for slot, buffers in enumerate(self._pool) if slot not in self._claims]

    # the caller's side of a save ----------------------------------------------
    def reserve(self, ticket: Ticket) -> StagingBuffers:
        """Wait for a free slot (backpressure) and claim it for ``ticket``; returns its buffers."""
        while True:
            waiter = _waiter()
            with self._lock:
                for slot, buffers in enumerate(self._pool):
                    if slot not in self._claims:
                        self._claims[slot] = ticket  # the claim: one store, where settle() looks for it
                        return buffers
                self._slot_waiters.append(waiter)
            waiter.acquire()

    def hand_off(self, ticket: Ticket, generation: str, job: Callable[[], Any]) -> SaveHandle:
        """Queue ``job`` (which publishes ``generation`` from ``ticket``'s buffers) for the writer thread.

        The append to the queue is the last step: before it the caller owns
        the slot, after it the writer does.
        """
        ticket.handle, ticket.job = SaveHandle(generation, self), job
        with self._lock:
            if self._serving is None:
                self._start_writer()
            self.high_water = max(self.high_water, len(self._queue) + 1)
            self._queue.append(ticket)  # the hand-off
        return ticket.handle

    def settle(self, ticket: Ticket) -> bool:
        """After an exception in a save: True if the writer owns ``ticket``; otherwise free its slot.

        It may follow an interrupt anywhere between the claim and the
        hand-off, so it asks the writer's state, not the caller's locals:
        handed off means queued, or already finished.
        """
        with self._lock:
            if ticket in self._queue or (ticket.handle is not None and ticket.handle._finished):
                return True
            freed = self._unclaim(ticket)
            waiters, self._slot_waiters = (self._slot_waiters, []) if freed else ([], self._slot_waiters)
        for waiter in waiters:
            waiter.release()
        return False

    def _unclaim(self, ticket: Ticket) -> bool:
        slots = [slot for slot, owner in self._claims.items() if owner is ticket]
        for slot in slots:
            del self._claims[slot]
        return bool(slots)

    # the writer thread ---------------------------------------------------------
    def _start_writer(self) -> None:
        """Start a writer thread (under the lock, so it first sees the queue after this hand-off)."""
        token = object()
        # Not threading.Thread: its start() waits on an Event, whose lock an interrupt can leave held,
        # and the new thread would then hang before publishing anything.
        self._threads += 1
        try:
            _thread.start_new_thread(self._run, (token,))
        except BaseException:
            self._threads -= 1
            raise
        self._serving = token  # recorded after the start: a thread whose token never was stops at once

    def _run(self, token: object) -> None:
        try:
            self._serve(token)  # its frame, and every object the save held, is gone when this returns
        finally:
            with self._lock:
                self._threads -= 1

    def wait_for_threads(self, timeout_s: float) -> None:
        """Wait (bounded) until every writer thread has returned, not only finished its saves."""
        deadline = time.monotonic() + timeout_s
        while self._threads and time.monotonic() < deadline:
            time.sleep(0.005)

    def _serve(self, token: object) -> None:
        """Publish the queued saves in order; stop when the queue is empty."""
        while True:
            with self._lock:
                if self._serving is not token:  # its start was interrupted before it was recorded
                    return
                if not self._queue:  # the hand-off that started it was interrupted before the append
                    self._serving = None
                    return
                ticket = self._queue[0]
            result, failed = None, None
            try:
                result = ticket.job()
            except BaseException as exc:  # raised to the caller later, once
                failed = exc
            if self._finish(ticket, result, failed):
                return

    def _finish(self, ticket: Ticket, result: Any, failed: BaseException | None) -> bool:
        """Record the outcome, free the slot, then wake the waiters; True when the queue is now empty.

        All of it is recorded before anyone wakes: a waiter woken by the
        result finds a failure already among the unreported ones.
        """
        handle = ticket.handle
        with self._lock:
            self._queue.popleft()
            self._unclaim(ticket)
            handle._result, handle._error, handle._finished = result, failed, True
            if failed is not None:
                self._unreported.append(handle)
            waiters = handle._waiters + self._slot_waiters
            handle._waiters, self._slot_waiters = [], []
            idle = not self._queue
            if idle:
                self._serving = None  # this thread stops; the next hand-off starts another
        if failed is not None:
            log.error("background save of %s failed: %r", handle.generation, failed)
        for waiter in waiters:
            waiter.release()
        return idle

    # waiting and reporting -----------------------------------------------------
    def _wait_for(self, handle: SaveHandle, timeout: float | None = None) -> bool:
        """Block until ``handle``'s save has finished; False if ``timeout`` seconds passed first."""
        waiter = _waiter()
        with self._lock:
            if handle._finished:
                return True
            handle._waiters.append(waiter)
        if timeout is None:
            return waiter.acquire()
        return waiter.acquire(timeout=min(max(timeout, 0.0), threading.TIMEOUT_MAX))

    def _mark_reported(self, handle: SaveHandle) -> None:
        with self._lock:
            if handle in self._unreported:
                self._unreported.remove(handle)

    def drain(self) -> None:
        """Wait for every save in flight (failures stay unreported)."""
        with self._lock:
            pending = [ticket.handle for ticket in self._queue]
        for handle in pending:
            self._wait_for(handle)

    def raise_unreported(self) -> None:
        """Raise the oldest unreported failure (once), with its original exception chained."""
        with self._lock:
            if not self._unreported:
                return
            handle = self._unreported[0]
        handle.wait()

    def failures(self) -> list[tuple[str, BaseException | None]]:
        """Unreported failures: (generation, original exception)."""
        with self._lock:
            return [(h.generation, h._error) for h in self._unreported]

    def unreported(self) -> list[str]:
        with self._lock:
            return [h.generation for h in self._unreported]

    def shutdown(self) -> None:
        """Finish every save in flight (the writer thread stops by itself once the queue is empty), then let go
        of every slot's buffers: a closed manager holds no host copy of the state, pinned or not."""
        self.drain()
        with self._lock:
            idle = not self._claims and not self._queue
        if idle:
            pinned = self.held()[1]
            for buffers in self._pool:
                buffers.release()
            empty = getattr(torch._C, "_accelerator_emptyHostCache", None)
            if pinned and empty is not None and torch.cuda.is_available():
                empty()  # the cached pinned blocks back to the system, not kept for a manager that is gone

    def held(self) -> tuple[int, int]:
        """Host bytes held by every slot's buffers, and how many of them are pinned."""
        counts = [buffers.held() for buffers in self._pool]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    def note_unreported(self, failing: BaseException) -> None:
        """Report every unreported failure beside ``failing``, the exception propagating through a close: logged,
        and added to it as a note (Python 3.11+), never raised over it."""
        with self._lock:
            handles, self._unreported = self._unreported, []
        for handle in handles:
            text = (f"trainstate: background save of {handle.generation} had failed too: "
                    f"{type(handle._error).__name__}: {handle._error}; nothing of it was published")
            log.error("%s", text)
            if hasattr(failing, "add_note"):
                failing.add_note(text)

    def abandon(self) -> list[str]:
        """Stop waiting for the saves in flight, as a crash would leave them; returns their generations.

        For a multi-rank close while an exception propagates: a background save there waits on collectives
        with ranks that may never join it, so nothing waits for it again (neither :meth:`drain` at
        interpreter exit nor the report of unreported failures). The writer thread goes on while the process
        lives; the publication protocol makes an interrupted save invisible, never partial.
        """
        with self._lock:
            self.abandoned = [ticket.handle.generation for ticket in self._queue]
        return self.abandoned

    # fork ----------------------------------------------------------------------
    def _forget_parent(self, parent: int) -> None:
        """In a forked child: start empty; the parent's saves and failures stay the parent's.

        Every lock is replaced, never acquired: the parent's writer thread may
        have held one at the fork, and that thread does not exist here.
        """
        for ticket in self._queue:
            ticket.handle._forked_from, ticket.handle._waiters, ticket.handle._finished = parent, [], True
        self._reset()


def report_at_exit(writer: Writer, directory: str) -> None:
    """Never lose a background failure silently, even if close() was never called."""
    if not writer.abandoned:
        writer.drain()
    for generation, cause in writer.failures():
        message = (f"trainstate: background save of {generation} in {directory} failed and was never reported "
                   f"(close() or wait() was not called); it was not published. Cause: {cause!r}")
        print(message, file=sys.stderr)  # printed, not logged: logging may already be shut down
