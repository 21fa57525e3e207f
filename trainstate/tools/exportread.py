"""Reading a generation for export: one output tensor at a time, from single-process and multi-rank generations.

The order of one read:

1. :func:`open_source` resolves the source (a generation directory, a run
   directory's recovery point, or either as an object-store URL) and opens it
   through :class:`~trainstate.restore.HeldFiles`: every file stays open, so
   what is read later is what the verifying pass checked, even if a prune
   removes the generation meanwhile (an object is downloaded once, pinned to
   its ETag, into a temporary local file that both passes read).
2. The generation is verified completely (manifest and signature, file set,
   sizes, every file's digest), in one streaming pass that keeps no large
   tensor.
3. The component's tensors are *planned* from headers alone: for a
   single-process generation, each state-dict key's entry in the tensor file;
   for a multi-rank one, DCP's metadata (``dcp-metadata.json``) says which
   piece of which full tensor each rank's shard file holds. Ties come from the
   generation itself: two keys referring to one stored tensor, or, for a
   multi-rank generation, the ``architecture.<component>`` contract field,
   which records the module's state-dict order and its ties.
4. :meth:`Source.read` assembles one full tensor from its pieces, read
   straight into place: no process holds the model, and no process group is
   needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CorruptGeneration, InvalidArgument, NoValidGeneration, StateMismatch
from ..format import shardrule, signing, tensorfile
from ..format.manifest import MANIFEST, MAX_DCP_METADATA_BYTES, Manifest, parse_generation_name
from ..format.signing import SigningKey
from ..lifecycle.candidates import recovery_point
from ..restore import HeldFiles
from ..storage.locate import open_existing, open_store, split_generation
from ..storage.objectclient import is_url
from ..storage.verify import read_json_file, read_layouts, read_state_json, verify_generation

DCP_METADATA = "dcp-metadata.json"  # trainstate.distributed.storage.DCP_METADATA (imported lazily there)
CHUNK_BYTES = 16 << 20  # what one read holds: the export's memory is a few of these, not a tensor
_WRAPPERS = ("_orig_mod.", "module.")  # torch.compile and DDP: DCP's keys lack them, module.state_dict() has them


def _strip(key: str) -> str:
    while key.startswith(_WRAPPERS):
        key = key.split(".", 1)[1]
    return key


@dataclass(frozen=True)
class Piece:
    """One stored block of an output tensor: an entry of a tensor file, and where it sits in the full tensor."""

    file: str
    layout: tensorfile.Layout
    entry: tensorfile.Entry
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class Spec:
    """One output tensor: its name, dtype and shape as stored, and the pieces that make it up."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Source:
    """A verified generation open for export: the plan of one component's tensors, read one at a time."""

    store: HeldFiles
    location: str
    manifest: Manifest
    manifest_digest: str
    state: dict[str, Any]
    component: str
    specs: dict[str, Spec] = field(default_factory=dict)  # kept names, in the module's state-dict order
    tied: dict[str, tuple[str, ...]] = field(default_factory=dict)  # kept name -> the names re-tied to it
    conversions: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)  # export mapping

    def read(self, spec: Spec) -> torch.Tensor:
        """The full tensor ``spec`` names, assembled from its pieces (each read straight into place)."""
        out = torch.empty(spec.shape, dtype=spec.dtype)
        for piece in spec.pieces:
            where = f"{self.manifest.generation}/{piece.file}"
            with self.store.open(self.manifest.generation, piece.file) as stream:
                target = out
                for dim, (offset, size) in enumerate(zip(piece.offsets, piece.entry.shape)):
                    if offset or size != out.shape[dim]:
                        target = target.narrow(dim, offset, size)
                if target.is_contiguous():
                    tensorfile.read_tensor_into(stream, piece.layout, piece.entry, where, target)
                else:  # a block that is not a leading-dimension slice: read it, then place it
                    target.copy_(tensorfile.read_tensor(stream, piece.layout, piece.entry, where))
        return out

    def stream(self, spec: Spec, target: torch.dtype, chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
        """The bytes of the full tensor ``spec`` names, as ``target``, in row-major order and bounded chunks.

        When the pieces are slabs along the first dimension (one whole tensor,
        or FSDP's shards), their bytes are the tensor's bytes in order: they are
        read (and cast) a chunk at a time, and the full tensor never exists in
        memory. Other blocks are assembled by :meth:`read` first."""
        pieces = _slabs(spec)
        if pieces is None:
            yield tensorfile.byte_view(self.read(spec).to(target).contiguous())
            return
        step = max(1, chunk_bytes // spec.dtype.itemsize) * spec.dtype.itemsize
        for piece in pieces:
            where = f"{self.manifest.generation}/{piece.file}"
            with self.store.open(self.manifest.generation, piece.file) as stream:
                stream.seek(piece.layout.data_start + piece.entry.begin)
                for done in range(0, piece.entry.nbytes, step):
                    buffer = bytearray(min(step, piece.entry.nbytes - done))
                    view = memoryview(buffer)
                    got = 0
                    while got < len(buffer):
                        n = stream.readinto(view[got:])
                        if not n:
                            raise CorruptGeneration(where, f"file ends inside tensor {piece.entry.name!r:.80}")
                        got += n
                    if target == spec.dtype:
                        yield view
                    else:
                        yield tensorfile.byte_view(torch.frombuffer(buffer, dtype=spec.dtype).to(target))

    def close(self) -> None:
        self.store.close()


def _slabs(spec: Spec) -> list[Piece] | None:
    """The pieces in order when they are consecutive slabs along the first dimension, else ``None``."""
    if not spec.shape:
        return list(spec.pieces) if len(spec.pieces) == 1 else None
    pieces = sorted(spec.pieces, key=lambda p: p.offsets[0])
    row = 0
    for piece in pieces:
        if piece.offsets[0] != row or any(piece.offsets[1:]) or piece.entry.shape[1:] != spec.shape[1:]:
            return None
        row += piece.entry.shape[0]
    return pieces if row == spec.shape[0] else None


def open_source(source: str | Path, component: str, key: SigningKey | bytes | str | None = None,
                storage_options: dict[str, Any] | None = None) -> Source:
    """Resolve, open (held), verify every digest, and plan ``component``'s tensors (see the module docstring).
    ``storage_options`` (endpoint, region, keys...) apply to an object-store URL; without them the
    environment's are used."""
    store, name = _resolve(source, storage_options)
    held = HeldFiles(store, spool=True)  # from a URL: each file downloaded once, verified and read locally
    try:
        key = signing.resolve(key, None if is_url(store.location) else store.location)
        if name is None:
            name = recovery_point(held, key)
            if name is None:
                raise NoValidGeneration(str(source), [])
        verified = verify_generation(held, name, content=True, key=key)
        state = read_state_json(held, verified.manifest)
        out = Source(held, store.location, verified.manifest, verified.manifest_digest, state, component)
        sharded = (state.get("sharded") or {}).get("components", {})
        if component in sharded:
            if sharded[component].get("kind") != "module":
                raise InvalidArgument(f"component {component!r} of {name} is an optimizer; export a module")
            _plan_sharded(out)
        elif component in state["components"]:
            _plan_single(out)
        else:
            found = sorted(set(state["components"]) | {n for n, d in sharded.items() if d.get("kind") == "module"})
            raise InvalidArgument(f"{name} has no component {component!r}; it has {', '.join(found) or 'none'}: "
                                  "pass component=... (--component)")
        return out
    except BaseException:
        held.close()
        raise


def _resolve(source: str | Path, storage_options: dict[str, Any] | None) -> tuple[Any, str | None]:
    text = str(source)
    if is_url(text):
        run, generation = split_generation(text)
        return open_store(run, storage_options=storage_options), generation
    if storage_options:
        raise InvalidArgument(f"storage_options apply to object-store URLs (s3://, gs://, az://); {text} is local")
    path = Path(text)
    if parse_generation_name(path.name) and (path / MANIFEST).exists():
        return open_existing(str(path.parent)), path.name
    return open_existing(text), None


def _refuse_non_tensors(name: str, component: str, keys: list[str]) -> None:
    if keys:
        raise StateMismatch(f"component {component!r} in {name} holds entries that are not tensors "
                            f"({', '.join(map(str, sorted(keys)[:10]))}); safetensors stores tensors only. Export a "
                            "module's parameters and buffers")


def _kept(groups: list[list[str]]) -> dict[str, tuple[str, ...]]:
    """Each group of names sharing one tensor, stored once under the name ``safetensors.torch.save_model``
    keeps (the first in sorted order), the others re-tied to it on load."""
    return {sorted(g)[0]: tuple(sorted(g)[1:]) for g in groups if len(g) > 1}


def _plan_single(src: Source) -> None:
    """A single-process generation (or a component every rank held whole): each key's entry in a tensor file."""
    name = src.manifest.generation
    saved = src.state["components"][src.component]["state"]
    if type(saved) is dict and set(saved) == {"$odict"}:
        saved = saved["$odict"]
    if type(saved) is not dict:
        raise StateMismatch(f"component {src.component!r} in {name} is not a module's state dict")
    refs = {key: value["$t"] for key, value in saved.items()
            if type(value) is dict and set(value) == {"$t"} and type(value["$t"]) is str}
    _refuse_non_tensors(name, src.component, [k for k in saved if k not in refs])
    entries = {}
    for file, layout in read_layouts(src.store, src.manifest).items():
        entries.update({e.name: (file, layout, e) for e in layout.entries})
    by_ref: dict[str, list[str]] = {}
    for key, ref in refs.items():
        if ref not in entries:
            raise CorruptGeneration(f"{name}/state.json", f"refers to tensor {ref!r:.80}, which no file holds")
        by_ref.setdefault(ref, []).append(key)
    src.tied = _kept(list(by_ref.values()))
    aliases = {n for names in src.tied.values() for n in names}
    for key, ref in refs.items():
        if key in aliases:
            continue
        file, layout, entry = entries[ref]
        src.specs[key] = Spec(key, entry.dtype, entry.shape, (Piece(file, layout, entry, (0,) * len(entry.shape)),))


@dataclass(frozen=True)
class _Item:
    """One entry of DCP's metadata: its state-dict path, and for a tensor its dtype, size and stored chunks."""

    path: tuple
    dtype: torch.dtype | None  # None: a non-tensor item
    size: tuple[int, ...] = ()
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...], str, str], ...] = ()  # offsets, sizes, file, entry


