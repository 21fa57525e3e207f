"""Verified, parallel reads of ``blake3-chunked`` tensor files: each byte read once.

A format-3 manifest lists the digest of every 4 MiB chunk of every file
(:mod:`trainstate.format.digest`), and the manifest itself is trusted through
the pointer (and the signature, when a key is set). So a chunk can be checked
on its own, as soon as it is read:

1. Worker threads (one per core, at most eight) each take the next chunk of
   a local file and map it (4 MiB of the page cache, unmapped at once).
2. The worker digests the chunk there (BLAKE3 releases the GIL) and compares
   it with the manifest; only then are its bytes copied into the tensors
   they belong to: fresh tensors, or live ones for an in-place restore. No
   unverified byte is ever copied into a live tensor, and no byte is copied
   twice (a chunk bound for a fresh tensor alone is copied first and
   verified where it landed). A file whose inode, size or change time moved
   while it was read fails the read.
3. A chunk that does not match stops the read (chunks already in flight on
   other workers finish). Verified chunks may already be in live tensors:
   :class:`Progress` says whether any were, and the restore path marks the
   state unusable then (see :mod:`trainstate.restore`). A fresh tensor that
   received an unverified chunk is dropped with the error.

An object store's file is fetched by ``FETCHERS`` threads at once, each a
run of whole chunks in one bounded ranged GET pinned to the object's
version (no request reaches past the file, none is open-ended), and each
thread verifies and places the chunks it fetched: one stream alone does not
reach the client's speed. Other streams that cannot be mapped are read in
order by one thread into a small ring of staging buffers (one per worker
plus one, within 5% of the file), and the workers verify and place each
chunk.

:func:`header_preview` reads only what restore checks before a live object
changes: each tensor file's header and the RNG tensors, each from verified
chunks. Meta tensors stand in for the rest.
"""

from __future__ import annotations

import io
import mmap
import os
import stat
import struct
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np
import torch

from ..errors import CorruptGeneration
from ..format import tensorfile
from ..format.digest import CHUNK_BYTES, chunk_digest, digest_stream
from ..format.manifest import FileRecord, Manifest
from .threads import in_order
from .base import Store
from .streams import Rewindable

WORKERS = max(1, min(8, os.cpu_count() or 1))
OnBytes = Callable[[int], None]  # told the bytes of each chunk once it verified
SpanReader = Callable[[int, int], "memoryview"]  # bytes [begin, end) of a file, in one request, from any thread
FETCHERS = 8  # object-store requests in flight (waiting on the network: not one per core)
FETCH_BYTES = 8 << 20  # one ranged GET: whole chunks (costs.FETCH_SPAN counts with it)


@dataclass
class Progress:
    """What a read has done so far: whether live tensors already hold bytes of it."""

    live_changed: bool = False
    chunks: int = 0
    bytes: int = 0
    files: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def chunk_done(self, n_bytes: int, on_bytes: OnBytes | None) -> None:
        """A chunk verified and placed, told from any worker thread."""
        with self._lock:
            self.chunks += 1
            self.bytes += n_bytes
        if on_bytes is not None:
            on_bytes(n_bytes)


@dataclass(frozen=True)
class _Target:
    begin: int  # file offsets of the entry's bytes
    end: int
    view: np.ndarray  # uint8 view of the destination memory
    live: bool


def _span_reader(stream: Any) -> SpanReader | None:
    """A stream's ranged reads that threads can make at once (an object store's), or None."""
    get = getattr(stream, "span_reader", None)
    return get() if get is not None else None


def _advise_sequential(stream: Any) -> None:
    """The whole file is about to be read in order: a local file's readahead, or an object's one request."""
    if _span_reader(stream) is not None:
        return  # read in parallel ranged requests instead: none to the end
    sequential = getattr(stream, "sequential", None)
    if sequential is not None:  # an object store's reader: from here on, one request to the end
        sequential()
        return
    try:
        os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
        pass


def _read_full(stream: BinaryIO, view: memoryview, where: str) -> None:
    got = tensorfile.fill(stream, view)
    if got < len(view):
        raise CorruptGeneration(where, f"file ends {len(view) - got} bytes early")


