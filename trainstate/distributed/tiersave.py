"""The tiered publication protocol: one commit per tier, top to bottom.

Every rank runs :func:`publish` on the checkpoint group; each node's leader
(its lowest rank) owns that node's directory. The rule, per tier:

**Local tier** (each node's own directory):

1. **begin**: every rank names the same generation; the leaders lock their
   directories, remove leftovers, agree on the run's identity and check
   the space for what their node writes now and the replicas it will keep;
   each leader begins a staging directory, which its node's ranks join.
2. **stage, write**: each rank writes its records and DCP shard into its
   node's staging; rank 0 also the global files and, inside DCP's finish,
   the manifest (every rank's file records) into node 0's staging.
3. **complete**: rank 0 hands the manifest and the global files to every
   other leader, which writes them (digested as written, compared with the
   manifest's records), the manifest last. Every leader then commits its
   staging: fsync, rename, fsync the parent.
4. **verify**: each leader re-reads its committed manifest and checks the
   files its node must hold; all agree, else every leader removes its
   holding (nothing names it).
5. **point**: each leader moves its node's ``latest``. A node's ``latest``
   therefore names only a generation every node had committed: the local
   tier as a whole can serve it.

``save`` returns here (``wait_replicas=False``, the default): this rank's
shard is durable on its own node and the local tier's commit holds.

**Replicated tier** (:func:`replicate`; in the background unless
``wait_replicas=True``): each rank sends its files, point to point, to the
leader of every node that keeps a replica of its node (:func:`.tiers.placement`);
the receiver writes them into a staging directory of its ``replicas`` store,
digesting as it writes and comparing with the manifest, then commits. Once
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
import torch.distributed.checkpoint as dcp

from ..errors import CheckpointFailed, CorruptGeneration, ExistingRun, InsufficientSpace, TrainStateError
from ..format.digest import digest_bytes
from ..format.manifest import (MANIFEST, POINTER, RUN, Manifest, Pointer, generation_name, generation_order,
                               parse_generation_name, parse_run, run_to_bytes)
from ..publish import Pending
from ..records import GenerationInfo
from ..storage.verify import Verified, read_manifest, read_pointed
from .capture import RankSnapshot
from .commit import _sharded_bytes, _stage, build_manifest
from .group import Ranks, _global_rank, collective
from .planner import SavePlanner
from .storage import Writer
from .tiers import GLOBAL_FILES, Tier, broadcast_bytes, placement, rank_files

log = logging.getLogger("trainstate")
PIECE = 16 << 20  # one message between ranks while replicating


def publish(snap: RankSnapshot, pending: Pending, ranks: Ranks, tier: Tier, publisher: Any,
            key: Any) -> tuple[GenerationInfo, bytes]:
    """Publish one generation into the local tier; returns (on every rank) its info and the manifest's bytes."""
    staging = _begin(snap, pending, ranks, tier, publisher, key)
    committed = False
    try:
        records = _stage(snap, pending, ranks, staging)
        manifest_bytes = _write(snap, pending, ranks, staging, records, key)
        manifest_bytes = _complete(pending, ranks, tier, staging, manifest_bytes, key)
        committed = True
        verified = _verify(pending.name, ranks, tier, manifest_bytes, key)
        _point(verified, ranks, tier, key)
    except BaseException:
        if tier.topology.is_leader:
            staging.abort()
            if committed:
                _remove_quietly(tier.own, pending.name)
        raise
    return GenerationInfo.from_verified(tier.own, verified), manifest_bytes


