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
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .errors import TrainStateError

log = logging.getLogger("trainstate")
_WRITERS: weakref.WeakSet = weakref.WeakSet()


def _drain_at_exit() -> None:
    """Finish every background save before interpreter shutdown stops thread pools from taking work.

    Registered after ``concurrent.futures`` registers its own exit hook, so it
    runs first: a save in flight at a normal exit is published, not failed.
    """
    for writer in list(_WRITERS):
        writer.drain()


threading._register_atexit(_drain_at_exit)  # private, but the only hook that runs early enough


class AsyncSaveFailed(TrainStateError):
    """A background save failed; its original exception is chained as ``__cause__``.

    Nothing of it was published: the pointer did not move and no partial
    generation is visible. The next save may proceed.
    """


class StagingBuffers:
    """Host buffers for one in-flight save, reused while the layout stays the same."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into owned buffers; returns the copies, complete when this returns."""
        pinned = torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors.values())
        for name in [n for n in self._buffers if n not in tensors]:
            del self._buffers[name]
        copies: dict[str, torch.Tensor] = {}
        streams: dict[torch.device, Any] = {}
        for name, tensor in tensors.items():
            buffer = self._buffers.get(name)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                     pin_memory=pinned and tensor.device.type == "cuda")
                self._buffers[name] = buffer
            if tensor.device.type == "cuda":
                stream = streams.get(tensor.device)
                if stream is None:
                    stream = streams[tensor.device] = torch.cuda.Stream(tensor.device)
                    stream.wait_stream(torch.cuda.current_stream(tensor.device))  # pending kernels first
                with torch.cuda.stream(stream):
                    buffer.copy_(tensor.detach(), non_blocking=buffer.is_pinned())
            else:
                buffer.copy_(tensor.detach())
            copies[name] = buffer
        for stream in streams.values():
            stream.synchronize()  # the copy must be complete before the caller may mutate the source
        return copies

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())


class SaveHandle:
    """One background save: ``done()``, ``wait()`` / ``result()`` (the GenerationInfo or the failure)."""

    def __init__(self, generation: str, future: Future, reported: Callable[[SaveHandle], None]):
        self.generation = generation
        self._future = future
        self._reported = reported

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until published; return its GenerationInfo, or raise :class:`AsyncSaveFailed`.

        A failure raised here is not raised again by the manager.
        """
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise
        except BaseException as exc:
            self._reported(self)
            raise AsyncSaveFailed(f"background save of {self.generation} failed: {type(exc).__name__}: {exc}. "
                                  "Nothing of it was published; the previous latest stands.") from exc

    result = wait

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._future.exception() else "published")
        return f"SaveHandle({self.generation!r}, {state})"


class Writer:
    """One writer thread, a bounded number of saves in flight, and unreported failures."""

    def __init__(self, max_in_flight: int):
        if type(max_in_flight) is not int or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be a positive int, got {max_in_flight!r}")
        self.max_in_flight = max_in_flight
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._pool = [StagingBuffers() for _ in range(max_in_flight)]
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight: list[SaveHandle] = []
        self._unreported: list[SaveHandle] = []
        self.high_water = 0  # most saves ever in flight at once (for tests and status)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def acquire(self) -> StagingBuffers:
        """Wait for a free slot (backpressure); returns that slot's buffers."""
        self._slots.acquire()
        with self._lock:
            return self._pool.pop()

    def release_unused(self, buffers: StagingBuffers) -> None:
        with self._lock:
            self._pool.append(buffers)
        self._slots.release()

    def submit(self, generation: str, buffers: StagingBuffers, job: Callable[[], Any]) -> SaveHandle:
        handle: SaveHandle | None = None

        def run() -> Any:
            # The bookkeeping happens here, on the writer thread, before the future resolves: a waiter
            # woken by the result must find the failure already recorded (done-callbacks run later).
            failed: BaseException | None = None
            try:
                return job()
            except BaseException as exc:
                failed = exc
                raise
            finally:
                with self._lock:  # submit holds it until `handle` exists
                    self._in_flight.remove(handle)
                    if failed is not None:
                        self._unreported.append(handle)
                        log.error("background save of %s failed: %r", generation, failed)
                    self._pool.append(buffers)
                self._slots.release()

        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainstate-writer")
                _WRITERS.add(self)
            future = self._executor.submit(run)
            handle = SaveHandle(generation, future, self._mark_reported)
            self._in_flight.append(handle)
            self.high_water = max(self.high_water, len(self._in_flight))
        return handle

    def _mark_reported(self, handle: SaveHandle) -> None:
        with self._lock:
            if handle in self._unreported:
                self._unreported.remove(handle)

    def drain(self) -> None:
        """Wait for every save in flight (failures stay unreported)."""
        with self._lock:
            pending = list(self._in_flight)
        for handle in pending:
            handle._future.exception()  # waits without raising

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
            return [(h.generation, h._future.exception()) for h in self._unreported]

    def unreported(self) -> list[str]:
        with self._lock:
            return [h.generation for h in self._unreported]

    def shutdown(self) -> None:
        self.drain()
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
