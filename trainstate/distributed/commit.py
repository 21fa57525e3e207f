"""The multi-rank publication protocol: one atomic commit for all ranks, top to bottom.

Every rank runs :func:`publish` with its :class:`~.capture.RankSnapshot`, on
the checkpoint group; rank 0 owns the directory (lock, leftovers, pointer,
pruning) through the same :class:`~trainstate.publish.Publisher` a single
process uses.

1. **begin** (rank 0, before anyone writes; the capture's round checked that
   every rank names the same generation and summed their bytes): what exists under that name is decided (set aside, superseded,
   a no-op when this state is already published, or a refusal); leftovers
   are removed; the disk preflight runs; the staging directory is created.
   Its name, or the refusal, is broadcast.
2. **stage** (every rank): its per-rank record; rank 0 also the global
   ``state.json`` and ``tensors.safetensors``. Each file is digested, fsynced
   and read back. Every rank learns whether all succeeded.
3. **write** (DCP): each rank writes its shard file; rank 0's ``finish``
   checks it has records from every rank, writes DCP's metadata as JSON and
   the manifest, fsyncs, renames staging to the final name and fsyncs the
   parent.
4. **verify**: rank 0 checks the committed manifest, the file set and every
   size; with ``verify="full"`` each rank also re-reads and digests the
   files it wrote; all agree.
5. **publish** (rank 0): the pointer moves, then pruning; the outcome is
   broadcast, and every rank returns the same result or raises.

Every round is O(1) bytes per rank but rank 0 (which gathers a small record
from each): rank 0 alone needs every rank's name and file records, and the
manifest crosses to the other ranks only where they use it (``verify="full"``,
``full_every``).

A failure on any rank in any phase aborts the generation on every rank: no
pointer moves, the staging directory is removed (or, if rank 0 died, the
next save removes it) and a committed-but-unverified generation is removed.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from typing import Any


from ..errors import CheckpointFailed, CorruptGeneration, TrainStateError
from ..format import tensorfile
from ..format.digest import digest_bytes, digest_stream
from ..format.manifest import MANIFEST, STATE, FileRecord, Manifest, parse_manifest
from .. import revisions
from ..publish import TENSORS, Pending, Publisher
from ..records import GenerationInfo
from ..state import contract as contract_mod
from ..state.snapshot import state_json
from ..storage import chunked
from ..storage.verify import point_at, verify_generation
from .capture import RankSnapshot
from .group import Ranks
from .increments import rank_view
from . import saveplan
from .storage import Writer

log = logging.getLogger("trainstate")


def rank_json(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def rank_tensors(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def publish(snap: RankSnapshot, pending: Pending, ranks: Ranks, store: Any, publisher: Publisher | None,
            key: Any, content: bool = False) -> GenerationInfo:
    """Publish one generation from every rank's share; returns on every rank once it is committed and latest."""
    try:
        begun = _begin(snap, pending, ranks, store, publisher)
    except BaseException:
        if publisher is not None:  # rank 0 may have begun its staging before a collective failed
            publisher.clean_due = True
        raise
    if begun.get("noop"):
        return GenerationInfo(**begun["noop"])
    pending.extra["lineage"] = begun["lineage"]  # rank 0's timeline ids, so every rank records the same
    pending.extra["run"] = begun["run"]
    staging = store.join(pending.name, begun["staging"]) if ranks.rank else begun["_staging"]
    superseded = begun.get("_superseded")  # rank 0: the old generation of this name, set aside until published
    try:
        records, error = stage_records(snap, ranks.rank, staging)  # a failure travels with the write's round
        written = _write(snap, pending, ranks, staging, records, key, error)
        info = _verify_and_publish(pending, ranks, store, publisher, written, key, content)
    except BaseException:
        if ranks.rank == 0:
            if publisher is not None:  # (should the abort below fail, the next save looks for what it left)
                publisher.clean_due = True
            staging.abort()  # nothing committed (or removed again): no leftover for the next save to find
            if superseded is not None:
                publisher._put_back(superseded, pending.name)
        raise
    if superseded is not None:
        _remove_quietly(store, superseded)
    return info