def _chunk_span(record: FileRecord, index: int) -> tuple[int, int]:
    return index * CHUNK_BYTES, min((index + 1) * CHUNK_BYTES, record.size)


def _span_length(record: FileRecord, index: int) -> int:
    lo, hi = _chunk_span(record, index)
    return hi - lo


def _check(record: FileRecord, index: int, data: memoryview | np.ndarray, where: str, algorithm: str) -> None:
    """Chunk ``index`` of the file ``record`` lists is ``data``, by its digest (every chunked reader checks here)."""
    if index >= len(record.chunks) or chunk_digest(data, algorithm) != record.chunks[index]:
        lo, hi = _chunk_span(record, index)
        raise CorruptGeneration(where, f"{algorithm} digest mismatch in chunk {index} (bytes {lo}-{hi}; content "
                                       "changed)")


def verified_range(stream: BinaryIO, record: FileRecord, begin: int, end: int, where: str, algorithm: str,
                   seen: dict[int, bytes] | None = None) -> bytes:
    """Bytes ``[begin, end)`` of a file, read from whole chunks that each verified.

    ``seen``: chunks this reader already verified (by index), reused rather
    than read and digested again; the chunks read here are added to it.
    """
    first, last = begin // CHUNK_BYTES, max(begin, end - 1) // CHUNK_BYTES
    lo = first * CHUNK_BYTES
    seen = {} if seen is None else seen
    parts = []
    for index in range(first, min(last, len(record.chunks) - 1) + 1):
        if index not in seen:
            c_lo, c_hi = _chunk_span(record, index)
            buf = bytearray(c_hi - c_lo)
            stream.seek(c_lo)
            _read_full(stream, memoryview(buf), where)
            _check(record, index, memoryview(buf), where, algorithm)
            seen[index] = bytes(buf) if c_hi - c_lo < 4096 else buf
        parts.append(seen[index])
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    return bytes(data[begin - lo : end - lo])


def verified_header(stream: BinaryIO, record: FileRecord, where: str, algorithm: str,
                    seen: dict[int, bytes] | None = None) -> tensorfile.Layout:
    """Parse a tensor file's header from verified chunks (a bit flip in a shape is damage, not a mismatch)."""
    if record.size < 8:
        raise CorruptGeneration(where, f"{record.size} bytes is too short for a safetensors file")
    seen = {} if seen is None else seen
    (length,) = struct.unpack("<Q", verified_range(stream, record, 0, 8, where, algorithm, seen))
    if length > min(tensorfile.MAX_HEADER_BYTES, record.size - 8):
        raise CorruptGeneration(where, f"declared header length {length} exceeds the file ({record.size} bytes)")
    header = verified_range(stream, record, 0, 8 + length, where, algorithm, seen)
    return tensorfile.parse_header(io.BytesIO(header), record.size, where)


def _held_header(store: Store, stream: BinaryIO, manifest: Manifest, name: str,
                 seen: dict[int, bytes] | None = None) -> tensorfile.Layout:
    """:func:`verified_header`, parsed once per restore: a store that holds its files open for one restore
    (``restore.HeldFiles``) keeps the layouts it verified, so the load pass reuses the preview's."""
    record, where = manifest.file(name), f"{manifest.generation}/{name}"
    memo = getattr(store, "layouts", None)
    key = (manifest.generation, name, record.digest)
    if memo is not None and key in memo:
        return memo[key]
    layout = verified_header(stream, record, where, manifest.digest_algorithm, seen)
    if memo is not None:
        memo[key] = layout
    return layout


def header_preview(store: Store, manifest: Manifest, names: list[str], keep: set[str]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, tensorfile.Layout]]:
    """Meta tensors for every entry, real ones for ``keep`` (the RNG states), all from verified chunks."""
    tensors: dict[str, torch.Tensor] = {}
    layouts = {}
    for name in names:
        record, where = manifest.file(name), f"{manifest.generation}/{name}"
        seen: dict[int, bytes] = {}  # chunks already verified: the RNG tensors mostly share one
        with store.open(manifest.generation, name) as stream:
            layout = layouts[name] = _held_header(store, stream, manifest, name, seen)
            for entry in layout.entries:
                if entry.name in tensors:
                    raise CorruptGeneration(where, f"tensor {entry.name!r:.80} appears in two files")
                if entry.name in keep:
                    data = verified_range(stream, record, layout.data_start + entry.begin,
                                          layout.data_start + entry.end, where, manifest.digest_algorithm, seen)
                    tensors[entry.name] = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
                                           torch.empty(0, dtype=torch.uint8)).view(entry.dtype).reshape(entry.shape)
                else:
                    tensors[entry.name] = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
    return tensors, layouts


