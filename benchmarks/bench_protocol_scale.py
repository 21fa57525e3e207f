"""Rank 0's part (and one other rank's) of a multi-rank save and restore, simulated at many ranks (issue 50).

    python benchmarks/bench_protocol_scale.py --ranks 256,1024,2048 --out a.json            # 7B, about 8 min
    python benchmarks/bench_protocol_scale.py --ranks 1024,8192 --model 7b-8l --out b.json   # 7B's first 8 layers
    python benchmarks/bench_protocol_scale.py --ranks 256,1024 --dcp   # and what DCP's own rounds would cost

(7B at 8,192 ranks needs about 23 GB on rank 0, more than this 24 GiB machine gives one process; its first 8
layers hold 1/3.88 of its items, and every cost of rank 0's that grows with the items is a sum over keys.)

No process group: the functions rank 0 (and rank 1) run in a save and at restore are called directly, with
every other rank's contribution generated. The state is an FSDP2 Llama-2-7B (32 layers, dim 4096, ffn 11008,
vocab 32000, untied output; fp32 parameters) with AdamW, each parameter ``Shard(0)`` over a 1-D mesh of N
ranks: each rank's local shape and offset come from torch's own ``_compute_local_shape_and_global_offset``
(``ceil(dim0 / N)`` rows, the last ranks fewer or none), DCP keys as ``get_model_state_dict`` /
``get_optimizer_state_dict`` name them under trainstate's component names (``model.<fqn>``,
``optim.state.<fqn>.exp_avg``, ``optim.state.<fqn>.step``, ``optim.param_groups.0.lr``...; the test checks
names, shapes and item kinds against torch's API on a small model of the same layout). Each rank's SavePlan is
what ``create_default_local_save_plan`` makes of that (a SHARD item per DTensor, a TENSOR item per 0-d
``step``, a BYTE_IO item per param-group value). Rank 0's and rank 1's ``rank-XXXXX`` records are written for
real (this process's RNG streams); the others' are generated with their sizes. File records carry a 64-hex
``blake3-chunked`` digest per 4 MiB of the file.

The save goes through ``trainstate.distributed.saveplan`` (DCP's planning without its rounds): every rank
writes the items its rule gives it (here: its own chunk of every parameter and moment; the small replicated
items, rank 0), describes them (``saveplan.describe``), and one gather brings every description to rank 0,
which builds DCP's ``Metadata`` (``saveplan.finish``) and runs ``Writer.finish``. Measured (CPU seconds by
``time.process_time``; peak memory as the rise of the process's peak RSS over its RSS before the phase, reset
through ``/proc/self/clear_refs``, or ``--memory tracemalloc``); each N in a fresh process, the restore in
another:

- ``rank_piece`` (rank 1, as every rank): ``saveplan.assign_replicated`` and its piece described and encoded;
  ``traffic``: what a rank sends (its piece padded to the largest, after the all-reduce of that size) and
  receives in the write round (that size, the outcome's broadcast frame), what rank 0 gathers;
- ``gather_decode`` (rank 0): every piece's JSON decoded, as ``Ranks.gather`` does;
- ``finish`` (rank 0): ``saveplan.finish`` (``metadata_build``: DCP's ``Metadata`` and WriteResults from the
  pieces, checked) and ``Writer.finish`` against a real ``LocalStore`` staging in ``workdir``, whose
  ``on_finish`` does what ``commit._write``'s callback does: ``build_manifest``, ``to_bytes``, the manifest
  written, the commit. Split: ``metadata_to_json``, the dcp-metadata write, ``build_manifest``, ``to_bytes``;
- ``restore_parse`` (every rank): ``read_manifest``, ``read_json_file`` of dcp-metadata.json as ``load._read``
  reads it (over ``MAX_JSON_BYTES`` it refuses: recorded, then the strict parse is measured anyway, up to
  ``PARSE_BYTES``), ``metadata_from_json``; ``load_plan``: rank 1's ``create_default_local_load_plan`` against
  a state dict of its shapes (stand-ins answering ``size()`` and ``__create_chunk_list__`` as its DTensors
  do); ``reshard_lookups``: the manifest lookups of every rank's two records, as a restore at another world
  size makes them (``load._read`` through ``verify.read_json_file`` / ``read_tensors``).

``--dcp`` adds what ``dcp.save``'s own rounds (trainstate's save path before ``saveplan``) would cost rank 0:
every rank's plan gathered and unpickled (estimated from a sample of plans rebuilt object by object, as a rank
pickles them: :func:`faithful`), ``SavePlanner().create_global_plan`` (dedup, metadata), its
``_validate_global_plan`` apart (every key up to 1,024 ranks, above that one key per kind times the keys of that
kind), every central plan pickled for the scatter (estimated), and the ``Metadata`` it broadcasts to every rank.
The plans stand in for N ranks: built cheaply, they share the objects that are equal (boxes, tensor properties,
the flatten mapping).

``simulate(n, workdir)`` returns everything as a dict (the test at CI size: ``tests/test_protocol_scale.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import dataclasses
import gc
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainstate.distributed import commit as commit_mod  # noqa: E402
from trainstate.distributed import group as group_mod  # noqa: E402
from trainstate.distributed import saveplan  # noqa: E402
from trainstate.distributed import storage as storage_mod  # noqa: E402
from trainstate.distributed.increments import shard_file  # noqa: E402
from trainstate.distributed.planner import SavePlanner, encode_item  # noqa: E402
from trainstate.format import strictjson, tensorfile  # noqa: E402
from trainstate.format.codec import TensorTable, encode  # noqa: E402
from trainstate.format.digest import CHUNKED, chunk_count, chunked_top  # noqa: E402
from trainstate.format.manifest import (FORMAT_VERSION, MANIFEST, MAX_JSON_BYTES, STATE, FileRecord,  # noqa: E402
                                        generation_name)
from trainstate.publish import TENSORS, Pending  # noqa: E402
from trainstate.state import rng as rng_mod  # noqa: E402
from trainstate.state.snapshot import state_json  # noqa: E402
from trainstate.storage.local import LocalStore  # noqa: E402
from trainstate.storage.verify import read_json_file, read_manifest  # noqa: E402
from trainstate.version import __version__  # noqa: E402

MIB = 1 << 20
MODELS = {  # layers, dim, ffn hidden, vocab (tied=False: output is its own parameter)
    "7b": (32, 4096, 11008, 32000),
    "13b": (40, 5120, 13824, 32000),
    "70b-mha": (80, 8192, 28672, 32000),  # Llama-2-70B's sizes with full attention heads (no GQA): an upper bound
    "7b-8l": (8, 4096, 11008, 32000),  # 7B's first 8 layers: a quarter of its items, where 7B's memory won't fit
    "tiny": (2, 8, 16, 32),  # the same names and layout, for checking them against torch's state-dict API
}
MODEL, OPTIM = "model", "optim"  # the TrainState component names (the first level of DCP keys)
DTYPE, ELEMENT = torch.float32, 4  # FSDP2 keeps sharded parameters and AdamW state in fp32
PROPS = TensorProperties(dtype=DTYPE)
ADAMW_GROUP = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
               "decoupled_weight_decay": True}
PARSE_BYTES = 600 << 20  # a dcp-metadata.json larger than this is not parsed at restore here (memory)
PARSE_PEAK_PER_BYTE = 9.5  # restore parse peak / dcp-metadata.json bytes, measured at 256 and 1,024 ranks
SAMPLE = 8  # ranks whose plans are pickled and unpickled to estimate what rank 0's gather holds


# the model and its shards -------------------------------------------------------------------------------
def llama_params(model: str = "7b") -> list[tuple[str, tuple[int, ...]]]:
    """``(fqn, shape)`` of every parameter, in ``named_parameters`` order (torchtitan's Llama naming)."""
    layers, dim, ffn, vocab = MODELS[model]
    out = [("tok_embeddings.weight", (vocab, dim))]
    for i in range(layers):
        p = f"layers.{i}."
        out += [(p + "attention.wq.weight", (dim, dim)), (p + "attention.wk.weight", (dim, dim)),
                (p + "attention.wv.weight", (dim, dim)), (p + "attention.wo.weight", (dim, dim)),
                (p + "feed_forward.w1.weight", (ffn, dim)), (p + "feed_forward.w2.weight", (dim, ffn)),
                (p + "feed_forward.w3.weight", (ffn, dim)),
                (p + "attention_norm.weight", (dim,)), (p + "ffn_norm.weight", (dim,))]
    return out + [("norm.weight", (dim,)), ("output.weight", (vocab, dim))]


def shard_chunks(shape: tuple[int, ...], n: int) -> list[ChunkStorageMetadata]:
    """Each rank's box of a ``Shard(0)`` DTensor on a 1-D mesh of ``n``, as DCP's write item records it."""
    out = []
    for rank in range(n):
        sizes, offsets = _compute_local_shape_and_global_offset(shape, (n,), [rank], [Shard(0)])
        out.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    return out


def numel(sizes: Any) -> int:
    return math.prod(sizes) if len(sizes) else 1


def _make(cls: type, **fields: Any) -> Any:
    """A dataclass instance with these fields (given in its fields' order), without its ``__init__`` (MetadataIndex:
    one more ``torch.Size`` copy of the offsets): equal, hashed, pickled and laid out in memory as one built normally.
    Only for the other ranks' plans, which stand in for what rank 0 would unpickle."""
    obj = object.__new__(cls)
    for key, value in fields.items():
        object.__setattr__(obj, key, value)
    return obj


class Spec:
    """What every rank's plan is made of: keys, boxes per shape, param-group bytes."""

    def __init__(self, n: int, model: str):
        self.n, self.model = n, model
        self.params = llama_params(model)
        self.boxes = {shape: shard_chunks(shape, n) for shape in {s for _, s in self.params}}
        self.sizes = {shape: torch.Size(shape) for shape in self.boxes}
        group = dict(ADAMW_GROUP, params=[f for f, _ in self.params])
        self.groups = [(f"{OPTIM}.param_groups.0.{k}", len(encode_item(v, k))) for k, v in group.items()]
        self.step_chunk = ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))
        self.step_size = torch.Size([])
        # the flatten mapping every rank's plan carries as planner_data (identical on every rank: shared here);
        # its keys are the very strings the items are named by, as in a real plan
        self.model_keys = {f: f"{MODEL}.{f}" for f, _ in self.params}
        self.state_keys = {(f, k): f"{OPTIM}.state.{f}.{k}" for f, _ in self.params
                           for k in ("step", "exp_avg", "exp_avg_sq")}
        self.mapping = {key: (MODEL, f) for f, key in self.model_keys.items()}
        self.mapping.update({key: (OPTIM, "state", f, k) for (f, k), key in self.state_keys.items()})
        self.mapping.update({key: (OPTIM, "param_groups", 0, key.rsplit(".", 1)[1]) for key, _ in self.groups})
        # replicated items are equal on every rank: one object each, in every plan
        self.steps = {f: WriteItem(index=MetadataIndex(self.state_keys[f, "step"], self.step_size),
                                   type=WriteItemType.TENSOR,
                                   tensor_data=TensorWriteData(chunk=self.step_chunk, properties=PROPS,
                                                               size=self.step_size))
                      for f, _ in self.params}
        self.group_items = [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k, _ in self.groups]
        self.group_bytes = {k: b for k, b in self.groups}

    def items(self, rank: int) -> list[WriteItem]:
        """Rank ``rank``'s write items, in the flattened state dict's order (objects that are equal on every rank
        are shared: see :func:`faithful` for a plan as a rank would pickle it)."""
        def shard(key: str, shape: tuple) -> WriteItem:
            box = self.boxes[shape][rank]
            return _make(WriteItem, index=_make(MetadataIndex, fqn=key, index=None, offset=torch.Size(box.offsets)),
                         type=WriteItemType.SHARD, bytes_io_data=None,
                         tensor_data=_make(TensorWriteData, chunk=box, properties=PROPS, size=self.sizes[shape]))
        out = [shard(self.model_keys[f], s) for f, s in self.params]
        for f, s in self.params:
            out += [self.steps[f], shard(self.state_keys[f, "exp_avg"], s), shard(self.state_keys[f, "exp_avg_sq"], s)]
        return out + self.group_items

    def nbytes(self, item: WriteItem) -> int:
        if item.type == WriteItemType.BYTE_IO:
            return self.group_bytes[item.index.fqn]
        return numel(item.tensor_data.chunk.sizes) * ELEMENT


