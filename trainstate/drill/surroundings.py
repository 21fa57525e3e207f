"""What a drill worker runs in besides its training: a slower disk (``--slow-fsync``), a mirror (``--mirror``)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..storage.posix import PosixOps

if TYPE_CHECKING:
    from ..manager import CheckpointManager

MIRROR_OPTIONS_ENV = "TRAINSTATE_DRILL_MIRROR_OPTIONS"  # with --mirror: its storage options, JSON


class Uploads:
    """``--mirror``: print ``uploaded <n>`` once the remote ``latest`` reaches update ``n`` (no-op without).

    The manager's thread uploads; the worker polls its status after each update
    (and after close, which waits) while what it saved or restored is not remote.
    """

    def __init__(self, ckpt: CheckpointManager | None, say: Callable[[str], None]):
        self._ckpt, self._say = ckpt, say
        self._remote = self._wanted = ckpt.status().mirror.remote_update if ckpt else None

    def wanted(self, update: int) -> None:
        self._wanted = update
        self.poll()

    def poll(self) -> None:
        if self._ckpt is None or self._wanted is None or (self._remote is not None and self._remote >= self._wanted):
            return
        update = self._ckpt.status().mirror.remote_update
        if update != self._remote:
            self._remote = update
            self._say(f"uploaded {update}")


class SlowFsync(PosixOps):
    """``--slow-fsync MS``: a slower disk, every file fsync taking MS milliseconds longer (then the real one)."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def fsync(self, fd: int) -> None:
        time.sleep(self.delay_s)
        super().fsync(fd)


def mirror_options() -> dict[str, Any] | None:
    """The storage options of ``--mirror``: JSON in ``$TRAINSTATE_DRILL_MIRROR_OPTIONS`` (keys stay off argv)."""
    return json.loads(os.environ.get(MIRROR_OPTIONS_ENV) or "null")
