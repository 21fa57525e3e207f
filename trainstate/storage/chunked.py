"""Verified, parallel reads of ``blake3-chunked`` tensor files: each byte read once.

A format-3 manifest lists the digest of every 4 MiB chunk of every file
(:mod:`trainstate.format.digest`), and the manifest itself is trusted through
the pointer (and the signature, when a key is set). So a chunk can be checked
on its own, as soon as it is read:

1. One thread reads the file in order into a small ring of staging buffers
   (one chunk per worker plus one, within 5% of the file but at least three:
   12 MiB on two cores), with sequential read-ahead advised to the kernel.
2. Worker threads (BLAKE3 releases the GIL) digest a staged chunk, compare it
   with the manifest, and only then copy its bytes into the tensors they
   belong to: fresh tensors, or live ones for an in-place restore.
3. A chunk that does not match stops the read. Nothing unverified was copied
   anywhere; but for an in-place restore, verified chunks before it may
   already be in live tensors. :class:`Progress` says whether any were, and
   the restore path marks the state unusable then (see
   :mod:`trainstate.restore`).

:func:`header_preview` reads only what restore checks before a live object
changes: each tensor file's header and the RNG tensors, each from verified
chunks. Meta tensors stand in for the rest.
"""

from __future__ import annotations

import io
import os
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
import torch

from ..errors import CorruptGeneration
from ..format import tensorfile
from ..format.digest import CHUNK_BYTES, chunk_digest
from ..format.manifest import FileRecord, Manifest
from .base import Store

WORKERS = max(1, min(8, os.cpu_count() or 1))


@dataclass
class Progress:
    """What a read has done so far: whether live tensors already hold bytes of it."""

    live_changed: bool = False
    chunks: int = 0
    bytes: int = 0
    files: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Target:
    begin: int  # file offsets of the entry's bytes
    end: int
    view: np.ndarray  # uint8 view of the destination memory
    live: bool


def _advise_sequential(stream: Any) -> None:
    try:
        os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
        pass  # not a local file: the object reader streams in order anyway


def _read_full(stream: BinaryIO, view: memoryview, where: str) -> None:
    got = 0
    while got < len(view):
        n = stream.readinto(view[got:])
        if not n:
            raise CorruptGeneration(where, f"file ends {len(view) - got} bytes early")
        got += n


def _chunk_span(record: FileRecord, index: int) -> tuple[int, int]:
    return index * CHUNK_BYTES, min((index + 1) * CHUNK_BYTES, record.size)


def _check(record: FileRecord, index: int, data: memoryview | np.ndarray, where: str, algorithm: str) -> None:
    if chunk_digest(data) != record.chunks[index]:
        lo, hi = _chunk_span(record, index)
        raise CorruptGeneration(where, f"{algorithm} digest mismatch in chunk {index} (bytes {lo}-{hi}; content "
                                       "changed)")


def verified_range(stream: BinaryIO, record: FileRecord, begin: int, end: int, where: str, algorithm: str) -> bytes:
    """Bytes ``[begin, end)`` of a file, read from whole chunks that each verified."""
    first, last = begin // CHUNK_BYTES, max(begin, end - 1) // CHUNK_BYTES
    lo = first * CHUNK_BYTES
    stream.seek(lo)
    parts = []
    for index in range(first, min(last, len(record.chunks) - 1) + 1):
        c_lo, c_hi = _chunk_span(record, index)
        buf = bytearray(c_hi - c_lo)
        _read_full(stream, memoryview(buf), where)
        _check(record, index, memoryview(buf), where, algorithm)
        parts.append(buf)
    data = b"".join(parts)
    return data[begin - lo : end - lo]


