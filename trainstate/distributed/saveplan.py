"""The sharded part of a save, planned without DCP's collectives: two rounds, O(1) bytes per rank but rank 0.

``dcp.save`` plans collectively: every rank's local plan is pickled and gathered to
rank 0 (each object gather first all-gathers every rank's size), rank 0 deduplicates
replicated items and scatters each rank's plan back, the ranks write, their results
are gathered, and rank 0 broadcasts the whole global metadata to every rank: nine
rounds, and O(N) bytes per rank at the end. Here each rank plans alone with DCP's own
planner (flattening, write items, chunk bounds) and decides by rule which of its items
it writes, so that nothing needs deciding together before the writes:

- a DTensor's chunk: the one rank among those holding it (the ranks that differ only
  in the mesh dimensions where it is replicated) whose coordinate is 0 on each of them;
  an empty chunk (a rank past the last of a tensor's rows) is not written at all;
- a tensor or value every rank holds (replicated: ``capture`` checked they are equal):
  a small one (``SMALL_BYTES``) by rank 0, so that every rank that loads them reads one
  small file; a larger one by the rank a size-balanced assignment names, the same
  answer on every rank (a pure function of the items, which every rank holds alike).

Then one all-reduce sizes the gather and asks whether every rank follows one rule
(:mod:`trainstate.format.shardrule`: every DTensor on ``Shard``/``Replicate``, each
replicated item whole by its owner, and no rank's shard laid out by what changed; each
rank checks that what it wrote is exactly what the rule says, and sends a stamp of
it). If so, each rank sends rank 0 its files' records alone (a few hundred bytes and a
digest per 4 MiB of shard) and rank 0 writes the rule as ``dcp-metadata.json``: O(items
+ N) where the listed form is O(items x N) (7 M records for a 7B model at 8,192 ranks,
minutes of rank 0's time), and at restore each rank lists from it only the chunks it
reads. Otherwise (an incremental save, ranks that hold different structures) each rank
sends what it wrote item by item and rank 0 builds DCP's ``Metadata`` from the pieces.
Either way rank 0 runs the writer's finish (metadata JSON, manifest, commit) and one
broadcast tells every rank the outcome.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import CheckpointFailed, StateMismatch, TrainStateError
from ..format import shardrule, tensorfile
from ..format.manifest import FileRecord
from ..lifecycle.incremental import manifest_fields
from .group import Ranks, _encode, paused_gc
from .planner import SavePlanner
from .storage import SMALL_BYTES, Writer, rule_to_json


def save(state_dict: dict[str, Any], writer: Writer, ranks: Ranks) -> None:
    """Write this rank's items through ``writer``; on rank 0 also DCP's metadata and ``writer``'s finish. Raises on
    every rank when any rank failed (the failed rank its own typed error, the others :class:`CheckpointFailed`)."""
    failed, error = write(state_dict, writer, ranks)
    outcome = ranks.broadcast({"failed": failed} if failed else {}, "write")
    if "failed" in outcome:
        raise failure(outcome["failed"], error)


def write(state_dict: dict[str, Any], writer: Writer, ranks: Ranks,
          error: BaseException | None = None) -> tuple[dict[int, str] | None, BaseException | None]:
    """The rounds of :func:`save` but its last: the caller tells every rank the outcome (in a broadcast of its
    own). Returns, on rank 0, the failures by rank (``{}``: written and finished), ``None`` elsewhere; and this
    rank's own error. ``error``: this rank already failed (its staging): it writes nothing, and says so."""
    listed: dict = {}
    compact: dict = {}
    rule: dict | None = None
    planner = None
    if error is None:
        try:
            planner = SavePlanner()
            planner.set_up_planner(state_dict, is_coordinator=ranks.rank == 0)
            plan = planner.create_local_plan()
            rule = rule_of(planner, plan, ranks)
            plan = planner.finish_plan(dataclasses.replace(plan, items=own_items(planner, plan, ranks)))
            results = writer.write_data(plan, planner).value()
            listed = describe(plan, results, writer.rank_files, planner.mappings)
            if rule is not None:
                rule = _fill_bytes(rule, results, ranks.rank)
                compact = by_rule(rule, results, writer.rank_files, ranks.rank)
        except Exception as exc:  # noqa: BLE001 - rank 0 learns it in the round below, every rank after it
            error = exc
    text = "" if error is None else f"{type(error).__name__}: {error}"[:1000]
    # one all-reduce sizes the gather and says whether every rank follows one rule: then each sends a few hundred
    # bytes (its files), not a record per item, and rank 0 writes the rule (format.shardrule) instead of the list
    lists, rules = {"piece": listed, "error": text}, {"piece": compact, "error": text}
    stamp = _stamp(rule) if compact and error is None else None
    low = torch.iinfo(torch.int64).min
    largest = ranks.largest([len(_encode(lists)), len(_encode(rules)), stamp if stamp is not None else low,
                             -stamp if stamp is not None else low, int(error is None and stamp is None)], "write")
    agreed = largest[4] == 0 and largest[2] == -largest[3] != low
    every = ranks.gather(rules if agreed else lists, "write", room=largest[1] if agreed else largest[0])
    if ranks.rank != 0:
        return None, error
    failed = {r: e["error"] for r, e in enumerate(every) if e["error"]}
    if not failed:
        try:
            with paused_gc():
                if agreed:
                    finish_by_rule(writer, rule, planner.mappings, [e["piece"] for e in every])
                else:
                    finish(writer, [e["piece"] for e in every])
        except (TrainStateError, OSError, ValueError) as exc:
            failed, error = {0: f"{type(exc).__name__}: {exc}"[:1000]}, exc
    return dict(list(failed.items())[:64]), error


