"""Local first, mirrored in the background: generations that outlive the machine.

A save publishes to the local directory exactly as without a mirror. Then
one uploader thread copies that already-verified generation to the remote
store (every file digested beside the upload and compared with the local
manifest, the manifest last, the create-only commit record), checks the
remote copy's file set and sizes, moves the remote ``latest`` by
compare-and-swap and prunes the remote under its retention policy.

- Uploads run in order, one at a time; when saves outpace them the uploader
  skips to the newest local generation of each kind.
- A file an incremental generation shares with its parent is copied on the
  server from the remote's copy, once that copy is proven to hold the
  recorded bytes (:func:`link_held`); a damaged remote copy is never copied
  into the next remote generation: the local bytes are uploaded instead.
- Local pruning keeps every generation newer than the remote ``latest``
  (and the one being uploaded): nothing is lost while the upload catches up.
- An upload failure never fails a save: it is logged, reported by
  ``status()`` and retried with a bounded backoff.
- ``restore`` on a machine whose local directory is empty (or behind) first
  copies the newest remote generation that verifies into the local
  directory, then restores from there as always.

Only the remote ``latest`` counts as protection: an enqueued or running
upload is reported as such, never as a remote recovery point.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import CorruptGeneration, ExistingRun, Rejection, TrainStateError
from ..format import sharing
from ..format.manifest import (MANIFEST, POINTER, RUN, FileRecord, Manifest, generation_order,
                               parse_generation_name, parse_run)
from ..format.signing import SigningKey
from ..progress import OnBytes
from ..records import RestoreInfo
from ..storage.base import Store, pinned
from ..storage.verify import Verified, point_at, read_manifest, read_pointed, verify_generation
from .generations import Lifecycle
from .incremental import intact
from .retention import Retention

log = logging.getLogger("trainstate")
BLOCK = 16 << 20


@dataclasses.dataclass(frozen=True)
class MirrorStatus:
    """Where the remote copy stands. ``remote_latest`` is what the remote pointer names: the only protection."""

    url: str
    remote_latest: str | None
    remote_update: int | None
    lag_updates: int | None  # local recovery point's update minus the remote one
    lag_s: float | None  # since the local generation the remote lacks was published
    uploading: str | None
    queued: tuple[str, ...]
    last_error: str | None
    failures: int


def copy_generation(src: Store, dst: Store, name: str, key: SigningKey | None, *,
                    on_bytes: OnBytes | None = None) -> Verified:
    """Copy one generation, checking every file's size and digest against the source manifest on the way.

    Each file is digested as the destination writes it; a file whose bytes
    do not match the manifest (damaged at the source, or in transit) aborts
    the copy with :class:`CorruptGeneration` and nothing is committed. A
    spare is sent from its twin (the same bytes: the copy a restore reads),
    so a damaged spare is not passed on and does not stop the copy.
    ``on_bytes`` is told each block of the manifest's files as it is read.
    """
    manifest, _, _ = read_manifest(src, name, None, key)
    with src.open(name, MANIFEST) as stream:
        manifest_bytes = stream.read()
    staging = dst.begin(name)
    try:
        for record in manifest.files:
            if record.name in manifest.shares and link_held(dst, staging, manifest, record, key):
                continue  # the destination holds these bytes already: linked or copied there, not sent
            read = sharing.twin_of(record.name) if sharing.is_spare(record.name) else record.name  # (same bytes:
            with src.open(name, read) as stream:  # a spare is sent from the copy a restore reads and checks)
                written = staging.write(record.name, _blocks(stream, on_bytes),
                                        algorithm=manifest.digest_algorithm, size_hint=record.size)
            if (written.size, written.digest) != (record.size, record.digest):
                raise CorruptGeneration(f"{src.location}/{name}/{record.name}",
                                        f"{manifest.digest_algorithm} digest mismatch while copying to {dst.location}")
        staging.write(MANIFEST, [manifest_bytes])
        staging.commit()
    except BaseException:
        staging.abort()
        raise
    return verify_generation(dst, name, content=False, key=key)


def link_held(dst: Store, staging: Any, manifest: Manifest, record: FileRecord, key: SigningKey | None,
               also: str | None = None) -> bool:
    """An incremental generation's shared file, staged from the copy the destination already holds (its parent's,
    the one that first wrote it, or ``also``: say the destination's latest), when that copy's manifest records
    the same size and digest and the copy is proven to hold those bytes: a local file by its bytes
    (:func:`.incremental.intact`), an object store's by the store
    (:meth:`trainstate.storage.objects.ObjectStaging.link`). Damage in the destination's copy is never linked
    into another generation: the caller sends the file from the source's verified bytes instead.

    A part kept with a spare takes the parent's *other* copy (the part its spare, the spare its part), as the
    source linked it: the destination's generations alternate between two copies too."""
    name = record.name
    paired = sharing.is_spare(name) or sharing.spare_of(name) in {f.name for f in manifest.files}
    crosswise = (sharing.twin_of(name) if sharing.is_spare(name) else sharing.spare_of(name)) if paired else name
    holders = ((manifest.parent, crosswise), sharing.origin(manifest.generation, manifest.shares, name), (also, name))
    for holder, theirs_name in dict.fromkeys(h for h in holders if h[0] is not None):
        try:
            theirs = read_manifest(dst, holder, None, key)[0]
            held = next((f for f in theirs.files if f.name == theirs_name), None)
        except (OSError, TrainStateError):
            continue
        if held is not None and (held.size, held.digest) == (record.size, record.digest) and intact(
                dst, theirs, held.name) and staging.link(name, holder, held) is not None:
            return True
    return False


