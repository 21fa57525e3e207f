"""A restore from an object store downloads each byte it needs once, verified as it arrives.

A restore reads a generation in several passes: its structure, every digest,
the decoded state, then the pieces each tensor is loaded from. On a local disk
the page cache makes the later passes cheap; over HTTP each pass is another
download. :class:`Fetched` is a view of a remote store through which one
restore reads: :meth:`Fetched.fetch` downloads the spans of a file a reader
will need, in bounded ranged GETs several at a time (no open-ended range, so
nothing is fetched past what is asked), checks each 4 MiB chunk against the
manifest's chunk digests (``blake3-chunked``; a file of an older format is
fetched whole and checked against its file digest), and keeps the verified
bytes in memory. Every later read of the file is served from there: the
digest pass, the decode and the tensor reads see exactly the verified bytes,
and nothing reaches a live tensor before the whole choice has verified.

Memory: the fetched share stays in memory until the restore ends (the
rank's share of the generation, besides the live state it loads into),
except the files a multi-rank restore reads as it loads (``direct``: a shard
one rank alone reads whole), which go from each ranged GET, verified, into
the live tensors (:class:`_RangedReader`, ``chunked.read_file``).
"""

from __future__ import annotations

import contextlib
import io
import threading
from typing import Any

from ..errors import CorruptGeneration, TrainStateError
from ..format.digest import CHUNK_BYTES, digest_bytes, is_chunked
from ..format.manifest import MANIFEST, FileRecord, Manifest
from .base import pinned
from .threads import in_order
from . import chunked
from .chunked import FETCHERS
from .streams import SeekableReader

REQUEST_BYTES = 16 << 20  # one ranged GET: big enough to stream at full speed, small enough to run several at once