def faithful(plan: SavePlan) -> SavePlan:
    """``plan`` with every item's own objects, as a rank builds (and pickles) it: its own boxes, sizes and tensor
    properties per item, names shared with its flatten mapping only. For pickled sizes and unpickling costs."""
    keys = {k: k for k in plan.planner_data or {}}
    items = []
    for item in plan.items:
        index = MetadataIndex(keys.get(item.index.fqn, item.index.fqn), item.index.offset, item.index.index)
        data = item.tensor_data
        if data is not None:
            p = data.properties
            data = TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(data.chunk.offsets),
                                                              torch.Size(data.chunk.sizes)),
                                   properties=TensorProperties(p.dtype, p.layout, p.requires_grad, p.memory_format,
                                                               p.pin_memory),
                                   size=torch.Size(data.size))
        items.append(dataclasses.replace(item, index=index, tensor_data=data))
    mapping = {k: tuple(v) for k, v in (plan.planner_data or {}).items()}
    return dataclasses.replace(plan, items=items, planner_data=mapping, storage_data=copy.deepcopy(plan.storage_data))


def faithful_metadata(metadata: Any) -> Any:
    """DCP's ``Metadata`` with every chunk its own object (the plans here share equal boxes)."""
    items = {}
    for fqn, md in metadata.state_dict_metadata.items():
        chunks = getattr(md, "chunks", None)
        items[fqn] = md if chunks is None else dataclasses.replace(md, chunks=[
            ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in chunks])
    return dataclasses.replace(metadata, state_dict_metadata=items)


