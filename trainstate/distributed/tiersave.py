"""The tiered publication protocol: one commit per tier, top to bottom.

Every rank runs :func:`publish` on the checkpoint group; each node's leader
(its lowest rank) owns that node's directory. The rule, per tier:

**Local tier** (each node's own directory):

1. **begin** (:mod:`.tierbegin`): every rank names the same generation; the
   leaders lock their directories, remove leftovers, agree on the run's
   identity and check the space for what their node writes now and the
   replicas it will keep; each leader begins a staging directory, which its
   node's ranks join.
2. **stage, write**: each rank writes its records and DCP shard into its
   node's staging; rank 0 also the global files and, inside DCP's finish,
   the manifest (every rank's file records) into node 0's staging.
3. **complete**: rank 0 hands the manifest and the global files, in one
   broadcast, to every other leader, which writes them (digested as
   written, compared with the manifest's records), the manifest last. Every
   leader then commits its staging: fsync, rename, fsync the parent.
4. **verify**: each leader re-reads its committed manifest and checks the
   files its node must hold; one round says whether every node committed
   and verified, else every leader removes its holding (nothing names it).
5. **point**: each leader moves its node's ``latest``. A node's ``latest``
   therefore names only a generation every node had committed: the local
   tier as a whole can serve it.

A second save at an update whose generation every node holds and names as
``latest`` is staged as its next revision; if every staged file and the
metrics equal that generation's, rank 0 says so in step 3 instead, every
leader discards its staging, and the save returns that generation.

Each step ends in one round that says whether every rank's part succeeded
(the begin: a gather to rank 0 and each rank's decision scattered back):
O(1) bytes per rank, whatever the number of nodes.

``save`` returns here (``wait_replicas=False``, the default): this rank's
shard is durable on its own node and the local tier's commit holds.

**Replicated tier** (:func:`replicate`; in the background unless
``wait_replicas=True``): each rank sends its files, point to point, as one
stream, to the leader of every node that keeps a replica of its node (:func:`.tiers.placement`);
the receiver writes them into a staging directory of its ``replicas`` store,
digesting as it writes and comparing with the manifest, then commits (a file
the generation links from an earlier one, the receiver links from its
replica of the parent when it holds the same bytes intact, and is not sent:
:func:`_transfer`). Once
every node has committed its replicas, every leader moves ``replicas/latest``:
the generation now survives the loss of any one failure domain. Pruning runs
after it (:func:`prune`).

A failure on any rank aborts that tier's step on every rank. A crash at any
moment leaves each node with committed holdings only, and a ``latest`` that
names the previous generation or the new one; a restore
(:mod:`.tierload`) takes the newest generation the surviving holdings cover.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CorruptGeneration, TrainStateError
from ..format import sharing
from ..format.digest import digest_bytes
from ..format.manifest import MANIFEST, POINTER, Manifest, Pointer, parse_manifest
from ..publish import Pending
from ..records import GenerationInfo
from ..lifecycle.incremental import intact
from ..revisions import log_same, same_files
from ..storage.verify import Verified, read_manifest
from . import saveplan
from .capture import RankSnapshot
from .commit import build_manifest, stage_records
from .group import Ranks, _global_rank, collective
from .increments import rank_view
from .storage import DCP_METADATA, Writer
from .tierbegin import begin as _begin  # (by this name: the benchmarks time each step of publish)
from .tiers import GLOBAL_FILES, Tier, broadcast_bytes, node_files, placement, rank_files, verified_from
from .tierprune import prune  # noqa: F401  (the save calls tiersave.prune: a test aims kills at it)

log = logging.getLogger("trainstate")
PIECE = 16 << 20  # one message between ranks while replicating
SAME = 1 << 63  # flags rank 0's hand-over: the state equals a generation every node holds (nothing is committed)


def publish(snap: RankSnapshot, pending: Pending, ranks: Ranks, tier: Tier, publisher: Any,
            key: Any) -> tuple[GenerationInfo, bytes]:
    """Publish one generation into the local tier; returns (on every rank) its info and the manifest's bytes."""
    staging, joined, same_as = _begin(snap, pending, ranks, tier, publisher, key)
    committed: list[bool] = []  # set by _complete once this leader's holding is committed
    try:
        records = _stage(snap, ranks, staging, joined)
        base = _base(tier, same_as, key) if same_as and ranks.rank == 0 else None
        written = _write(snap, pending, ranks, staging, records, key, base)
        manifest, manifest_bytes, error = _complete(pending, ranks, tier, staging, written, key, committed)
        if error is None and manifest.generation != pending.name:  # every byte as ``same_as`` holds them
            if tier.topology.is_leader:
                staging.abort()
            publisher.was_published_as(pending.prepared, manifest.generation)
            log_same(manifest.generation)
            return GenerationInfo.from_verified(tier.own, verified_from(manifest, manifest_bytes)), b""
        verified = _verify(manifest, manifest_bytes, ranks, tier, key, error)
        pending.manifest, pending.linked = manifest, bool(manifest.shares)  # (full_every: see .increments)
        _point(verified, ranks, tier, key)
    except BaseException:
        if tier.topology.is_leader:
            staging.abort()
            if committed:
                _remove_quietly(tier.own, pending.name)
        raise
    return GenerationInfo.from_verified(tier.own, verified), manifest_bytes


