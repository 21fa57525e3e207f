"""A release bundle: its durable publication, the files it includes, and the manifest that makes it verifiable.

The order of one publication (:func:`publish`, called by ``trainstate export``):

1. Every file is written into a staging directory beside ``out``
   (``.NAME.trainstate-staging-*``), digested (SHA-256) from the very bytes
   written, and fsynced; so is every directory in it.
2. Last, the release manifest (``release-manifest.json``) lists every file
   with its size and digest, signed (HMAC-SHA256) when a signing key is
   configured, and is written and fsynced like the others.
3. The staging directory is renamed to ``out`` and the parent fsynced: a crash
   leaves at most the staging directory, never a partial ``out``.

:func:`verify_bundle` (``trainstate verify OUT``) checks a bundle against its
manifest: every listed file present with its size and digest, nothing
unlisted, and the signature when a key is given. SHA-256 so that whoever
receives the bundle can check it without trainstate (``sha256sum``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CorruptGeneration, GenerationExists, InvalidArgument
from ..format.signing import SigningKey
from ..storage.posix import PosixOps, _write_all, coalesce

log = logging.getLogger("trainstate")

RELEASE_MANIFEST = "release-manifest.json"
FORMAT = "trainstate-release"
DIGEST = "sha256"
Content = bytes | Callable[[], Iterable[bytes | memoryview]]  # a file's bytes, or how to stream them when written
COPY_BYTES = 1 << 20


@dataclass(frozen=True)
class FileDigest:
    """One file of a bundle: its path inside the bundle (``/``-separated), size and SHA-256."""

    name: str
    size: int
    digest: str


@dataclass(frozen=True)
class BundleReport:
    """What :func:`verify_bundle` found: ``problems`` maps each bad file to what is wrong (empty: it verifies)."""

    directory: str
    files: tuple[str, ...]
    problems: Mapping[str, str]
    signed: bool
    signature_checked: bool

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def authenticated(self) -> bool:
        """Whether the signature was checked with the key; digests alone authenticate nothing."""
        return self.signed and self.signature_checked


# --- included files ----------------------------------------------------------------------------------------

def includes(paths: Iterable[str | Path], reserved: Iterable[str]) -> dict[str, Path]:
    """Where each included file goes in the bundle: a file as its own name, a directory's files (recursively)
    at their paths inside it, so a tokenizer directory's files land beside the weights. Regular files only;
    a name taken twice, or by a file the export writes itself, is refused."""
    taken = set(reserved)
    out: dict[str, Path] = {}
    for raw in paths:
        path = Path(raw)
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise InvalidArgument(f"--include {raw}: not a regular file or directory (symbolic links are not "
                                  "followed); name the file itself")
        found = [(path.name, path)] if path.is_file() else sorted(
            (p.relative_to(path).as_posix(), p) for p in path.rglob("*") if not p.is_dir() or p.is_symlink())
        for name, file in found:
            if file.is_symlink() or not file.is_file():
                raise InvalidArgument(f"--include {raw}: {file} is not a regular file (symbolic links are not "
                                      "followed); copy the file itself into the directory")
            if name in taken or name in out:
                raise InvalidArgument(f"--include {raw}: {name!r} is already in the bundle (written by the export "
                                      "or included twice); rename one of them")
            out[name] = file
    return out


def file_digest(path: Path) -> tuple[int, str]:
    """Size and SHA-256 of a file, read in bounded chunks."""
    hasher, size = hashlib.sha256(), 0
    with open(path, "rb") as stream:
        while chunk := stream.read(COPY_BYTES):
            hasher.update(chunk)
            size += len(chunk)
    return size, hasher.hexdigest()


def copier(path: Path) -> Callable[[], Iterable[bytes]]:
    """A file's bytes, streamed when the bundle is written."""
    def chunks() -> Iterable[bytes]:
        with open(path, "rb") as stream:
            while chunk := stream.read(COPY_BYTES):
                yield chunk
    return chunks


# --- the manifest (pure) -------------------------------------------------------------------------------------

def manifest_bytes(files: Iterable[FileDigest], about: Mapping[str, Any], key: SigningKey | None) -> bytes:
    """The release manifest: every file's size and digest, what it was exported from, signed with ``key``."""
    body: dict[str, Any] = {"format": FORMAT, "version": 1, "digest_algorithm": DIGEST, **about,
                            "files": [{"name": f.name, "size": f.size, "digest": f.digest}
                                      for f in sorted(files, key=lambda f: f.name)]}
    if key is not None:
        body["signature"] = key.sign(body)
    return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()


