"""Local POSIX storage: the only module that calls fsync and rename.

Publication of one generation::

    mkdir   .trainstate-staging-<gen>-<token>/         invisible to readers
    write   each file, digest computed on the bytes written
    fsync   each file; meanwhile re-read it and compare digests
    fsync   the staging directory                       its entries are durable
    rename  staging -> gen-<update>                     atomic on one filesystem
    fsync   the run directory                           the rename is durable

The pointer is replaced the same way at file level (temp file, fsync,
``os.replace``, fsync of the directory), so there is never a moment with no
pointer. Pruning renames a generation to a trash name first, so a crash mid-delete
never leaves a half-deleted directory that looks like a generation.

A failed fsync is never retried: the kernel may already have dropped the dirty
pages, so the staging area is abandoned and the error raised.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import stat
import threading
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from ..format.digest import Hasher, digest_stream, new_hasher
from ..errors import CorruptGeneration, DirectoryLocked, GenerationExists, TrainStateError
from ..format.manifest import FileRecord, newest_first

LOCK_FILE = ".trainstate.lock"
_PREFIX = ".trainstate-"
_LEFTOVER_RE = re.compile(r"\.trainstate-(staging|trash|tmp)-[A-Za-z0-9._-]{1,80}-[0-9a-f]{16}")
_LOCK_HOLDERS: weakref.WeakSet = weakref.WeakSet()
_KEPT_COPIES_LIMIT = 64 << 20  # coalesced small-tensor copies held for digesting after the write


def _drop_inherited_locks() -> None:
    """In a forked child (a DataLoader worker, say), let go of the parent's directory locks.

    A flock belongs to the open file description, which fork shares: a child
    that kept it would hold the run directory locked after the parent closed
    its manager, or after the parent was killed, until the child exits.
    Closing the child's descriptor (never LOCK_UN, which would release the
    parent's lock too) leaves the lock with the parent alone.
    """
    for store in list(_LOCK_HOLDERS):
        if store._lock_fd is not None:
            try:
                os.close(store._lock_fd)
            except OSError:
                pass
            store._lock_fd = None
    _LOCK_HOLDERS.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def _token() -> str:
    return secrets.token_hex(8)


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


class LocalStaging:
    """A staging directory for one generation; see the module docstring."""

    def __init__(self, store: LocalStore, generation: str):
        self.generation = generation
        self._store = store
        self._ops = store.ops
        self.path = store.root / f"{_PREFIX}staging-{generation}-{_token()}"
        self._ops.mkdir(self.path)

    def write(self, file: str, chunks: Iterable[bytes | memoryview], *, stable: bool = False) -> FileRecord:
        hasher = new_hasher(self._store.digest_algorithm)
        fd = self._ops.create(self.path / file)
        try:
            if stable:
                size = self._write_then_hash_during_sync(fd, coalesce(chunks), hasher)
                digest = hasher.hexdigest()
            else:
                size = _hash_while_writing(self._ops, fd, coalesce(chunks), hasher)
                digest = hasher.hexdigest()
                self._sync_and_read_back(fd, file, size, digest)
        finally:
            self._ops.close(fd)
        return FileRecord(file, size, digest)

    def _write_then_hash_during_sync(self, fd: int, views: Iterable[memoryview], hasher: Hasher) -> int:
        """Write every view at full speed, then digest the same (unchanged) views while fsync runs.

        For sources that stay unchanged until this returns (CPU tensors during a
        blocking save, owned staging buffers in a background one): the write
        gets the memory bandwidth to itself, and the digest costs nothing
        while the disk flushes. The digest is of the bytes handed to write().
        """
        kept: list[memoryview] = []
        size = copied = 0
        for view in views:
            _write_all(self._ops, fd, view)
            kept.append(view)
            size += len(view)
            if isinstance(view.obj, bytearray):  # a coalesced copy of small tensors, not source memory
                copied += len(view)
                if copied > _KEPT_COPIES_LIMIT:  # bound the copies held: digest what is kept so far, in order
                    for done in kept:
                        hasher.update(done)
                    kept.clear()
                    copied = 0
        def digest_kept() -> None:
            for view in kept:
                hasher.update(view)

        _fsync_beside(self._ops, fd, digest_kept)
        return size

    def _sync_and_read_back(self, fd: int, file: str, size: int, digest: str) -> None:
        """fsync ``fd`` while re-reading the file to check what landed in it."""
        got: list[tuple[int, str]] = []

        def read_back() -> None:
            with open_regular(self.path / file) as stream:
                got.append(digest_stream(stream, self._store.digest_algorithm))

        _fsync_beside(self._ops, fd, read_back)
        read_size, read_digest = got[0]
        if (read_size, read_digest) != (size, digest):
            raise TrainStateError(
                f"read-back of staged {file} for {self.generation} does not match what was written "
                f"({read_size} bytes, digest {read_digest[:16]}... vs {size}, {digest[:16]}...); "
                "the generation was abandoned. Check the disk and memory of this machine.")

    def commit(self) -> None:
        final = self._store.root / self.generation
        if os.path.lexists(final):
            raise GenerationExists(f"{final} already exists; a published generation is never overwritten")
        self._ops.fsync_dir(self.path)
        self._ops.rename(self.path, final)
        self._ops.fsync_dir(self._store.root)

    def abort(self) -> None:
        """Best effort: if removal fails too, the next save's cleanup removes the leftover."""
        try:
            self._ops.rmtree(self.path)
        except OSError:
            pass


