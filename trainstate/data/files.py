"""Fingerprint a dataset's files for the experiment contract.

``data_manifest("data/")`` lists every file under the given paths with its
size and content digest (``mode="full"``) or its size and modification time
(``mode="fast"``: no data is read, so it costs one ``stat`` per file). Put the
result in the contract and a changed, added or removed file is named on
resume::

    state = ts.TrainState(..., contract={"data": ts.data_manifest("data/train")})
    # ContractMismatch: data.files.shard-00017.bin: checkpoint has '...', this run has '...'
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..format.digest import digest_stream, new_hasher
from ..errors import InvalidArgument


def _files(paths: Iterable[str | os.PathLike]) -> list[tuple[str, Path]]:
    found: list[tuple[str, Path]] = []
    for root in paths:
        if os.fspath(root) in ("", b""):
            raise InvalidArgument("data_manifest: an empty path was given (an unset setting?); "
                             "pass '.' to fingerprint the current directory")
        root = Path(root)
        if root.is_file():
            found.append((root.name, root))
        elif root.is_dir():
            for directory, dirs, names in os.walk(root):
                dirs.sort()
                for name in sorted(names):
                    path = Path(directory) / name
                    if path.is_file():
                        found.append((path.relative_to(root).as_posix(), path))
        else:
            raise FileNotFoundError(f"data_manifest: {root} is neither a file nor a directory")
    names = [n for n, _ in found]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise InvalidArgument(f"data_manifest: several paths give the same relative name {dupes[:5]}; "
                         "pass one root directory, or call it once per root under separate contract fields")
    return sorted(found)


def data_manifest(paths: str | os.PathLike | Iterable[str | os.PathLike], *, mode: str = "full",
                  digest: str = "blake3", files: bool = True) -> dict[str, Any]:
    """A JSON-like fingerprint of every file under ``paths``.

    Returns ``{"mode", "count", "bytes", "digest", "files"}``. ``files`` maps
    each relative path to ``"<size>:<digest>"`` (full) or
    ``"<size>:<mtime_ns>"`` (fast), so a contract mismatch names the file;
    pass ``files=False`` to keep only the aggregate ``digest`` (for millions
    of shards). Symbolic links to directories are not followed.
    """
    if mode not in ("full", "fast"):
        raise InvalidArgument(f"mode must be 'full' or 'fast', got {mode!r}")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise InvalidArgument("data_manifest: no paths given")
    entries: dict[str, str] = {}
    total = 0
    for name, path in _files(paths):
        try:
            info = path.stat()
            if mode == "fast":
                entries[name] = f"{info.st_size}:{info.st_mtime_ns}"
            else:
                with path.open("rb") as stream:
                    size, hexdigest = digest_stream(stream, digest)
                entries[name] = f"{size}:{hexdigest}"
        except FileNotFoundError:
            raise FileNotFoundError(f"data_manifest: {path} disappeared while the dataset was being "
                                    "fingerprinted; fingerprint a dataset that is not being written") from None
        total += info.st_size
    aggregate = new_hasher(digest)
    for name, value in entries.items():
        aggregate.update(f"{len(name)}:{name}={value}\n".encode())
    out: dict[str, Any] = {"mode": mode, "algorithm": digest, "count": len(entries), "bytes": total,
                           "digest": aggregate.hexdigest()}
    if files:
        out["files"] = entries
    return out
