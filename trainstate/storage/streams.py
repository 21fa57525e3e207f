"""Read-only streams with a position, and a remote stream that keeps what it read.

:class:`SeekableReader` is what every stream of ours shares: a position, and
``seek`` over a known size. :class:`Rewindable` keeps what it read, so that a
second pass over the same file downloads nothing twice: reading a tensor file
verifies its header first (the first 4 MiB chunk), then streams the whole file
from its start; a restore previews ``state.json``, the header and the RNG
chunk before its load pass. On a local disk the page cache serves the
repeats; over HTTP each would be another download.
"""

from __future__ import annotations

import io
import shutil
import tempfile
from collections.abc import Callable
from typing import Any


class SeekableReader(io.RawIOBase):
    """A readable stream with a position; a subclass gives ``size`` and ``readinto``, and may react to a move."""

    _pos = 0

    @property
    def size(self) -> int:
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self._pos + offset}.get(whence)
        self._moved(max(0, self.size + offset if target is None else target))
        return self._pos

    def _moved(self, target: int) -> None:
        self._pos = target


class Rewindable(SeekableReader):
    """A held remote stream that keeps what it read (up to ``RETAIN`` bytes): a later pass over the same file
    (the load, after the preview read ``state.json``, a tensor file's header chunk and its RNG chunk) reads
    those bytes from memory and downloads only the rest, so no byte is downloaded twice."""

    RETAIN = 16 << 20
    keeps_reads = True  # a reader that would wrap a stream in one sees that this one already is

    def __init__(self, stream: Any):
        self._inner, self._pos = stream, 0
        self._kept: list[tuple[int, bytearray]] = []  # (offset, bytes) regions read, in the order read
        self._budget = self.RETAIN

    @property
    def size(self) -> int:
        return self._inner.seek(0, io.SEEK_END)  # moves the inner stream: the next read seeks it back

    def sequential(self) -> None:
        """The rest is read in order: the inner stream may ask for it in one request."""
        advise = getattr(self._inner, "sequential", None)
        if advise is not None:
            advise()

    def span_reader(self) -> Callable[[int, int], memoryview] | None:
        """The inner stream's ranged reads (see ``ObjectReader.span_reader``), a span this stream already kept
        served from memory: None where the inner stream has none."""
        inner = getattr(self._inner, "span_reader", None)
        fetch = inner() if inner is not None else None
        if fetch is None:
            return None

        def span(begin: int, end: int) -> memoryview:
            kept = sorted((max(begin, start), min(end, start + len(data)), start, data)
                          for start, data in list(self._kept) if start < end and begin < start + len(data))
            if not kept:  # (a snapshot: kept regions only grow, on the thread that reads in order)
                return fetch(begin, end)
            out, at = bytearray(end - begin), begin  # the kept bytes copied (a region may grow), the gaps fetched
            for lo, hi, start, data in kept:
                if lo > at:
                    out[at - begin:lo - begin] = fetch(at, lo)
                out[lo - begin:hi - begin] = memoryview(data)[lo - start:hi - start]
                at = max(at, hi)
            if at < end:
                out[at - begin:] = fetch(at, end)
            return memoryview(out)

        return span

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        while done < len(out):
            n = self._from_kept(out[done:])
            if not n:
                if self._inner.tell() != self._pos:
                    self._inner.seek(self._pos)
                ahead = [start for start, _ in self._kept if start > self._pos]
                if hasattr(self._inner, "stop"):  # download nothing this stream already holds
                    self._inner.stop = min(ahead, default=None)
                n = self._inner.readinto(out[done:done + (min(ahead) - self._pos if ahead else len(out))])
                if not n:
                    break
                self._keep(out[done:done + n])
            self._pos += n
            done += n
        return done

    def _from_kept(self, out: memoryview) -> int:
        for start, data in self._kept:
            if start <= self._pos < start + len(data):
                n = min(len(out), start + len(data) - self._pos)
                out[:n] = data[self._pos - start:self._pos - start + n]
                return n
        return 0

    def _keep(self, data: memoryview) -> None:
        take = min(len(data), self._budget)
        if not take:
            return
        self._budget -= take
        if self._kept and self._kept[-1][0] + len(self._kept[-1][1]) == self._pos:
            self._kept[-1][1].extend(data[:take])
        else:
            self._kept.append((self._pos, bytearray(data[:take])))

    def close(self) -> None:
        self._inner.close()
        super().close()


def spooled(stream: Any) -> Any:
    """``stream`` downloaded once, in one request, into an unnamed temporary file (in ``$TMPDIR``) that every
    later read uses: for readers that read a remote file more than once. Closes ``stream``."""
    with stream:
        advise = getattr(stream, "sequential", None)
        if advise is not None:
            advise()
        local = tempfile.TemporaryFile(prefix="trainstate-")
        try:
            shutil.copyfileobj(stream, local, 16 << 20)
        except BaseException:
            local.close()
            raise
    local.seek(0)
    return local