def verify_file(stream: BinaryIO, record: FileRecord, where: str, algorithm: str,
                workers: int | None = None, on_bytes: OnBytes | None = None) -> None:
    """Check every chunk of a whole file, on every core (for files that are checked now and read later)."""
    _advise_sequential(stream)
    stream.seek(0)
    _stream_chunks(stream, record, [], where, algorithm, Progress(), workers or WORKERS, on_bytes)
    stream.seek(record.size)
    if stream.read(1):
        raise CorruptGeneration(where, f"is longer than the {record.size} bytes the manifest records")


def holds(stream: BinaryIO, record: FileRecord, where: str, algorithm: str) -> None:
    """Check that the whole file ``stream`` reads is ``record``'s, by its chunk digests (every chunk on its own,
    in parallel ranged reads for an object) or, under a whole-file digest, by that digest: else
    :class:`CorruptGeneration`."""
    if record.chunks:
        verify_file(stream, record, where, algorithm)
        return
    _advise_sequential(stream)
    if digest_stream(stream, algorithm, record.size) != (record.size, record.digest):
        raise CorruptGeneration(where, f"{algorithm} digest mismatch (content changed)")


def fits(dest: torch.Tensor | None, entry: tensorfile.Entry) -> bool:
    return (dest is not None and dest.device.type == "cpu" and dest.dtype == entry.dtype
            and tuple(dest.shape) == tuple(entry.shape) and dest.is_contiguous()
            and not dest.is_conj() and not dest.is_neg())  # their memory is not their values


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    return tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else np.empty(0, np.uint8)


def read_file(store: Store, manifest: Manifest, name: str, wanted: set[str], tensors: dict[str, torch.Tensor], *,
              preview: bool = False, preview_bytes: int = 1 << 16, into: dict[str, torch.Tensor] | None = None,
              progress: Progress | None = None, workers: int | None = None, on_bytes: OnBytes | None = None
              ) -> None:
    """Read one chunked tensor file once, every chunk verified before its bytes are used.

    Entries land in ``into``'s tensors where they fit (name, shape, dtype),
    else in fresh tensors; with ``preview``, entries above ``preview_bytes``
    are verified but not kept (meta placeholders).
    """
    record, where = manifest.file(name), f"{manifest.generation}/{name}"
    progress = progress if progress is not None else Progress()
    with store.open(manifest.generation, name) as opened:
        # a stream (an object store) keeps the header chunk it verifies: the pass below re-reads it from memory
        keeps = positional(opened) is not None or getattr(opened, "keeps_reads", False)  # (a lent stream forwards)
        stream = opened if keeps else Rewindable(opened)
        _advise_sequential(stream)
        layout = _held_header(store, stream, manifest, name)
        targets: list[_Target] = []
        for entry in layout.entries:
            if entry.name in tensors:
                raise CorruptGeneration(where, f"tensor {entry.name!r:.80} appears in two files")
            begin, end = layout.data_start + entry.begin, layout.data_start + entry.end
            if preview and entry.nbytes > preview_bytes:
                tensor = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
            elif into is not None and fits(into.get(entry.name), entry):
                tensor = into[entry.name]
                targets.append(_Target(begin, end, _bytes_of(tensor.detach()), True))
            else:
                raw = torch.empty(entry.nbytes, dtype=torch.uint8)
                targets.append(_Target(begin, end, raw.numpy(), False))
                tensor = raw.view(entry.dtype).reshape(entry.shape)
            if entry.name in wanted:
                tensors[entry.name] = tensor
        stream.seek(0)
        _stream_chunks(stream, record, targets, where, manifest.digest_algorithm, progress, workers or WORKERS,
                       on_bytes)
    progress.files.append(name)


