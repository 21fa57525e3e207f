"""A pickle-free storage layer for ``torch.distributed.checkpoint``.

DCP decides *what* each rank writes (planning, deduplication of replicated
items, resharding on load); this layer decides *how*. It is not a
``FileSystemWriter`` subclass, because every part of that format is pickle:
its ``.metadata`` is ``pickle.dump``-ed and ``pickle.load``-ed, its data files
are ``torch.save`` archives. Here:

- each rank's items go into one safetensors file, ``shard-<rank>.safetensors``,
  written by the same staging code as a single-process generation (digest
  beside the write, fsync, read-back); entries are named ``<fqn>@<offsets>``;
  small replicated items (an optimizer's step counters and param groups, every
  rank loads them) go into ``shard-<rank>-small.safetensors`` instead, so that
  a rank whose own pieces are all in its own shard reads nothing else of any
  other rank's shard: on an object store a foreign shard costs at least the
  4 MiB chunk a digest covers, a small file only its own few bytes; with
  ``full_every`` the shard is split by what changes, and the parts that did
  not are linked from the parent (:mod:`.increments`);
- DCP's global metadata is JSON (``dcp-metadata.json``), rebuilt into DCP's
  ``Metadata`` on read by a strict parser;
- non-tensor items are trainstate's tagged JSON (see :mod:`.planner`).

Call order (DCP drives it; "coordinator" is rank 0):

1. (every rank) ``prepare_local_plan``: the plan carries this rank's number
   and the records of the per-rank files it has already written;
2. (coordinator) ``prepare_global_plan``: checks there is a plan from every rank;
3. (every rank) ``write_data``: writes, digests and fsyncs its shard file;
   each :class:`WriteResult` names the file and entry, the first carries the
   file's record;
4. (coordinator) ``finish``: writes the metadata JSON, then hands every file
   record to the commit callback, which writes the manifest and commits.
"""

from __future__ import annotations

import dataclasses
import io
import json
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..errors import CorruptGeneration, TrainStateError
from ..format import tensorfile
from ..format.digest import CHUNK_BYTES
from ..format import shardrule
from ..format.manifest import FileRecord
from ..format.shardrule import shard_file, small_file
from ..lifecycle.incremental import manifest_fields
from ..storage import chunked
from .group import paused_gc
from .increments import ShardPlan, carried, collect, own_files

DCP_METADATA = "dcp-metadata.json"
_FORMAT = "trainstate-dcp-metadata"


SMALL_BYTES = 64 << 10  # a replicated item up to this size goes into the rank's small file


def _small_and_replicated(item: Any, tensor: torch.Tensor) -> bool:
    if tensor.nbytes > SMALL_BYTES:
        return False
    if item.type == WriteItemType.BYTE_IO:
        return True
    data = item.tensor_data
    return data is not None and tuple(data.chunk.sizes) == tuple(data.size)  # the whole tensor: not sharded


def entry_name(index: MetadataIndex) -> str:
    return shardrule.entry_name(index.fqn, index.offset)


# metadata <-> JSON -------------------------------------------------------------------------------------

def _storage_order(record: list) -> list:
    return record[1] or []


