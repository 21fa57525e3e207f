"""The remote tier behind the nodes: every ``mirror_every``-th generation, uploaded from the nodes' disks.

With ``CheckpointManager(node_dir, replicas=N, mirror=URL, mirror_every=K)``
the first save of a manager and then every K-th goes to the object store too,
on the writer thread after its replicas (collective, on the background group):

1. rank 0 takes the remote's lease, gives the remote the run's identity,
   removes leftovers of an interrupted upload and begins a staging area
   (an upload of a generation the remote already holds is only verified);
2. every rank uploads its own files from its node's holding, digested as
   they are sent and compared with the manifest; rank 0 also the global files
   (incremental: a part the remote already holds under the same digest, in
   the parent, the generation that wrote it or the remote's latest, is a
   reference to that object instead: nothing is sent or stored again);
3. rank 0 writes the manifest and the commit record (create-only), verifies
   the remote copy's file set and sizes, moves the remote ``latest`` (a
   compare-and-swap, never backwards) and prunes the remote under
   ``mirror_retention``.

The result is an ordinary multi-rank generation on the object store:
``trainstate verify URL`` and a run straight on the URL read it. A failure
is raised by the next ``save``, ``wait`` or ``close`` (exactly once), and the
generation stays in every node's local tier until a later upload succeeds
(:attr:`Remote.pending` is never pruned).
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import TrainStateError
from ..format.manifest import MANIFEST, POINTER
from ..lifecycle.generations import Lifecycle
from ..lifecycle.mirror import link_held, same_run
from ..lifecycle.retention import Retention
from ..storage.verify import point_at, read_pointed, verify_generation
from .group import Ranks
from .tiers import GLOBAL_FILES, Tier, rank_files

log = logging.getLogger("trainstate")
BLOCK = 16 << 20


class Remote:
    """The object store behind the nodes, and which generations go there."""

    def __init__(self, store: Any, retention: Retention, every: int, key: Any):
        self.store, self.retention, self.every, self.key = store, retention, every, key
        self._since = every - 1  # the first save of this manager is uploaded: protection early
        self.pending: str | None = None  # chosen for upload, not on the remote yet: kept in the local tier
        self.latest: dict | None = None  # what the remote latest names, as of the last upload (rank 0's view)
        self.failures = 0

    def due(self, name: str) -> bool:
        """Called once per published generation, on every rank alike: whether this one is uploaded."""
        self._since += 1
        if self._since < self.every:
            return False
        self._since = 0
        self.pending = name
        return True

    def read_latest(self) -> dict | None:
        pointer = read_pointed(self.store, POINTER, self.key)
        return None if pointer is None else {"generation": pointer.generation, "update": pointer.next_update}


def upload(name: str, manifest: Any, manifest_bytes: bytes, ranks: Ranks, tier: Tier, remote: Remote) -> None:
    """Put generation ``name`` on the remote from the nodes' disks (collective; see the module docstring). Rank 0
    holds the remote's lease for the upload only: uploads are seconds apart at most once per save."""
    try:
        _upload(name, manifest, manifest_bytes, ranks, tier, remote)
    finally:
        if ranks.rank == 0:
            try:
                remote.store.unlock()
            except (TrainStateError, OSError) as exc:
                log.warning("could not release the lease on %s (%r); it expires by itself", remote.store.location, exc)


def _upload(name: str, manifest: Any, manifest_bytes: bytes, ranks: Ranks, tier: Tier, remote: Remote) -> None:
    staging, outcome, error = None, {}, None
    if ranks.rank == 0:
        try:
            remote.store.lock()
            same_run(tier.own, remote.store, remote.key)
            if name in remote.store.generations():
                outcome = {"exists": True}
            else:
                for leftover in remote.store.clean_leftovers():
                    log.info("removed leftover %s from an interrupted upload", leftover)
                staging = remote.store.begin(name)
                staging.shared = True  # (every node's leader stages into it: an object store lists their references)
                outcome = {"staging": staging.name}
        except (TrainStateError, OSError) as exc:
            outcome, error = {"error": f"{type(exc).__name__}: {exc}"}, exc
    outcome = ranks.rank0_outcome(outcome, error, "upload")
    if not outcome.get("exists"):
        try:
            _send(name, manifest, ranks, tier, remote, staging, outcome["staging"])
        except BaseException:
            if staging is not None:
                staging.abort()
            raise
    _commit(name, manifest_bytes, ranks, remote, staging)
    if remote.pending == name:
        remote.pending = None


def _send(name: str, manifest: Any, ranks: Ranks, tier: Tier, remote: Remote, staging: Any, staged: str) -> None:
    from .tiersave import _write_checked

    error = None
    try:
        staging = staging if staging is not None else remote.store.join(name, staged)
        present = {f.name for f in manifest.files}
        files = rank_files(manifest, ranks.rank) if ranks.rank < len(manifest.ranks) else []
        if ranks.rank == 0:
            files = [f for f in GLOBAL_FILES if f in present] + files
        newest = remote.latest and remote.latest["generation"]
        for file in files:
            if file in manifest.shares and link_held(remote.store, staging, manifest, manifest.file(file),
                                                      remote.key, newest):
                continue  # incremental: the remote holds these bytes already; referenced
            with _local(tier, name, file).open(name, file) as stream:
                _write_checked(staging, manifest, file, iter(lambda: stream.read(BLOCK), b""))
    except (TrainStateError, OSError, ValueError) as exc:
        error = exc
    ranks.check("upload", error)


def _local(tier: Tier, name: str, file: str) -> Any:
    """The store of this node that holds ``file`` of ``name`` (its own holding, else a replica)."""
    for store in tier.stores().values():
        if name in store.generations() and file in store.files(name):
            return store
    raise FileNotFoundError(f"{tier.own.location}: this node holds no {name}/{file} to upload")


def _commit(name: str, manifest_bytes: bytes, ranks: Ranks, remote: Remote, staging: Any) -> None:
    outcome, error = {}, None
    if ranks.rank == 0:
        try:
            if staging is not None:
                staging.write(MANIFEST, [manifest_bytes])  # the very bytes every node holds: one digest
                staging.commit()
            verified = verify_generation(remote.store, name, content=False, key=remote.key)
            current = remote.read_latest()
            if current is None or verified.manifest.next_update >= current["update"]:
                point_at(remote.store, verified, remote.key)
            remote.latest = remote.read_latest()
            outcome = {"latest": remote.latest, "created": verified.manifest.created}
            try:
                Lifecycle(remote.store, remote.key).prune(remote.retention, {"full": remote.latest["generation"]})
            except Exception as exc:  # uploaded: pruning the remote is retried after the next upload
                log.error("%s is on %s, but pruning the remote failed (%r)", name, remote.store.location, exc)
        except (TrainStateError, OSError) as exc:
            if staging is not None:
                staging.abort()
            outcome, error = {"error": f"{type(exc).__name__}: {exc}"}, exc
    outcome = ranks.rank0_outcome(outcome, error, "upload")
    remote.latest = outcome["latest"] and {**outcome["latest"], "created": outcome["created"]}
    log.info("uploaded %s to %s", name, remote.store.location)


__all__ = ["Remote", "upload"]