def failure(failed: dict, error: BaseException | None) -> BaseException:
    """What a rank raises when the write failed somewhere: its own typed error, else :class:`CheckpointFailed`
    naming the failed ranks (from its own error, if any)."""
    if isinstance(error, TrainStateError):
        return error
    exc = CheckpointFailed("write", {int(r): t for r, t in failed.items()})
    exc.__cause__ = error
    return exc


# which items this rank writes ---------------------------------------------------------------------------------------
def own_items(planner: SavePlanner, plan: SavePlan, ranks: Ranks) -> list[WriteItem]:
    """The items of ``plan`` (every item this rank holds) that this rank writes (see the module docstring)."""
    mine, replicated = [], []
    for item in plan.items:
        value = planner.state_dict.get(item.index.fqn)
        if isinstance(value, DTensor) and value.numel() == 0:
            replicated.append(item)  # an empty tensor: every rank holds the same empty chunk
        elif isinstance(value, DTensor):
            if _first_replica(value) and _size(item, elements=True):
                mine.append(item)  # (the empty chunk of a rank past a tensor's rows holds nothing: not written)
        else:
            replicated.append(item)
    owner = assign_replicated(replicated, ranks.world_size)
    return mine + [item for item in replicated if owner[_key(item)] == ranks.rank]


def _first_replica(value: DTensor) -> bool:
    """Whether this rank holds the chunk at coordinate 0 of every mesh dimension that replicates ``value``."""
    coordinate = value.device_mesh.get_coordinate()
    if coordinate is None:  # not on this rank's part of the mesh
        return False
    return all(c == 0 for c, p in zip(coordinate, value.placements) if p.is_replicate())


def _key(item: WriteItem) -> tuple:
    return _index_key(item.index)


def _index_key(index: MetadataIndex) -> tuple:
    return index.fqn, tuple(index.offset or ())