def metadata_to_json(metadata: Metadata) -> bytes:
    with paused_gc():
        items: dict[str, Any] = {}
        for fqn, item in metadata.state_dict_metadata.items():
            if isinstance(item, BytesStorageMetadata):
                items[fqn] = {"bytes": True}
                continue
            props = item.properties
            if props.layout != torch.strided:
                raise TrainStateError(f"{fqn}: only strided (dense) tensors are stored, not {props.layout}")
            items[fqn] = {"dtype": tensorfile.dtype_name(props.dtype), "requires_grad": bool(props.requires_grad),
                          "size": [int(s) for s in item.size],
                          "chunks": [[list(map(int, c.offsets)), list(map(int, c.sizes))] for c in item.chunks]}
        planner = {fqn: list(path) for fqn, path in (metadata.planner_data or {}).items()}
        by_fqn: dict[str, list] = {}  # sorted by fqn, then offsets (None as []), ties in insertion order
        for index, info in (metadata.storage_data or {}).items():
            record = [index.fqn, None if index.offset is None else list(map(int, index.offset)), info["file"],
                      info["entry"]]
            group = by_fqn.get(index.fqn)
            if group is None:
                by_fqn[index.fqn] = [record]
            else:
                group.append(record)
        storage = [record for fqn in sorted(by_fqn) for record in sorted(by_fqn[fqn], key=_storage_order)]
        data = {"format": _FORMAT, "version": metadata.version, "items": items, "planner_data": planner,
                "storage": storage}
        return json.dumps(data, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()


def metadata_from_json(raw: dict, where: str, files: set[str], lazy: bool = False) -> Metadata:
    """DCP's ``Metadata`` from its parsed JSON, checking every field; ``files``: the shard files the manifest lists.
    A rule-form file (:mod:`trainstate.format.shardrule`) is listed first, every chunk of every rank; with ``lazy``
    it stays a rule (:class:`RuleMetadata`): a rank's load lists only the chunks it reads."""
    with paused_gc():
        if type(raw) is dict and "rule" in raw:
            if lazy:
                return RuleMetadata(raw, where, files)
            raw = shardrule.explicit(raw, where)
        return _metadata_from_json(raw, where, files)


class RuleMetadata(Metadata):
    """DCP's metadata written by rule, not listed: :meth:`view` lists what one rank's load reads.

    Given to :class:`.planner.LoadPlanner`, which plans against ``view(its flattened state dict)``: every key the
    generation stores, and of each tensor only the chunks that meet the rank's own (found by division, not by
    scanning every rank's, :func:`trainstate.format.shardrule.overlapping`). At N ranks a restore lists O(items)
    records per rank where the listed form is O(items x N) for every rank to parse."""

    def __init__(self, raw: dict, where: str, files: set[str]):
        if not (set(raw) == {"format", "version", "planner_data", "rule"} and raw["format"] == _FORMAT
                and (raw["version"] is None or type(raw["version"]) is str) and type(raw["planner_data"]) is dict):
            raise CorruptGeneration(where, "not trainstate DCP metadata")
        planner = {}
        for fqn, path in raw["planner_data"].items():
            if not (type(path) is list and path and all(type(p) in (str, int) for p in path)):
                raise CorruptGeneration(where, f"malformed path {fqn!r:.80}")
            planner[fqn] = tuple(path)
        super().__init__(state_dict_metadata={}, planner_data=planner, storage_data={}, version=raw["version"])
        self.rule, self.where, self.files = shardrule.checked(raw["rule"], where), where, files

    def view(self, flat: dict[str, Any]) -> Metadata:
        """The listed metadata of what a load into ``flat`` (a flattened state dict) reads: every stored key, each
        tensor with the chunks that overlap this rank's (all keys, so that DCP's check for keys of an older
        format sees what it would; chunks only where ``flat`` holds the key)."""
        from torch.distributed.checkpoint.planner_helpers import _create_chunk_list

        items: dict[str, Any] = {}
        storage: dict[MetadataIndex, dict] = {}
        for fqn, item in self.rule["items"].items():
            if item.get("bytes"):
                items[fqn] = BytesStorageMetadata()
                found = shardrule.overlapping(self.rule, fqn, []) if fqn in flat else []
            else:
                value = flat.get(fqn)
                boxes = [(list(map(int, c.offsets)), list(map(int, c.sizes))) for c in _create_chunk_list(value)] \
                    if isinstance(value, torch.Tensor) or hasattr(value, "__create_chunk_list__") else []
                found = shardrule.overlapping(self.rule, fqn, boxes) if boxes else []
                props = TensorProperties(dtype=tensorfile.torch_dtype(item["dtype"], self.where),
                                         requires_grad=item["requires_grad"])
                items[fqn] = TensorStorageMetadata(props, torch.Size(item["size"]), [
                    ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes, _, _ in found])
            for offsets, _, file, entry in found:
                if file not in self.files:
                    raise CorruptGeneration(self.where, f"{fqn!r:.80} is stored in {file}, which the manifest "
                                                        "does not list")
                storage[MetadataIndex(fqn, None if offsets is None else torch.Size(offsets))] = {"file": file,
                                                                                                  "entry": entry}
        return Metadata(state_dict_metadata=items, planner_data=dict(self.planner_data), storage_data=storage,
                        version=self.version)

    def entries(self, file: str) -> set[str]:
        """Every entry the rule stores in ``file`` (one rank's shard or small file)."""
        writer = shardrule.writer_of(file)
        return {entry for _, _, _, name, entry in shardrule.written_by(self.rule, writer) if name == file} \
            if writer is not None else set()


def rule_to_json(rule: dict, planner_data: dict, version: str | None) -> bytes:
    """``dcp-metadata.json`` in rule form: what each rank wrote, by rule (:mod:`trainstate.format.shardrule`)."""
    data = {"format": _FORMAT, "version": version, "planner_data": planner_data, "rule": rule}
    return json.dumps(data, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()


def _naturals(value: Any, n: int | None = None) -> bool:
    """A list of ints >= 0 (of length ``n``), checked without a Python call per element."""
    return type(value) is list and (not value or (set(map(type, value)) == {int} and min(value) >= 0)) and (
        n is None or len(value) == n)


def _metadata_from_json(raw: dict, where: str, files: set[str]) -> Metadata:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CorruptGeneration(where, what)

    ints = _naturals
    need(type(raw) is dict and set(raw) == {"format", "version", "items", "planner_data", "storage"}
         and raw["format"] == _FORMAT, "not trainstate DCP metadata")
    need(raw["version"] is None or type(raw["version"]) is str, "malformed version")
    need(type(raw["items"]) is dict and type(raw["planner_data"]) is dict and type(raw["storage"]) is list,
         "malformed sections")
    items: dict[str, Any] = {}
    for fqn, item in raw["items"].items():
        need(type(item) is dict, f"malformed item {fqn!r:.80}")
        if item == {"bytes": True}:
            items[fqn] = BytesStorageMetadata()
            continue
        need(set(item) == {"dtype", "requires_grad", "size", "chunks"} and type(item["requires_grad"]) is bool
             and type(item["dtype"]) is str and ints(item["size"]) and type(item["chunks"]) is list,
             f"malformed tensor item {fqn!r:.80}")
        size = item["size"]
        chunks = []
        for chunk in item["chunks"]:  # (the message is formatted only for a chunk that fails)
            if not (type(chunk) is list and len(chunk) == 2 and ints(chunk[0], len(size)) and ints(chunk[1], len(size))
                    and all(map(operator.le, map(operator.add, chunk[0], chunk[1]), size))):
                raise CorruptGeneration(where, f"malformed chunk of {fqn!r:.80}")
            chunks.append(ChunkStorageMetadata(torch.Size(chunk[0]), torch.Size(chunk[1])))
        props = TensorProperties(dtype=tensorfile.torch_dtype(item["dtype"], where),
                                 requires_grad=item["requires_grad"])
        items[fqn] = TensorStorageMetadata(props, torch.Size(size), chunks)
    planner = {}
    for fqn, path in raw["planner_data"].items():
        need(type(path) is list and path and all(type(p) in (str, int) for p in path), f"malformed path {fqn!r:.80}")
        planner[fqn] = tuple(path)
    storage = {}
    for record in raw["storage"]:
        if not (type(record) is list and len(record) == 4 and type(record[0]) is str and record[0] in items
                and (record[1] is None or ints(record[1])) and record[2] in files and type(record[3]) is str):
            raise CorruptGeneration(where, f"malformed storage record {record!r:.120}")
        storage[MetadataIndex(record[0], record[1])] = {"file": record[2], "entry": record[3]}
    return Metadata(state_dict_metadata=items, planner_data=planner, storage_data=storage, version=raw["version"])


# writing -----------------------------------------------------------------------------------------------
class Writer(StorageWriter):
    """Writes one rank's DCP items into the shared staging directory (see the module docstring)."""

    def __init__(self, staging: Any, rank: int, world_size: int, rank_files: list[FileRecord],
                 on_finish: Callable[[bytes, list[FileRecord], dict], None], increment: ShardPlan | None = None):
        self.staging, self.rank, self.world_size = staging, rank, world_size
        self.rank_files = rank_files
        self.on_finish = on_finish  # (DCP's metadata, every file's record, the manifest's format-4 fields)
        self.increment = increment  # full_every: this rank's shard by what changes (see .increments)
        self.plan_files: dict[int, list[FileRecord]] = {}
        self.own: dict[str, dict] = {}  # this rank's shard files as written: {file: {"record", "prints", "share"}}

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return dataclasses.replace(plan, storage_data={"rank": self.rank,
                                                       "files": [dataclasses.astuple(f) for f in self.rank_files]})

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        ranks = [p.storage_data.get("rank") if isinstance(p.storage_data, dict) else None for p in plans]
        if ranks != list(range(self.world_size)):
            raise TrainStateError(f"plans came from ranks {ranks}, not from each of the {self.world_size} ranks")
        self.plan_files = {p.storage_data["rank"]: [FileRecord(*f) for f in p.storage_data["files"]] for p in plans}
        return plans

    def write_data(self, plan: SavePlan, planner: Any) -> Future[list[WriteResult]]:
        files: dict[str, dict[str, torch.Tensor]] = {shard_file(self.rank): {}, small_file(self.rank): {}}
        placed = []  # (item, entry name, its bytes, file)
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                tensor = torch.frombuffer(bytearray(data.getvalue()), dtype=torch.uint8)
            else:
                tensor = data.detach()
                tensor = tensor if tensor.device.type == "cpu" else tensor.cpu()
            name = entry_name(item.index)
            file = small_file(self.rank) if _small_and_replicated(item, tensor) else shard_file(self.rank)
            files[file][name] = tensor
            placed.append((item, name, tensor, file))
        extra: dict[str, dict] = {}  # by file: the record, and with full_every its items' fingerprints and share
        if self.increment is not None:  # the shard by what changes: unchanged parts linked from the parent
            records, fields = self.increment.write(self.staging, self.rank, files.pop(shard_file(self.rank)))
            moved = {n: file for file, items in fields.get("fingerprints", {}).items() for n in items}
            placed = [(i, n, t, moved.get(n, f)) for i, n, t, f in placed]
            extra = carried(records, fields)
        for file, tensors in files.items():
            if not tensors:
                continue
            layout = tensorfile.plan(tensors)
            # stable: CPU memory nobody changes while this runs (training waits for a blocking save; a
            # background save writes from its own copy)
            record = self.staging.write(file, tensorfile.chunks(layout, tensors), stable=True, size_hint=layout.size)
            extra[file] = {"record": dataclasses.astuple(record)}
        self.own = own_files(extra)
        results = []
        for item, name, tensor, file in placed:  # the first result of each file carries what is known of it
            results.append(WriteResult(index=item.index, size_in_bytes=tensor.nbytes,
                                       storage_data={"file": file, "entry": name, **extra.pop(file, {})}))
        future: Future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage, shards, prints, shares = {}, [], {}, {}
        for rank_results in results:
            for result in rank_results:
                data = result.storage_data
                storage[result.index] = {"file": data["file"], "entry": data["entry"]}
                collect(data, shards, prints, shares)
        metadata.storage_data = storage
        self.finish_data(metadata_to_json(metadata), shards, manifest_fields(prints, shares, [r.name for r in shards]))
        # DCP broadcasts what finish was given to every rank once it returns: every rank's chunk of every item,
        # O(N) bytes per rank (hundreds of MB at thousands of ranks) that no rank reads. It is written: drop it.
        metadata.state_dict_metadata, metadata.storage_data, metadata.planner_data = {}, None, None

    def finish_data(self, data: bytes, shards: list[FileRecord], fields: dict) -> None:
        """Rank 0: DCP's metadata (``data``, listed or by rule) written, then every file's record (the per-rank
        files each rank gave, ``shards``, the metadata) handed to the commit."""
        missing = [r for r in range(self.world_size) if r not in self.plan_files]
        if missing:
            raise TrainStateError(f"no file records from ranks {missing}")
        records = [f for r in range(self.world_size) for f in self.plan_files[r]] + shards
        records.append(self.staging.write(DCP_METADATA, [data]))
        self.on_finish(data, records, fields)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


# reading -----------------------------------------------------------------------------------------------
class Reader(StorageReader):
    """Reads DCP items from a generation's shard files, through ``store`` (files held open).

    With ``manifest`` (a local generation whose shards carry chunk digests), the
    shards are verified while they are read, in one pass: every 4 MiB chunk is
    digested and compared with the manifest before any of its bytes reaches a
    tensor (:mod:`trainstate.storage.chunked`). A file this rank loads whole,
    each entry into a live tensor of its shape, is read straight into those
    tensors on every core; any other is read entry by entry from verified
    chunks into fresh tensors, then copied. A chunk that does not match raises
    :class:`CorruptGeneration`; ``progress.live_changed`` then says whether live
    tensors already hold verified bytes of it. Without ``manifest`` the bytes
    were verified before (fetched from an object store or from peers); with
    ``only``, just those files are verified here (a tiered restore's shards
    that its node's disk serves), the rest were.
    """

    def __init__(self, store: Any, generation: str, metadata: Metadata, sizes: dict[str, int],
                 manifest: Any = None, progress: Any = None, only: frozenset[str] | None = None):
        self.store, self.generation, self.metadata, self.sizes = store, generation, metadata, sizes
        self.manifest, self.progress, self.only = manifest, progress, only  # only: the files verified here

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: Any) -> Future[None]:
        by_file: dict[str, dict[str, list]] = {}
        metadata = getattr(planner, "metadata", None) or self.metadata  # (by rule: the planner's view of it)
        for request in plan.items:
            info = metadata.storage_data.get(request.storage_index)
            if info is None:
                raise CorruptGeneration(self.generation, f"no stored item for {request.storage_index.fqn!r:.80}")
            by_file.setdefault(info["file"], {}).setdefault(info["entry"], []).append(request)
        for file, entries in by_file.items():
            where = f"{self.generation}/{file}"
            verify = self.manifest is not None and (self.only is None or file in self.only)
            record = self.manifest.file(file) if verify else None
            if record is not None and record.chunks:
                self._read_verified(file, record, entries, planner, where)
                continue
            with self.store.open(self.generation, file) as stream:
                layout = tensorfile.parse_header(stream, self.sizes[file], where)
                index = {e.name: e for e in layout.entries}
                for name, requests in entries.items():
                    if name not in index:
                        raise CorruptGeneration(where, f"has no entry {name!r:.80}")
                    target = _whole_target(index[name], requests, planner)
                    if target is not None:  # verified already: straight into the live tensor, one copy
                        tensorfile.read_tensor_into(stream, layout, index[name], where, target)
                        planner.commit_tensor(requests[0], target)
                        continue
                    tensor = tensorfile.read_tensor(stream, layout, index[name], where)
                    for request in requests:
                        self._deliver(request, tensor, planner, where)
        future: Future = Future()
        future.set_result(None)
        return future

    def _read_verified(self, file: str, record: FileRecord, entries: dict[str, list], planner: Any,
                       where: str) -> None:
        """One shard file, each chunk verified before its bytes are used (see the class docstring)."""
        algorithm = self.manifest.digest_algorithm
        with self.store.open(self.generation, file) as stream:
            layout = chunked._held_header(self.store, stream, self.manifest, file)
        index = {e.name: e for e in layout.entries}
        missing = sorted(set(entries) - set(index))
        if missing:
            raise CorruptGeneration(where, f"has no entry {missing[0]!r:.80}")
        into = _whole_targets(index, entries, planner) if len(entries) == len(index) else None
        if into is not None:  # the whole file, entry by entry into live tensors: read once, on every core
            tensors: dict[str, torch.Tensor] = {}
            chunked.read_file(self.store, self.manifest, file, set(entries), tensors, into=into,
                              progress=self.progress)
            for name, (request,) in entries.items():
                if tensors[name] is into[name]:
                    planner.commit_tensor(request, into[name])
                else:  # did not fit (a non-contiguous target, say): landed in a fresh tensor
                    self._deliver(request, tensors[name], planner, where)
            return
        seen: dict[int, bytes] = {}  # verified chunks, kept only while an entry still needs them
        with self.store.open(self.generation, file) as stream:
            for name in sorted(entries, key=lambda n: index[n].begin):
                entry = index[name]
                begin, end = layout.data_start + entry.begin, layout.data_start + entry.end
                for old in [i for i in seen if i < begin // CHUNK_BYTES]:
                    del seen[old]
                data = chunked.verified_range(stream, record, begin, end, where, algorithm, seen) if end > begin \
                    else b""
                raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0,
                                                                                                   dtype=torch.uint8)
                tensor = raw.view(entry.dtype).reshape(entry.shape)
                for request in entries[name]:
                    self._deliver(request, tensor, planner, where)

    @staticmethod
    def _deliver(request: Any, tensor: torch.Tensor, planner: Any, where: str) -> None:
        if request.type == LoadItemType.BYTE_IO:
            planner.load_bytes(request, io.BytesIO(tensor.numpy().tobytes()))
            return
        source = narrow_tensor_by_index(tensor, request.storage_offsets, request.lengths)
        target = planner.resolve_tensor(request).detach()
        if target.size() != source.size() or target.dtype != source.dtype:
            raise CorruptGeneration(where, f"{request.storage_index.fqn!r:.80}: stored {tuple(source.shape)} "
                                           f"{source.dtype}, expected {tuple(target.shape)} {target.dtype}")
        target.copy_(source)
        planner.commit_tensor(request, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def _whole_request(entry: Any, requests: list) -> Any:
    """The one tensor request that reads ``entry`` whole, or None."""
    if len(requests) != 1 or requests[0].type == LoadItemType.BYTE_IO or any(requests[0].storage_offsets):
        return None
    return requests[0] if tuple(requests[0].lengths) == tuple(entry.shape) else None


def _whole_targets(index: dict[str, Any], entries: dict[str, list], planner: Any) -> dict[str, torch.Tensor] | None:
    """Each entry's live destination, when every entry is read whole by exactly one tensor request; else None."""
    into = {}
    for name, requests in entries.items():
        request = _whole_request(index[name], requests)
        if request is None:
            return None
        into[name] = planner.resolve_tensor(request).detach()
    return into


def _whole_target(entry: Any, requests: list, planner: Any) -> torch.Tensor | None:
    """The live tensor one request reads ``entry`` whole into, if it can take the bytes directly (contiguous,
    on the CPU, of the entry's dtype and shape)."""
    request = _whole_request(entry, requests)
    if request is None:
        return None
    target = planner.resolve_tensor(request).detach()
    return target if chunked.fits(target, entry) else None