# 1. begin (.tierbegin) -------------------------------------------------------------------------------------
def _base(tier: Tier, name: str, key: Any) -> tuple[Manifest, bytes] | None:
    """Rank 0: the manifest of the generation a second save at its update may turn out to equal."""
    try:
        with tier.own.open(name, MANIFEST) as stream:
            data = stream.read()
        return read_manifest_bytes(data, name, key), data
    except (TrainStateError, OSError):
        return None  # unreadable here: the save is a revision, as any changed state is


# 2. stage, write ---------------------------------------------------------------------------------------------
def _stage(snap: RankSnapshot, ranks: Ranks, staging: Any, joined: BaseException | None) -> list:
    """Each rank's records (rank 0's also the global files) into its node's staging; one round reports every rank's
    outcome, a failed join included."""
    records, error = ([], joined) if joined is not None else stage_records(snap, ranks.rank, staging)
    ranks.check("stage", error)
    return records


def _write(snap: RankSnapshot, pending: Pending, ranks: Ranks, staging: Any, records: list, key: Any,
           base: tuple[Manifest, bytes] | None = None) -> bytes:
    """DCP writes the shards into each node's staging; rank 0 writes the manifest into node 0's (no commit yet)
    and returns what every other leader needs: the manifest and the global files, in one buffer. When every file
    and the metrics equal ``base``'s, it returns ``base``'s manifest instead, flagged (the top bit of the length)."""
    written: dict[str, bytes] = {}

    def manifest(metadata: bytes, every_file: list, incremental: dict) -> None:
        metrics = pending.extra["metrics"]  # none given: unchanged, as for one directory (revisions._changes)
        if base is not None and same_files(every_file, base[0]) and (not metrics or metrics == base[0].metrics):
            written["same"] = base[1]
            return
        built = build_manifest(snap, pending, ranks.world_size, staging._store.digest_algorithm, every_file,
                               incremental)
        written["manifest"] = built.to_bytes(key)
        written[DCP_METADATA] = metadata  # in memory already: not read back from the staging
        written["globals"] = [n for n in GLOBAL_FILES if any(f.name == n for f in every_file)]
        staging.write(MANIFEST, [written["manifest"]], stable=True)

    writer = Writer(staging, ranks.rank, ranks.world_size, records, manifest, getattr(pending, "increment", None))
    saveplan.save(snap.dcp, writer, ranks)
    if writer.increment is not None:  # the next save's plan: this rank's own files, prints included
        pending.own = rank_view(pending.name, staging._store.digest_algorithm, writer.own)
    if ranks.rank != 0:
        return b""
    if "same" in written:
        return (len(written["same"]) | SAME).to_bytes(8, "big") + written["same"]
    parts = [written["manifest"]]
    for name in written["globals"]:
        if name in written:
            parts.append(written[name])
        else:
            with open(staging.path / name, "rb") as stream:
                parts.append(stream.read())
    return len(parts[0]).to_bytes(8, "big") + b"".join(parts)


