"""Content digests. The algorithm is named in every manifest.

The chunked algorithms (format 3) digest each 4 MiB chunk of a file on its
own, and the file's digest is BLAKE3 over a domain tag, the file size and the
chunk digests in order. The manifest lists the chunk digests beside the file
digest, so a reader can verify any chunk by itself: restore digests chunks on
every core at once and copies a chunk into a live tensor only after that
chunk verified. Two of them:

- ``xxh3-chunked``: XXH3-128 per chunk, the default of a run without a
  signing key. It detects corruption (a changed chunk matches its digest with
  probability 2^-128) at 8-9 GB/s per core here, near memory speed, so
  verifying every byte costs a restore little. It is not collision-resistant:
  whoever can write the files on purpose can match it, so it never stands
  behind a signature.
- ``blake3-chunked``: BLAKE3 per chunk, cryptographic (a signed manifest
  covers file contents through it), about 3 GB/s per core here; the default
  of a run with a signing key.

``blake3`` (one digest over the whole file, formats 1-2) and ``sha256`` stay
readable and selectable.
"""

from __future__ import annotations

import hashlib
from typing import Any, BinaryIO, Callable, Protocol

import blake3
import xxhash

from ..errors import InvalidArgument


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...
    def hexdigest(self) -> str: ...


def _blake3() -> Hasher:
    # Single-threaded on purpose: blake3's multithreaded mode starts a global thread
    # pool, and a process that forks after that (DataLoader workers, our own drill)
    # gets a child whose hashing waits forever on threads that were not copied.
    # Hashing already runs on its own thread beside the write or the read.
    return blake3.blake3()


CHUNK_BYTES = 4 << 20  # the chunk of the chunked algorithms: fixed by the algorithm's name, never by a file
CHUNKED = "blake3-chunked"
FAST_CHUNKED = "xxh3-chunked"
CHUNKED_ALGORITHMS = (CHUNKED, FAST_CHUNKED)
CRYPTOGRAPHIC = frozenset({"blake3", "sha256", CHUNKED})  # what a signature may stand on
_CHUNK_HASHERS: dict[str, Any] = {CHUNKED: blake3.blake3, FAST_CHUNKED: xxhash.xxh3_128}
_CHUNK_HEX = {CHUNKED: 64, FAST_CHUNKED: 32}  # hex digits of one chunk digest


def default_algorithm(signed: bool) -> str:
    """A new run's digest: ``blake3-chunked`` when its manifests are signed, else ``xxh3-chunked``."""
    return CHUNKED if signed else FAST_CHUNKED


def is_chunked(algorithm: str) -> bool:
    return algorithm in _CHUNK_HASHERS


def chunk_hex_length(algorithm: str) -> int:
    return _CHUNK_HEX[algorithm]


def chunk_digest(data: bytes | memoryview | Any, algorithm: str) -> str:
    """The digest of one chunk of a chunked file (both hashes release the GIL: threads scale)."""
    return _CHUNK_HASHERS[algorithm](data).hexdigest()


def chunked_top(size: int, chunks: list[str] | tuple[str, ...], algorithm: str) -> str:
    """A chunked file's digest from its size and chunk digests (BLAKE3 over the algorithm's tag, the size, the
    chunk digests)."""
    top = blake3.blake3(f"trainstate.{algorithm}.v1\0".encode() + size.to_bytes(8, "little"))
    for c in chunks:
        top.update(bytes.fromhex(c))
    return top.hexdigest()


def chunk_count(size: int) -> int:
    return -(-size // CHUNK_BYTES)


class ChunkedHasher:
    """A streaming chunked digest: accepts updates of any size; :attr:`chunks` after :meth:`hexdigest`."""

    def __init__(self, algorithm: str = CHUNKED) -> None:
        self.algorithm = algorithm
        self._new = _CHUNK_HASHERS[algorithm]
        self._current = self._new()
        self._filled = 0
        self._size = 0
        self.chunks: list[str] = []

    def update(self, data: bytes | memoryview, /) -> None:
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        while len(view):
            take = min(len(view), CHUNK_BYTES - self._filled)
            self._current.update(view[:take])
            self._filled += take
            self._size += take
            view = view[take:]
            if self._filled == CHUNK_BYTES:
                self.chunks.append(self._current.hexdigest())
                self._current, self._filled = self._new(), 0

    def hexdigest(self) -> str:
        if self._filled:
            self.chunks.append(self._current.hexdigest())
            self._current, self._filled = self._new(), 0
        return chunked_top(self._size, self.chunks, self.algorithm)


_ALGORITHMS: dict[str, Callable[[], Hasher]] = {
    "blake3": _blake3, "sha256": hashlib.sha256,
    CHUNKED: lambda: ChunkedHasher(CHUNKED), FAST_CHUNKED: lambda: ChunkedHasher(FAST_CHUNKED)}
ALGORITHMS = tuple(sorted(_ALGORITHMS))


def new_hasher(algorithm: str) -> Hasher:
    try:
        return _ALGORITHMS[algorithm]()
    except KeyError:
        raise InvalidArgument(f"unknown digest algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}") from None


def digest_bytes(algorithm: str, data: bytes) -> str:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


def digest_stream(stream: BinaryIO, algorithm: str, expected_size: int | None = None,
                  chunk_bytes: int = 16 << 20) -> tuple[int, str]:
    """Digest a stream with a bounded buffer: ``(bytes read, hexdigest)``.

    With ``expected_size``, reads at most one byte past it (the size then
    mismatches), so a file that keeps growing cannot hang the reader.
    """
    hasher = new_hasher(algorithm)
    view = memoryview(bytearray(chunk_bytes))
    size = 0
    limit = None if expected_size is None else expected_size + 1
    while limit is None or size < limit:
        n = stream.readinto(view if limit is None else view[: limit - size])
        if not n:
            break
        hasher.update(view[:n])
        size += n
    return size, hasher.hexdigest()
