"""Byte progress bars for long operations: tqdm on stderr when shown, a no-op object otherwise.

Library functions that take long accept ``on_bytes: OnBytes | None = None``
and call it with each batch of bytes read, checked or written (from any
thread); callers that want a bar pass ``bar(...).update``. tqdm is imported
only when a bar is actually shown, and never writes to stdout.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Callable, Iterable

OnBytes = Callable[[int], None]  # told each batch of bytes once it is read, checked or written


def auto(enabled: bool | None) -> bool:
    """``None`` means: on when stderr is a terminal."""
    if enabled is not None:
        return enabled
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class Bar:
    """A byte counter; shows a tqdm bar on stderr when enabled. ``update`` is thread-safe."""

    def __init__(self, total_bytes: int | None, desc: str, enabled: bool | None = None, *,
                 deferred: bool = False) -> None:
        self.count = 0
        self.total, self.desc = total_bytes, desc
        self._lock = threading.Lock()
        self._tqdm: Any = None
        self._shown = auto(enabled)  # ``deferred``: drawn from the first restart, once the total is known
        if self._shown and not deferred:
            self._draw()

    def _draw(self) -> None:
        from tqdm import tqdm  # imported only when a bar is shown
        self._tqdm = tqdm(total=self.total, desc=self.desc, unit="B", unit_scale=True, unit_divisor=1024,
                          file=sys.stderr, leave=False, dynamic_ncols=True)

    def restart(self, total_bytes: int | None, desc: str) -> None:
        """Count again from zero towards a new total (a restore that falls back to an older generation)."""
        with self._lock:
            self.count = 0
            self.total, self.desc = total_bytes, desc
            if self._tqdm is not None:
                self._tqdm.reset(total=total_bytes)
                self._tqdm.set_description(desc, refresh=True)
            elif self._shown:
                self._draw()

    def update(self, n_bytes: int) -> None:
        with self._lock:
            self.count += n_bytes
            if self._tqdm is not None:
                self._tqdm.update(n_bytes)

    def close(self) -> None:
        with self._lock:
            self._shown = False
            if self._tqdm is not None:
                self._tqdm.close()
                self._tqdm = None

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bar(total_bytes: int | None, desc: str, enabled: bool | None = None) -> Bar:
    return Bar(total_bytes, desc, enabled)


def optional(total_bytes: int | None, desc: str, enabled: bool | None, *, deferred: bool = False) -> Bar | None:
    """The library's own opt-in (``CheckpointManager(progress=...)``): no counter at all when ``False``."""
    return None if enabled is False else Bar(total_bytes, desc, enabled, deferred=deferred)


def counted(chunks: Iterable[Any], meter: Bar | None) -> Iterable[Any]:
    """``chunks`` as they are handed on, each counted by its byte length once it has been taken."""
    if meter is None:
        yield from chunks
        return
    for chunk in chunks:
        yield chunk
        meter.update(memoryview(chunk).nbytes)


def add_flag(parser: Any) -> None:
    """``--progress/--no-progress`` on an argparse parser; unset (None) means: on when stderr is a terminal."""
    import argparse
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="byte progress bar on stderr (default: only when stderr is a terminal)")


def log_rate(verb: str, info: Any, seconds: float, note: str) -> None:
    """One INFO line per save and restore: what, how much, how long, how fast (``info``: a GenerationInfo)."""
    logging.getLogger("trainstate").info("%s %s: %s bytes in %.3f s (%.2f GB/s)%s", verb, info.name,
                                         f"{info.size:,}", seconds, info.size / 1e9 / max(seconds, 1e-9),
                                         f"; {note}" if note else "")