def _blocks(stream: Any, on_bytes: OnBytes | None = None) -> Iterator[bytes]:
    sequential = getattr(stream, "sequential", None)  # an object: the whole file, in one request
    if sequential is not None:
        sequential()
    while block := stream.read(BLOCK):
        yield block
        if on_bytes is not None:
            on_bytes(len(block))


def same_run(src: Store, dst: Store, key: SigningKey | None) -> None:
    """Give ``dst`` the run identity of ``src`` when it has none; refuse when it holds another run."""
    ours = src.read_pointer(RUN)
    if ours is None:
        return
    theirs = dst.read_pointer(RUN)
    if theirs is None:
        dst.write_pointer(RUN, ours)
    elif parse_run(theirs, f"{dst.location}/{RUN}", key) != parse_run(ours, f"{src.location}/{RUN}", key):
        raise ExistingRun(f"{dst.location} holds another run than {src.location}; a mirror belongs to one run. "
                          "Use another URL for this run's mirror, or remove the old one.")


def pointer_update(store: Store, key: SigningKey | None) -> tuple[str, int] | None:
    p = read_pointed(store, POINTER, key)
    return None if p is None else (p.generation, p.next_update)


def pull_newer(local: Store, remote: Store, key: SigningKey | None, rejected: list[Rejection] | None = None
               ) -> str | None:
    """Copy the newest remote full generation that verifies and is newer than every local one; its name.

    Before a restore: on a fresh machine (empty local directory) this brings
    the run back; where local is ahead or level nothing is copied. A remote
    candidate that fails verification is passed over for the next older, and
    added to ``rejected``.
    """
    newest_local = max((generation_order(n) for n in local.generations()
                        if parse_generation_name(n)[1] == "full"), default=(-1, 0))
    candidates = [n for n in remote.generations() if parse_generation_name(n)[1] == "full"
                  and generation_order(n) > newest_local]  # a later revision at the same update is newer
    if not candidates:
        return None
    same_run(remote, local, key)
    for name in candidates:
        try:
            verified = copy_generation(remote, local, name, key)
        except (CorruptGeneration, FileNotFoundError) as exc:
            log.warning("remote %s/%s does not verify (%s); trying an older one", remote.location, name, exc)
            if rejected is not None:
                rejected.append(Rejection(name, f"the mirror's copy in {remote.location} does not verify ({exc}); "
                                                "not pulled"))
            continue
        point_at(local, verified, key)
        log.info("copied %s from %s to %s for the restore", name, remote.location, local.location)
        return name
    return None


