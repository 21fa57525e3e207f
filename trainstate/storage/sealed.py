"""Sealing a folder another program wrote, and trusting it only if it verifies.

Sealing a folder (``checkpoint-N/`` as Hugging Face Trainer leaves it)::

    for each file   read it, digesting, while fsync runs on the same file
    fsync           every directory inside the folder, deepest first
    write           trainstate-seal.json: temp file, fsync, rename, fsync the folder   <- the commit
    fsync           the folder's parent                  the folder's own entry is durable
    write           the seal pointer beside the folders: temp file, fsync, rename, fsync

A crash before the seal's rename leaves a folder with no seal: never
committed, passed over by :func:`newest_verified`. A file changed after the
seal (a truncation, a rewrite in place, a file added or removed) makes the
folder fail :func:`verify_folder`. Every create, fsync and rename goes through
:class:`PosixOps`, as for generations.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CorruptGeneration, Rejection
from ..format.digest import digest_bytes, digest_stream
from ..format.manifest import FileRecord
from ..format.seal import (SEAL, SEAL_POINTER, Seal, SealPointer, check_meta, check_path, parse_seal,
                           parse_seal_pointer)
from .local import LocalStore
from .posix import PosixOps, _fsync_beside, open_regular

log = logging.getLogger("trainstate")
_OUR_TEMP_RE = re.compile(r"\.trainstate-tmp-[A-Za-z0-9._-]{1,80}-[0-9a-f]{16}")
_MAX_SEAL_BYTES = 64 << 20


@dataclass(frozen=True)
class SealInfo:
    """One sealed folder: what it holds and what sealing it cost."""

    folder: str
    seal: Seal
    seconds: float


@dataclass(frozen=True)
class Choice:
    """The newest folder that verified (``None``: none did), and every folder passed over on the way, and why."""

    folder: str | None
    seal: Seal | None
    rejected: list[Rejection] = field(default_factory=list)
    unsealed: list[str] = field(default_factory=list)  # never committed (no seal): an interrupted save


def _walk(folder: Path) -> list[tuple[str, Path, bool]]:
    """``(relative path, path, is a regular file)`` for everything under ``folder`` but the seal, sorted.

    Symbolic links are not followed and count as non-regular; directories are
    descended into.
    """
    out = []
    pending = [(folder, "")]
    while pending:
        directory, prefix = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                rel = prefix + entry.name
                if rel == SEAL:
                    continue
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    pending.append((Path(entry.path), rel + "/"))
                    continue
                out.append((rel, Path(entry.path), stat.S_ISREG(st.st_mode)))
    return sorted(out)


def _directories(folder: Path) -> list[Path]:
    """Every directory inside ``folder`` (itself included), deepest first."""
    found = [folder]
    for root, dirs, _ in os.walk(folder):
        found.extend(Path(root) / d for d in dirs)
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def seal_folder(folder: str | Path, *, digest: str = "blake3", meta: dict | None = None,
                ops: PosixOps | None = None, pointer: bool = True) -> SealInfo:
    """Make ``folder`` a durable, verified generation: see the module docstring for the order of steps.

    A seal already in the folder (the folder was rewritten under the same
    name) is replaced atomically by the new one. With ``pointer``, the seal
    pointer in the folder's parent then names this folder.
    """
    start = time.perf_counter()
    folder = Path(folder)
    ops = ops if ops is not None else PosixOps()
    meta = check_meta(dict(meta or {}))
    store = LocalStore(folder, digest, create=False, ops=ops)
    remove_temp_files(folder, ops)  # our own, from a seal that was interrupted
    records = []
    for rel, path, regular in _walk(folder):
        check_path(rel)
        if not regular:
            raise CorruptGeneration(str(path), "is not a regular file (a link, a socket, ...): it cannot be sealed")
        records.append(_digest_and_sync(path, rel, digest, ops))
    for directory in _directories(folder):
        ops.fsync_dir(directory)
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")
    seal = Seal(folder.name, digest, tuple(records), created, meta)
    data = seal.to_bytes()
    store.write_pointer(SEAL, data)  # temp file, fsync, rename, fsync of the folder: the commit
    ops.fsync_dir(folder.parent)
    if pointer:
        record = SealPointer(folder.name, digest_bytes(digest, data), len(data), digest)
        LocalStore(folder.parent, digest, create=False, ops=ops).write_pointer(SEAL_POINTER, record.to_bytes())
    return SealInfo(str(folder), seal, time.perf_counter() - start)


def remove_temp_files(directory: str | Path, ops: PosixOps | None = None) -> list[str]:
    """Remove trainstate's own temp files (``.trainstate-tmp-...``) that an interrupted seal or pointer move left."""
    ops = ops if ops is not None else PosixOps()
    removed = sorted(n for n in os.listdir(directory) if _OUR_TEMP_RE.fullmatch(n))
    for name in removed:
        ops.unlink(Path(directory) / name)
    return removed