# 3. complete, 4. verify -----------------------------------------------------------------------------------------
def _complete(pending: Pending, ranks: Ranks, tier: Tier, staging: Any, written: bytes, key: Any,
              committed: list) -> tuple[Manifest | None, bytes, BaseException | None]:
    """Rank 0's manifest and global files reach every leader in one broadcast; each leader writes them (digested
    as written, against the manifest's records) and commits its staging (fsync, rename, fsync the parent). No
    round here: :func:`_verify`'s reports this step's outcome too."""
    topo = tier.topology
    payload = memoryview(broadcast_bytes(ranks, written, 0, "complete"))
    manifest, manifest_bytes, error = None, b"", None
    try:
        length = int.from_bytes(payload[:8], "big")
        manifest_bytes = bytes(payload[8:8 + (length & ~SAME)])
        manifest = read_manifest_bytes(manifest_bytes, pending.name, key)
        if length & SAME:  # the state a generation already holds: nothing to write or commit
            return manifest, manifest_bytes, None
        if topo.is_leader:
            if topo.node != 0:
                offset = 8 + len(manifest_bytes)
                for name in node_files(manifest, []):  # the global files, in the order rank 0 packed them
                    size = manifest.file(name).size
                    if offset + size > len(payload):
                        raise CorruptGeneration(f"{pending.name}/{name}", "arrived shorter than its record")
                    _write_checked(staging, manifest, name, [payload[offset:offset + size]])
                    offset += size
                staging.write(MANIFEST, [manifest_bytes], stable=True)
            staging.commit()
            committed.append(True)
    except (TrainStateError, OSError) as exc:
        error = exc
    return manifest, manifest_bytes, error


def _verify(manifest: Manifest | None, manifest_bytes: bytes, ranks: Ranks, tier: Tier, key: Any,
            error: BaseException | None) -> Verified:
    """Each leader checks its committed holding: the manifest re-read, each file its node must hold present at its
    recorded size. One round then says whether every node committed and verified its holding."""
    topo = tier.topology
    if error is None and topo.is_leader:
        try:
            check_holding(tier.own, manifest, manifest_bytes, node_files(manifest, topo.ranks_on(topo.node)), key)
        except (TrainStateError, OSError) as exc:
            error = exc
    ranks.check("commit", error)
    return verified_from(manifest, manifest_bytes)


def read_manifest_bytes(data: bytes, name: str, key: Any) -> Manifest:
    return parse_manifest(data, f"{name}/{MANIFEST}", key)


def _write_checked(staging: Any, manifest: Manifest, name: str, chunks: Any) -> None:
    """Write a file another rank wrote first, digesting it as written; it must match the manifest's record. The
    chunks are buffers nobody changes (received, or handed over): digested as written, not read back."""
    record = manifest.file(name)
    got = staging.write(name, chunks, algorithm=manifest.digest_algorithm, size_hint=record.size, stable=True)
    if (got.size, got.digest, tuple(got.chunks)) != (record.size, record.digest, tuple(record.chunks)):
        raise CorruptGeneration(f"{manifest.generation}/{name}", "arrived with other bytes than the manifest records")


def check_holding(store: Any, manifest: Manifest, manifest_bytes: bytes, files: list[str], key: Any) -> None:
    """A committed holding: the manifest written, and each of ``files`` present at its recorded size."""
    _, digest, size = read_manifest(store, manifest.generation, None, key)
    if (digest, size) != (digest_bytes(manifest.digest_algorithm, manifest_bytes), len(manifest_bytes)):
        raise CorruptGeneration(f"{manifest.generation}/{MANIFEST}", "committed manifest differs from the one written")
    present = store.files(manifest.generation)
    for name in files:
        if present.get(name) != manifest.file(name).size:
            raise CorruptGeneration(f"{store.location}/{manifest.generation}/{name}",
                                    "missing" if name not in present else "has the wrong size")


# 5. point --------------------------------------------------------------------------------------------------------
def _point(verified: Verified, ranks: Ranks, tier: Tier, key: Any, pointer: str = POINTER,
           store: Any = None) -> None:
    topo = tier.topology
    store = store if store is not None else tier.own
    m = verified.manifest
    error, previous = None, None
    if topo.is_leader:
        try:
            previous = store.read_pointer(pointer)
            store.write_pointer(pointer, Pointer(m.generation, verified.manifest_digest, verified.manifest_size,
                                                 m.digest_algorithm, m.next_update, m.kind).to_bytes(key))
        except (TrainStateError, OSError) as exc:
            error = exc
    try:
        ranks.check("publish", error)
    except BaseException:
        if topo.is_leader and error is None and previous is not None:
            try:
                store.write_pointer(pointer, previous)  # every node names the same generation, or none moves
            except OSError as exc:
                log.error("could not move %s back after another node failed (%r)", store.location, exc)
        raise


