"""Generations in an object store (S3, GCS, Azure, through ``obstore``): no rename, so a commit record instead.

Layout under the run's URL (``s3://bucket/runs/exp1``)::

    attempts/<gen>-<token>/<file>     every file of one save attempt, the manifest last
    staging/<gen>-<token>             marks an attempt begun (what ``join`` finds, what cleanup removes)
    commits/<gen>                     the commit record: names the attempt that *is* the generation
    aside/<gen>.<reason>-<token>      a set-aside generation's record (its files stay where they are)
    refs/<gen>-<token>/<file>         a linked file staged: the object holding its bytes (see ``objectrefs``)
    latest, latest-weights, pins, run-identity     small objects, replaced by compare-and-swap
    lock, mutex-<name>                advisory leases

Publication of one generation::

    put     attempts/<gen>-<token>/<file>, digested beside the upload (multipart when large)
    put     attempts/<gen>-<token>/manifest.json        last
    put     commits/<gen>  (create-only)                 stands in for rename: one committer wins (and
                                                         carries the references of the files it links)
    delete  staging/<gen>-<token>

A reader sees a generation only through its commit record, so an attempt is
invisible until the record exists and complete once it does. Object-store
ETags are not content digests (a multipart ETag never is): trainstate's own
digests, in the manifest, are the integrity check, verified on read.

Every request goes through the client's bounded retry (5xx, timeouts, resets).
A retried create-only put that had in fact landed answers "already exists":
the record is read back, and if it names this attempt the commit stands, so a
retry never commits twice and never reports a lost race that was won.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

from ..errors import CorruptGeneration, DirectoryLocked, GenerationExists, TrainStateError
from ..format.digest import FAST_CHUNKED, new_hasher
from ..format.manifest import MANIFEST, MAX_JSON_BYTES, POINTER, WEIGHTS_POINTER, FileRecord, newest_first
from . import objectrefs
from .lease import Lease, token as _token
from .objectclient import Client, Precondition, Taken
from .multipart import OpenUploads, part_size
from .posix import coalesce

__all__ = ["ObjectStaging", "ObjectStore"]
log = logging.getLogger("trainstate")

_TOKEN = r"[0-9a-f]{16}"
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}"
_ATTEMPT_RE = re.compile(rf"({_NAME})-({_TOKEN})")
_ASIDE_RE = re.compile(rf"(gen-\d{{12}}(?:-weights|-r\d{{3}})?)\.(rejected|abandoned|superseded)-{_TOKEN}")
ASIDE_REASONS = ("rejected", "abandoned", "superseded")
_RECORD = "trainstate-commit"
def _record(generation: str, attempt: str, refs: objectrefs.Refs | None = None) -> bytes:
    return json.dumps({"format": _RECORD, "generation": generation, "attempt": attempt,
                       **objectrefs.to_record(refs or {})}).encode()


def _parse_record(data: bytes, where: str) -> tuple[str, objectrefs.Refs]:
    """The attempt a commit (or aside) record names, and the files it references (see :mod:`.objectrefs`)."""
    try:
        raw = json.loads(data)
        attempt = raw["attempt"]
        if raw.get("format") != _RECORD or not isinstance(attempt, str) or not _ATTEMPT_RE.fullmatch(attempt):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise CorruptGeneration(where, "is not a trainstate commit record") from None
    return attempt, objectrefs.from_record(raw, where)


class ObjectStaging:
    """One save attempt: files under ``attempts/<gen>-<token>/``, invisible until :meth:`commit`."""

    def __init__(self, store: ObjectStore, generation: str, joined: str | None = None):
        self.generation = generation
        self._store = store
        if joined is None:
            self.name = f"{generation}-{_token()}"
            store.client.put(f"staging/{self.name}", _marker(), create=True)
        else:  # another rank's attempt: it must exist (rank 0 began it), and be of this generation
            match = _ATTEMPT_RE.fullmatch(joined)
            if match is None or match.group(1) != generation:
                raise ValueError(f"{joined!r} is not a staging area of {generation}")
            if store.client.head(f"staging/{joined}") is None:
                raise FileNotFoundError(f"{store.location}: the staging area {joined} (begun by rank 0) does "
                                        "not exist; every rank must use the same run URL")
            self.name = joined
        self.prefix = f"attempts/{self.name}/"
        self.refs: objectrefs.Refs = {}  # the files this attempt references (:meth:`link`), staged as objects too
        self.shared = False  # other ranks stage files (and references) into this attempt: list them at commit

    def write(self, file: str, chunks: Iterable[bytes | memoryview], *, stable: bool = False,
              algorithm: str | None = None, size_hint: int | None = None) -> FileRecord:
        """Upload one file, digesting every byte as it is handed to the client; multipart when large."""
        hasher = new_hasher(algorithm or self._store.digest_algorithm)
        size = 0
        part = part_size(size_hint)

        def digested() -> Iterator[memoryview]:
            nonlocal size
            for view in coalesce(chunks, part):
                hasher.update(view)
                size += len(view)
                yield view

        self._store.client.put_stream(self.prefix + file, digested(), part)
        landed = self._store.client.head(self.prefix + file)
        if landed is None or landed != size:
            raise CorruptGeneration(f"{self.generation}/{file}", f"uploaded {size} bytes, the store holds "
                                    f"{landed if landed is not None else 'nothing'}; the attempt was abandoned")
        digest = hasher.hexdigest()
        return FileRecord(file, size, digest, tuple(getattr(hasher, "chunks", ())))

    def link(self, file: str, generation: str, record: FileRecord) -> FileRecord | None:
        """Stage ``file`` as a reference to the object holding committed ``generation``'s ``record`` (the one its
        bytes were first uploaded as): nothing is uploaded or copied, the bytes are stored once (:mod:`.objectrefs`).
        ``None`` where the object is gone, is not the recorded size, or does not hold ``record``'s bytes.

        The object is proven to hold ``record`` (:meth:`ObjectStore.proven`): at once when it is a version this
        store proved before, else by reading it back against ``record``'s digests. A damaged object (a replaced
        one, a flipped bit) thus never becomes a file of a new generation."""
        client = self._store.client
        try:
            source = self._store.key(generation, record.name)  # (a spare's twin, or the same name; resolved)
            version = client.version(source)
        except (OSError, TrainStateError):
            return None
        if version is None or version[0] != record.size:
            return None
        if not self._store.proven(source, version[1], record) and not self._store.prove(
                source, record, f"{generation}/{record.name}", version[1]):
            return None
        client.put(f"{objectrefs.REFS}{self.name}/{file}", objectrefs.encode(source, record.size))
        self.refs[file] = (source, record.size)
        return dataclasses.replace(record, name=file)

    def commit(self) -> None:
        """The create-only commit record: the one moment the generation becomes visible."""
        client, key = self._store.client, f"commits/{self.generation}"
        refs = {**objectrefs.staged(client, self.name), **self.refs} if self.shared else self.refs
        try:
            client.put(key, _record(self.generation, self.name, refs), create=True)
        except Taken:
            if self._store._attempt(self.generation) != self.name:  # not a retry of our own landed put
                raise GenerationExists(f"{self._store.location}/{key} already exists; a published generation is "
                                       "never overwritten") from None
        client.delete(f"staging/{self.name}")
        if refs:  # the record carries them now (a leftover is a live attempt's, consistent with it)
            client.delete_prefix(f"{objectrefs.REFS}{self.name}/")

    def abort(self) -> None:
        """Best effort: whatever stays is a leftover that the next save's cleanup removes."""
        with contextlib.suppress(Exception):
            if self._store._attempt_or_none(self.generation) == self.name:
                return  # committed after all (a commit that raised after landing): never delete a generation
            self._store.client.delete(f"staging/{self.name}")
            self._store.sweep()