# 1. begin -------------------------------------------------------------------------------------------------
def _begin(snap: RankSnapshot, pending: Pending, ranks: Ranks, tier: Tier, publisher: Any, key: Any) -> Any:
    size = sum(t.nbytes for t in snap.rank_tensors.values()) + sum(t.nbytes for t in snap.global_tensors.values())
    size += sum(_sharded_bytes(v) for v in snap.dcp.values())
    names = ranks.all_gather([pending.name, size], "begin")
    if len({n for n, _ in names}) != 1:
        raise CheckpointFailed("begin", {r: f"saves {n}" for r, (n, _) in enumerate(names)})
    topo = tier.topology
    report: dict[str, Any] = {}
    error = None
    if topo.is_leader:
        try:
            tier.own.lock()
            for store in tier.stores().values():
                for leftover in store.clean_leftovers():
                    log.info("removed leftover %s from an interrupted save", leftover)
            report = {"names": sorted({n for s in tier.stores().values() for n in s.generations()}),
                      "run": _recorded_run(tier, key), "free": tier.own.free_bytes()}
        except (TrainStateError, OSError) as exc:
            error = exc
    reports = ranks.all_gather(report, "begin")
    ranks.check("begin", error)
    run = next((r["run"] for r in reports if r.get("run")), None)
    if run is None:  # a new run: rank 0 names it, every node records it
        run = ranks.broadcast(publisher.run_identity() if ranks.rank == 0 else None, "begin")
    name = _fresh_name(pending.name, [n for r in reports for n in r.get("names", ())])
    error = None
    if topo.is_leader:
        try:
            _check_space(tier, name, [s for _, s in names], reports[topo.rank]["free"])
            _adopt_run(tier, run, key, bool(reports[topo.rank]["names"]))
            staging = tier.own.begin(name)
        except (TrainStateError, OSError) as exc:
            error = exc
    shared = ranks.all_gather(staging.name if topo.is_leader and not error else None, "begin")
    try:
        ranks.check("begin", error)
    except BaseException:
        if topo.is_leader and error is None:
            staging.abort()  # another node refused (no space, another run): nothing of this save stays
        raise
    if name != pending.name:
        publisher.was_published_as(pending.prepared, name)
        pending.name = name
    pending.extra["run"] = run
    pending.extra["lineage"] = ranks.broadcast(pending.extra["lineage"], "begin")
    error = None
    if not topo.is_leader:  # the node's ranks write into their leader's staging directory
        try:
            staging = tier.own.join(name, shared[topo.leader(topo.node)])
        except (ValueError, OSError) as exc:
            error = exc
    try:
        ranks.check("begin", error)
    except BaseException:
        if topo.is_leader:
            staging.abort()
        raise
    return staging


def _fresh_name(name: str, existing: list[str]) -> str:
    """``name``, or the next revision of it when some node already holds a generation of that name (a later save
    at the same update, or a holding left from a timeline a restore abandoned): a holding is never overwritten."""
    if name not in existing:
        return name
    update, kind = parse_generation_name(name)
    revisions = [generation_order(n)[1] for n in existing if parse_generation_name(n) == (update, kind)]
    return generation_name(update, kind, max(revisions) + 1)


def _recorded_run(tier: Tier, key: Any) -> str | None:
    try:
        data = tier.own.read_pointer(RUN)
        return None if data is None else parse_run(data, RUN, key)
    except CorruptGeneration:
        return None


def _adopt_run(tier: Tier, run: str, key: Any, holds_any: bool) -> None:
    """Every node's directory records the same run identity: the one some node already records, else rank 0's."""
    mine = _recorded_run(tier, key)
    if mine != run:
        if mine is not None and holds_any:
            raise ExistingRun(f"{tier.own.location} holds generations of another run ({mine[:16]}); this run is "
                              f"{run[:16]}. Give this node an empty directory, or remove the old run's")
        tier.own.write_pointer(RUN, run_to_bytes(run, key))


def _check_space(tier: Tier, name: str, sizes: list[int], free: int | None) -> None:
    """What this node writes now (its ranks' shares and the global files) and the replicas it will receive."""
    topo = tier.topology
    mine = sum(sizes[r] for r in topo.ranks_on(topo.node)) + sizes[0]
    incoming = sum(sizes[r] for source, targets in enumerate(placement(topo.domains, tier.replicas))
                   if topo.node in targets for r in topo.ranks_on(source))
    needed = int((mine + incoming + (64 << 10)) * (1 + tier.headroom))
    if tier.preflight and free is not None and free < needed:
        raise InsufficientSpace(tier.own.location, name, needed, free)