def _size(item: WriteItem, elements: bool = False) -> int:
    """The bytes of an item's chunk (``elements``: its number of elements)."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    numel = 1
    for s in item.tensor_data.chunk.sizes:
        numel *= int(s)
    return numel if elements else numel * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()


def assign_replicated(items: list[WriteItem], world_size: int) -> dict[tuple, int]:
    """Which rank writes each replicated item: rank 0 the small ones, the largest first to the least loaded rank
    for the rest (ties to the lowest rank). The same answer on every rank."""
    owner: dict[tuple, int] = {}
    large = []
    for item in items:
        size = _size(item)
        if size <= SMALL_BYTES:
            owner[_key(item)] = 0
        else:
            large.append((-size, _key(item)))
    loads = [(0, rank) for rank in range(world_size)]
    for negative, key in sorted(large):
        load, rank = heapq.heappop(loads)
        owner[key] = rank
        heapq.heappush(loads, (load - negative, rank))
    return owner



# the rule every rank's writes follow, when they follow one ------------------------------------------------------
def rule_of(planner: SavePlanner, plan: SavePlan, ranks: Ranks) -> dict | None:
    """The rule (:mod:`trainstate.format.shardrule`) by which the ranks write ``plan``'s items, as this rank sees
    it, or ``None`` when some item is not placed by one (a DTensor on a strided or partial placement, on a mesh of
    ranks outside the group, a non-tensor item another rank writes). Every rank that holds the same state sees the
    same rule; whether they all do is the write round's question (:func:`_stamp`)."""
    replicated = [item for item in plan.items if _replicated(planner.state_dict.get(item.index.fqn))]
    owner = assign_replicated(replicated, ranks.world_size)
    meshes: list[dict] = []
    items: dict[str, dict] = {}
    for item in plan.items:
        fqn = item.index.fqn
        value = planner.state_dict.get(fqn)
        if item.type == WriteItemType.BYTE_IO:
            if owner[_key(item)] != 0:
                return None
            items[fqn] = {"bytes": True, "writer": 0, "small": None}  # (rank 0 fills "small" from its write)
            continue
        t = item.tensor_data
        described = {"dtype": tensorfile.dtype_name(t.properties.dtype), "requires_grad": bool(t.properties.requires_grad),
                     "size": [int(s) for s in t.size]}
        if not isinstance(value, DTensor) or value.numel() == 0:
            if list(t.chunk.sizes) != described["size"] or any(t.chunk.offsets):
                return None
            items[fqn] = {**described, "writer": owner[_key(item)], "small": _size(item) <= SMALL_BYTES}
            continue
        if not all(type(p) in (Shard, Replicate) for p in value.placements):
            return None
        layout = value.device_mesh.mesh
        mesh = {"shape": [int(d) for d in layout.shape], "ranks": _group_ranks(layout.flatten().tolist(), ranks)}
        if mesh["ranks"] is None:
            return None
        if mesh not in meshes:
            meshes.append(mesh)
        items[fqn] = {**described, "mesh": meshes.index(mesh),
                      "placements": [["shard", p.dim] if type(p) is Shard else ["replicate"] for p in value.placements]}
    return {"world_size": ranks.world_size, "small_bytes": SMALL_BYTES, "meshes": meshes, "items": items}


def _replicated(value: Any) -> bool:
    """An item every rank holds whole (one rank writes it): not a DTensor's chunk, or an empty DTensor."""
    return not isinstance(value, DTensor) or value.numel() == 0


def _group_ranks(ranks_global: list[int], ranks: Ranks) -> list[int] | None:
    """A mesh's global ranks as ranks of ``ranks``'s group (the numbers its files carry); ``None`` when one is not
    in the group."""
    if ranks.group is None or ranks.group == dist.group.WORLD:
        return [int(r) for r in ranks_global]
    out = []
    for r in ranks_global:
        try:
            out.append(dist.get_group_rank(ranks.group, int(r)))
        except (ValueError, RuntimeError):
            return None
    return out if all(r >= 0 for r in out) else None


def _fill_bytes(rule: dict, results: list[WriteResult], rank: int) -> dict | None:
    """``rule`` with the non-tensor items' file (small or not, by their encoded size) taken from rank 0's write;
    on other ranks as it is. ``None`` if rank 0 did not write one of them."""
    if rank != 0:
        return rule
    where = {r.index.fqn: r.storage_data["file"] for r in results if r.index.offset is None}
    for fqn, item in rule["items"].items():
        if item.get("bytes"):
            if fqn not in where:
                return None
            item["small"] = where[fqn] == shardrule.small_file(0)
    return rule