def _marker() -> bytes:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}).encode()


class ObjectStore:
    """Generations as immutable objects plus commit records and CAS-replaced pointers; see the module docstring."""

    remote = True  # every read is a download: restore reads each byte once (no second, in-place pass)

    def __init__(self, url: str, digest_algorithm: str = FAST_CHUNKED, *, storage_options: dict[str, Any] | None = None,
                 lease_s: float = 60.0, client: Client | None = None):
        self.location = url.rstrip("/")
        self.digest_algorithm = digest_algorithm
        self.client = client if client is not None else Client(url, storage_options)
        self.lease_s = lease_s
        self._lease: Lease | None = None
        self.uploads = OpenUploads(url, storage_options)
        # generation -> attempt, as read from its commit (or aside) record, kept only while this store holds the
        # writer lease: then nobody else creates or deletes records, and this store forgets what it changes
        self._attempts: dict[str, str] = {}
        self._manifests: dict[str, bytes] = {}  # attempt -> its manifest: never rewritten once an attempt committed,
        # so kept by every store, a reader's too (attempt names are never reused)
        self._refs: dict[str, objectrefs.Refs] = {}  # attempt -> the files it references: as immutable
        self._pins = 0  # open pinned() scopes: commit records read once each, for a reader too
        # object key -> (ETag, digest): versions whose bytes this store proved to hold the file of that digest
        # (read back against the manifest's digests, or copied by the server from such a version)
        self._proven: dict[str, tuple[str, str]] = {}

    # reading -----------------------------------------------------------------
    def generations(self) -> list[str]:
        return newest_first(self.client.names("commits/"))

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """Within, each generation's commit record is read once (one restore: every rank opens every file of a
        candidate, and each open named it again). A generation replaced meanwhile is read from the attempt first
        seen, whose objects are immutable: gone, a read fails as a vanished file, never as other bytes."""
        self._pins += 1
        try:
            yield
        finally:
            self._pins -= 1
            if not self._pins and self._lease is None:
                self._attempts.clear()

    # proof of the bytes a server-side copy starts from --------------------------------
    def proven(self, key: str, e_tag: str, record: FileRecord) -> bool:
        """Whether object ``key``, now at version ``e_tag``, holds ``record``'s bytes as far as this store knows:
        it proved that version (:meth:`prove`) or copied it from one it proved. A replacement of the object moves
        its ETag, so what a replaced object holds is proven again; what is at rest is the store's to keep (it
        checks its own checksums, a server-side copy included)."""
        return bool(e_tag) and self._proven.get(key) == (e_tag, record.digest)

    def prove_as(self, key: str, e_tag: str, record: FileRecord) -> None:
        if e_tag:
            self._proven[key] = (e_tag, record.digest)
            if len(self._proven) > 4096:
                self._proven.pop(next(iter(self._proven)))

    def prove(self, key: str, record: FileRecord, where: str, e_tag: str) -> bool:
        """Read object ``key`` back (bounded ranged GETs, every chunk against ``record``'s digests) and remember
        the version proven. ``False``, with a warning, when it does not hold ``record``'s bytes."""
        from .chunked import holds  # (imports torch, which a bare store does not need)

        try:
            with self.client.reader(key) as stream:
                holds(stream, record, where, self.digest_algorithm)
                version = stream.version
        except CorruptGeneration as exc:
            log.warning("not linking %s: the object does not hold what was recorded when it was written "
                        "(%s); the file is written from the bytes in memory or on disk instead. Every generation "
                        "naming it is damaged: `trainstate verify %s` lists them", where, exc.reason, self.location)
            return False
        except OSError as exc:
            log.warning("not linking %s: the object could not be read back (%s); the file is written "
                        "from the bytes in memory or on disk instead", where, exc)
            return False
        self.prove_as(key, version if version == e_tag else "", record)  # (replaced meanwhile: proven once)
        return True

    def forget_proven(self) -> None:
        """Prove every object again before it is copied: a verification found bytes this store took as proven
        to be damaged (bit rot the store did not catch)."""
        self._proven.clear()

    def read_ranges(self, generation: str, file: str, spans: list[tuple[int, int]]) -> list[memoryview]:
        """The bytes of each ``[begin, end)`` span of a committed file (bounded ranged GETs, in parallel)."""
        return self.client.read_ranges(self.key(generation, file), spans)

    def key(self, generation: str, file: str) -> str:
        """The object holding ``file`` of committed ``generation``: its own, or the one it references."""
        return self._object(self._attempt(generation), file)

    def _object(self, attempt: str, file: str) -> str:
        ref = self._refs.get(attempt, {}).get(file)
        return ref[0] if ref is not None else f"attempts/{attempt}/{file}"

    def _attempt_or_none(self, generation: str) -> str | None:
        if (self._lease is not None or self._pins) and generation in self._attempts:
            return self._attempts[generation]
        data = self.client.get_small(f"commits/{generation}")
        if data is None and _ASIDE_RE.fullmatch(generation):  # a set-aside generation: kept as evidence
            data = self.client.get_small(f"aside/{generation}")
        attempt = None
        if data is not None:
            attempt, refs = _parse_record(data, f"{self.location}/commits/{generation}")
            self._refs[attempt] = refs
        if attempt is not None and (self._lease is not None or self._pins):
            self._attempts[generation] = attempt
        return attempt

    def _attempt(self, generation: str) -> str:
        attempt = self._attempt_or_none(generation)
        if attempt is None:
            raise FileNotFoundError(f"{self.location}: no generation {generation}")
        return attempt

    def identity(self, generation: str) -> str:
        """The attempt the commit record names: another for a generation replaced under its own name."""
        return self._attempt(generation)

    def files(self, generation: str) -> dict[str, int | None]:
        """Its own objects and the ones it references, with their sizes as listed (a referenced object that
        is gone is missing here)."""
        attempt = self._attempt(generation)
        prefix = f"attempts/{attempt}/"
        found: dict[str, int | None] = {path[len(prefix):]: size for path, size in self.client.listing(prefix).items()}
        listed: dict[str, dict[str, int]] = {}
        for file, (target, _) in self._refs.get(attempt, {}).items():
            folder = target.rsplit("/", 1)[0] + "/"
            if folder not in listed:
                listed[folder] = self.client.listing(folder)
            if target in listed[folder]:
                found[file] = listed[folder][target]
        return found

    def open(self, generation: str, file: str) -> BinaryIO:
        attempt = self._attempt(generation)
        if file != MANIFEST:
            return self.client.reader(self._object(attempt, file))
        # every save and restore reads a few manifests several times; an attempt's never changes once committed
        data = self._manifests.get(attempt)
        if data is None:
            from .verify import read_bounded  # storage.verify imports torch, which a bare store does not need

            with self.client.reader(f"attempts/{attempt}/{file}") as stream:
                data = read_bounded(stream, MAX_JSON_BYTES)  # a larger one is refused by the reader all the same
            if len(self._manifests) >= 4096:
                self._manifests.pop(next(iter(self._manifests)))
            self._manifests[attempt] = data
        return io.BytesIO(data)

    def read_pointer(self, name: str) -> bytes | None:
        data = self.client.get_small(name)
        if data is not None and len(data) > 1 << 20:
            raise CorruptGeneration(f"{self.location}/{name}", "is larger than any pointer")
        return data

    def leftovers(self) -> list[str]:
        """Attempts that no commit or aside record names: interrupted saves, and prunes that stopped halfway."""
        named = set(self._named_attempts())
        # from the objects themselves: some servers (SeaweedFS) keep an emptied "folder" listed
        objects = self.client.listing("attempts/")
        found = {path.split("/", 2)[1] for path in objects}
        found |= set(self.client.names("staging/"))
        found |= {key.split("/", 2)[1] for key, _ in self.uploads.listed("attempts/")}
        found |= {key.split("/", 2)[1] for key in self.client.listing(objectrefs.REFS)}
        # an attempt whose generation is gone but whose objects a kept one references is not left over
        found -= objectrefs.retained(objects, named, self._referenced(named))
        return sorted(a for a in found if a not in named and _ATTEMPT_RE.fullmatch(a))

    def _named_attempts(self) -> Iterator[str]:
        for name in self.client.names("commits/"):  # (each record read once while this store holds the lease)
            with contextlib.suppress(CorruptGeneration):
                attempt = self._attempt_or_none(name)
                if attempt is not None:
                    yield attempt
        for name in self.client.names("aside/"):
            data = self.client.get_small(f"aside/{name}")
            if data is not None:
                with contextlib.suppress(CorruptGeneration):
                    attempt, refs = _parse_record(data, f"aside/{name}")
                    self._refs[attempt] = refs
                    yield attempt

    def _live(self) -> tuple[set[str], set[str]]:
        """The live attempts (named by a record, or staged: a marker) and the objects their records reference."""
        named = set(self._named_attempts())
        live = named | set(self.client.names("staging/"))
        return live, self._referenced(named)

    def _referenced(self, attempts: set[str]) -> set[str]:
        """The objects the records of ``attempts`` reference (read with them: :meth:`_attempt_or_none`)."""
        return {target for a in attempts for target, _ in self._refs.get(a, {}).values()}

    def sweep(self) -> list[str]:
        """Delete what no live attempt holds or references (:func:`.objectrefs.sweep`); the attempts now gone."""
        live, kept = self._live()
        gone = objectrefs.sweep(self.client, self.uploads, live, kept)
        for attempt in gone:
            self._manifests.pop(attempt, None)
        return gone

    def listings_held(self) -> contextlib.AbstractContextManager[None]:
        """A scope in which each listing of the records is requested once until this store writes anything (one
        save's steps before its first write: :meth:`Client.listings_held`)."""
        return self.client.listings_held()

    # writing -----------------------------------------------------------------
    def begin(self, generation: str) -> ObjectStaging:
        if not re.fullmatch(_NAME, generation):
            raise ValueError(f"{generation!r} cannot name a generation in an object store")
        return ObjectStaging(self, generation)

    def join(self, generation: str, staging: str) -> ObjectStaging:
        return ObjectStaging(self, generation, staging)

    def write_pointer(self, name: str, data: bytes) -> None:
        """Replace ``name`` by compare-and-swap, re-reading on a lost race; never backwards for ``latest``.

        ``latest`` (and ``latest-weights``) never moves from a generation that
        is still committed to an older one: that would be another writer
        racing ahead of this one, and this one stops with :class:`DirectoryLocked`.
        """
        for _ in range(64):
            current = self.client.get_versioned(name)
            if current is not None and current[0] == data:
                return
            if current is not None and name in (POINTER, WEIGHTS_POINTER):
                self._refuse_backwards(name, current[0], data)
            try:
                self.client.put(name, data, create=current is None, e_tag=current[1] if current else None)
                return
            except (Taken, Precondition):
                continue  # someone else replaced it meanwhile (or our retried put landed): look again
        raise DirectoryLocked(f"{self.location}/{name} kept changing under this writer (64 attempts): another "
                              "process is writing this run; give each run its own URL")

    def _refuse_backwards(self, name: str, current: bytes, new: bytes) -> None:
        def fields(data: bytes) -> tuple[str, int] | None:
            try:
                raw = json.loads(data)
                return str(raw["generation"]), int(raw["next_update"])
            except (ValueError, KeyError, TypeError):
                return None  # garbage: replacing it is always right

        now, then = fields(current), fields(new)
        if now and then and now[1] > then[1] and now[0] in self.generations():
            raise DirectoryLocked(
                f"{self.location}/{name} names {now[0]} (update {now[1]}), newer than {then[0]} which this writer "
                "publishes: another writer is ahead on this run. The pointer was left alone; give each run its "
                "own URL, and let only one job write it")

    def remove(self, generation: str) -> None:
        """The commit record first (the generation is gone at once), then its objects."""
        attempt = self._attempt_or_none(generation)
        folder = "aside" if _ASIDE_RE.fullmatch(generation) else "commits"
        self._attempts.pop(generation, None)
        self.client.delete(f"{folder}/{generation}")
        if attempt is not None:
            self.client.delete(f"staging/{attempt}")
            self.sweep()

    def set_aside(self, generation: str, reason: str) -> str:
        if reason not in ASIDE_REASONS:
            raise ValueError(f"reason must be one of {ASIDE_REASONS}, got {reason!r}")
        aside = f"{generation}.{reason}-{_token()}"
        attempt = self._attempt(generation)
        self.client.put(f"aside/{aside}", _record(aside, attempt, self._refs.get(attempt)), create=True)
        self._attempts.pop(generation, None)
        self.client.delete(f"commits/{generation}")
        return aside

    def aside(self) -> list[str]:
        return sorted(n for n in self.client.names("aside/") if _ASIDE_RE.fullmatch(n))

    def reinstate(self, aside: str, generation: str) -> None:
        attempt = self._attempt(aside)
        try:
            self.client.put(f"commits/{generation}", _record(generation, attempt, self._refs.get(attempt)),
                            create=True)
        except Taken:
            if self._attempt_or_none(generation) != attempt:
                raise GenerationExists(f"cannot put {aside} back: {self.location}/commits/{generation} exists") \
                    from None
        self._attempts.pop(aside, None)
        self.client.delete(f"aside/{aside}")

    def defer_removals(self) -> None:
        """Removal is a few deletes of small objects after the commit record goes: kept on the caller's thread."""

    def join_removals(self, timeout: float | None = None) -> bool:
        return True

    def clean_leftovers(self) -> list[str]:
        removed = self.leftovers()
        for attempt in removed:
            self.client.delete(f"staging/{attempt}")
        if removed:
            self.sweep()
        return removed

    # leases ------------------------------------------------------------------
    def lock(self) -> None:
        """Take (or keep) the run's writer lease; a background thread renews it until :meth:`unlock`."""
        if self._lease is not None:
            self._lease.check()
            return
        self._attempts.clear()  # records may have changed while another writer held the run (manifests: never)
        self._lease = Lease(self.client, "lock", self.lease_s, self.location, renew=True)

    def unlock(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        self._attempts.clear()

    @contextlib.contextmanager
    def exclusive(self, name: str) -> Iterator[None]:
        lease = Lease(self.client, f"mutex-{name}", 30.0, self.location, renew=False, wait=True)
        try:
            yield
        finally:
            lease.release()

    def free_bytes(self) -> int | None:
        return None
