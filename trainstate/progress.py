"""Byte progress bars for long operations: tqdm on stderr when shown, a no-op object otherwise.

Library functions that take long accept ``on_bytes: OnBytes | None = None``
and call it with each batch of bytes read, checked or written (from any
thread); callers that want a bar pass ``bar(...).update``. tqdm is imported
only when a bar is actually shown, and never writes to stdout.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

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

    def __init__(self, total_bytes: int | None, desc: str, enabled: bool | None = None) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._tqdm: Any = None
        if auto(enabled):
            from tqdm import tqdm  # imported only when a bar is shown
            self._tqdm = tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                              file=sys.stderr, leave=False, dynamic_ncols=True)

    def update(self, n_bytes: int) -> None:
        with self._lock:
            self.count += n_bytes
            if self._tqdm is not None:
                self._tqdm.update(n_bytes)

    def close(self) -> None:
        with self._lock:
            if self._tqdm is not None:
                self._tqdm.close()
                self._tqdm = None

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bar(total_bytes: int | None, desc: str, enabled: bool | None = None) -> Bar:
    return Bar(total_bytes, desc, enabled)


def add_flag(parser: Any) -> None:
    """``--progress/--no-progress`` on an argparse parser; unset (None) means: on when stderr is a terminal."""
    import argparse
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="byte progress bar on stderr (default: only when stderr is a terminal)")