class LocalStore:
    """Generations as directories on one local POSIX filesystem."""

    def __init__(self, root: str | Path, digest_algorithm: str = "blake3", *, create: bool = True,
                 ops: PosixOps | None = None):
        self.root = Path(root)
        self.ops = ops if ops is not None else PosixOps()
        self.location = str(self.root)
        self.digest_algorithm = digest_algorithm
        self._lock_fd: int | None = None
        if create:
            self.root.mkdir(parents=True, exist_ok=True)

    # reading -----------------------------------------------------------------
    def _names(self) -> list[str]:
        try:
            return os.listdir(self.root)
        except FileNotFoundError:
            return []

    def generations(self) -> list[str]:
        return [n for n in newest_first(self._names()) if (self.root / n).is_dir() and not (self.root / n).is_symlink()]

    def leftovers(self) -> list[str]:
        return sorted(n for n in self._names() if _LEFTOVER_RE.fullmatch(n))

    def files(self, generation: str) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        with os.scandir(self.root / generation) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                out[entry.name] = st.st_size if stat.S_ISREG(st.st_mode) else None
        return out

    def open(self, generation: str, file: str) -> BinaryIO:
        return open_regular(self.root / generation / file)

    def path(self, generation: str, file: str = "") -> Path:
        return self.root / generation / file if file else self.root / generation

    def read_pointer(self, name: str) -> bytes | None:
        """The pointer's bytes; ``None`` if absent. A pointer that is not a readable
        regular file raises :class:`CorruptGeneration`, which readers treat like garbage."""
        try:
            with open_regular(self.root / name) as stream:
                return stream.read(1 << 20)
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise CorruptGeneration(str(self.root / name), "is not a regular file") from None
        except OSError as exc:
            raise CorruptGeneration(str(self.root / name), f"unreadable ({exc.strerror})") from None

    # writing -----------------------------------------------------------------
    def begin(self, generation: str) -> LocalStaging:
        return LocalStaging(self, generation)

    def write_pointer(self, name: str, data: bytes) -> None:
        ops = self.ops
        tmp = self.root / f"{_PREFIX}tmp-{name}-{_token()}"
        fd = ops.create(tmp)
        try:
            try:
                _write_all(ops, fd, memoryview(data))
                ops.fsync(fd)
            finally:
                ops.close(fd)
            target = self.root / name
            if target.is_dir() and not target.is_symlink():
                # Something that is not our pointer occupies its name; keep it, out of the way.
                ops.rename(target, self.root / f"{name}.rejected-{_token()}")
            ops.replace(tmp, target)
        except BaseException:
            try:
                ops.unlink(tmp)
            except OSError:
                pass  # the next save's cleanup removes it
            raise
        ops.fsync_dir(self.root)

    def remove(self, generation: str) -> None:
        trash = self.root / f"{_PREFIX}trash-{generation}-{_token()}"
        self.ops.rename(self.root / generation, trash)
        self.ops.fsync_dir(self.root)
        self.ops.rmtree(trash)

    def set_aside(self, generation: str, reason: str) -> str:
        """Rename a generation out of sight of restore and cleanup, keeping its files as evidence."""
        aside = f"{generation}.{reason}-{_token()}"
        self.ops.rename(self.root / generation, self.root / aside)
        self.ops.fsync_dir(self.root)
        return aside

    def clean_leftovers(self) -> list[str]:
        removed = []
        for name in self.leftovers():
            path = self.root / name
            if path.is_dir() and not path.is_symlink():
                self.ops.rmtree(path)
            elif path.exists() or path.is_symlink():
                self.ops.unlink(path)
            removed.append(name)
        return removed

    def lock(self) -> None:
        if self._lock_fd is not None:
            return
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise DirectoryLocked(
                f"{self.root} is being written by another process (pid {holder}); only one manager may "
                "write a run directory. Stop the other run, or give this one its own directory.") from None
        # The kernel drops a flock when its holder dies, even by SIGKILL: no stale locks.
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        _LOCK_HOLDERS.add(self)

    @contextlib.contextmanager
    def exclusive(self, name: str) -> Iterator[None]:
        """A short, blocking, cross-process mutex (``.trainstate.<name>.lock``), e.g. pins against prune."""
        fd = os.open(self.root / f".trainstate.{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def free_bytes(self) -> int | None:
        """Bytes available to this process on the directory's filesystem."""
        try:
            info = os.statvfs(self.root)
        except OSError:
            return None
        return info.f_bavail * info.f_frsize

    def unlock(self) -> None:
        if self._lock_fd is not None:
            # Explicitly, in case a forked child still shares the description (see _drop_inherited_locks).
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None
            _LOCK_HOLDERS.discard(self)