def by_rule(rule: dict | None, results: list[WriteResult], rank_files: list[FileRecord], rank: int) -> dict:
    """This rank's piece when what it wrote is exactly what ``rule`` says it writes (every item, file and entry;
    checked here, so that rank 0 can trust the rule): its files' records alone. Else ``{}``.

    With ``full_every`` that holds while the rank's shard is one file (what changed, and everything small):
    its fingerprints then stay with the rank (:class:`.increments.RankIncrements` keeps them for its next
    save), out of the manifest, which a rule keeps O(N). A shard with parts (a frozen block of 1 MiB or more
    laid out apart, or linked from the parent) names files no rule says: it is listed."""
    if rule is None or any(r.storage_data.get("share") for r in results):
        return {}
    written = {(r.index.fqn, tuple(r.index.offset) if r.index.offset is not None else None, r.storage_data["file"],
                r.storage_data["entry"]) for r in results}
    ruled = shardrule.checked(_comparable(rule), "this save's rule")
    expected = {(fqn, tuple(offsets) if offsets is not None else None, file, entry)
                for fqn, offsets, _, file, entry in shardrule.written_by(ruled, rank)}
    if written != expected:
        return {}
    extra = {r.storage_data["file"]: {"record": list(r.storage_data["record"])} for r in results
             if "record" in r.storage_data}
    return {"rule": True, "extra": extra, "rank_files": [list(dataclasses.astuple(f)) for f in rank_files]}


def _comparable(rule: dict) -> dict:
    """``rule`` as the checker takes it: a non-tensor item's unknown ``small`` (ranks but 0) as small."""
    items = {fqn: ({**item, "small": True} if item.get("bytes") and item["small"] is None else item)
             for fqn, item in rule["items"].items()}
    return {**rule, "items": items}


def _stamp(rule: dict) -> int:
    """A 62-bit digest of what every rank must agree on in ``rule`` (rank 0's knowledge of non-tensor items'
    files left out): equal on every rank iff the ranks follow one rule."""
    same = {fqn: ({**item, "small": None} if item.get("bytes") else item) for fqn, item in rule["items"].items()}
    data = json.dumps({**rule, "items": same}, sort_keys=True, separators=(",", ":")).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


def finish_by_rule(writer: Writer, rule: dict, mappings: dict, pieces: list[dict]) -> None:
    """Rank 0: ``dcp-metadata.json`` as the rule, then the writer's finish with every rank's files."""
    shards = []
    for rank, piece in enumerate(pieces):
        shards += [FileRecord(*_record(extra["record"])) for extra in piece["extra"].values()]
        writer.plan_files[rank] = [FileRecord(*_record(f)) for f in piece["rank_files"]]
    planner_data = {fqn: list(path) for fqn, path in mappings.items()}
    writer.finish_data(rule_to_json(rule, planner_data, Metadata(state_dict_metadata={}).version), shards,
                       manifest_fields({}, {}))