def dcp_items(raw: Any, where: str, files: set[str]) -> dict[str, _Item]:
    """DCP's metadata as trainstate writes it (``dcp-metadata.json``, see
    :func:`trainstate.distributed.storage.metadata_to_json`), parsed strictly without importing
    ``torch.distributed.checkpoint`` (an export needs none of it)."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CorruptGeneration(where, what)

    def ints(value: Any, n: int) -> bool:
        return type(value) is list and len(value) == n and all(type(v) is int and v >= 0 for v in value)

    if type(raw) is dict and "rule" in raw:  # written by rule: every chunk listed first
        raw = shardrule.explicit(raw, where)
    need(type(raw) is dict and set(raw) == {"format", "version", "items", "planner_data", "storage"}
         and raw["format"] == "trainstate-dcp-metadata" and type(raw["items"]) is dict
         and type(raw["planner_data"]) is dict and type(raw["storage"]) is list, "not trainstate DCP metadata")
    stored: dict[tuple[str, tuple], tuple[str, str]] = {}
    for record in raw["storage"]:
        need(type(record) is list and len(record) == 4 and type(record[0]) is str and record[2] in files
             and type(record[3]) is str and (record[1] is None or type(record[1]) is list),
             f"malformed storage record {record!r:.120}")
        stored[record[0], tuple(record[1] or ())] = (record[2], record[3])
    items = {}
    for fqn, item in raw["items"].items():
        path = raw["planner_data"].get(fqn, fqn.split(".", 1))
        need(type(path) is list and path and all(type(p) in (str, int) for p in path), f"malformed path {fqn!r:.80}")
        if item == {"bytes": True}:
            items[fqn] = _Item(tuple(path), None)
            continue
        need(type(item) is dict and set(item) == {"dtype", "requires_grad", "size", "chunks"}
             and type(item["size"]) is list and type(item["chunks"]) is list, f"malformed item {fqn!r:.80}")
        size = item["size"]
        need(ints(size, len(size)), f"malformed size of {fqn!r:.80}")
        chunks = []
        for chunk in item["chunks"]:
            need(type(chunk) is list and len(chunk) == 2 and ints(chunk[0], len(size)) and ints(chunk[1], len(size))
                 and all(o + n <= d for o, n, d in zip(chunk[0], chunk[1], size)), f"malformed chunk of {fqn!r:.80}")
            found = stored.get((fqn, tuple(chunk[0])))
            need(found is not None, f"no stored piece of {fqn!r:.80} at {chunk[0]}")
            chunks.append((tuple(chunk[0]), tuple(chunk[1]), *found))
        items[fqn] = _Item(tuple(path), tensorfile.torch_dtype(item["dtype"], where), tuple(size), tuple(chunks))
    return items


def _plan_sharded(src: Source) -> None:
    """A multi-rank generation: DCP's metadata names the pieces of every full tensor in the rank shard files."""
    manifest, name = src.manifest, src.manifest.generation
    where = f"{name}/{DCP_METADATA}"
    shards = {f.name for f in manifest.files if f.name.startswith("shard-")}
    items = dcp_items(read_json_file(src.store, manifest, DCP_METADATA, MAX_DCP_METADATA_BYTES), where, shards)
    layouts: dict[str, tuple[tensorfile.Layout, dict[str, tensorfile.Entry]]] = {}
    planned: dict[str, Spec] = {}
    others = []
    for fqn, item in items.items():
        if item.path[0] != src.component:
            continue
        key = ".".join(map(str, item.path[1:]))
        if item.dtype is None:
            others.append(key)
            continue
        pieces = []
        for offsets, sizes, file, entry_name in item.chunks:
            if file not in layouts:
                with src.store.open(name, file) as stream:
                    layout = tensorfile.parse_header(stream, manifest.file(file).size, f"{name}/{file}")
                layouts[file] = layout, {e.name: e for e in layout.entries}
            layout, entries = layouts[file]
            entry = entries.get(entry_name)
            if entry is None or entry.dtype != item.dtype or entry.shape != sizes:
                raise CorruptGeneration(f"{name}/{file}", f"holds no {item.dtype} piece {list(sizes)} of {fqn!r:.80}")
            pieces.append(Piece(file, layout, entry, offsets))
        if sum(math.prod(p.entry.shape) for p in pieces) != math.prod(item.size):
            raise CorruptGeneration(where, f"the pieces of {fqn!r:.80} do not cover it")
        planned[key] = Spec(key, item.dtype, item.size, tuple(pieces))
    _refuse_non_tensors(name, src.component, others)
    order, groups = _architecture(src.state, src.component, planned)
    src.tied = _kept(groups)
    for kept, aliases in src.tied.items():  # the tensor is stored under any of its names
        if kept not in planned:
            present = [a for a in aliases if a in planned]
            if not present:
                raise CorruptGeneration(f"{name}/{DCP_METADATA}", f"stores none of {[kept, *aliases]}")
            stored = planned[present[0]]
            planned[kept] = Spec(kept, stored.dtype, stored.shape, stored.pieces)
    dropped = {a for aliases in src.tied.values() for a in aliases}
    for key in order:
        if key in planned and key not in dropped:
            src.specs[key] = planned[key]


def _architecture(state: dict[str, Any], component: str, planned: dict[str, Spec]
                  ) -> tuple[list[str], list[list[str]]]:
    """The module's state-dict order and its tie groups, from the ``architecture.<component>`` contract field
    (names as ``module.state_dict()`` gave them: a DDP ``module.`` or compile ``_orig_mod.`` prefix, which
    DCP's keys lack, is removed). Keys the field does not list follow in sorted order, untied."""
    entries = state["contract"]["fields"].get(f"architecture.{component}")
    order: list[str] = []
    first: dict[str, list[str]] = {}
    if type(entries) is list:
        for entry in entries:
            if type(entry) is not list or not entry or type(entry[0]) is not str:
                continue
            key = entry[0] if entry[0] in planned else _strip(entry[0])
            order.append(key)
            tied_to = entry[3] if len(entry) == 4 and type(entry[3]) is str else None
            if tied_to is not None:
                target = tied_to if tied_to in planned else _strip(tied_to)
                first.setdefault(target, [target]).append(key)
    listed = set(order)
    order += sorted(k for k in planned if k not in listed)
    return order, list(first.values())