# 2. stage, write ---------------------------------------------------------------------------------------------
def _write(snap: RankSnapshot, pending: Pending, ranks: Ranks, staging: Any, records: list, key: Any) -> bytes:
    """DCP writes the shards into each node's staging; rank 0 writes the manifest into node 0's (no commit yet)."""
    written: dict[str, bytes] = {}

    def manifest(metadata: bytes, every_file: list) -> None:
        built = build_manifest(snap, pending, ranks.world_size, staging._store.digest_algorithm, every_file)
        written["manifest"] = built.to_bytes(key)
        staging.write(MANIFEST, [written["manifest"]])

    writer = Writer(staging, ranks.rank, ranks.world_size, records, manifest)
    with collective("write", ranks):
        dcp.save(snap.dcp, storage_writer=writer, planner=SavePlanner(), process_group=ranks.group)
    return written.get("manifest", b"")


# 3. complete ----------------------------------------------------------------------------------------------------
def _complete(pending: Pending, ranks: Ranks, tier: Tier, staging: Any, manifest_bytes: bytes, key: Any) -> bytes:
    topo = tier.topology
    manifest_bytes = broadcast_bytes(ranks, manifest_bytes, 0, "complete")
    manifest = read_manifest_bytes(manifest_bytes, pending.name, key)
    error = None
    for name in GLOBAL_FILES:
        if not any(f.name == name for f in manifest.files):
            continue
        data = None
        if ranks.rank == 0:
            with open(staging.path / name, "rb") as stream:
                data = stream.read()
        data = broadcast_bytes(ranks, data, 0, "complete")
        if topo.is_leader and topo.node != 0 and error is None:
            try:
                _write_checked(staging, manifest, name, [data])
            except (TrainStateError, OSError) as exc:
                error = exc
    if topo.is_leader and error is None:
        try:
            if topo.node != 0:
                staging.write(MANIFEST, [manifest_bytes])
            staging.commit()
        except (TrainStateError, OSError) as exc:
            error = exc
    ranks.check("commit", error)
    return manifest_bytes


def read_manifest_bytes(data: bytes, name: str, key: Any) -> Manifest:
    from ..format.manifest import parse_manifest

    return parse_manifest(data, f"{name}/{MANIFEST}", key)


def _write_checked(staging: Any, manifest: Manifest, name: str, chunks: Any) -> None:
    """Write a file another rank wrote first, digesting it as written; it must match the manifest's record."""
    record = manifest.file(name)
    got = staging.write(name, chunks, algorithm=manifest.digest_algorithm, size_hint=record.size)
    if (got.size, got.digest, tuple(got.chunks)) != (record.size, record.digest, tuple(record.chunks)):
        raise CorruptGeneration(f"{manifest.generation}/{name}", "arrived with other bytes than the manifest records")


# 4. verify, 5. point ------------------------------------------------------------------------------------------
def _verify(name: str, ranks: Ranks, tier: Tier, manifest_bytes: bytes, key: Any) -> Verified:
    topo = tier.topology
    manifest = read_manifest_bytes(manifest_bytes, name, key)
    verified = Verified(manifest, digest_bytes(manifest.digest_algorithm, manifest_bytes), len(manifest_bytes))
    error = None
    if topo.is_leader:
        try:
            check_holding(tier.own, manifest, manifest_bytes, node_files(manifest, topo.ranks_on(topo.node)), key)
        except (TrainStateError, OSError) as exc:
            error = exc
    ranks.check("verify", error)
    return verified


def node_files(manifest: Manifest, ranks_on_node: list[int]) -> list[str]:
    present = {f.name for f in manifest.files}
    return [f for f in GLOBAL_FILES if f in present] + [f for r in ranks_on_node if r < len(manifest.ranks)
                                                          for f in rank_files(manifest, r)]


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


def _point(verified: Verified, ranks: Ranks, tier: Tier, key: Any, pointer: str = POINTER,
           store: Any = None) -> None:
    topo = tier.topology
    store = store if store is not None else tier.own
    m = verified.manifest
    error = None
    previous = None
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
            error = exc
    ranks.check("replicate", error)
    try:
        error = _transfer(manifest, ranks, tier, targets, staging)
        if staging is not None and error is None:
            try:
                staging.write(MANIFEST, [manifest_bytes])
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
    verified = Verified(manifest, digest_bytes(manifest.digest_algorithm, manifest_bytes), len(manifest_bytes))
    _point(verified, ranks, tier, key, POINTER, tier.replica)