# 1. begin -------------------------------------------------------------------------------------------------
def _begin(snap: RankSnapshot, pending: Pending, ranks: Ranks, store: Any, publisher: Publisher | None) -> dict:
    """Rank 0 begins (every rank's name and bytes came with the capture's round: same name, summed bytes); one
    broadcast tells every rank the staging directory, or the refusal."""
    outcome: dict[str, Any] = {}
    staging, error = None, None
    if ranks.rank == 0:
        try:
            outcome, staging = _rank0_begin(pending, store, publisher, snap.total_bytes)
        except (TrainStateError, OSError) as exc:
            outcome = {"error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__}
            error = exc
    shared = ranks.broadcast({k: v for k, v in outcome.items() if not k.startswith("_")}, "begin")
    if "error" in shared:
        if ranks.rank == 0:
            raise error
        raise CheckpointFailed("begin", {0: shared["error"]})
    if staging is not None:
        staging.shared = True  # (every rank stages into it: an object store lists their references at the commit)
        shared["_staging"], shared["_superseded"] = staging, outcome.get("_superseded")
    pending.name = shared.get("name", pending.name)  # rank 0 may publish it as a revision (gen-U-r001)
    return shared


def _rank0_begin(pending: Pending, store: Any, publisher: Publisher, total_bytes: int) -> tuple[dict, Any]:
    store.lock()
    publisher.finish_interrupted_replacements()
    existing = publisher.make_room(pending)
    if isinstance(existing, GenerationInfo):
        if pending.kind == "full":
            publisher.point_if_behind(existing.name)  # a crash cut its publication before the pointer moved
        return {"noop": dataclasses.asdict(existing)}, None
    if pending.kind == "full" and pending.parent is not None:
        publisher.point_if_behind(pending.parent, ahead_only=True)  # restore rolled forward to it: latest catches up
    publisher.clean_if_due()
    if publisher.preflight:
        publisher.check_space(pending.name, total_bytes)
    run = publisher.run_identity()
    staging = store.begin(pending.name)
    return {"staging": staging.name, "lineage": pending.extra["lineage"], "run": run, "name": pending.name,
            "_superseded": existing}, staging


# 2. stage ---------------------------------------------------------------------------------------------------
def stage_records(snap: RankSnapshot, rank: int, staging: Any) -> tuple[list[FileRecord], BaseException | None]:
    """This rank's records (rank 0's also the global files) into ``staging``; the records, and the failure if any
    (the caller reports it to every rank)."""
    records: list[FileRecord] = []
    try:
        records.append(_write_tensors(staging, rank_tensors(rank), snap.rank_tensors))
        records.append(staging.write(rank_json(rank), [state_json(snap.rank_skeleton)]))
        if rank == 0:
            records.append(staging.write(STATE, [state_json(snap.global_skeleton)]))
            records.append(_write_tensors(staging, TENSORS, snap.global_tensors))
    except (TrainStateError, OSError, ValueError, RuntimeError) as exc:
        return records, exc
    return records, None


def _write_tensors(staging: Any, name: str, tensors: dict) -> FileRecord:
    layout = tensorfile.plan(tensors)
    return staging.write(name, tensorfile.chunks(layout, tensors), size_hint=layout.size,
                         stable=all(t.device.type == "cpu" for t in tensors.values()))


# 3. write (DCP) ----------------------------------------------------------------------------------------------
def _write(snap: RankSnapshot, pending: Pending, ranks: Ranks, staging: Any, records: list[FileRecord],
           key: Any, error: BaseException | None) -> dict[str, Any]:
    """Each rank writes its shards (:mod:`.saveplan`: DCP's planning, without its rounds); rank 0 then commits, or
    discards the staging when every file's digest equals the generation ``pending.unless_same`` (a save at the
    same update that changed nothing). Returns, on rank 0, ``{"manifest": bytes}``, ``{"same": GenerationInfo
    fields}`` or ``{"failed": {rank: error}}`` (some rank's staging or writing failed: nothing was committed); on
    every rank ``"own"`` (its files, :func:`.increments.rank_view`) and ``"error"`` (its own failure, or None).
    ``error``: this rank's staging failed."""
    written: dict[str, Any] = {}

    def commit(metadata: bytes, every_file: list[FileRecord], incremental: dict) -> None:
        # rank 0, inside DCP's finish: every rank's records are here; the manifest goes last, then the rename
        base = pending.unless_same
        if base is not None:
            if revisions.same_files(every_file, base.manifest):
                staging.abort()
                revisions.log_same(base.manifest.generation)
                written["same"] = dataclasses.asdict(GenerationInfo.from_verified(staging._store, base))
                return
            revisions.log_revision(pending, base.manifest.generation, ["tensor bytes, by digest"])
        manifest = build_manifest(snap, pending, ranks.world_size, staging._store.digest_algorithm, every_file,
                                  incremental)
        written["manifest"] = manifest.to_bytes(key)
        staging.write(MANIFEST, [written["manifest"]])
        staging.commit()

    writer = Writer(staging, ranks.rank, ranks.world_size, records, commit, getattr(pending, "increment", None))
    failed, error = saveplan.write(snap.dcp, writer, ranks, error)
    if failed:
        written["failed"] = failed
    written["own"], written["error"] = writer.own, error
    return written


def build_manifest(snap: RankSnapshot, pending: Pending, world_size: int, algorithm: str,
                   every_file: list[FileRecord], incremental: dict) -> Manifest:
    """The manifest of a multi-rank generation: every rank's file records, and which rank wrote which file;
    ``incremental``: the format-4 fields (fingerprints, shares) when saved with ``full_every``."""
    per_rank: list[list[str]] = [[] for _ in range(world_size)]
    for record in every_file:
        per_rank[_owner(record.name)].append(record.name)
    return Manifest(
        generation=pending.name, kind=pending.kind, next_update=pending.next_update, digest_algorithm=algorithm,
        files=tuple(every_file),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds"),
        contract_fingerprint=contract_mod.digest(snap.global_skeleton["contract"]["fields"]),
        versions=snap.global_skeleton["contract"]["versions"], parent=pending.parent,
        world_size=world_size, ranks=per_rank, **pending.extra, **incremental)


def _owner(name: str) -> int:
    """The rank a file belongs to (0 for the global files)."""
    for prefix in ("rank-", "shard-"):
        if name.startswith(prefix):
            return int(name[len(prefix):len(prefix) + 5])
    return 0


# 4. verify, 5. publish ------------------------------------------------------------------------------------
def _verify_and_publish(pending: Pending, ranks: Ranks, store: Any, publisher: Publisher | None,
                        written: dict[str, Any], key: Any, content: bool) -> GenerationInfo:
    """Rank 0 verifies what it committed and moves the pointer; one broadcast tells every rank the outcome.

    Only where the other ranks need the manifest (``verify="full"``: each digests its share) is it broadcast
    first, and every rank's verdict agreed, before the pointer moves: O(N) bytes per rank that the default
    ("fast") save does without. An incremental save's ranks keep their own view of it (:func:`.increments.rank_view`)."""
    manifest_bytes = written.get("manifest", b"")
    error: BaseException | None = written["error"]
    if content:
        shared = ranks.broadcast(({k: written[k] for k in ("same", "failed") if k in written} or
                                  {"manifest": manifest_bytes.decode()}) if ranks.rank == 0 else None, "verify")
        if "failed" in shared:
            raise saveplan.failure(shared["failed"], error)
        if "same" in shared:
            return _same(pending, publisher, shared["same"])
        try:
            pending.manifest = parse_manifest(shared["manifest"].encode(), f"{pending.name}/{MANIFEST}", key)
            verify_share(store, pending.manifest, ranks)  # verify="full"; "fast" trusts what each rank digested
        except (TrainStateError, OSError) as exc:
            error = exc
        try:
            ranks.check("verify", error)
        except BaseException:
            if ranks.rank == 0:
                _remove_quietly(store, pending.name)  # committed but not verified everywhere: never latest
            raise
    outcome: dict[str, Any] = {}
    if ranks.rank == 0:
        outcome, error = ({"failed": written["failed"]}, error) if "failed" in written else \
            _rank0_publish(pending, store, publisher, written, key)
    shared = ranks.broadcast(outcome, "publish")
    if "failed" in shared:  # some rank's staging or writing failed: nothing was committed
        raise saveplan.failure(shared["failed"], error)
    if "same" in shared:
        return _same(pending, publisher, shared["same"])
    if "error" in shared:
        if ranks.rank == 0:
            raise error
        raise CheckpointFailed(shared["phase"], {0: shared["error"]})
    if getattr(pending, "increment", None) is not None:
        pending.own = rank_view(pending.name, store.digest_algorithm, written["own"])
        pending.manifest = pending.manifest or pending.own
    pending.linked = shared["linked"]
    if ranks.rank == 0:
        try:
            publisher.prune({pending.kind: pending.name})
        except Exception as exc:  # published: cleaning up after it is not the save's failure
            publisher.clean_due = True  # (a prune that stopped halfway leaves objects no record names)
            log.error("%s is published, but pruning after it failed (%r); the next save retries", pending.name, exc)
    return GenerationInfo(**shared["info"])


def _rank0_publish(pending: Pending, store: Any, publisher: Publisher, written: dict[str, Any],
                   key: Any) -> tuple[dict, BaseException | None]:
    """Rank 0's verification of the committed generation and the pointer's move: the outcome every rank learns
    (``info``, ``same``: nothing was committed, or ``error`` with its ``phase``) and rank 0's own error."""
    if "same" in written:  # every rank's staged bytes equal a published generation's: nothing was committed
        return {"same": written["same"]}, None
    manifest_bytes, phase = written["manifest"], "verify"
    try:
        verified = verify_generation(store, pending.name, content=False, key=key)
        if (verified.manifest_digest, verified.manifest_size) != (
                digest_bytes(verified.manifest.digest_algorithm, manifest_bytes), len(manifest_bytes)):
            raise CorruptGeneration(pending.name, "committed manifest differs from the one written")
        if pending.manifest is None:
            pending.manifest = verified.manifest
        phase = "publish"
        point_at(store, verified, key)
        publisher.published = pending.name
        return {"info": dataclasses.asdict(GenerationInfo.from_verified(store, verified)),
                "linked": bool(verified.manifest.shares)}, None
    except (TrainStateError, OSError) as exc:
        if phase == "verify":
            _remove_quietly(store, pending.name)  # committed but not verified: never latest
        else:
            publisher.withdraw(pending.name, pending.kind)  # a failed save publishes nothing
        return {"error": f"{type(exc).__name__}: {exc}", "phase": phase}, exc


def _same(pending: Pending, publisher: Publisher | None, same: dict) -> GenerationInfo:
    info = GenerationInfo(**same)
    if publisher is not None:
        publisher.was_published_as(pending.prepared, info.name)
    return info


def share_of(manifest: Manifest, ranks: Ranks) -> list[FileRecord]:
    """This rank's share of a generation's files: the files a rank wrote go to that rank (modulo the world size),
    so each rank checks what it will load itself; the global files go to rank 0. Every file in one share."""
    owner = {name: r for r, names in enumerate(manifest.ranks) for name in names if not name.startswith(
        ("state.json", "tensors.safetensors", "dcp-metadata.json"))}
    return [record for record in manifest.files if owner.get(record.name, 0) % ranks.world_size == ranks.rank]


def verify_share(store: Any, manifest: Manifest, ranks: Ranks, skip: set[str] = frozenset()) -> None:
    """Digest this rank's share of a generation's files (:func:`share_of`). ``skip``: files verified elsewhere (a
    restore's shards, chunk by chunk as they load)."""
    for record in share_of(manifest, ranks):
        if record.name in skip:
            continue
        where = f"{manifest.generation}/{record.name}"
        try:
            with store.open(manifest.generation, record.name) as stream:
                if record.chunks:  # a chunked digest: every chunk checked on its own, on every core
                    chunked.verify_file(stream, record, where, manifest.digest_algorithm)
                    continue
                size, digest = digest_stream(stream, manifest.digest_algorithm, record.size)
        except FileNotFoundError:
            raise CorruptGeneration(where, "missing") from None
        if (size, digest) != (record.size, record.digest):
            raise CorruptGeneration(where, f"{manifest.digest_algorithm} digest mismatch (content changed)")


def _remove_quietly(store: Any, name: str) -> None:
    try:
        if name in store.generations() or name in store.aside():
            store.remove(name)
    except OSError as exc:
        log.error("could not remove the unverified %s (%r); restore never picks it", name, exc)