def verified_header(stream: BinaryIO, record: FileRecord, where: str, algorithm: str) -> tensorfile.Layout:
    """Parse a tensor file's header from verified chunks (a bit flip in a shape is damage, not a mismatch)."""
    if record.size < 8:
        raise CorruptGeneration(where, f"{record.size} bytes is too short for a safetensors file")
    (length,) = struct.unpack("<Q", verified_range(stream, record, 0, 8, where, algorithm))
    if length > min(tensorfile.MAX_HEADER_BYTES, record.size - 8):
        raise CorruptGeneration(where, f"declared header length {length} exceeds the file ({record.size} bytes)")
    header = verified_range(stream, record, 0, 8 + length, where, algorithm)
    return tensorfile.parse_header(io.BytesIO(header), record.size, where)


def header_preview(store: Store, manifest: Manifest, names: list[str], keep: set[str]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, tensorfile.Layout]]:
    """Meta tensors for every entry, real ones for ``keep`` (the RNG states), all from verified chunks."""
    tensors: dict[str, torch.Tensor] = {}
    layouts = {}
    for name in names:
        record, where = manifest.file(name), f"{manifest.generation}/{name}"
        with store.open(manifest.generation, name) as stream:
            layout = layouts[name] = verified_header(stream, record, where, manifest.digest_algorithm)
            for entry in layout.entries:
                if entry.name in tensors:
                    raise CorruptGeneration(where, f"tensor {entry.name!r:.80} appears in two files")
                if entry.name in keep:
                    data = verified_range(stream, record, layout.data_start + entry.begin,
                                          layout.data_start + entry.end, where, manifest.digest_algorithm)
                    tensors[entry.name] = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
                                           torch.empty(0, dtype=torch.uint8)).view(entry.dtype).reshape(entry.shape)
                else:
                    tensors[entry.name] = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
    return tensors, layouts


def verify_file(stream: BinaryIO, record: FileRecord, where: str, algorithm: str,
                workers: int | None = None) -> None:
    """Check every chunk of a whole file, on every core (for files that are checked now and read later)."""
    _advise_sequential(stream)
    stream.seek(0)
    _stream_chunks(stream, record, [], where, algorithm, Progress(), workers or WORKERS)
    if stream.read(1):
        raise CorruptGeneration(where, f"is longer than the {record.size} bytes the manifest records")


def fits(dest: torch.Tensor | None, entry: tensorfile.Entry) -> bool:
    return (dest is not None and dest.device.type == "cpu" and dest.dtype == entry.dtype
            and tuple(dest.shape) == tuple(entry.shape) and dest.is_contiguous()
            and not dest.is_conj() and not dest.is_neg())  # their memory is not their values


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    return tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else np.empty(0, np.uint8)


def read_file(store: Store, manifest: Manifest, name: str, wanted: set[str], tensors: dict[str, torch.Tensor], *,
              preview: bool = False, preview_bytes: int = 1 << 16, into: dict[str, torch.Tensor] | None = None,
              progress: Progress | None = None, workers: int | None = None) -> None:
    """Read one chunked tensor file once, every chunk verified before its bytes are used.

    Entries land in ``into``'s tensors where they fit (name, shape, dtype),
    else in fresh tensors; with ``preview``, entries above ``preview_bytes``
    are verified but not kept (meta placeholders).
    """
    record, where = manifest.file(name), f"{manifest.generation}/{name}"
    progress = progress if progress is not None else Progress()
    with store.open(manifest.generation, name) as stream:
        _advise_sequential(stream)
        layout = verified_header(stream, record, where, manifest.digest_algorithm)
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
        _stream_chunks(stream, record, targets, where, manifest.digest_algorithm, progress, workers or WORKERS)
    progress.files.append(name)


def _stream_chunks(stream: BinaryIO, record: FileRecord, targets: list[_Target], where: str, algorithm: str,
                   progress: Progress, workers: int) -> None:
    """Read every chunk in order; workers verify each and copy it to the targets it overlaps."""
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
        for t in _overlapping(targets, lo, hi):
            a, b = max(t.begin, lo), min(t.end, hi)
            np.copyto(t.view[a - t.begin : b - t.begin], buf[a - lo : b - lo])
            if t.live:
                progress.live_changed = True
        progress.chunks += 1
        progress.bytes += n

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