def _stream_chunks(stream: BinaryIO, record: FileRecord, targets: list[_Target], where: str, algorithm: str,
                   progress: Progress, workers: int, on_bytes: OnBytes | None = None) -> None:
    """Verify every chunk of the file and copy each to the targets it overlaps, on ``workers`` threads."""
    fd = positional(stream)
    spans = _span_reader(stream) if fd is None else None
    if spans is not None:
        _ranged_chunks(spans, record, targets, where, algorithm, progress, on_bytes, getattr(stream, "held", None))
    elif fd is None:
        _ring_chunks(stream, record, targets, where, algorithm, progress, workers, on_bytes)
    else:
        _mapped_chunks(fd, record, targets, where, algorithm, progress, workers, on_bytes)


def positional(stream: BinaryIO) -> int | None:
    """The descriptor of a local regular file that threads can map at offsets; None for a stream."""
    try:
        fd = stream.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
        return None


def _moved(before: os.stat_result, after: os.stat_result) -> bool:
    """Whether the file may have been written between two stats: its inode, size, modification or change time
    moved. A change time that moved with the link count is a generation linking or releasing the file (an
    incremental save, a prune), not a write: a write moves the modification time too."""
    if (before.st_ino, before.st_size, before.st_mtime_ns) != (after.st_ino, after.st_size, after.st_mtime_ns):
        return True
    return before.st_ctime_ns != after.st_ctime_ns and before.st_nlink == after.st_nlink


def _mapped_chunks(fd: int, record: FileRecord, targets: list[_Target], where: str, algorithm: str,
                   progress: Progress, workers: int, on_bytes: OnBytes | None) -> None:
    """Each worker maps the next chunk from the page cache, verifies it there and only then copies it.

    No read copy: the digest reads the page cache through a 4 MiB mapping
    (unmapped at once, so the mapping never adds more than a chunk per
    worker to the process's memory), and a verified chunk is copied once,
    into its tensors. A chunk bound for fresh tensors only is copied first
    and verified where it landed. The file must be as long as the manifest
    says before anything is mapped (a mapping past the end would fault), and
    its identity (inode, size, change times) must be the same after the last
    chunk as before the first: a file written while it was read fails the
    read, like a bad chunk.
    """
    count = len(record.chunks)
    before = os.fstat(fd)
    if before.st_size < record.size:
        raise CorruptGeneration(where, f"file ends {record.size - before.st_size} bytes early")

    def one(index: int) -> None:
        lo, hi = _chunk_span(record, index)
        _one_chunk(fd, record, index, lo, hi, targets, where, algorithm, progress)
        progress.chunk_done(hi - lo, on_bytes)

    in_order(count, max(1, min(workers, count)), one)
    if _moved(before, os.fstat(fd)):
        raise CorruptGeneration(where, "was written while it was being read (its size or change time moved); "
                                       "nothing read from it is trusted")


def _one_chunk(fd: int, record: FileRecord, index: int, lo: int, hi: int, targets: list[_Target], where: str,
               algorithm: str, progress: Progress) -> None:
    if hi <= lo:
        return
    over = _overlapping(targets, lo, hi)
    mapped = mmap.mmap(fd, hi - lo, prot=mmap.PROT_READ, offset=lo)
    data = np.frombuffer(mapped, np.uint8)
    try:
        only = over[0] if len(over) == 1 else None
        if only is not None and not only.live and only.begin <= lo and only.end >= hi:
            view = only.view[lo - only.begin : hi - only.begin]
            np.copyto(view, data)  # a fresh tensor: verify the bytes where they landed
            _check(record, index, view, where, algorithm)
        else:
            _check(record, index, data, where, algorithm)
            _place(over, lo, hi, data, progress)
    finally:
        del data
        try:
            mapped.close()
        except BufferError:
            pass  # an error's traceback still holds a view of it: the mapping goes when that does


def _place(over: list[_Target], lo: int, hi: int, data: np.ndarray, progress: Progress) -> None:
    """Copy a verified chunk's bytes into the targets it overlaps."""
    for t in over:
        a, b = max(t.begin, lo), min(t.end, hi)
        if t.live:
            progress.live_changed = True  # before the copy: a copy cut short still changed live bytes
        np.copyto(t.view[a - t.begin : b - t.begin], data[a - lo : b - lo])


