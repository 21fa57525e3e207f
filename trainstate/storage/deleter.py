"""Deleting pruned generations off the save path.

A removal is two steps: a rename of the generation to a trash name (atomic
and fsynced: from then on no reader can pick it, and a crash leaves only
trash that the next save's cleanup removes), then the deletion of its files,
which for a large generation costs as much as a fraction of the save itself.
:class:`BackgroundDeleter` runs the second step on a thread of its own. The
store joins it before it unlocks the directory (``close``), and its pending
trash is not a leftover for the cleanup of the next save (the deleter is
already removing it). A process killed mid-deletion leaves trash, never a
generation with files missing under its real name.
"""

from __future__ import annotations

import _thread
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("trainstate")


class BackgroundDeleter:
    """Deletes trash directories one after another on a thread of its own.

    Only C-level locks, as in :mod:`trainstate.asyncsave`: a Ctrl-C can land
    between any two Python-level steps of the caller, and a
    ``threading.Condition`` runs Python code while holding its lock (an
    interrupt there would leave it held, and every later save would hang).
    """

    def __init__(self, rmtree: Callable[[Path], None]):
        self._rmtree = rmtree
        self._queue: deque[Path] = deque()
        self._busy: set[str] = set()  # names queued or being deleted
        self._lock = _thread.allocate_lock()
        self._running = False

    def submit(self, trash: Path) -> None:
        with self._lock:
            self._queue.append(trash)
            self._busy.add(trash.name)
            if not self._running:  # an interrupt between these two lines at worst starts a second thread
                _thread.start_new_thread(self._run, ())
                self._running = True

    def pending(self) -> set[str]:
        with self._lock:
            return set(self._busy)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every submitted deletion finished; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._busy:
                    return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                trash = self._queue.popleft()
            try:
                self._rmtree(trash)
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 - left as trash: the next save's cleanup tries again
                log.warning("could not delete %s in the background (%s); the next save removes it", trash, exc)
            finally:
                with self._lock:
                    self._busy.discard(trash.name)