def _remove_quietly(store: Any, name: str) -> None:
    try:
        if name in store.generations():
            store.remove(name)
    except OSError as exc:
        log.error("could not remove the unpublished %s from %s (%r)", name, store.location, exc)


# the replicated tier ----------------------------------------------------------------------------------------
def replicate(name: str, manifest_bytes: bytes, ranks: Ranks, tier: Tier, key: Any) -> None:
    """Copy every node's rank files to the nodes that keep its replicas (collective; see the module docstring)."""
    topo = tier.topology
    manifest = read_manifest_bytes(manifest_bytes, name, key)
    targets = placement(topo.domains, tier.replicas)
    receives = [s for s, ts in enumerate(targets) if topo.node in ts]
    staging, error = None, None
    if topo.is_leader and receives:
        try:
            staging = tier.replica.begin(name)
        except (TrainStateError, OSError) as exc:
            error = exc  # still receives every byte (so no sender waits), writes nothing, reports it below
    try:
        error = _transfer(manifest, ranks, tier, targets, staging, error, key)
        if staging is not None and error is None:
            try:
                staging.write(MANIFEST, [manifest_bytes], stable=True)
                staging.commit()
                check_holding(tier.replica, manifest, manifest_bytes,
                              [f for s in receives for r in topo.ranks_on(s) for f in rank_files(manifest, r)], key)
            except (TrainStateError, OSError) as exc:
                error = exc
        ranks.check("replicate", error)
    except BaseException:
        if staging is not None:
            staging.abort()
        raise
    verified = verified_from(manifest, manifest_bytes)
    _point(verified, ranks, tier, key, POINTER, tier.replica)


def _transfer(manifest: Manifest, ranks: Ranks, tier: Tier, targets: list[list[int]], staging: Any,
              error: BaseException | None, key: Any = None) -> Any:
    """Every (rank, target node) pair in one global order, point to point, a rank's files as one stream of
    pieces: no rank ever waits on a pair that its partner has not reached (the earliest unfinished pair has
    both ends ready), so the order cannot deadlock. Returns the first error on this rank (or ``error``).

    Where the manifest says some of a rank's files are linked (``full_every``: bytes an earlier generation
    wrote), the receiver first links those its replica of the parent holds intact (:func:`_link_held`) and
    tells the sender, in one message of a byte per such file, which it still needs: a replica carries what
    its holder lacks, and an unchanged part crosses the network once."""
    topo = tier.topology
    parent: list = []  # the receiver's replica of the parent, read once (:func:`_replica_parent`)
    for source, nodes in enumerate(targets):
        for target in nodes:
            receiver = topo.leader(target)
            for rank in topo.ranks_on(source):
                files = rank_files(manifest, rank) if rank < len(manifest.ranks) else []
                shared = [f for f in files if f in manifest.shares]
                if topo.rank == rank:
                    if shared:
                        needed = _asked(len(shared), receiver, ranks)
                        files = [f for f in files if f not in shared or needed[shared.index(f)]]
                    error = _send(tier.own, manifest, files, receiver, ranks) or error
                elif topo.rank == receiver:
                    if shared:
                        if not parent:
                            parent.append(_replica_parent(tier, manifest, key) if staging is not None else None)
                        held = _link_held(staging, tier, parent[0], manifest, shared) if error is None else set()
                        _ask([f not in held for f in shared], rank, ranks)
                        files = [f for f in files if f not in held]
                    stream = _Stream(_receive(sum(manifest.file(f).size for f in files), rank, ranks))
                    for file in files if error is None else ():
                        try:
                            _write_checked(staging, manifest, file, stream.take(manifest.file(file).size))
                        except (TrainStateError, OSError) as exc:
                            error = exc  # a file failed: receive the rest, write nothing more
                            break
                    stream.drain()  # the sender sends every piece: take them, or the order breaks
    return error


def _replica_parent(tier: Tier, manifest: Manifest, key: Any) -> Manifest | None:
    """This node's replica holding of ``manifest``'s parent (``None`` when it holds none, or one unreadable)."""
    if manifest.parent is None or manifest.parent not in tier.replica.generations():
        return None
    try:
        with tier.replica.open(manifest.parent, MANIFEST) as stream:
            return read_manifest_bytes(stream.read(), manifest.parent, key)
    except (TrainStateError, OSError) as exc:
        log.info("replicating every byte: this node's replica of %s cannot be read (%s)", manifest.parent, exc)
        return None