class Mirror:
    """The uploader: one thread, newest generation of each kind first, failures reported and retried."""

    def __init__(self, local: Store, remote: Store, key: SigningKey | None, retention: Retention,
                 *, retry_s: tuple[float, float] = (1.0, 60.0)):
        self.local, self.remote, self.key, self.retention = local, remote, key, retention
        self.remote_lifecycle = Lifecycle(remote, key)
        self._retry_s = retry_s
        self._cond = threading.Condition()
        self._queued: dict[str, tuple[str, float]] = {}  # kind -> (newest generation, when it was published)
        self._uploading: str | None = None
        self._behind_since: float | None = None  # when the oldest local generation the remote lacks was published
        self._closed = False
        self._locked = False
        self.last_error: str | None = None
        self.failures = 0
        self._remote = pointer_update(remote, key) if _reachable(remote) else None
        self.pull_rejected: list[Rejection] = []  # what the last pull passed over (restored() reports it)
        self._thread = threading.Thread(target=self._run, name="trainstate-mirror", daemon=True)
        self._thread.start()

    # the manager's hooks ------------------------------------------------------
    def pull(self) -> str | None:
        """Before a restore: the remote copy when the local directory is empty or behind (see :func:`pull_newer`);
        the remote generations it passed over are kept for the restore's report (:meth:`restored`)."""
        self.pull_rejected = []
        try:
            newer = [n for n in self.remote.generations()]
        except (TrainStateError, OSError) as exc:
            log.error("mirror: cannot list %s (%s); restoring from the local directory only", self.remote.location,
                      exc)
            return None
        if self.local.read_pointer(RUN) is None and self.remote.read_pointer(RUN) is not None:
            # A fresh local directory continues the mirror's run, also one whose first upload was cut off
            # before any commit (its identity is there, no generation): else every upload is refused.
            self.local.lock()
            same_run(self.remote, self.local, self.key)
        if not newer:
            return None
        self.local.lock()
        with pinned(self.remote):  # each remote commit record read once while the newest is chosen and copied
            return pull_newer(self.local, self.remote, self.key, self.pull_rejected)

    def published(self, name: str) -> None:
        """A local generation was published: upload it next (replacing an older one of its kind still queued)."""
        kind = parse_generation_name(name)[1]
        with self._cond:
            self._queued[kind] = (name, time.time())
            if self._behind_since is None:
                self._behind_since = time.time()
            self._cond.notify_all()

    def restored(self, info: RestoreInfo) -> RestoreInfo:
        """After a restore: upload its generation now if the remote ``latest`` is older; ``info`` with the remote
        generations the pull passed over first among its rejections.

        An earlier process may have published it locally and stopped (killed,
        or closed before its upload finished); without this it would be
        uploaded only after the next save, and never if the run saves no more.
        """
        name = info.generation.name
        kind = parse_generation_name(name)[1]
        if kind == "full" and (self._remote is None or generation_order(name) > generation_order(self._remote[0])):
            self.published(name)
        passed, self.pull_rejected = tuple(self.pull_rejected), []
        return dataclasses.replace(info, rejected=passed + info.rejected) if passed else info

    def held(self) -> set[str]:
        """Local generations pruning must keep: newer than the remote ``latest``, or being uploaded."""
        remote_update = self._remote[1] if self._remote else -1
        keep = {n for n in self.local.generations() if parse_generation_name(n)[0] >= remote_update}
        return keep | ({self._uploading} if self._uploading else set())

    def status(self, local_update: int | None) -> MirrorStatus:
        with self._cond:
            queued = tuple(n for n, _ in self._queued.values())
            since = self._behind_since
            uploading = self._uploading
        remote = self._remote
        lag = None if local_update is None else local_update - (remote[1] if remote else 0)
        return MirrorStatus(self.remote.location, remote[0] if remote else None, remote[1] if remote else None,
                            lag, (0.0 if remote else None) if since is None else time.time() - since, uploading, queued,
                            self.last_error, self.failures)

    def close(self, timeout_s: float) -> list[str]:
        """Wait up to ``timeout_s`` for the queue to drain; the generations still not uploaded."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._queued or self._uploading) and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.2))
            self._closed = True
            left_over = [n for n, _ in self._queued.values()] + ([self._uploading] if self._uploading else [])
            self._cond.notify_all()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()) + 0.1)
        if not self._thread.is_alive() and self._locked:
            _quietly(self.remote.unlock)
        return sorted(set(left_over))

    # the thread ------------------------------------------------------------------
    def _run(self) -> None:
        delay = self._retry_s[0]
        while True:
            with self._cond:
                while not self._queued and not self._closed:
                    self._cond.wait()
                if self._closed and not self._queued:
                    return
                kind = "full" if "full" in self._queued else next(iter(self._queued))
                name, when = self._queued.pop(kind)
                self._uploading = name
            try:
                self._upload(name)
                self.last_error, delay = None, self._retry_s[0]
            except Exception as exc:  # reported and retried; never the training loop's failure
                self.failures += 1
                self.last_error = f"{name}: {type(exc).__name__}: {exc}"
                log.error("mirror: uploading %s to %s failed (%s); retrying in %.0f s", name,
                          self.remote.location, self.last_error, delay)
                with self._cond:
                    self._queued.setdefault(kind, (name, when))
                    self._uploading = None
                    self._cond.wait(delay)
                    if self._closed:
                        return
                delay = min(delay * 2, self._retry_s[1])
                continue
            with self._cond:
                self._uploading = None
                if not self._queued:
                    self._behind_since = None  # the remote has the newest local generation
                self._cond.notify_all()

    def _upload(self, name: str) -> None:
        if name not in self.local.generations():
            return  # pruned locally before its turn (a newer one of its kind was published and uploaded)
        if not self._locked:
            self.remote.lock()
            self._locked = True
        else:
            self.remote.lock()  # renews, and notices a lost lease
        same_run(self.local, self.remote, self.key)
        verified = self._held_remotely(name) if name in self.remote.generations() else None
        if verified is None:
            for leftover in self.remote.clean_leftovers():
                log.info("mirror: removed leftover %s from an interrupted upload", leftover)
            verified = copy_generation(self.local, self.remote, name, self.key)
        if verified.manifest.kind == "full":
            current = self._remote
            if current is None or verified.manifest.next_update >= current[1]:
                point_at(self.remote, verified, self.key)
                self._remote = (name, verified.manifest.next_update)
        else:
            point_at(self.remote, verified, self.key)
        try:
            anchors = {**self.remote_lifecycle.anchors(), verified.manifest.kind: name}
            self.remote_lifecycle.prune(self.retention, anchors)
        except Exception as exc:
            log.error("mirror: %s is uploaded, but pruning the remote failed (%r); retried after the next upload",
                      name, exc)

    def _held_remotely(self, name: str) -> Verified | None:
        """A generation the remote holds already (an upload whose pointer move was cut off), verified to its last
        byte before the remote ``latest`` names it; ``None`` once a damaged one is set aside (it is uploaded
        again). Rare: only such an upload leaves a generation there that ``latest`` does not name yet."""
        try:
            return verify_generation(self.remote, name, content=True, key=self.key)
        except CorruptGeneration as exc:
            aside = self.remote.set_aside(name, "rejected")
            log.warning("mirror: %s on %s is damaged (%s); set aside as %s, uploading it again", name,
                        self.remote.location, exc, aside)
            return None


def _reachable(store: Store) -> bool:
    try:
        store.read_pointer(POINTER)
        return True
    except (TrainStateError, OSError) as exc:
        log.error("mirror: %s is not reachable now (%s); uploads will retry", store.location, exc)
        return False


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as exc:
        log.debug("mirror: %r", exc)


def attach(manager: Any, location: str, options: dict[str, Any] | None, retention: Retention | None) -> Mirror:
    """Mirror ``manager``'s run to ``location``: its publisher reports each generation, its pruning waits."""
    from ..errors import InvalidArgument
    from ..storage.locate import open_store

    if manager._session is not None:
        raise InvalidArgument("mirror= is for single-process runs; a multi-rank run saves to the object-store URL "
                              "directly (CheckpointManager('s3://bucket/run', ...)), with no shared filesystem")
    remote = open_store(location, manager.store.digest_algorithm, storage_options=options)
    if remote.location == manager.store.location:
        raise InvalidArgument(f"mirror= must name another location than the run's own ({location})")
    mirror = Mirror(manager.store, remote, manager.key, retention or manager.retention)
    manager.lifecycle.hold = mirror.held
    manager._publisher.after_publish = mirror.published
    return mirror


def finish(mirror: Mirror, timeout_s: float) -> None:
    """At close: wait for uploads in flight, and say plainly what is not remote yet."""
    left = mirror.close(timeout_s)
    if left:
        log.error("mirror: %s not uploaded to %s when the manager closed (waited %.0f s); the remote latest is %s. "
                  "They stay in the local directory; the next manager with this mirror uploads the newest",
                  ", ".join(left), mirror.remote.location, timeout_s, mirror.status(None).remote_latest)