def _digest_and_sync(path: Path, rel: str, algorithm: str, ops: PosixOps) -> FileRecord:
    with open_regular(path) as stream:
        got: list[tuple[int, str]] = []
        _fsync_beside(ops, stream.fileno(), lambda: got.append(digest_stream(stream, algorithm)))
    size, hexdigest = got[0]
    return FileRecord(rel, size, hexdigest)


def read_seal(folder: str | Path) -> tuple[Seal, bytes]:
    """The folder's seal and its bytes; :class:`FileNotFoundError` if it has none."""
    folder = Path(folder)
    with open_regular(folder / SEAL) as stream:
        data = stream.read(_MAX_SEAL_BYTES + 1)
    return parse_seal(data, str(folder / SEAL)), data


def verify_folder(folder: str | Path) -> Seal:
    """The folder's seal, once its name, file set, every size and every digest match it.

    Raises :class:`FileNotFoundError` if the folder has no seal (never
    committed) and :class:`CorruptGeneration` naming the first difference.
    """
    folder = Path(folder)
    seal, _ = read_seal(folder)
    where = str(folder)
    if seal.name != folder.name:
        raise CorruptGeneration(where, f"was sealed as {seal.name!r:.80}: a folder renamed or copied over another")
    found = {rel: (path, regular) for rel, path, regular in _walk(folder)}
    listed = {f.name: f for f in seal.files}
    added, missing = sorted(set(found) - set(listed)), sorted(set(listed) - set(found))
    if added:
        raise CorruptGeneration(where, f"{', '.join(added)} not in the seal (added after sealing)")
    if missing:
        raise CorruptGeneration(where, f"{', '.join(missing)} missing")
    for rel, (path, regular) in sorted(found.items()):
        size = path.stat().st_size if regular else None
        if size != listed[rel].size:
            raise CorruptGeneration(where, f"{rel} has {size} bytes, the seal says {listed[rel].size} (truncated or "
                                           "rewritten)")
    for record in seal.files:
        with open_regular(folder / record.name) as stream:
            size, hexdigest = digest_stream(stream, seal.digest_algorithm, record.size)
        if (size, hexdigest) != (record.size, record.digest):
            raise CorruptGeneration(where, f"{record.name} does not match its digest (its bytes changed)")
    return seal


def read_seal_pointer(root: str | Path) -> SealPointer | None:
    """The seal pointer in ``root``; ``None`` if absent or unreadable (a damaged pointer is only a hint lost)."""
    try:
        data = LocalStore(root, create=False).read_pointer(SEAL_POINTER)
        return None if data is None else parse_seal_pointer(data, str(Path(root) / SEAL_POINTER))
    except CorruptGeneration as exc:
        log.warning("ignoring the seal pointer: %s", exc)
        return None


def newest_verified(root: str | Path, candidates: Iterable[str]) -> Choice:
    """The first of ``candidates`` (folder names in ``root``, newest first) that verifies.

    A folder without a seal was never committed and is listed in
    ``unsealed``; a sealed one that fails verification is a rejection. One
    WARNING is logged per rejection; nothing is deleted.
    """
    root = Path(root)
    rejected: list[Rejection] = []
    unsealed: list[str] = []
    for name in candidates:
        try:
            seal = verify_folder(root / name)
        except FileNotFoundError:
            unsealed.append(name)
            log.info("passing over %s: it has no seal (a save that did not complete)", name)
            continue
        except (CorruptGeneration, OSError) as exc:
            reason = exc.reason if isinstance(exc, CorruptGeneration) else str(exc)
            rejected.append(Rejection(name, reason))
            log.warning("passing over %s: %s", name, reason)
            continue
        return Choice(str(root / name), seal, rejected, unsealed)
    return Choice(None, None, rejected, unsealed)