class Fetched:
    """A remote store seen through one restore: fetched spans served from memory, the rest passed through."""

    def __init__(self, store: Any):
        self._store = store
        self._files: dict[tuple[str, str], _Sparse] = {}
        self._small: dict[tuple[str, str], bytes] = {}  # manifests, read whole once
        self.requested = 0  # bytes asked of the store: what the restore downloaded
        self._lock = threading.Lock()
        self._pin = pinned(store)  # each commit record read once during the restore
        self._pin.__enter__()
        self._names: list[str] | None = None
        self.planned: tuple | None = None  # (generation, DCP load planner): the reads planned to fetch, for the load
        self.metadata: tuple | None = None  # (generation, DCP metadata): decoded once, to plan; the load takes it
        self.more_rounds = True  # whether a rank still needs a fetch round (multi-rank: the header rounds)
        self.direct: set[str] = set()  # files DCP reads from their store as it loads them (chosen per candidate)
        self._ranged: dict[tuple[str, str], tuple[int, dict]] = {}  # direct files: size, chunks read (unverified)
        self.offers_direct = False  # whether a shard this rank alone reads, whole, may be read so (one pass)
        self.layouts: dict = {}  # shard headers verified once (chunked._held_header), for the direct loads

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def generations(self) -> list[str]:
        """The store's generations as first listed in this restore: the choice and the lineage it continues see
        one listing (one request, not one per use)."""
        with self._lock:
            if self._names is None:
                self._names = self._store.generations()
            return list(self._names)

    def fetch(self, manifest: Manifest, name: str, spans: list[tuple[int, int]] | None = None) -> None:
        """Download and verify the bytes of file ``name`` covering ``spans`` (``None``: the whole file), each once.

        Raises :class:`CorruptGeneration` naming the file (and chunk) whose bytes do not match the manifest.
        """
        self.fetch_chunks(manifest, name, self.missing(manifest, name, spans))

    def missing(self, manifest: Manifest, name: str, spans: list[tuple[int, int]] | None = None) -> list[int]:
        """The chunks covering ``spans`` of file ``name`` not fetched yet; a file of an older format (one digest
        over the whole file) is one unit, chunk 0."""
        record = manifest.file(name)
        sparse = self._files.get((manifest.generation, name))
        if not _chunked(manifest, record):
            return [] if sparse is not None and sparse.whole else [0]
        have = set(sparse.chunks) if sparse is not None else set()
        return sorted({i for b, e in (spans if spans is not None else [(0, record.size)]) if e > b
                       for i in range(b // CHUNK_BYTES, -(-e // CHUNK_BYTES))} - have)

    def fetch_chunks(self, manifest: Manifest, name: str, chunks: list[int]) -> None:
        """Download and verify these chunks of file ``name`` (see :meth:`missing`), in bounded ranged GETs."""
        if not chunks:
            return
        record = manifest.file(name)
        if not _chunked(manifest, record):
            data = self._download(manifest.generation, name, [(0, record.size)])[0] if record.size else b""
            self.put_chunk(manifest, name, 0, data)
            return
        requests = _requests(chunks, record.size)
        where = f"{manifest.generation}/{name}"
        got: list[memoryview | None] = [None] * len(requests)

        def one(at: int) -> None:  # each request verified by the thread that fetched it, beside the others' GETs
            begin, end = requests[at]
            data = self._download(manifest.generation, name, [(begin, end)])[0]
            if len(data) != end - begin:
                raise CorruptGeneration(where, f"{len(data)} bytes where {end - begin} were expected (truncated?)")
            for offset in range(0, len(data), CHUNK_BYTES):
                chunked._check(record, (begin + offset) // CHUNK_BYTES, data[offset:offset + CHUNK_BYTES], where,
                               manifest.digest_algorithm)
            got[at] = data

        in_order(len(requests), max(1, min(FETCHERS, len(requests))), one)
        sparse = self._files.setdefault((manifest.generation, name), _Sparse(record.size))
        for (begin, _), data in zip(requests, got):
            for offset in range(0, len(data), CHUNK_BYTES):
                sparse.chunks[(begin + offset) // CHUNK_BYTES] = data[offset:offset + CHUNK_BYTES]

    def put_chunk(self, manifest: Manifest, name: str, index: int, data: memoryview | bytes) -> None:
        """Keep a chunk (of an older format's file: the whole file) once it verified against the manifest,
        wherever its bytes came from (this store, or another rank that downloaded them)."""
        record = manifest.file(name)
        where = f"{manifest.generation}/{name}"
        sparse = self._files.setdefault((manifest.generation, name), _Sparse(record.size))
        view = memoryview(data).cast("B")
        if not _chunked(manifest, record):
            if len(view) != record.size or digest_bytes(manifest.digest_algorithm, bytes(view)) != record.digest:
                raise CorruptGeneration(where, f"{manifest.digest_algorithm} digest mismatch (content changed)")
            sparse.put(0, view, whole=True)
            return
        chunked._check(record, index, view, where, manifest.digest_algorithm)
        sparse.chunks[index] = view

    def chunk(self, manifest: Manifest, name: str, index: int) -> memoryview:
        """A verified chunk (of an older format's file: the whole file), to hand to another rank."""
        sparse = self._files[(manifest.generation, name)]
        if not _chunked(manifest, manifest.file(name)):
            return memoryview(b"".join(sparse.chunks[i] for i in sorted(sparse.chunks)))
        return sparse.chunks[index]

    def _download(self, generation: str, name: str, spans: list[tuple[int, int]]) -> list[memoryview]:
        with self._lock:  # (several fetching threads)
            self.requested += sum(e - b for b, e in spans)
        return self._store.read_ranges(generation, name, spans)

    def loads_direct(self, manifest: Manifest, name: str) -> bool:
        """Whether this rank reads file ``name`` as it loads, decided on its own: never, here (a tiered view
        reads its node's own shards so, :class:`~trainstate.distributed.tierfetch.Holdings`). With
        ``offers_direct``, the fetch rounds decide together instead (:func:`~trainstate.distributed.share.
        fetch_together`): a shard that one rank alone reads, and reads whole, is read by that rank while it
        loads, in parallel ranged GETs, each chunk verified on its way into the live tensors."""
        return False

    def read_as_loaded(self, manifest: Manifest, names: set[str]) -> None:
        """These files are read as they load (``direct``), straight from the store in bounded ranged GETs (no
        HEAD: the manifest gives the size); a chunk fetched before (the header's, in the round that chose this)
        is not downloaded again."""
        self.direct.update(names)
        for name in names:
            self._ranged[(manifest.generation, name)] = (manifest.file(name).size, {})

    def fetched(self, generation: str, name: str) -> bool:
        return (generation, name) in self._files

    def open(self, generation: str, name: str) -> Any:
        sparse = self._files.get((generation, name))
        ranged = self._ranged.get((generation, name)) if name in self.direct else None
        if ranged is not None:  # (the chunks fetched so far, verified: the header's)
            size, held = ranged
            held.update(sparse.chunks if sparse is not None else {})
            return _RangedReader(lambda b, e: self._download(generation, name, [(b, e)])[0], size, held)
        if sparse is not None:
            return _SparseReader(sparse, f"{generation}/{name}")
        if name == MANIFEST:  # read by every structural check: once
            data = self._small.get((generation, name))
            if data is None:
                with self._store.open(generation, name) as stream:
                    data = self._small[(generation, name)] = stream.read()
            return io.BytesIO(data)
        return self._store.open(generation, name)

    def close(self) -> None:
        self._files.clear()
        self._ranged.clear()
        self._small.clear()
        self.layouts.clear()
        self._pin.__exit__(None, None, None)
        self._pin = contextlib.nullcontext()


def _requests(chunks: list[int], size: int) -> list[tuple[int, int]]:
    """Runs of consecutive chunks as byte spans of at most ``REQUEST_BYTES``."""
    out: list[tuple[int, int]] = []
    per = REQUEST_BYTES // CHUNK_BYTES
    run: list[int] = []
    for index in chunks + [None]:  # type: ignore[list-item]
        if run and (index is None or index != run[-1] + 1 or len(run) == per):
            out.append((run[0] * CHUNK_BYTES, min(size, (run[-1] + 1) * CHUNK_BYTES)))
            run = []
        if index is not None:
            run.append(index)
    return out


def _chunked(manifest: Manifest, record: FileRecord) -> bool:
    return is_chunked(manifest.digest_algorithm) and bool(record.chunks)


class _Sparse:
    """A file's verified bytes: whole, or by 4 MiB chunk."""

    def __init__(self, size: int):
        self.size = size
        self.chunks: dict[int, memoryview] = {}
        self.whole = False

    def put(self, offset: int, data: memoryview | bytes, whole: bool = False) -> None:
        view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
        for start in range(0, len(view), CHUNK_BYTES):
            self.chunks[(offset + start) // CHUNK_BYTES] = view[start:start + CHUNK_BYTES]
        self.whole = whole


class _SparseReader(SeekableReader):
    """A seekable stream over fetched bytes; reading a byte that was never fetched is a bug, said loudly."""

    def __init__(self, sparse: _Sparse, where: str):
        self._sparse, self._where, self._pos = sparse, where, 0

    @property
    def size(self) -> int:
        return self._sparse.size

    def readinto(self, buffer: Any) -> int:
        """Fills ``buffer`` up to the end of the file (never a short read inside it)."""
        out = memoryview(buffer).cast("B")
        done = 0
        while done < len(out) and self._pos < self._sparse.size:
            index, within = divmod(self._pos, CHUNK_BYTES)
            chunk = self._sparse.chunks.get(index)
            chunk = self._unfetched(index) if chunk is None else chunk
            n = min(len(out) - done, len(chunk) - within)
            if n <= 0:
                break  # (a short object: the reader that expected more says so)
            out[done:done + n] = chunk[within:within + n]
            self._pos += n
            done += n
        return done

    def _unfetched(self, index: int) -> memoryview:
        raise TrainStateError(f"{self._where}: byte {self._pos} was read but never fetched (a restore must fetch "
                              "what it reads); please report this")

    def read(self, size: int | None = -1) -> bytes:
        left = self._sparse.size - self._pos
        n = left if size is None or size < 0 else min(size, left)
        buffer = bytearray(max(n, 0))
        return bytes(buffer[:self.readinto(buffer)])


class _RangedReader(_SparseReader):
    """A file read from the store in whole-chunk ranged GETs, each chunk once: what it read stays in ``held``
    (shared by the file's readers in one restore, unverified: each reader checks what it uses), and
    :meth:`span_reader` fetches any span. For a shard read as it loads: its header chunk is read first, and the
    verifying pass (``chunked.read_file``) takes it from ``held`` rather than downloading it again."""

    keeps_reads = True

    def __init__(self, fetch: Any, size: int, held: dict[int, memoryview]):
        sparse = _Sparse(size)
        sparse.chunks = held
        super().__init__(sparse, "")
        self._fetch = fetch

    @property
    def held(self) -> dict[int, memoryview]:  # (chunked._ranged_chunks places these rather than fetching them)
        return self._sparse.chunks

    def span_reader(self) -> Any:
        return self._fetch

    def _unfetched(self, index: int) -> memoryview:
        lo = index * CHUNK_BYTES
        chunk = self._sparse.chunks[index] = memoryview(self._fetch(lo, min(self.size, lo + CHUNK_BYTES))).cast("B")
        return chunk
