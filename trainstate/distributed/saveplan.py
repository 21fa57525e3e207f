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

Then one round (its room sized by an all-reduce of the largest) gathers to rank 0
what each rank wrote (chunk bounds, files, records) or why it failed; rank 0 builds
DCP's ``Metadata`` from them and runs the writer's ``finish`` (metadata JSON, manifest,
commit); one broadcast tells every rank the outcome. Restores read the same
``dcp-metadata.json`` as before: the on-disk format does not change.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from ..errors import CheckpointFailed, StateMismatch, TrainStateError
from ..format import tensorfile
from ..format.manifest import FileRecord
from .group import Ranks, paused_gc
from .planner import SavePlanner
from .storage import SMALL_BYTES, Writer


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
    piece: dict = {}
    if error is None:
        try:
            planner = SavePlanner()
            planner.set_up_planner(state_dict, is_coordinator=ranks.rank == 0)
            plan = planner.create_local_plan()
            plan = planner.finish_plan(dataclasses.replace(plan, items=own_items(planner, plan, ranks)))
            results = writer.write_data(plan, planner).value()
            piece = describe(plan, results, writer.rank_files, planner.mappings)
        except Exception as exc:  # noqa: BLE001 - rank 0 learns it in the round below, every rank after it
            error = exc
    text = "" if error is None else f"{type(error).__name__}: {error}"[:1000]
    every = ranks.gather({"piece": piece, "error": text}, "write", room=None)
    if ranks.rank != 0:
        return None, error
    failed = {r: e["error"] for r, e in enumerate(every) if e["error"]}
    if not failed:
        try:
            with paused_gc():
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
                                   if k in ("record", "prints", "share")}
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
                data.update({k: (_record(v) if k == "record" else v) for k, v in extra.pop(name).items()})
            index = MetadataIndex(fqn, torch.Size(offset) if offset is not None else None)
            mine.append(WriteResult(index=index, size_in_bytes=0, storage_data=data))
        results.append(mine)
        writer.plan_files[rank] = [FileRecord(*_record(f)) for f in piece["rank_files"]]
    covered(state)
    writer.finish(Metadata(state_dict_metadata=state, planner_data=planner_data), results)


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