# generated file records ---------------------------------------------------------------------------------
class Records:
    """File records with digests as a save makes them (``blake3-chunked``: one 64-hex digest per 4 MiB)."""

    def __init__(self) -> None:
        self._pool = os.urandom(32 * 4096).hex()  # chunk digests are cut from here (distinct per file)
        self._next = 0

    def _digest(self) -> str:
        i = self._next = (self._next + 1) % 4096
        return self._pool[i * 64:(i + 1) * 64]

    def record(self, name: str, size: int) -> FileRecord:
        chunks = tuple(self._digest() for _ in range(chunk_count(size)))
        return FileRecord(name, size, chunked_top(size, chunks, CHUNKED), chunks)


def rank_record_bytes(rank: int, n: int) -> tuple[bytes, dict[str, torch.Tensor]]:
    """A real per-rank record of this process (its RNG streams, no rank-local component): rank-XXXXX.json and
    the tensors of rank-XXXXX.safetensors."""
    table = TensorTable()
    skeleton = {"format": "trainstate-rank", "format_version": FORMAT_VERSION, "rank": rank, "world_size": n,
                "rng": encode(rng_mod.capture({}, include_globals=True), "rng", table), "components": {}}
    return state_json(skeleton), table.tensors


def staged_rank_files(staging: Any, rank: int, n: int) -> list[FileRecord]:
    """``commit.stage_records`` for one rank, written for real into ``staging``."""
    data, tensors = rank_record_bytes(rank, n)
    layout = tensorfile.plan(tensors)
    records = [staging.write(commit_mod.rank_tensors(rank), tensorfile.chunks(layout, tensors), size_hint=layout.size),
               staging.write(commit_mod.rank_json(rank), [data])]
    if rank == 0:
        records.append(staging.write(STATE, [state_json(global_skeleton(n))]))
        records.append(staging.write(TENSORS, tensorfile.chunks(tensorfile.plan({}), {})))
    return records


def global_skeleton(n: int) -> dict:
    """A small real ``state.json`` skeleton (what ``build_manifest`` reads of it: the contract)."""
    return {"format": "trainstate-state", "format_version": FORMAT_VERSION, "kind": "full",
            "clocks": {"next_update": 1000, "tokens_seen": 0}, "counters": {}, "facts": {}, "components": {},
            "contract": {"fields": {"world_size": n, "model.architecture": "llama2-" + "0" * 56},
                         "versions": {"torch": torch.__version__, "trainstate": __version__}},
            "history": [], "sharded": {"world_size": n, "components": {
                MODEL: {"type": "torch.nn.Module", "kind": "module", "owner": None},
                OPTIM: {"type": "torch.optim.adamw.AdamW", "kind": "optimizer", "owner": MODEL}},
                "settings": "0" * 64, "rank_local": {"components": [], "counters": False, "facts": False,
                                                     "tokens_seen": False}}}


# measurement ----------------------------------------------------------------------------------------------
def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def _trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class Meter:
    """Per-phase CPU seconds, wall seconds and peak memory (MiB above the phase's start)."""

    def __init__(self, memory: str = "rss"):
        if memory == "rss":
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                _rss_kib("VmHWM")
            except OSError:
                memory = "tracemalloc"
        self.memory = memory
        self.phases: dict[str, dict] = {}

    @contextlib.contextmanager
    def phase(self, name: str, **extra: Any):
        _trim()
        if self.memory == "rss":
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak RSS (VmHWM) starts again from the current RSS
            before = _rss_kib("VmRSS")
        else:
            tracemalloc.start()
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0] >> 10
        cpu, wall = time.process_time(), time.perf_counter()
        out = dict(extra)
        try:
            yield out
        finally:
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            if self.memory == "rss":
                peak = _rss_kib("VmHWM") - before
            else:
                peak = (tracemalloc.get_traced_memory()[1] >> 10) - before
                tracemalloc.stop()
            self.phases[name] = {"cpu_s": round(cpu, 4), "wall_s": round(wall, 4), "peak_mib": round(peak / 1024, 1),
                                 "rss_before_mib": round(before / 1024, 1),
                                 **({"hwm_mib": round(_rss_kib("VmHWM") / 1024, 1)} if self.memory == "rss" else {}),
                                 **out}


