"""The POSIX calls of the publication protocol, and the write helpers around them.

:class:`PosixOps` is the only place that creates, writes, fsyncs, renames or
removes anything for a local run directory (:mod:`trainstate.storage.local`
decides the order); tests substitute a recording or fault-injecting subclass
and so exercise the very code path production runs. The helpers write chunks
while digesting them, and run work beside an fsync.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from ..errors import CorruptGeneration
from ..format.digest import Hasher


class PosixOps:
    """The mutating filesystem calls of the publication protocol, and nothing else.

    Every create, write, fsync, rename and removal the store performs goes
    through one of these methods, so a test can substitute a recording or
    fault-injecting subclass and exercise the very code path production runs.
    """

    def mkdir(self, path: Path) -> None:
        os.mkdir(path)

    def create(self, path: Path) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)

    def replace(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)

    def link(self, src: Path, dst: Path) -> None:
        """A second name for an existing file (a hard link; the link itself is durable once ``dst``'s directory
        is fsynced)."""
        os.link(src, dst, follow_symlinks=False)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def rmtree(self, path: Path) -> None:
        shutil.rmtree(path)


def open_regular(path: str | Path) -> BinaryIO:
    """Open a regular file for reading without following a final symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptGeneration(str(path), "is a symbolic link, not a regular file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptGeneration(str(path), "is not a regular file")
    return os.fdopen(fd, "rb")


def coalesce(chunks: Iterable[bytes | memoryview], limit: int = 4 << 20) -> Iterator[memoryview]:
    """Merge small chunks (one per small tensor) into writes of about ``limit`` bytes.

    Large chunks pass through without a copy; only small ones are copied, so a
    state of many small tensors costs a few large writes instead of thousands
    of tiny ones.
    """
    pending = bytearray()
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        if len(view) >= limit:
            if pending:
                yield memoryview(pending)
                pending = bytearray()
            yield view
            continue
        pending += view
        if len(pending) >= limit:
            yield memoryview(pending)
            pending = bytearray()
    if pending:
        yield memoryview(pending)


def _hash_while_writing(ops: PosixOps, fd: int, views: Iterable[memoryview], hasher: Hasher) -> int:
    """Write ``views`` to ``fd`` while a second thread digests the same views, in order.

    The digest is of the bytes handed to write(), computed beside the write
    rather than before it, so hashing does not lengthen the save. At most a few
    views are in flight, which bounds the memory held for chunks that are
    temporary copies (from CUDA, or coalesced small tensors).
    """
    size = 0
    in_flight: deque[Future] = deque()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainstate-digest") as hashing:
        try:
            for view in views:
                in_flight.append(hashing.submit(hasher.update, view))
                _write_all(ops, fd, view)
                size += len(view)
                while len(in_flight) > 4:
                    in_flight.popleft().result()
        except BaseException:
            for pending in in_flight:  # the file is abandoned: skip what has not started
                pending.cancel()
            raise
        for pending in in_flight:
            pending.result()
    return size


def _fsync_beside(ops: PosixOps, fd: int, work: Callable[[], None]) -> None:
    """Run ``work`` on this thread while ``fd`` is fsynced on another; raise the fsync's error, if any.

    The fsync is mostly waiting for the disk, which is when digesting costs nothing.
    A failed fsync is raised, never retried.
    """
    failure: list[BaseException] = []

    def sync() -> None:
        try:
            ops.fsync(fd)
        except BaseException as exc:  # re-raised below, on the caller's thread
            failure.append(exc)

    syncer = threading.Thread(target=sync, name="trainstate-fsync")
    syncer.start()
    try:
        work()
    finally:
        syncer.join()
    if failure:
        raise failure[0]


def _write_all(ops: PosixOps, fd: int, data: memoryview) -> None:
    while data:
        written = ops.write(fd, data)
        data = data[written:]