# what rank 0 learns of each rank's writes ---------------------------------------------------------------------------
def describe(plan: SavePlan, results: list[WriteResult], rank_files: list[FileRecord], mappings: dict) -> dict:
    """What rank 0 needs of this rank's writes, as JSON: each item's metadata and where it went, the files'
    records (and with ``full_every`` their fingerprints and shares), this rank's per-rank files."""
    stored = {_index_key(r.index): r.storage_data for r in results}
    items, files = [], []
    for item in plan.items:
        data = stored[_key(item)]
        if data["file"] not in files:
            files.append(data["file"])
        where = [files.index(data["file"]), data["entry"]]
        path = list(mappings.get(item.index.fqn, ())) or None
        if item.type == WriteItemType.BYTE_IO:
            items.append([item.index.fqn, None, None, None, None, None, where, path])
            continue
        t = item.tensor_data
        items.append([item.index.fqn, list(item.index.offset) if item.index.offset is not None else None,
                      tensorfile.dtype_name(t.properties.dtype), bool(t.properties.requires_grad),
                      [int(s) for s in t.size], [[int(o) for o in t.chunk.offsets], [int(s) for s in t.chunk.sizes]],
                      where, path])
    extra = {}
    for result in results:  # the first result of each file carries what is known of it (Writer.write_data)
        data = result.storage_data
        if "record" in data:
            extra[data["file"]] = {k: (list(v) if k == "record" else v) for k, v in data.items()
                                   if k in ("record", "prints", "share", "spare")}
    return {"items": items, "files": files, "extra": extra, "rank_files": [list(dataclasses.astuple(f))
                                                                         for f in rank_files]}


def finish(writer: Writer, pieces: list[dict]) -> None:
    """Rank 0: DCP's global metadata from every rank's piece, checked, then the writer's finish."""
    state: dict[str, Any] = {}
    planner_data: dict[str, tuple] = {}
    results: list[list[WriteResult]] = []
    for rank, piece in enumerate(pieces):
        mine = []
        extra = dict(piece["extra"])
        for fqn, offset, dtype, grad, size, chunk, (file, entry), path in piece["items"]:
            name = piece["files"][file]
            if path is not None:
                planner_data.setdefault(fqn, tuple(path))
            if dtype is None:
                if fqn in state:
                    raise TrainStateError(f"rank {rank} writes {fqn!r}, which another rank writes too")
                state[fqn] = BytesStorageMetadata()
            else:
                held = state.setdefault(fqn, TensorStorageMetadata(
                    TensorProperties(dtype=tensorfile.torch_dtype(dtype, fqn), requires_grad=grad), torch.Size(size),
                    []))
                if not isinstance(held, TensorStorageMetadata) or list(held.size) != size:
                    raise TrainStateError(f"rank {rank} writes {fqn!r} with another shape than another rank")
                held.chunks.append(ChunkStorageMetadata(torch.Size(chunk[0]), torch.Size(chunk[1])))
            data = {"file": name, "entry": entry}
            if name in extra:
                data.update({k: _records(k, v) for k, v in extra.pop(name).items()})
            index = MetadataIndex(fqn, torch.Size(offset) if offset is not None else None)
            mine.append(WriteResult(index=index, size_in_bytes=0, storage_data=data))
        results.append(mine)
        writer.plan_files[rank] = [FileRecord(*_record(f)) for f in piece["rank_files"]]
    covered(state)
    writer.finish(Metadata(state_dict_metadata=state, planner_data=planner_data), results)


def _records(key: str, value: Any) -> Any:
    """A file's extra as it crossed in JSON, its records (its own, its spare's) back as tuples."""
    if key == "record":
        return _record(value)
    return {**value, "record": _record(value["record"])} if key == "spare" else value


def _record(fields: list) -> tuple:
    """A file record's fields as they crossed in JSON, back as ``dataclasses.astuple`` gave them."""
    return (*fields[:3], tuple(fields[3]) if len(fields) > 3 else ())


def covered(state: dict[str, Any]) -> None:
    """Every tensor's chunks add up to the whole tensor: none missing, none written twice (by volume; a missing
    chunk and a doubled one of the same size would cancel only if two ranks broke the rule the same way)."""
    for fqn, held in state.items():
        if not isinstance(held, TensorStorageMetadata):
            continue
        total = 1
        for s in held.size:
            total *= int(s)
        volume = 0
        for chunk in held.chunks:
            n = 1
            for s in chunk.sizes:
                n *= int(s)
            volume += n
        if volume != total:
            raise StateMismatch(f"{fqn}: its written chunks hold {volume} of its {total} elements: the ranks did "
                                         "not divide it between them exactly (a DTensor on a mesh that does not "
                                         "match the process group?)")