def _link_held(staging: Any, tier: Tier, parent: Manifest | None, manifest: Manifest, shared: list[str]) -> set[str]:
    """Of ``shared`` (files ``manifest`` links from an earlier generation), those linked into ``staging`` from this
    node's replica of ``parent``: a file of it whose bytes were first written where this one's were, recorded
    alike, and proven intact by its bytes (:func:`.incremental.intact`): a damaged replica is not passed on."""
    if parent is None or staging is None:
        return set()
    where = {sharing.origin(parent.generation, parent.shares, f.name): f for f in parent.files}
    held = set()
    for file in shared:
        record = manifest.file(file)
        source = where.get(sharing.origin(manifest.generation, manifest.shares, file))
        if source is None or (source.size, source.digest, tuple(source.chunks)) != (
                record.size, record.digest, tuple(record.chunks)) or not intact(tier.replica, parent, source.name):
            continue
        if staging.link(file, parent.generation, source) is not None:
            held.add(file)
    return held


def _ask(needed: list[bool], sender: int, ranks: Ranks) -> None:
    """Tell ``sender`` which of its linked files this receiver needs (a byte each)."""
    with collective("replicate", ranks):
        dist.send(torch.tensor(needed, dtype=torch.uint8), dst=_global_rank(ranks.group, sender), group=ranks.group)


def _asked(count: int, receiver: int, ranks: Ranks) -> list[bool]:
    """Which of this rank's ``count`` linked files ``receiver`` needs (:func:`_ask`)."""
    flags = torch.empty(count, dtype=torch.uint8)
    with collective("replicate", ranks):
        dist.recv(flags, src=_global_rank(ranks.group, receiver), group=ranks.group)
    return [bool(f) for f in flags.tolist()]


def _pieces(size: int) -> list[int]:
    return [min(PIECE, size - offset) for offset in range(0, size, PIECE)] or []


def _send(store: Any, manifest: Manifest, files: list[str], receiver: int, ranks: Ranks) -> BaseException | None:
    """Every piece of ``files`` (read from this node's holding, one after another). A read that fails still sends
    every piece (zeros: the receiver's digest check refuses them), so the receiver never waits out the timeout;
    returns the error."""
    error: BaseException | None = None
    left = [(f, manifest.file(f).size) for f in files]
    stream, remaining = None, 0
    try:
        for length in _pieces(sum(size for _, size in left)):
            buffer = bytearray(length)
            view, filled = memoryview(buffer), 0
            while filled < length and error is None:
                try:
                    if remaining == 0:
                        if stream is not None:
                            stream.close()
                        file, remaining = left.pop(0)
                        stream = store.open(manifest.generation, file)
                        continue
                    got = stream.readinto(view[filled:filled + min(remaining, length - filled)])
                    if not got:
                        raise CorruptGeneration(f"{manifest.generation}/{file}", "is shorter than its record")
                    filled, remaining = filled + got, remaining - got
                except (TrainStateError, OSError) as exc:
                    error = exc
            with collective("replicate", ranks):
                dist.send(torch.frombuffer(buffer, dtype=torch.uint8), dst=_global_rank(ranks.group, receiver),
                          group=ranks.group)
    finally:
        if stream is not None:
            stream.close()
    return error


def _receive(size: int, sender: int, ranks: Ranks) -> Any:
    """The pieces of ``size`` bytes as ``sender`` sends them."""
    for length in _pieces(size):
        buffer = torch.empty(length, dtype=torch.uint8)
        with collective("replicate", ranks):
            dist.recv(buffer, src=_global_rank(ranks.group, sender), group=ranks.group)
        yield memoryview(buffer.numpy())


class _Stream:
    """Received pieces as consecutive files: ``take(n)`` yields views of the next ``n`` bytes."""

    def __init__(self, pieces: Any):
        self.pieces, self.rest = iter(pieces), memoryview(b"")

    def take(self, size: int) -> Any:
        while size > 0:
            if not len(self.rest):
                self.rest = next(self.pieces)
            view, self.rest = self.rest[:size], self.rest[size:]
            size -= len(view)
            yield view

    def drain(self) -> None:
        for _ in self.pieces:
            pass


__all__ = ["check_holding", "prune", "publish", "replicate"]