def _transfer(manifest: Manifest, ranks: Ranks, tier: Tier, targets: list[list[int]], staging: Any) -> Any:
    """Every (file, target node) pair in one global order, point to point: no rank ever waits on a pair that its
    partner has not reached (the earliest unfinished pair has both ends ready), so the order cannot deadlock."""
    topo = tier.topology
    error = None
    for source, nodes in enumerate(targets):
        for target in nodes:
            receiver = topo.leader(target)
            for rank in topo.ranks_on(source):
                for file in rank_files(manifest, rank) if rank < len(manifest.ranks) else ():
                    if topo.rank == rank:
                        error = _send(tier.own, manifest, file, receiver, ranks) or error
                    elif topo.rank == receiver:
                        pieces = _receive(manifest, file, rank, ranks)
                        try:
                            if error is not None:
                                raise error  # a file before failed: receive the rest, write nothing more
                            _write_checked(staging, manifest, file, pieces)
                        except (TrainStateError, OSError) as exc:
                            error = error or exc
                            for _ in pieces:  # the sender sends every piece: take them, or the order breaks
                                pass
    return error


def _pieces(size: int) -> list[int]:
    return [min(PIECE, size - offset) for offset in range(0, size, PIECE)] or []


def _send(store: Any, manifest: Manifest, file: str, receiver: int, ranks: Ranks) -> BaseException | None:
    """Every piece of ``file``, read from this node's holding. A read that fails still sends every piece (zeros:
    the receiver's digest check refuses them), so the receiver never waits out the timeout; returns the error."""
    error: BaseException | None = None
    stream = None
    try:
        stream = store.open(manifest.generation, file)
    except OSError as exc:
        error = exc
    try:
        for length in _pieces(manifest.file(file).size):
            buffer = bytearray(length)
            if error is None:
                try:
                    stream.readinto(buffer)
                except OSError as exc:
                    error = exc
            with collective("replicate", ranks):
                dist.send(torch.frombuffer(buffer, dtype=torch.uint8), dst=_global_rank(ranks.group, receiver),
                          group=ranks.group)
    finally:
        if stream is not None:
            stream.close()
    return error


def _receive(manifest: Manifest, file: str, sender: int, ranks: Ranks) -> Any:
    """The pieces of ``file`` as ``sender`` sends them; every piece is received even after a local write failed,
    so the sender is never left waiting."""
    for length in _pieces(manifest.file(file).size):
        buffer = torch.empty(length, dtype=torch.uint8)
        with collective("replicate", ranks):
            dist.recv(buffer, src=_global_rank(ranks.group, sender), group=ranks.group)
        yield memoryview(buffer.numpy())


# retention ------------------------------------------------------------------------------------------------
def prune(tier: Tier, key: Any) -> list[str]:
    """On a leader: keep the newest ``keep_last`` generations its ``latest`` covers, the one ``replicas/latest``
    names and anything newer than ``latest`` (still being published); remove the rest from both tiers."""
    if not tier.topology.is_leader:
        return []
    local = read_pointed(tier.own, POINTER, key)
    if local is None:
        return []
    replicated = read_pointed(tier.replica, POINTER, key) if tier.replicas > 1 else None
    newest = generation_order(local.generation)
    kept = [n for n in tier.own.generations() if parse_generation_name(n)[1] == "full"
            and generation_order(n) <= newest][:tier.keep_last]
    keep = set(kept) | {local.generation} | ({replicated.generation} if replicated else set())
    if tier.remote is not None and tier.remote.pending:  # chosen for upload, not on the remote yet
        keep.add(tier.remote.pending)
    removed = []
    for store in tier.stores().values():
        for name in store.generations():
            if name in keep or generation_order(name) > newest:
                continue
            try:
                store.remove(name)
                removed.append(name)
            except OSError as exc:
                log.error("could not prune %s from %s (%r); the next save retries", name, store.location, exc)
    return removed


__all__ = ["check_holding", "node_files", "prune", "publish", "replicate"]