class Clock:
    """CPU seconds of named sub-steps, by wrapping the callables that do them."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] = round(self.spent.get(name, 0.0) + time.process_time() - start, 4)
        return timed


class _TimedStaging:
    """A staging that times each write by file name (and forwards everything else)."""

    def __init__(self, staging: Any, clock: Clock):
        self._staging, self._clock = staging, clock

    def write(self, file: str, chunks: Any, **kwargs: Any) -> FileRecord:
        return self._clock.wrap(f"write {file}", self._staging.write)(file, chunks, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._staging, name)


class _DTensorLike:
    """What DCP's load planning asks of a DTensor: its global ``size()`` and this rank's box."""

    def __init__(self, size: torch.Size, box: ChunkStorageMetadata):
        self._size, self._box = size, box

    def size(self) -> torch.Size:
        return self._size

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._box]


# the simulation -------------------------------------------------------------------------------------------
def _sample(n: int, other: int, size: int = SAMPLE) -> list[int]:
    """The ranks whose plans are pickled to estimate DCP's rounds: rank 0, ``other``, the last, and ``size`` spread
    over the rest."""
    return sorted({0, other, n - 1, *range(0, n, max(1, n // size))})


def write_results(r: int, items: list[WriteItem], spec: Spec, records: Records,
                  header_per_entry: float) -> list[WriteResult]:
    """Rank ``r``'s WriteResults for the items it writes, as ``Writer.write_data`` returns them: each names its file
    (the small replicated ones in ``shard-r-small``) and entry; the first of each file carries the file's record
    (generated: the items' bytes, the header at ``header_per_entry``, a chunk digest per 4 MiB)."""
    placed, sizes, counts = [], {}, {}
    for item in items:
        nbytes = spec.nbytes(item)
        file = storage_mod.small_file(r) if storage_mod._small_and_replicated(
            item, SimpleNamespace(nbytes=nbytes)) else shard_file(r)
        placed.append((item, nbytes, file))
        sizes[file] = sizes.get(file, 0) + nbytes
        counts[file] = counts.get(file, 0) + 1
    extra = {f: {"record": dataclasses.astuple(records.record(f, sizes[f] + int(header_per_entry * counts[f])))}
             for f in sizes}
    return [WriteResult(index=item.index, size_in_bytes=nbytes, storage_data={
        "file": file, "entry": storage_mod.entry_name(item.index), **extra.pop(file, {})})
        for item, nbytes, file in placed]


def _header_per_entry(items: list[WriteItem]) -> float:
    """The safetensors header bytes per entry of a shard file, from one rank's real layout (meta tensors)."""
    meta = {storage_mod.entry_name(i.index): torch.empty(tuple(i.tensor_data.chunk.sizes), dtype=DTYPE, device="meta")
            for i in items if i.type == WriteItemType.SHARD}
    return tensorfile.plan(meta).data_start / len(meta) if meta else 128.0


def replicated_items(spec: Spec) -> list[WriteItem]:
    """The items every rank holds alike (AdamW's 0-d steps, the param-group values), in plan order."""
    return [spec.steps[f] for f, _ in spec.params] + spec.group_items


def own_items(spec: Spec, r: int, owner: dict) -> list[WriteItem]:
    """``saveplan.own_items``'s rule on a 1-D ``Shard(0)`` mesh: every non-empty DTensor chunk is written by the rank
    holding it (no mesh dimension replicates it; a rank past a tensor's rows writes nothing of it); a replicated
    item by the rank ``saveplan.assign_replicated`` named."""
    items = spec.items(r)
    return [i for i in items if i.type == WriteItemType.SHARD and saveplan._size(i, elements=True)] + [
        i for i in items if i.type != WriteItemType.SHARD and owner[saveplan._key(i)] == r]


def piece(spec: Spec, r: int, owner: dict, records: Records, rank_files: list[FileRecord],
          header_per_entry: float) -> bytes:
    """What rank ``r`` sends rank 0 in ``saveplan.write``'s gather (JSON, as ``Ranks.gather`` encodes it): its
    ``describe`` of the items it wrote, the files' records, its per-rank files."""
    items = own_items(spec, r, owner)
    plan = SavePlan(items, planner_data=spec.mapping)  # (finish_plan: DCP's default planner changes nothing)
    results = write_results(r, items, spec, records, header_per_entry)
    return group_mod._encode({"piece": saveplan.describe(plan, results, rank_files, spec.mapping), "error": ""})


def _rank0_writer(store: Any, staging: Any, name: str, n: int, rank_files: list[FileRecord], clock: Clock,
                  done: dict) -> Any:
    """Rank 0's ``storage.Writer`` into ``staging``, every write timed by ``clock``; its finish builds, encodes and
    writes the manifest and commits, as ``commit._write`` does (the manifest's bytes and files into ``done``)."""
    timed = _TimedStaging(staging, clock)
    pending = Pending(name, "full", 1000, None, {}, {}, {
        "data": {}, "metrics": {}, "retention": {"keep_last": 3, "keep_last_weights": None, "milestone_every": None,
                                                 "best": None},
        "lineage": [["0123456789abcdef", None]], "run": "0" * 32})
    snap = SimpleNamespace(global_skeleton=global_skeleton(n))

    def on_finish(data: bytes, every_file: list[FileRecord], incremental: dict) -> None:  # commit._write's commit
        manifest = clock.wrap("build_manifest", commit_mod.build_manifest)(
            snap, pending, n, store.digest_algorithm, every_file, incremental)
        done["manifest"] = clock.wrap("to_bytes", manifest.to_bytes)(None)
        done["files"] = len(manifest.files)
        timed.write(MANIFEST, [done["manifest"]])
        clock.wrap("commit", staging.commit)()

    return storage_mod.Writer(timed, 0, n, rank_files, on_finish)


def _setting(n: int, workdir: Path, model: str, other: int, out: dict) -> tuple:
    """A save's store and staging under ``workdir``, the model's spec, generated records, and rank 0's and rank
    ``other``'s per-rank files written for real."""
    store = LocalStore(workdir / f"run-{n}", CHUNKED)
    name = generation_name(1000)
    staging = store.begin(name)
    out["store"], out["generation"] = str(store.root), name
    real = {r: staged_rank_files(staging, r, n) for r in sorted({0, other})}
    return store, name, staging, Spec(n, model), Records(), real


def save_side(n: int, workdir: Path, model: str = "7b", memory: str = "rss", other: int = 1) -> dict:
    """Rank 0's part of one save at ``n`` ranks through ``saveplan.write`` (and what rank ``other`` computes, sends
    and receives); writes a real generation under ``workdir``: the manifest, dcp-metadata.json, rank 0's and rank
    ``other``'s records."""
    meter, out = Meter(memory), {"n_ranks": n, "model": model, "memory": memory, "path": "listed"}
    store, name, staging, spec, records, real = _setting(n, workdir, model, other, out)

    # inputs: every rank's piece of the gather, as rank 0 receives them (the other ranks' work, not measured) ----
    start = time.perf_counter()
    tensors_size, json_size = real[other][0].size, real[other][1].size
    replicated = replicated_items(spec)
    owner = saveplan.assign_replicated(replicated, n)
    header = _header_per_entry(own_items(spec, other, owner))
    written = [0] * n
    frames = []
    gc.disable()
    for r in range(n):
        files = real.get(r) or [records.record(commit_mod.rank_tensors(r), tensors_size),
                                records.record(commit_mod.rank_json(r), json_size)]
        frames.append(piece(spec, r, owner, records, files, header))
        written[r] = len(own_items(spec, r, owner)) if r in (0, other) else None
    gc.enable()
    out["inputs"] = {"build_s": round(time.perf_counter() - start, 2), "params": len(spec.params),
                     "items_per_rank": len(spec.items(other)), "items_written_rank0": written[0],
                     "items_written_other": written[other]}

    # a non-zero rank's own share of the round (every rank's): the assignment, its plan described, encoded ------
    with meter.phase("rank_piece") as note:
        cpu = time.process_time()
        mine = saveplan.assign_replicated(replicated, n)
        note["assign_cpu_s"] = round(time.process_time() - cpu, 4)
        cpu = time.process_time()
        sent = piece(spec, other, mine, records, real[other], header)
        note["describe_cpu_s"] = round(time.process_time() - cpu, 4)
    largest = max(len(f) for f in frames)
    out["traffic"] = {
        "piece_bytes_other": len(sent),
        "sent_bytes_per_rank": 5 * 8 + largest + 8,  # the all-reduce (sizes, stamp), then its frame padded
        "received_bytes_per_rank": 5 * 8 + group_mod.ROOM + 8,  # the all-reduce; the outcome's broadcast frame
        "gathered_bytes_rank0": n * (largest + 8)}

    # 1. rank 0 decodes the gather -----------------------------------------------------------------------------
    with meter.phase("gather_decode"):
        every = [json.loads(f.decode()) for f in frames]  # Ranks.gather: _decoded(frame) per rank
    del frames

    # 2. rank 0: DCP's metadata from the pieces (saveplan.finish), then Writer.finish --------------------------
    clock, done = Clock(), {}
    writer0 = _rank0_writer(store, staging, name, n, real[0], clock, done)
    writer_finish = writer0.finish

    def finish(metadata: Any, results: list) -> None:  # what saveplan.finish hands the writer, counted
        done["chunks"] = sum(len(md.chunks) for md in metadata.state_dict_metadata.values() if hasattr(md, "chunks"))
        done["keys"] = len(metadata.state_dict_metadata)
        done["results"] = sum(len(r) for r in results)
        done["distinct"] = len({x.index for r in results for x in r})
        clock.wrap("Writer.finish", writer_finish)(metadata, results)

    writer0.finish = finish
    to_json = storage_mod.metadata_to_json
    storage_mod.metadata_to_json = clock.wrap("metadata_to_json", to_json)
    try:
        with meter.phase("finish") as note:
            cpu = time.process_time()
            saveplan.finish(writer0, [e["piece"] for e in every])
            total = time.process_time() - cpu
    finally:
        storage_mod.metadata_to_json = to_json
    spent = dict(clock.spent)
    meter.phases["finish"].update(spent)
    meter.phases["finish"]["metadata_build"] = round(total - spent["Writer.finish"], 4)
    del every, writer0
    out["counts"] = {"items_written_total": done["results"], "storage_records": done["distinct"],
                     "metadata_keys": done["keys"], "metadata_chunks": done["chunks"]}
    return _written(out, meter, store, name, done, json_size, tensors_size)


def _written(out: dict, meter: Meter, store: Any, name: str, done: dict, json_size: int, tensors_size: int) -> dict:
    """``out`` with the sizes of what rank 0 wrote and its phases (its added time: the decode and the finish)."""
    manifest_bytes = done["manifest"]
    out["sizes"] = {"manifest_bytes": len(manifest_bytes),
                    "dcp_metadata_bytes": os.path.getsize(store.path(name, storage_mod.DCP_METADATA)),
                    "rank_json_bytes": json_size, "rank_tensors_bytes": tensors_size,
                    "manifest_files": done["files"], "manifest_chunk_digests": manifest_bytes.count(b'\n   "')}
    out["phases"] = meter.phases
    out["rank0_added_cpu_s"] = round(meter.phases["gather_decode"]["cpu_s"] + meter.phases["finish"]["cpu_s"], 4)
    return out


def spec_rule(spec: Spec, owner: dict) -> dict:
    """The rule (``format/shardrule.py``) every rank's ``saveplan.rule_of`` gives for this model: each parameter and
    moment ``Shard(0)`` on the 1-D mesh of N, each step counter and param-group value written whole by its owner."""
    items: dict[str, dict] = {}
    for item in spec.items(0):
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            items[fqn] = {"bytes": True, "writer": 0, "small": spec.group_bytes[fqn] <= storage_mod.SMALL_BYTES}
        elif item.type == WriteItemType.SHARD:
            items[fqn] = {"dtype": "float32", "requires_grad": False, "size": list(item.tensor_data.size), "mesh": 0,
                          "placements": [["shard", 0]]}
        else:
            items[fqn] = {"dtype": "float32", "requires_grad": False, "size": [], "writer": owner[saveplan._key(item)],
                          "small": spec.nbytes(item) <= storage_mod.SMALL_BYTES}
    return {"world_size": spec.n, "small_bytes": storage_mod.SMALL_BYTES,
            "meshes": [{"shape": [spec.n], "ranks": list(range(spec.n))}], "items": items}


def rule_piece(rule: dict | None, r: int, results: list[WriteResult], rank_files: list[FileRecord]) -> bytes:
    """What rank ``r`` sends rank 0 when the ranks follow one rule: its files' records (``saveplan.by_rule``; with
    ``rule`` None the piece is built without the check, for the ranks whose work is not measured)."""
    if rule is not None:
        piece_ = saveplan.by_rule(rule, results, rank_files, r)
    else:
        piece_ = {"rule": True, "extra": {x.storage_data["file"]: {"record": list(x.storage_data["record"])}
                                          for x in results if "record" in x.storage_data},
                  "rank_files": [list(dataclasses.astuple(f)) for f in rank_files]}
    return group_mod._encode({"piece": piece_, "error": ""})


def rule_save_side(n: int, workdir: Path, model: str = "7b", memory: str = "rss", other: int = 1) -> dict:
    """Rank 0's part of one save at ``n`` ranks that follow one rule (``saveplan.write``'s agreed path): a few
    hundred bytes gathered from each rank, ``dcp-metadata.json`` written as the rule (``saveplan.finish_by_rule``),
    ``Writer.finish_data`` (the manifest, the commit). And rank ``other``'s own share: the rule's stamp and its
    writes checked against the rule (``saveplan.by_rule``)."""
    meter, out = Meter(memory), {"n_ranks": n, "model": model, "memory": memory, "path": "rule"}
    start = time.perf_counter()
    store, name, staging, spec, records, real = _setting(n, workdir, model, other, out)
    tensors_size, json_size = real[other][0].size, real[other][1].size
    owner = saveplan.assign_replicated(replicated_items(spec), n)
    rule = spec_rule(spec, owner)
    header = _header_per_entry(own_items(spec, other, owner))
    frames, written = [], 0
    gc.disable()
    for r in range(n):
        files = real.get(r) or [records.record(commit_mod.rank_tensors(r), tensors_size),
                                records.record(commit_mod.rank_json(r), json_size)]
        results = write_results(r, own_items(spec, r, owner), spec, records, header)
        written += len(results)
        frames.append(rule_piece(None, r, results, files))
    gc.enable()
    out["inputs"] = {"build_s": round(time.perf_counter() - start, 2), "params": len(spec.params),
                     "items_per_rank": len(spec.items(other))}

    with meter.phase("rank_piece") as note:  # rank `other`: the stamp it sends, its writes checked, encoded
        results = write_results(other, own_items(spec, other, owner), spec, records, header)
        cpu = time.process_time()
        saveplan._stamp(rule)
        note["stamp_cpu_s"] = round(time.process_time() - cpu, 4)
        cpu = time.process_time()
        sent = rule_piece(rule, other, results, real[other])
        note["describe_cpu_s"] = round(time.process_time() - cpu, 4)
    assert json.loads(sent)["piece"].get("rule"), "rank other's writes do not follow the rule"
    largest = max(len(f) for f in frames)
    out["traffic"] = {"piece_bytes_other": len(sent),
                      "sent_bytes_per_rank": 5 * 8 + largest + 8,  # the all-reduce (sizes, stamp), its frame
                      "received_bytes_per_rank": 5 * 8 + group_mod.ROOM + 8,  # the all-reduce; the outcome
                      "gathered_bytes_rank0": n * (largest + 8)}

    with meter.phase("gather_decode"):
        every = [json.loads(f.decode()) for f in frames]
    del frames

    clock, done = Clock(), {}
    writer0 = _rank0_writer(store, staging, name, n, real[0], clock, done)
    with meter.phase("finish") as note:
        cpu = time.process_time()
        with group_mod.paused_gc():
            saveplan.finish_by_rule(writer0, rule, spec.mapping, [e["piece"] for e in every])
        total = time.process_time() - cpu
    spent = dict(clock.spent)
    meter.phases["finish"].update(spent)
    meter.phases["finish"]["metadata_build"] = round(total - sum(spent.values()), 4)
    out["counts"] = {"items_written_total": written, "metadata_keys": len(rule["items"])}
    return _written(out, meter, store, name, done, json_size, tensors_size)


def manifest_only(n: int, model: str = "7b", dcp_bytes: int = 140_000) -> dict:
    """The manifest of a save at ``n`` ranks (its files as ``Writer.finish`` lists them, from generated records:
    what it holds does not depend on DCP's metadata), built and encoded as the commit does: its bytes and CPU
    seconds, for an N where the whole save does not fit in memory here (``dcp_bytes``: dcp-metadata.json's size
    per rank, for its record's chunk digests)."""
    spec, records = Spec(n, model), Records()
    owner = saveplan.assign_replicated(replicated_items(spec), n)
    header = _header_per_entry(own_items(spec, 1 % n, owner))
    every_file = [records.record(STATE, 20000), records.record(TENSORS, 8)]
    shards = []
    for r in range(n):
        every_file += [records.record(commit_mod.rank_tensors(r), 7752), records.record(commit_mod.rank_json(r), 7040)]
        results = write_results(r, own_items(spec, r, owner), spec, records, header)
        shards += [FileRecord(*x.storage_data["record"]) for x in results if "record" in x.storage_data]
    every_file += shards + [records.record(storage_mod.DCP_METADATA, dcp_bytes * n)]
    pending = Pending(generation_name(1000), "full", 1000, None, {}, {}, {
        "data": {}, "metrics": {}, "retention": {}, "lineage": [["0123456789abcdef", None]], "run": "0" * 32})
    cpu = time.process_time()
    manifest = commit_mod.build_manifest(SimpleNamespace(global_skeleton=global_skeleton(n)), pending, n, CHUNKED,
                                         every_file, {})
    built = time.process_time() - cpu
    data = manifest.to_bytes(None)
    return {"n_ranks": n, "model": model, "manifest_bytes": len(data), "files": len(manifest.files),
            "build_manifest_cpu_s": round(built, 4), "to_bytes_cpu_s": round(time.process_time() - cpu - built, 4)}


# DCP's own rounds, for comparison (no longer in trainstate's save path) ------------------------------------
def _validate(meter: Meter, central: list[SavePlan], metadata: Any, full: bool) -> None:
    """DCP's ``_validate_global_plan`` (taken out of ``create_global_plan`` here): every key, or with ``full``
    False one key of each kind (size and number of chunks), its time multiplied by the keys of that kind."""
    groups: dict[tuple, list[str]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        groups.setdefault((tuple(getattr(md, "size", ())), len(getattr(md, "chunks", ()))), []).append(fqn)
    with meter.phase("dcp_validate", sampled=not full) as note:
        total, errors = 0.0, 0
        for keys in groups.values():
            for fqn in keys if full else keys[:1]:
                part = dataclasses.replace(metadata, state_dict_metadata={fqn: metadata.state_dict_metadata[fqn]})
                cpu = time.process_time()
                errors += len(_REAL_VALIDATE(central, part))
                spent = time.process_time() - cpu
                total += spent if full else spent * len(keys)
        note["validate_cpu_s"] = round(total, 3)
        note["errors"] = errors


_REAL_VALIDATE = default_planner._validate_global_plan


def dcp_rounds(n: int, model: str = "7b", memory: str = "rss", other: int = 1, validate: str = "auto",
               sample: int = SAMPLE) -> dict:
    """What ``dcp.save``'s own rounds cost rank 0 (trainstate's save went through them before ``saveplan``): every
    rank's local plan gathered (pickled) and unpickled, ``SavePlanner().create_global_plan`` (dedup, metadata;
    its ``_validate_global_plan`` apart, see :func:`_validate`), every central plan pickled for the scatter."""
    meter, out = Meter(memory), {}
    records = Records()
    gc.disable()
    spec = Spec(n, model)
    files = [records.record(commit_mod.rank_tensors(0), 7752), records.record(commit_mod.rank_json(0), 7040)]
    plans = [storage_mod.Writer(None, r, n, files, None).prepare_local_plan(
        SavePlan(spec.items(r), planner_data=spec.mapping)) for r in range(n)]
    gc.enable()
    ranks = _sample(n, other, sample)
    pickled = {r: pickle.dumps(faithful(plans[r])) for r in ranks}
    _trim()
    tracemalloc.start()
    held = [pickle.loads(pickled[r]) for r in ranks]
    held_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del held
    pickle.loads(pickled[other])  # (the first unpickling imports and caches what the others reuse)
    unpickle_s = 0.0
    gc.disable()  # the least of 3 per plan, without the collector: a lower bound (rank 0's collector walks more)
    for r in ranks:
        least = math.inf
        for _ in range(3):
            cpu = time.process_time()
            pickle.loads(pickled[r])
            least = min(least, time.process_time() - cpu)
        unpickle_s += least / len(ranks)
    gc.enable()
    out["gathered_plans_bytes_est"] = n * max(len(p) for p in pickled.values())  # each padded to the largest
    out["gathered_plans_mib_est"] = round(n * held_bytes / len(ranks) / MIB, 1)
    out["gather_unpickle_s_min"] = round(n * unpickle_s, 3)
    del pickled
    default_planner._validate_global_plan = lambda plan, metadata: []
    try:
        with meter.phase("dcp_global_plan"):
            central, metadata = SavePlanner().create_global_plan(plans)
    finally:
        default_planner._validate_global_plan = _REAL_VALIDATE
    del plans
    _validate(meter, central, metadata, validate == "full" or (validate == "auto" and n <= 1024))
    out["metadata_chunks"] = sum(len(md.chunks) for md in metadata.state_dict_metadata.values()
                                 if hasattr(md, "chunks"))
    counts = [len(p.items) for p in central]
    sizes = {r: len(pickle.dumps(faithful(central[r]))) for r in sorted({*ranks, counts.index(max(counts))})}
    spent = 0.0
    pickle.dumps(faithful(central[other]))  # (warm, as above)
    for r in ranks:  # rank 0 pickles every rank's central plan for the scatter (estimated from the sample)
        plan = faithful(central[r])
        cpu = time.process_time()
        pickle.dumps(plan)
        spent += time.process_time() - cpu
    out["scatter_pickle_s_est"] = round(n * spent / len(ranks), 3)
    out["scatter_bytes_per_rank"] = max(sizes.values())  # every rank's central plan is padded to the largest
    # what all_reduce("write") would broadcast to every rank, had Writer.finish not stripped it
    out["broadcast_metadata_bytes"] = len(pickle.dumps(faithful_metadata(metadata)))
    out["phases"] = meter.phases
    return out


def restore_side(store_root: str, name: str, n: int, model: str = "7b", memory: str = "rss", other: int = 1,
                 max_parse_bytes: int = PARSE_BYTES) -> dict:
    """What rank ``other`` parses of the generation at restore (every rank does the same), and its local load
    plan at the same world size. A dcp-metadata.json over ``max_parse_bytes`` is not parsed (its peak would pass
    this machine's budget): the result says so, with the peak projected from ``PARSE_PEAK_PER_BYTE``."""
    meter, out = Meter(memory), {}
    store = LocalStore(store_root, CHUNKED, create=False)
    refused = None
    size = os.path.getsize(store.path(name, storage_mod.DCP_METADATA))
    parse = size <= max_parse_bytes
    with meter.phase("restore_parse") as note:
        cpu = time.process_time()
        manifest = read_manifest(store, name)[0]
        note["manifest_cpu_s"] = round(time.process_time() - cpu, 4)
        cpu = time.process_time()
        shards = {f.name for f in manifest.files if f.name.startswith("shard-")}
        raw = None
        try:  # as load._read reads it
            raw = read_json_file(store, manifest, storage_mod.DCP_METADATA)
        except Exception as exc:  # noqa: BLE001 - a size limit: recorded, then the parse is measured anyway
            refused = f"{type(exc).__name__}: {exc}"
            if parse:
                raw = strictjson.loads(store.path(name, storage_mod.DCP_METADATA).read_bytes(), "dcp-metadata.json")
        if raw is not None:
            note["json_cpu_s"] = round(time.process_time() - cpu, 4)
            cpu = time.process_time()
            restored = storage_mod.metadata_from_json(raw, "dcp-metadata.json", shards, lazy=True)
            del raw
            note["metadata_cpu_s"] = round(time.process_time() - cpu, 4)
    out["restore_refused"] = refused
    out["max_json_bytes"] = MAX_JSON_BYTES
    out["files_each_rank_opens"] = len(manifest.files)  # load._check_candidate holds every listed file open
    with meter.phase("reshard_lookups"):  # at another world size load._read reads every rank's two records,
        for r in range(n):  # each found in the manifest by verify.read_json_file / read_tensors
            manifest.file(commit_mod.rank_json(r))
            manifest.file(commit_mod.rank_tensors(r))
    if not parse:
        out["restore_parse_skipped"] = (f"dcp-metadata.json is {size:,} bytes, over {max_parse_bytes:,}: its parse "
                                        f"would peak near {PARSE_PEAK_PER_BYTE * size / (1 << 30):.1f} GiB")
        out["phases"] = meter.phases
        return out

    spec = Spec(n, model)
    with meter.phase("load_plan") as note:
        sd: dict[str, Any] = {MODEL: {}, OPTIM: {"state": {}, "param_groups": [
            dict(ADAMW_GROUP, params=[f for f, _ in spec.params])]}}
        for f, s in spec.params:
            box, size = spec.boxes[s][other], spec.sizes[s]
            sd[MODEL][f] = _DTensorLike(size, box)
            sd[OPTIM]["state"][f] = {"step": torch.tensor(1.0), "exp_avg": _DTensorLike(size, box),
                                     "exp_avg_sq": _DTensorLike(size, box)}
        flat, _ = flatten_state_dict(sd)
        if hasattr(restored, "view"):  # by rule: this rank's records listed (planner.LoadPlanner does the same)
            restored = restored.view(flat)
            note["listed_records"] = len(restored.storage_data)
        note["read_items"] = len(create_default_local_load_plan(flat, restored, True).items)
    out["phases"] = meter.phases
    return out


def simulate(n_ranks: int, workdir: Path, model: str = "7b", memory: str = "rss", other: int = 1,
             validate: str = "auto", isolate: bool = False, max_parse_bytes: int = PARSE_BYTES,
             sample: int = SAMPLE, with_dcp: bool = False, path: str = "rule") -> dict:
    """Rank 0's and rank ``other``'s work of one save and one restore at ``n_ranks`` ranks; see the module
    docstring. ``isolate``: the restore side (and DCP's rounds) each in a fresh process (a rank at restore starts
    from nothing; the save side's freed memory does not hide the restore's peak). ``with_dcp``: also what DCP's
    own rounds would cost (:func:`dcp_rounds`; ``validate``: its plan validation on every key ("full"), one per
    kind ("sample") or "auto": every key up to 1,024 ranks; ``sample``: how many ranks' plans are pickled).
    ``path``: "rule" (the ranks follow one rule: ``saveplan``'s agreed path, the default for a non-incremental save)
    or "listed" (every rank's chunks listed: an incremental save, or ranks that hold different structures)."""
    n, workdir = n_ranks, Path(workdir)
    other = min(other, n - 1)
    result = (rule_save_side if path == "rule" else save_side)(n, workdir, model, memory, other)

    def run(what: str, args: list) -> dict:
        if isolate:
            command = [sys.executable, __file__, f"--{what}", json.dumps(args)]
            return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
        return (restore_side if what == "restore-side" else dcp_rounds)(*args)

    restored = run("restore-side", [result["store"], result["generation"], n, model, memory, other, max_parse_bytes])
    result["phases"].update(restored.pop("phases"))
    result.update(restored)
    shutil.rmtree(result.pop("store"), ignore_errors=True)
    if with_dcp:
        compared = run("dcp-rounds", [n, model, memory, other, validate, sample])
        result["phases"].update(compared.pop("phases"))
        result["dcp"] = compared
    return result


# growth ---------------------------------------------------------------------------------------------------
def exponent(n0: int, v0: float, n1: int, v1: float) -> float | None:
    """The growth exponent between two points: 1.0 is linear in N, 2.0 quadratic."""
    if v0 <= 0 or v1 <= 0:
        return None
    return round(math.log(v1 / v0) / math.log(n1 / n0), 2)


def at_most_linear(ns: list[int], values: list[float], slack: float = 1.15) -> bool:
    """Whether ``values`` (at the increasing ``ns``) grow no faster than linearly: each step's ratio is at most
    ``slack`` times the ratio of the Ns."""
    return all(v1 <= slack * v0 * (n1 / n0) for n0, n1, v0, v1 in zip(ns, ns[1:], values, values[1:]))


# the report -----------------------------------------------------------------------------------------------
ROWS = [  # (label, path into the result)
    ("rank 1: assign_replicated CPU s", ("phases", "rank_piece", "assign_cpu_s")),
    ("rank 1: own items described and encoded CPU s", ("phases", "rank_piece", "describe_cpu_s")),
    ("rank 1: the rule's stamp CPU s", ("phases", "rank_piece", "stamp_cpu_s")),
    ("rank 0: gather decoded (json) CPU s", ("phases", "gather_decode", "cpu_s")),
    ("rank 0: gather decoded peak MiB", ("phases", "gather_decode", "peak_mib")),
    ("rank 0: saveplan.finish + Writer.finish CPU s", ("phases", "finish", "cpu_s")),
    ("  saveplan.finish: Metadata from the pieces", ("phases", "finish", "metadata_build")),
    ("  Writer.finish", ("phases", "finish", "Writer.finish")),
    ("    metadata_to_json", ("phases", "finish", "metadata_to_json")),
    ("    write dcp-metadata.json", ("phases", "finish", "write dcp-metadata.json")),
    ("    build_manifest", ("phases", "finish", "build_manifest")),
    ("    Manifest.to_bytes", ("phases", "finish", "to_bytes")),
    ("    commit", ("phases", "finish", "commit")),
    ("    write manifest.json", ("phases", "finish", "write manifest.json")),
    ("rank 0: finish peak MiB", ("phases", "finish", "peak_mib")),
    ("rank 0: added CPU s (decode + finish)", ("rank0_added_cpu_s",)),
    ("restore: parse manifest CPU s", ("phases", "restore_parse", "manifest_cpu_s")),
    ("restore: dcp-metadata JSON CPU s", ("phases", "restore_parse", "json_cpu_s")),
    ("restore: metadata_from_json CPU s", ("phases", "restore_parse", "metadata_cpu_s")),
    ("restore: parse peak MiB", ("phases", "restore_parse", "peak_mib")),
    ("restore: local load plan CPU s", ("phases", "load_plan", "cpu_s")),
    ("restore: records listed for the rank (by rule)", ("phases", "load_plan", "listed_records")),
    ("restore at another world size: every rank's records found in the manifest CPU s",
     ("phases", "reshard_lookups", "cpu_s")),
    ("manifest.json bytes", ("sizes", "manifest_bytes")),
    ("dcp-metadata.json bytes", ("sizes", "dcp_metadata_bytes")),
    ("rank-XXXXX.json bytes", ("sizes", "rank_json_bytes")),
    ("rank-XXXXX.safetensors bytes", ("sizes", "rank_tensors_bytes")),
    ("files in the manifest (each rank opens at restore)", ("sizes", "manifest_files")),
    ("a rank's piece bytes (rank 1)", ("traffic", "piece_bytes_other")),
    ("bytes each rank sends in the write round", ("traffic", "sent_bytes_per_rank")),
    ("bytes each rank receives in the write round", ("traffic", "received_bytes_per_rank")),
    ("bytes rank 0 gathers", ("traffic", "gathered_bytes_rank0")),
    ("items written, all ranks", ("counts", "items_written_total")),
    ("DCP metadata chunks", ("counts", "metadata_chunks")),
    ("DCP: gathered plans unpickled on rank 0 CPU s (est., at least)", ("dcp", "gather_unpickle_s_min")),
    ("DCP: gathered plans on rank 0 MiB (est.)", ("dcp", "gathered_plans_mib_est")),
    ("DCP: create_global_plan CPU s (without validation)", ("phases", "dcp_global_plan", "cpu_s")),
    ("DCP: create_global_plan peak MiB", ("phases", "dcp_global_plan", "peak_mib")),
    ("DCP: _validate_global_plan CPU s", ("phases", "dcp_validate", "validate_cpu_s")),
    ("DCP: scatter pickling CPU s (est.)", ("dcp", "scatter_pickle_s_est")),
    ("DCP: scatter bytes per rank (largest plan)", ("dcp", "scatter_bytes_per_rank")),
    ("DCP: Metadata broadcast bytes per rank (unstripped)", ("dcp", "broadcast_metadata_bytes")),
    ("DCP: metadata chunks (after dedup)", ("dcp", "metadata_chunks")),
]


def _get(result: dict, path: tuple) -> Any:
    for key in path:
        if not isinstance(result, dict) or key not in result:
            return None
        result = result[key]
    return result


def table(results: list[dict]) -> str:
    """One row per figure, one column per N, and the growth exponent between each two Ns (1: linear, 2: N^2)."""
    ns = [r["n_ranks"] for r in results]
    pairs = list(zip(range(len(ns)), range(1, len(ns))))
    head = ["", *(f"N={n:,}" for n in ns)] + [f"exp. {ns[a]:,}->{ns[b]:,}" for a, b in pairs]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for label, path in ROWS:
        values = [_get(r, path) for r in results]
        if all(v is None for v in values):
            continue
        cells = [label] + ["" if v is None else f"{v:,}" if isinstance(v, int) else f"{v:.3g}" for v in values]
        for a, b in pairs:
            ok = all(isinstance(v, (int, float)) for v in (values[a], values[b]))
            e = exponent(ns[a], values[a], ns[b], values[b]) if ok else None
            cells.append("" if e is None else f"{e}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="256,1024", help="comma-separated world sizes")
    parser.add_argument("--model", default="7b", choices=sorted(MODELS))
    parser.add_argument("--memory", default="rss", choices=("rss", "tracemalloc"))
    parser.add_argument("--path", default="rule", choices=("rule", "listed"),
                        help="the save's path: the metadata by rule (default) or listed (incremental saves)")
    parser.add_argument("--dcp", action="store_true", help="also what dcp.save's own rounds would cost rank 0")
    parser.add_argument("--validate", default="auto", choices=("auto", "full", "sample"),
                        help="with --dcp: its plan validation on every key, one key per kind, or every key up to "
                             "1,024 ranks")
    parser.add_argument("--workdir", default=None, help="where the generations are written (default: a temp dir)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one N, JSON on stdout
    parser.add_argument("--restore-side", default=None, help=argparse.SUPPRESS)  # internal
    parser.add_argument("--dcp-rounds", default=None, help=argparse.SUPPRESS)  # internal
    args = parser.parse_args(argv)
    if args.restore_side:
        print(json.dumps(restore_side(*json.loads(args.restore_side))))
        return
    if args.dcp_rounds:
        print(json.dumps(dcp_rounds(*json.loads(args.dcp_rounds))))
        return
    if args.one:
        n, workdir = json.loads(args.one)
        start = time.perf_counter()
        result = simulate(n, Path(workdir), args.model, args.memory, validate=args.validate, isolate=True,
                          with_dcp=args.dcp, path=args.path)
        result["total_wall_s"] = round(time.perf_counter() - start, 1)
        print(json.dumps(result))
        return
    results = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for n in [int(x) for x in args.ranks.split(",")]:  # each N in a fresh process: its own memory and heap
            proc = subprocess.run([sys.executable, __file__, "--one", json.dumps([n, tmp]), "--model", args.model,
                                   "--memory", args.memory, "--validate", args.validate, "--path", args.path]
                                  + (["--dcp"] if args.dcp else []), capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"N={n} failed:\n{proc.stderr[-4000:]}")
            result = json.loads(proc.stdout)
            results.append(result)
            peak = max(p.get("hwm_mib", 0) for p in result["phases"].values())
            print(f"N={n:,}: {result['total_wall_s']} s, peak RSS {peak:,.0f} MiB; rank 0 added "
                  f"{result['rank0_added_cpu_s']} s CPU; manifest {result['sizes']['manifest_bytes']:,} B, "
                  f"dcp-metadata {result['sizes']['dcp_metadata_bytes']:,} B"
                  + (f"; restore refuses: {result['restore_refused']}" if result["restore_refused"] else ""),
                  flush=True)
            if args.out:  # after each N, so a long run keeps what it measured
                Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