def parse_manifest(data: bytes, where: str, key: SigningKey | None) -> tuple[dict[str, FileDigest], bool]:
    """The files a release manifest lists, and whether it is signed; the signature is checked when ``key``."""
    try:
        body = json.loads(data)
    except ValueError as exc:
        raise CorruptGeneration(where, f"is not JSON ({exc})") from None
    if type(body) is not dict or body.get("format") != FORMAT or body.get("digest_algorithm") != DIGEST \
            or type(body.get("files")) is not list:
        raise CorruptGeneration(where, "is not a trainstate release manifest")
    if key is not None:
        key.check(body, body.get("signature"), where)
    files = {}
    for record in body["files"]:
        if type(record) is not dict or type(record.get("name")) is not str or type(record.get("size")) is not int \
                or type(record.get("digest")) is not str or not _safe(record["name"]):
            raise CorruptGeneration(where, f"malformed file record {record!r:.120}")
        files[record["name"]] = FileDigest(record["name"], record["size"], record["digest"])
    return files, "signature" in body


def _safe(name: str) -> bool:
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and all(p not in ("", ".", "..") for p in parts) \
        and name != RELEASE_MANIFEST


def is_bundle(directory: str | Path) -> bool:
    return (Path(directory) / RELEASE_MANIFEST).is_file()


def verify_bundle(directory: str | Path, key: SigningKey | None = None) -> BundleReport:
    """Check every file of a bundle against its manifest: changed, missing and unlisted files are named."""
    root = Path(directory)
    where = str(root / RELEASE_MANIFEST)
    try:
        data = (root / RELEASE_MANIFEST).read_bytes()
    except OSError as exc:
        raise CorruptGeneration(where, f"unreadable ({exc.strerror})") from None
    listed, signed = parse_manifest(data, where, key)
    present = {p.relative_to(root).as_posix(): p for p in root.rglob("*") if p.is_symlink() or not p.is_dir()}
    present.pop(RELEASE_MANIFEST)
    problems: dict[str, str] = {}
    for name, record in listed.items():
        path = present.get(name)
        if path is None:
            problems[name] = "missing"
        elif path.is_symlink() or not path.is_file():
            problems[name] = "is not a regular file"
        else:
            size, digest = file_digest(path)
            if size != record.size:
                problems[name] = f"is {size} bytes, the manifest says {record.size}"
            elif digest != record.digest:
                problems[name] = f"{DIGEST} digest differs from the manifest's (content changed)"
    for name in sorted(set(present) - set(listed)):
        problems[name] = "is not listed in the manifest (added after the export)"
    return BundleReport(str(root), tuple(sorted(listed)), dict(sorted(problems.items())), signed, key is not None)


# --- publication ----------------------------------------------------------------------------------------------

def check_out(out: Path) -> None:
    """``out`` is absent or an empty directory, and its parent exists."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise GenerationExists(f"{out} exists and is not a directory; nothing was written. Choose a new path "
                               "for the export")
    if out.is_dir() and any(out.iterdir()):
        raise GenerationExists(f"{out} is not empty and an export never overwrites; nothing was written. Choose "
                               "a new path, or remove the old export first")
    if not out.parent.is_dir():
        raise InvalidArgument(f"the parent of {out} does not exist; create it first")


def _write(ops: PosixOps, path: Path, content: Content) -> tuple[int, str]:
    hasher, size = hashlib.sha256(), 0
    fd = ops.create(path)
    try:
        for view in coalesce([content] if isinstance(content, bytes) else content()):
            hasher.update(view)
            _write_all(ops, fd, view)
            size += len(view)
        ops.fsync(fd)
    finally:
        ops.close(fd)
    return size, hasher.hexdigest()


def publish(out: Path, files: Mapping[str, Content], ops: PosixOps | None = None,
            last: Callable[[list[FileDigest]], bytes] | None = None) -> list[FileDigest]:
    """Write ``files`` (``/``-separated names) into a staging directory beside ``out``, then ``last(digests)``
    as the release manifest, fsync everything, rename the directory to ``out`` and fsync the parent.
    Returns each file's size and digest, as written."""
    ops = ops or PosixOps()
    check_out(out)
    staging = out.parent / f".{out.name}.trainstate-staging-{secrets.token_hex(4)}"
    ops.mkdir(staging)
    written: list[FileDigest] = []
    try:
        directories = [staging]
        for name, content in files.items():
            path = staging / name
            for parent in reversed(path.relative_to(staging).parents[:-1]):
                if staging / parent not in directories:
                    ops.mkdir(staging / parent)
                    directories.append(staging / parent)
            written.append(FileDigest(name, *_write(ops, path, content)))
        if last is not None:
            _write(ops, staging / RELEASE_MANIFEST, last(written))
        for directory in reversed(directories):
            ops.fsync_dir(directory)
        try:
            ops.rename(staging, out)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise GenerationExists(f"{out} appeared while exporting and is not empty; nothing was "
                                       "published. Choose a new path") from None
            raise
    except BaseException:
        try:
            ops.rmtree(staging)
        except OSError as cleanup:  # the original error matters more; the leftover is named
            log.warning("export: could not remove the staging directory %s: %s", staging, cleanup)
        raise
    ops.fsync_dir(out.parent)
    return written