def _ring_chunks(stream: BinaryIO, record: FileRecord, targets: list[_Target], where: str, algorithm: str,
                 progress: Progress, workers: int, on_bytes: OnBytes | None) -> None:
    """For streams (object stores): one thread reads in order into a ring; workers verify and place."""
    count = len(record.chunks)
    # workers + 1 buffers, but within 5% of the file (at least three: two workers and the reader)
    ring_size = min(count, workers + 1, max(3, record.size // 20 // CHUNK_BYTES))
    workers = max(1, ring_size - 1)
    ring = [np.empty(min(CHUNK_BYTES, record.size), np.uint8) for _ in range(ring_size)]
    slots: deque[Future] = deque()
    error: list[BaseException] = []

    def work(index: int, buf: np.ndarray, n: int) -> None:
        if error:
            return  # an earlier chunk failed: verify nothing more, copy nothing more
        lo, hi = _chunk_span(record, index)
        try:
            _check(record, index, buf[:n], where, algorithm)
        except CorruptGeneration as exc:
            error.append(exc)
            return
        _place(_overlapping(targets, lo, hi), lo, hi, buf[:n], progress)
        progress.chunk_done(n, on_bytes)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="trainstate-chunks") as pool:
        try:
            for index in range(count):
                if len(slots) == len(ring):
                    slots.popleft().result()
                if error:
                    break
                lo, hi = _chunk_span(record, index)
                buf = ring[index % len(ring)]
                _read_full(stream, memoryview(buf)[: hi - lo], where)
                slots.append(pool.submit(work, index, buf, hi - lo))
        finally:
            error_in_flight = [f.exception() for f in slots]  # waits for every chunk in flight
    for exc in [*error, *(e for e in error_in_flight if e is not None)]:
        raise exc


def _ranged_chunks(spans: SpanReader, record: FileRecord, targets: list[_Target], where: str, algorithm: str,
                   progress: Progress, on_bytes: OnBytes | None, held: dict[int, Any] | None = None) -> None:
    """For object stores: ``FETCHERS`` threads each fetch the next run of chunks in one ranged GET, verify each
    chunk and place it. At most ``FETCHERS`` x ``FETCH_BYTES`` are in memory; the first failure (lowest chunk)
    stops every thread from starting another request and is raised once the requests in flight end. ``held``:
    chunks the stream read already (the header's), verified and placed like the others but not fetched again."""
    count = len(record.chunks)
    per = max(1, FETCH_BYTES // CHUNK_BYTES)
    held = {i: c for i, c in (held or {}).items() if i < count and len(c) == _span_length(record, i)}
    runs: list[tuple[int, int]] = []  # [first, end) chunks: one GET each, or one held chunk
    for index in range(count):
        last = runs[-1] if runs else None
        if index not in held and last and last[0] not in held and last[1] - last[0] < per:
            runs[-1] = (last[0], index + 1)
        else:
            runs.append((index, index + 1))

    def one(at: int) -> None:
        first, end = runs[at]
        lo, hi = _chunk_span(record, first)[0], _chunk_span(record, end - 1)[1]
        data = np.frombuffer(held[first] if first in held else spans(lo, hi), np.uint8)
        if len(data) != hi - lo:
            raise CorruptGeneration(where, f"{len(data)} bytes at {lo} where {hi - lo} were expected (truncated?)")
        for index in range(first, end):
            c_lo, c_hi = _chunk_span(record, index)
            chunk = data[c_lo - lo : c_hi - lo]
            _check(record, index, chunk, where, algorithm)
            _place(_overlapping(targets, c_lo, c_hi), c_lo, c_hi, chunk, progress)
            progress.chunk_done(c_hi - c_lo, on_bytes)

    in_order(len(runs), max(1, min(FETCHERS, len(runs))), one)


def _overlapping(targets: list[_Target], lo: int, hi: int) -> list[_Target]:
    """Targets (in file order, not overlapping each other) that overlap ``[lo, hi)``."""
    left, right = 0, len(targets)
    while left < right:  # the first target ending after lo
        mid = (left + right) // 2
        if targets[mid].end <= lo:
            left = mid + 1
        else:
            right = mid
    out = []
    for t in targets[left:]:
        if t.begin >= hi:
            break
        if t.end > t.begin:
            out.append(t)
    return out
