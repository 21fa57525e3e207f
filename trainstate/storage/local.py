"""Local POSIX storage: the order of every fsync and rename (the calls themselves are in ``posix.py``).

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
import dataclasses
import errno
import fcntl
import os
import re
import secrets
import stat
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from ..errors import (CorruptGeneration, DirectoryLocked, GenerationExists, ReadOnlyDirectory, RunDirectoryGone,
                      TrainStateError)
from ..format.digest import FAST_CHUNKED, Hasher, digest_stream, new_hasher
from ..format.manifest import FileRecord, newest_first
from .deleter import BackgroundDeleter
from .posix import PosixOps, _fsync_beside, _hash_while_writing, _write_all, coalesce, open_regular

__all__ = ["LOCK_FILE", "LocalStaging", "LocalStore", "PosixOps", "coalesce", "open_regular"]

LOCK_FILE = ".trainstate.lock"
_PREFIX = ".trainstate-"
_LEFTOVER_RE = re.compile(r"\.trainstate-(staging|trash|tmp)-[A-Za-z0-9._-]{1,80}-[0-9a-f]{16}")
_ASIDE_RE = re.compile(r"(gen-\d{12}(?:-weights|-r\d{3})?|latest|latest-weights|pins|run-identity)\.(rejected|abandoned|superseded)-[0-9a-f]{16}")
ASIDE_REASONS = ("rejected", "abandoned", "superseded")
_READ_ONLY = (errno.EACCES, errno.EROFS, errno.EPERM)
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


def staging_name(generation: str, token: str) -> str:
    """The staging directory of ``generation`` begun with ``token``."""
    return f"{_PREFIX}staging-{generation}-{token}"


class LocalStaging:
    """A staging directory for one generation; see the module docstring."""

    def __init__(self, store: LocalStore, generation: str, joined: str | None = None, token: str | None = None):
        self.generation = generation
        self._store = store
        self._ops = store.ops
        if joined is None:
            self.path = store.root / staging_name(generation, token or _token())
            self._ops.mkdir(self.path)
        else:  # another rank's staging directory, on a filesystem the ranks share
            if not re.fullmatch(rf"{re.escape(_PREFIX)}staging-{re.escape(generation)}-[0-9a-f]{{16}}", joined):
                raise ValueError(f"{joined!r} is not a staging directory of {generation}")
            self.path = store.root / joined
            if not self.path.is_dir():
                raise FileNotFoundError(
                    f"{self.path} (created by rank 0) is not visible here: every rank must see the run directory "
                    "on one shared filesystem")
        self.name = self.path.name
    def write(self, file: str, chunks: Iterable[bytes | memoryview], *, stable: bool = False,
              algorithm: str | None = None, size_hint: int | None = None) -> FileRecord:
        algorithm = algorithm or self._store.digest_algorithm
        hasher = new_hasher(algorithm)
        fd = self._ops.create(self.path / file)
        try:
            if stable:
                size = self._write_then_hash_during_sync(fd, coalesce(chunks), hasher)
                digest = hasher.hexdigest()
            else:
                size = _hash_while_writing(self._ops, fd, coalesce(chunks), hasher)
                digest = hasher.hexdigest()
                self._sync_and_read_back(fd, file, size, digest, algorithm)
        finally:
            self._ops.close(fd)
        return FileRecord(file, size, digest, tuple(getattr(hasher, "chunks", ())))

    def link(self, file: str, generation: str, record: FileRecord) -> FileRecord | None:
        """Stage ``file`` as a hard link to the file of committed ``generation`` whose manifest recorded it as
        ``record`` (``record.name``: the same name, or a spare's twin): no byte is written, and the bytes are
        stored once for both. ``None`` where it cannot (the file is gone, is not a regular file of the recorded
        size, or the filesystem has no hard links): the caller writes the file instead."""
        source = self._store.root / generation / record.name
        try:
            st = os.lstat(source)
            if not stat.S_ISREG(st.st_mode) or st.st_size != record.size:
                return None
            self._ops.link(source, self.path / file)
        except OSError:
            return None
        return dataclasses.replace(record, name=file)

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

    def _sync_and_read_back(self, fd: int, file: str, size: int, digest: str, algorithm: str) -> None:
        """fsync ``fd`` while re-reading the file to check what landed in it."""
        got: list[tuple[int, str]] = []

        def read_back() -> None:
            with open_regular(self.path / file) as stream:
                got.append(digest_stream(stream, algorithm))

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

    def __init__(self, root: str | Path, digest_algorithm: str = FAST_CHUNKED, *, create: bool = True,
                 ops: PosixOps | None = None):
        self.root = Path(root)
        self.ops = ops if ops is not None else PosixOps()
        self.location = str(self.root)
        self.digest_algorithm = digest_algorithm
        self._lock_fd: int | None = None
        self._deleter: BackgroundDeleter | None = None
        self._identity: tuple[int, int, int, int] | None = None  # (dev, inode) of the directory and lock file
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                if exc.errno not in _READ_ONLY:
                    raise
                # reading needs no directory of our own; the first write names the problem (ReadOnlyDirectory)

    # reading -----------------------------------------------------------------
    def _names(self) -> list[str]:
        try:
            return os.listdir(self.root)
        except FileNotFoundError:
            return []

    def generations(self) -> list[str]:
        return [n for n in newest_first(self._names()) if (self.root / n).is_dir() and not (self.root / n).is_symlink()]

    def leftovers(self) -> list[str]:
        busy = self._deleter.pending() if self._deleter is not None else set()  # being deleted right now
        return sorted(n for n in self._names() if _LEFTOVER_RE.fullmatch(n) and n not in busy)

    def _generation_dir(self, generation: str) -> Path:
        """A generation's directory, refusing a symbolic link (the listing skips them; so must every reader)."""
        path = self.root / generation
        if path.is_symlink():
            raise CorruptGeneration(generation, "is a symbolic link, not a generation directory; a generation "
                                                "is never read through a link")
        return path

    def files(self, generation: str) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        with os.scandir(self._generation_dir(generation)) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                out[entry.name] = st.st_size if stat.S_ISREG(st.st_mode) else None
        return out

    def identity(self, generation: str) -> tuple[int, int]:
        """The generation directory's inode and modification time: another for a generation replaced under its
        own name (a weights-only one saved again at its update), whose file listing may be the same."""
        st = os.stat(self._generation_dir(generation))
        return st.st_ino, st.st_mtime_ns

    def open(self, generation: str, file: str) -> BinaryIO:
        return open_regular(self._generation_dir(generation) / file)

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
    def begin(self, generation: str, token: str | None = None) -> LocalStaging:
        """A new staging directory for ``generation``; ``token`` (16 hex digits) names it where other ranks must
        find it without being told (:func:`staging_name`), else a random one."""
        if token is not None and not re.fullmatch(r"[0-9a-f]{16}", token):
            raise ValueError(f"a staging token is 16 hex digits, not {token!r}")
        return LocalStaging(self, generation, token=token)

    def join(self, generation: str, staging: str) -> LocalStaging:
        """The staging directory ``staging`` another rank began, to write this rank's files into."""
        return LocalStaging(self, generation, staging)

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
        """Gone at once (an fsynced rename to trash); the files are deleted here, or in the background after
        :meth:`defer_removals` (see :mod:`trainstate.storage.deleter`)."""
        trash = self.root / f"{_PREFIX}trash-{generation}-{_token()}"
        self.ops.rename(self.root / generation, trash)
        self.ops.fsync_dir(self.root)
        if self._deleter is not None:
            self._deleter.submit(trash)
        else:
            self.ops.rmtree(trash)

    def defer_removals(self) -> None:
        """Delete removed generations' files on a background thread, joined by :meth:`unlock`."""
        if self._deleter is None:
            self._deleter = BackgroundDeleter(lambda path: self.ops.rmtree(path))

    def join_removals(self, timeout: float | None = None) -> bool:
        return self._deleter.join(timeout) if self._deleter is not None else True

    def set_aside(self, generation: str, reason: str) -> str:
        """Rename a generation out of sight of restore and cleanup, keeping its files as evidence."""
        if reason not in ASIDE_REASONS:
            raise ValueError(f"reason must be one of {ASIDE_REASONS}, got {reason!r}")
        aside = f"{generation}.{reason}-{_token()}"
        self.ops.rename(self.root / generation, self.root / aside)
        self.ops.fsync_dir(self.root)
        return aside

    def aside(self) -> list[str]:
        return sorted(n for n in self._names() if _ASIDE_RE.fullmatch(n))

    def reinstate(self, aside: str, generation: str) -> None:
        if os.path.lexists(self.root / generation):
            raise GenerationExists(f"cannot put {aside} back: {self.root / generation} exists")
        self.ops.rename(self.root / aside, self.root / generation)
        self.ops.fsync_dir(self.root)

    def clean_leftovers(self) -> list[str]:
        """Remove what interrupted writes left (staging directories, temporary files); one that vanishes while
        this runs was a write that finished (a timing record renamed into place by the training thread while a
        background save begins) and is not an error."""
        removed = []
        for name in self.leftovers():
            path = self.root / name
            try:
                if path.is_dir() and not path.is_symlink():
                    self.ops.rmtree(path)
                elif path.exists() or path.is_symlink():
                    self.ops.unlink(path)
            except FileNotFoundError:
                continue
            removed.append(name)
        return removed

    def lock(self) -> None:
        """Take the single-writer lock; while held, check the directory is still the one locked."""
        if self._lock_fd is not None:
            self._check_still_ours()
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if exc.errno in _READ_ONLY:
                raise ReadOnlyDirectory(
                    f"cannot write to {self.root} ({exc.strerror}): saving needs a run directory this process can "
                    "write. Reading (restore, ls, verify, inspect) works without it; to save, use a writable "
                    "directory, or copy the run to one.") from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            if holder == str(os.getpid()):
                raise DirectoryLocked(
                    f"{self.root} is already open for writing by another CheckpointManager in this process "
                    f"(pid {holder}); only one manager may write a run directory. Close the first one (or leave "
                    "its `with` block) before opening another, or use that one.") from None
            raise DirectoryLocked(
                f"{self.root} is being written by another process (pid {holder}); only one manager may "
                "write a run directory. Stop the other run, or give this one its own directory.") from None
        # The kernel drops a flock when its holder dies, even by SIGKILL: no stale locks.
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        here, lock = os.stat(self.root), os.fstat(fd)
        self._identity = (here.st_dev, here.st_ino, lock.st_dev, lock.st_ino)
        self._lock_fd = fd
        _LOCK_HOLDERS.add(self)

    def _check_still_ours(self) -> None:
        """The directory (and lock file) this lock was taken on must still be the one at ``root``.

        A run directory deleted, or deleted and recreated, while the manager
        holds it would otherwise fail deep in a save with a staging path, or
        let a second manager lock the new directory beside this one.
        """
        try:
            here, lock = os.stat(self.root), os.stat(self.root / LOCK_FILE)
            now = (here.st_dev, here.st_ino, lock.st_dev, lock.st_ino)
        except FileNotFoundError:
            now = None
        if now != self._identity:
            what = "was deleted" if now is None else "was deleted and created again (another writer may use it)"
            raise RunDirectoryGone(
                f"the run directory {self.root} {what} while this manager had it open; nothing more is written "
                "there. Restore from wherever the run's generations are now, in a new manager.")

    @contextlib.contextmanager
    def exclusive(self, name: str) -> Iterator[None]:
        """A short, blocking, cross-process mutex (``.trainstate.<name>.lock``), e.g. pins against prune."""
        try:
            fd = os.open(self.root / f".trainstate.{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if exc.errno in _READ_ONLY:
                raise ReadOnlyDirectory(f"cannot write to {self.root} ({exc.strerror}); changing pins or pruning "
                                        "needs a writable run directory") from None
            raise
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
        self.join_removals()  # no deletion of ours outlives our hold on the directory
        if self._lock_fd is not None:
            # Explicitly, in case a forked child still shares the description (see _drop_inherited_locks).
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None
            _LOCK_HOLDERS.discard(self)
