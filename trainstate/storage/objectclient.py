"""The few object-store requests trainstate makes, through ``obstore``, with its errors made ours.

``obstore`` (Rust's ``object_store``) speaks S3, GCS and Azure behind one API,
with the conditional puts this protocol needs (create-only, and replace only
if the ETag still matches), multipart uploads, and a bounded retry with
backoff for 5xx answers, timeouts and connection resets. Credentials, region
and endpoint come from the environment, as each cloud's own tools read them
(``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``,
``AZURE_STORAGE_ACCOUNT_NAME`` ...), or from ``storage_options``, which win.

Errors: a permanent refusal (403, bad credentials, a missing bucket) raises at
once with a message naming the bucket and the setting to fix; a transient one
that outlasts the retries raises :class:`~trainstate.errors.StorageUnavailable`.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ..errors import InvalidArgument, StorageAccessDenied, StorageNotFound, StorageUnavailable
from .streams import SeekableReader

SCHEMES = ("s3", "gs", "az", "abfs", "abfss")
_SETTINGS = {"s3": "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or storage_options access_key_id/secret_access_key)",
             "gs": "GOOGLE_APPLICATION_CREDENTIALS (or storage_options service_account_path)",
             "az": "AZURE_STORAGE_ACCOUNT_NAME/AZURE_STORAGE_ACCOUNT_KEY (or storage_options account_name/account_key)"}
T = TypeVar("T")
_DENIED = re.compile(r"status code: 403\b|\b403 Forbidden\b|AccessDenied|SignatureDoesNotMatch|InvalidAccessKeyId")
_BACKOFF_S = (0.1, 0.3, 1.0, 3.0)  # our own retries of a replayable request, after the client's
_WRITES = frozenset({"writing", "copying", "uploading", "deleting"})  # what _call is told a request does


class Taken(Exception):
    """A create-only put found the object already there."""


class Precondition(Exception):
    """A compare-and-swap found another version than the one expected."""


class Missing(Exception):
    """The object is not there."""


def is_url(location: str) -> bool:
    return urlsplit(str(location)).scheme in SCHEMES


class Client:
    """One bucket and prefix; every method maps the store's errors onto trainstate's."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        from obstore.store import from_url  # an extra: `pip install trainstate[s3]`

        parts = urlsplit(url)
        if parts.scheme not in SCHEMES or not parts.netloc:
            raise InvalidArgument(f"{url!r} is not an object-store URL; use s3://bucket/prefix, gs://bucket/prefix "
                                  "or az://container/prefix")
        self.url = url.rstrip("/")
        self.bucket = parts.netloc
        self.setting = _SETTINGS.get(parts.scheme, _SETTINGS["az"])
        options = dict(storage_options or {})
        try:
            self.store = from_url(self.url, **options)
        except Exception as exc:  # an unknown option, a malformed endpoint
            raise InvalidArgument(f"cannot use {url!r} with storage_options {sorted(options)}: {exc}") from None
        self._listed: dict[tuple[str, bool], list[str]] | None = None  # names() within listings_held()
        self._holders = 0
        self._writes = 0  # every write through this client: a listing made before one is not kept after it
        self._memo_lock = threading.Lock()

    @contextlib.contextmanager
    def listings_held(self) -> Iterator[None]:
        """Within, each :meth:`names` listing is requested once and answered from memory after, until this
        client writes or deletes anything (any key: then every listing is requested again). One save asks
        for the generations and the set-aside records several times before its first write (interrupted
        replacements, the name, leftovers), each a LIST request on the server."""
        with self._memo_lock:
            self._holders += 1
            if self._listed is None:
                self._listed = {}
        try:
            yield
        finally:
            with self._memo_lock:
                self._holders -= 1
                if not self._holders:
                    self._listed = None

    # mapping -----------------------------------------------------------------
    def _call(self, what: str, key: str, fn: Callable[[], T], *, replayable: bool = True) -> T:
        """``fn`` with the store's errors mapped; a transient failure is tried again (bounded) when the request
        can be replayed. The client retries 5xx answers itself, but not a connection that broke mid-request
        for a conditional put: the caller resolves that ambiguity (a create that had landed reads back as
        ours), so replaying here never commits twice."""
        if what not in _WRITES:
            return self._attempts(what, key, fn, replayable)
        self._forget_listings()
        try:
            return self._attempts(what, key, fn, replayable)
        finally:  # (a listing made while the write was in flight is not kept either)
            self._forget_listings()

    def _attempts(self, what: str, key: str, fn: Callable[[], T], replayable: bool) -> T:
        for delay in (*_BACKOFF_S, None) if replayable else (None,):
            try:
                return self._mapped(what, key, fn)
            except StorageUnavailable:
                if delay is None:
                    raise
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _forget_listings(self) -> None:
        with self._memo_lock:
            self._writes += 1
            if self._listed:
                self._listed.clear()

    def _mapped(self, what: str, key: str, fn: Callable[[], T]) -> T:
        from obstore import exceptions as ox

        where = f"{self.url}/{key}" if key else self.url
        try:
            return fn()
        except ox.AlreadyExistsError:
            raise Taken(where) from None
        except (ox.PreconditionError, ox.NotModifiedError):
            raise Precondition(where) from None
        except (FileNotFoundError, ox.NotFoundError) as exc:
            if "NoSuchBucket" in str(exc) or "ContainerNotFound" in str(exc):
                raise StorageNotFound(f"{what} {where}: the bucket {self.bucket!r} does not exist (or this "
                                      "endpoint does not serve it); create it, or fix the URL or the endpoint "
                                      "(storage_options endpoint / AWS_ENDPOINT_URL)") from None
            raise Missing(where) from None
        except (PermissionError, ox.PermissionDeniedError, ox.UnauthenticatedError) as exc:
            raise StorageAccessDenied(f"{what} {where}: access denied ({_first_line(exc)}); check the credentials "
                                      f"and their permissions on bucket {self.bucket!r}: {self.setting}") from None
        except (ox.BaseError, OSError) as exc:
            text = str(exc)
            if _DENIED.search(text):  # not a bare "403": request timings such as "102.974032ms" contain it
                raise StorageAccessDenied(f"{what} {where}: access denied ({_first_line(exc)}); check the "
                                          f"credentials and their permissions on bucket {self.bucket!r}: "
                                          f"{self.setting}") from None
            raise StorageUnavailable(f"{what} {where} failed after the client's retries: {_first_line(exc)}. "
                                     "Nothing was committed by this request; check the endpoint and the network, "
                                     "then retry (a save can simply be called again)") from None

    # requests ----------------------------------------------------------------
    def put(self, key: str, data: bytes, *, create: bool = False, e_tag: str | None = None) -> str:
        """Write a small object whole; ``create``: only if absent; ``e_tag``: only if still that version."""
        import obstore

        mode: Any = "create" if create else ({"e_tag": e_tag} if e_tag is not None else "overwrite")
        result = self._call("writing", key, lambda: obstore.put(self.store, key, data, mode=mode,
                                                                 use_multipart=False))
        return result["e_tag"] or ""

    def copy(self, source: str, key: str) -> None:
        """A server-side copy of object ``source`` to ``key`` (no byte passes through this client)."""
        import obstore

        try:
            self._call("copying", key, lambda: obstore.copy(self.store, source, key))
        except Missing:
            raise FileNotFoundError(f"{self.url}/{source}") from None

    def put_stream(self, key: str, views: Iterator[memoryview], part_size: int) -> None:
        """Upload what ``views`` yields: one request when it all fits in a part, else a multipart upload."""
        import obstore

        first = next(views, memoryview(b""))
        second = next(views, None) if len(first) < part_size else None
        if second is None and len(first) < part_size:
            self._call("uploading", key, lambda: obstore.put(self.store, key, bytes(first), use_multipart=False))
            return

        def chained() -> Iterator[memoryview]:
            yield first
            if second is not None:
                yield second
            yield from views

        self._call("uploading", key, lambda: obstore.put(self.store, key, chained(), chunk_size=part_size,
                                                         max_concurrency=8), replayable=False)

    def head(self, key: str) -> int | None:
        version = self.version(key)
        return None if version is None else version[0]

    def version(self, key: str) -> tuple[int, str] | None:
        """The object's size and ETag (``""`` where the store gives none), or ``None`` when it is not there. A
        replacement of the object moves its ETag, whatever its size."""
        import obstore

        try:
            meta = self._call("reading", key, lambda: obstore.head(self.store, key))
        except Missing:
            return None
        return int(meta["size"]), meta["e_tag"] or ""

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        import obstore

        try:
            def fetch() -> tuple[bytes, str]:
                result = obstore.get(self.store, key)
                return bytes(result.bytes()), result.meta["e_tag"] or ""

            return self._call("reading", key, fetch)
        except Missing:
            return None

    def get_small(self, key: str) -> bytes | None:
        got = self.get_versioned(key)
        return None if got is None else got[0]

    def names(self, prefix: str, *, folders: bool = False) -> list[str]:
        """Names directly under ``prefix`` (``folders``: the sub-prefixes instead of the objects)."""
        import obstore

        with self._memo_lock:
            held, writes = self._listed, self._writes
            if held is not None and (prefix, folders) in held:
                return list(held[(prefix, folders)])
        listing = self._call("listing", prefix, lambda: obstore.list_with_delimiter(self.store, prefix.rstrip("/")))
        if folders:
            out = [p.rstrip("/").rsplit("/", 1)[-1] for p in listing["common_prefixes"]]
        else:
            out = [o["path"].rsplit("/", 1)[-1] for o in listing["objects"]]
        with self._memo_lock:
            if self._listed is not None and self._writes == writes:  # no write since the request was made
                self._listed[(prefix, folders)] = list(out)
        return out

    def listing(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix``, recursively: path to size."""
        import obstore

        def collect() -> dict[str, int]:
            out: dict[str, int] = {}
            for batch in obstore.list(self.store, prefix=prefix.rstrip("/")):
                for meta in batch:
                    out[meta["path"]] = int(meta["size"])
            return out

        return self._call("listing", prefix, collect)

    def delete(self, key: str) -> None:
        import obstore

        with contextlib.suppress(Missing):
            self._call("deleting", key, lambda: obstore.delete(self.store, key))

    def delete_prefix(self, prefix: str) -> None:
        import obstore

        paths = sorted(self.listing(prefix))
        for start in range(0, len(paths), 1000):
            batch = paths[start:start + 1000]
            with contextlib.suppress(Missing):
                self._call("deleting", prefix, lambda: obstore.delete(self.store, batch))

    def read_ranges(self, key: str, spans: list[tuple[int, int]]) -> list[memoryview]:
        """The bytes of each ``[begin, end)`` span of one object: bounded ranged GETs, several in flight at once
        (no HEAD: the caller knows the size, and verifies each span against its digests)."""
        import obstore

        if not spans:
            return []
        try:
            got = self._call("reading", key, lambda: obstore.get_ranges(
                self.store, key, starts=[b for b, _ in spans], ends=[e for _, e in spans], coalesce=0))
        except Missing:
            raise FileNotFoundError(f"{self.url}/{key}") from None
        return [memoryview(g).cast("B") for g in got]

    def reader(self, key: str) -> Any:
        """A seekable stream of one object, every range pinned to the version first seen (If-Match)."""
        import obstore

        try:
            meta = self._call("reading", key, lambda: obstore.head(self.store, key))
        except Missing:
            raise FileNotFoundError(f"{self.url}/{key}") from None
        e_tag, size = meta["e_tag"], int(meta["size"])

        def open_range(offset: int, end: int) -> Iterator[memoryview]:
            options: Any = {"range": (offset, end)} if (offset, end) != (0, size) else {}  # whole: a plain GET
            if e_tag:
                options["if_match"] = e_tag
            try:
                result = self._call("reading", key, lambda: obstore.get(self.store, key, options=options))
            except (Missing, Precondition):
                raise FileNotFoundError(f"{self.url}/{key} was removed or replaced while being read") from None
            stream = result.stream(min_chunk_size=8 << 20)
            return _views(functools.partial(self._call, "reading", key, replayable=False), stream)

        def fetch(offset: int, end: int) -> memoryview:
            options: Any = {"range": (offset, end)}
            if e_tag:
                options["if_match"] = e_tag
            try:  # the body inside the call: a transfer cut short is retried like a refused request
                body = self._call("reading", key, lambda: obstore.get(self.store, key, options=options).bytes())
            except (Missing, Precondition):
                raise FileNotFoundError(f"{self.url}/{key} was removed or replaced while being read") from None
            return memoryview(body).cast("B")

        return ObjectReader(open_range, size, f"{self.url}/{key}", fetch, version=e_tag or "")


def _views(call: Callable[[Callable[[], Any]], Any], stream: Any) -> Iterator[memoryview]:
    while True:
        try:
            chunk = call(lambda: next(stream))
        except StopIteration:
            return
        yield memoryview(chunk).cast("B")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


class ObjectReader(SeekableReader):
    """A committed object read as a stream of bounded ranged GETs, each pinned to the object's ETag.

    No request reaches past what is about to be read: a GET that a reader
    abandons (a seek, or a pass that reads only a header) was transferred in
    full all the same. The first after an open or a seek covers the read
    asked for (at least ``FIRST_SPAN``); while reads stay sequential, each
    next request doubles, up to ``MAX_SPAN``, and the next one is asked for
    early. A reader that will read the rest in order says so
    (:meth:`sequential`): then one request covers it, to the end or ``stop``.
    """

    FIRST_SPAN = 1 << 20
    MAX_SPAN = 64 << 20

    def __init__(self, open_range: Callable[[int, int], Iterator[memoryview]], size: int, name: str,
                 fetch: Callable[[int, int], memoryview] | None = None, *, version: str = ""):
        self._open_range, self._size, self.name, self._fetch = open_range, size, name, fetch
        self.version = version  # the ETag every request is pinned to ("" where the store gives none)
        self._pos = 0
        self._chunks: Iterator[memoryview] | None = None
        self._pending = memoryview(b"")
        self._span = 0  # the size of the last request; 0 after an open or a seek
        self.stop: int | None = None  # no request reaches past this offset (a caller that holds the bytes there)
        self._ahead: tuple[int, int, Iterator[memoryview]] | None = None  # the next range, requested early
        self._to_end = False  # sequential(): each request runs to the end (or to ``stop``)

    def sequential(self) -> None:
        """The rest of the object is read in order: each request from here on runs to its end (or ``stop``)."""
        self._to_end = True

    def span_reader(self) -> Callable[[int, int], memoryview] | None:
        """Bytes ``[begin, end)`` in one bounded ranged GET, pinned to the same version, wherever this stream
        stands: callable from several threads at once (the position and the pending requests stay as they
        are)."""
        return self._fetch

    @property
    def size(self) -> int:
        return self._size

    def _moved(self, target: int) -> None:
        if target != self._pos:  # the requests under way are dropped; the next one starts small again
            self._chunks, self._pending, self._pos, self._span, self._ahead = None, memoryview(b""), target, 0, None

    def _fill(self, want: int) -> bool:
        """Make ``_pending`` hold the next bytes; False at the end of the object."""
        while not self._pending:
            if self._chunks is not None:
                self._pending = next(self._chunks, memoryview(b""))
                if self._pending:
                    return True
                self._chunks = None  # this range is read to its end
            if self._pos >= self._size:
                return False
            sequential = self._span > 0  # the last range was read to its end: the reader streams
            if self._ahead is not None and self._ahead[0] == self._pos:
                self._span, self._chunks = self._ahead[1] - self._pos, self._ahead[2]
            else:
                self._span = self._size - self._pos if self._to_end else min(
                    self.MAX_SPAN, max(want, self.FIRST_SPAN, 2 * self._span))
                self._chunks = self._open_range(self._pos, self._end(self._pos, self._span))
            self._ahead = None
            if sequential:  # ask for the next range now: it arrives while this one is consumed
                start = self._pos + self._span
                if start < self._size and (self.stop is None or start < self.stop or self._pos >= self.stop):
                    end = self._end(start, min(self.MAX_SPAN, 2 * self._span))
                    self._ahead = (start, end, self._open_range(start, end))
        return True

    def _end(self, start: int, span: int) -> int:
        end = min(self._size, start + span)
        return min(end, self.stop) if self.stop is not None and start < self.stop else end

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        if self._pos >= self._size or len(out) == 0:
            return 0
        if not self._fill(len(out)):
            return 0
        n = min(len(out), len(self._pending))
        out[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        self._pos += n
        self._to_end = self._to_end and self._pos < self._size  # the sequential pass is over at the end
        return n

    def read(self, size: int | None = -1) -> bytes:
        """One copy out of the pending chunk (``RawIOBase.read`` copies twice: into a buffer, then to bytes)."""
        if size is None or size < 0:
            return self.readall()
        if self._pos >= self._size or size == 0:
            return b""
        if not self._fill(size):
            return b""
        data = bytes(self._pending[:size])
        self._pending = self._pending[len(data):]
        self._pos += len(data)
        self._to_end = self._to_end and self._pos < self._size
        return data
