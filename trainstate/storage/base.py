"""The storage interface a checkpoint manager publishes through.

Only the local POSIX backend exists today (``trainstate.storage.local``); an object
store (immutable objects plus a pointer written last) and a multi-rank commit
plug in here without changing the manager. Paths are plain ``str`` names so
that URLs survive.

Call order for one save, and who calls each step (the manager, always):

1. ``begin(generation)`` returns a :class:`Staging` area invisible to readers.
2. ``Staging.write(file, chunks)`` once per file: writes, digests and makes the
   file durable, returning its :class:`~trainstate.format.manifest.FileRecord`.
3. ``Staging.commit()`` makes the whole generation visible under its final
   name, durably and atomically. ``Staging.abort()`` discards it instead.
4. The manager verifies the committed generation through the read methods.
5. ``write_pointer(name, data)`` atomically replaces a small pointer object.
6. ``remove(generation)`` prunes, only after the pointer has moved.

Replacing a generation of the same name never removes it first: it is set
aside as ``superseded``, the replacement is published, and only after the
pointer has moved is the old one removed (or, if publishing fails, put back
with ``reinstate``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any
from typing import BinaryIO, Protocol

from ..format.manifest import FileRecord


class Staging(Protocol):
    generation: str
    name: str  # what another process passes to ``Store.join`` to write into this staging area

    def write(self, file: str, chunks: Iterable[bytes | memoryview], *, stable: bool = False,
              algorithm: str | None = None, size_hint: int | None = None) -> FileRecord:
        """Write one file from ``chunks``; return its size and digest once durable.

        ``algorithm``: the digest to compute (default: the store's), e.g. a
        copied generation's own, so the copy checks against its manifest.

        ``size_hint``: the bytes ``chunks`` will yield, when the caller knows;
        an object store sizes its multipart parts from it (at most 10,000
        parts per object). A backend with no such limit ignores it.

        ``stable``: the chunks' memory stays unchanged until this returns, so
        the backend may digest it after writing instead of beside the write.
        """

    def link(self, file: str, generation: str, record: FileRecord) -> FileRecord | None:
        """Stage ``file`` as the very same file of committed ``generation`` (recorded there as ``record``),
        writing none of its bytes; ``None`` where this backend or this file cannot, and the caller writes it.
        A linked file is immutable like every published file: its bytes are stored once however many
        generations name it, and are gone only when the last of them is removed."""

    def commit(self) -> None:
        """Publish the staged files under the generation's final name, durably."""

    def abort(self) -> None:
        """Discard the staged files. Safe to call after a failed write or commit."""


class Store(Protocol):
    location: str
    digest_algorithm: str

    def generations(self) -> list[str]:
        """Names of committed generations, newest first by parsed update number."""

    def leftovers(self) -> list[str]:
        """Names of staging or trash entries left by an interrupted save."""

    def files(self, generation: str) -> dict[str, int | None]:
        """File name to size for one generation; ``None`` for a non-regular entry."""

    def open(self, generation: str, file: str) -> BinaryIO:
        """Open a committed file for reading (never following links)."""

    def read_pointer(self, name: str) -> bytes | None:
        """The pointer's bytes, or ``None`` when there is no pointer."""

    def begin(self, generation: str) -> Staging: ...

    def join(self, generation: str, staging: str) -> Staging:
        """The staging area another process began (``Staging.name``), to add this process's files to it.

        Multi-rank saves: every rank writes its files into rank 0's staging
        area, and only rank 0 commits.
        """

    def write_pointer(self, name: str, data: bytes) -> None: ...

    def remove(self, generation: str) -> None:
        """Make a generation invisible atomically, then delete its files."""

    def defer_removals(self) -> None:
        """From now on :meth:`remove` may delete the files in the background, after the generation is invisible.

        Deletion then stays off the save path. A store whose removal is already
        cheap may ignore this. Pending deletions are joined by
        :meth:`join_removals` and by :meth:`unlock`; one a crash cut short
        leaves only a leftover that :meth:`clean_leftovers` removes.
        """

    def join_removals(self, timeout: float | None = None) -> bool:
        """Wait for background deletions; ``True`` when none is pending (always, for a store that defers none)."""

    def set_aside(self, generation: str, reason: str) -> str:
        """Move a generation out of sight of readers and cleanup, keeping its files; return its new name.

        ``reason`` is one of ``rejected`` (damaged), ``abandoned`` (another
        timeline) or ``superseded`` (being replaced: removed once the
        replacement is published, or put back if the replacement fails).
        """

    def aside(self) -> list[str]:
        """Names of everything set aside (kept as evidence, or mid-replacement), sorted."""

    def reinstate(self, aside: str, generation: str) -> None:
        """Move a set-aside generation back under its own name; ``GenerationExists`` if that name is taken."""

    def clean_leftovers(self) -> list[str]:
        """Delete what ``leftovers`` lists; return the names removed."""

    def lock(self) -> None:
        """Take the single-writer lock, or raise ``DirectoryLocked``."""

    def unlock(self) -> None: ...

    def exclusive(self, name: str) -> AbstractContextManager[None]:
        """A short cross-process mutex, held while pins are changed or a prune runs."""

    def free_bytes(self) -> int | None:
        """Space available for new generations, or ``None`` when unknown (the preflight is then skipped)."""


def pinned(store: Any) -> AbstractContextManager[None]:
    """A scope in which an object store reads each generation's commit record once (one restore, one
    verification, one export); a no-op for a store without records (a local directory)."""
    pin = getattr(store, "pinned", None)
    return pin() if pin is not None else contextlib.nullcontext()


def listings_held(store: Any) -> AbstractContextManager[None]:
    """A scope in which an object store lists its records once until it writes anything (one save's steps before
    its first write each ask); a no-op for a local directory, whose listings cost a system call."""
    held = getattr(store, "listings_held", None)
    return held() if held is not None else contextlib.nullcontext()
