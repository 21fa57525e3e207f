"""``trainstate diff`` on multi-rank generations: every rank's own record and the sharded state.

A multi-rank generation keeps three kinds of state (see
:mod:`trainstate.distributed.capture`): the global ``state.json`` (compared by
:mod:`trainstate.tools.diff` as for one process), each rank's
``rank-NNNNN.json`` with its tensors (RNG streams, a loader's position, rank
counters), and the modules and optimizers as DCP items spread over the
``shard-NNNNN.safetensors`` files. This module adds the last two:

- rank records become trees keyed ``rank<r>.<name>`` in the categories a
  single-process state would put them in, their tensor references pointing
  into that rank's tensor file;
- each DCP item is compared piece by piece where both generations cut it the
  same way (the same world size and sharding), else assembled into its full
  tensor on each side first; every byte counts, never a tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CorruptGeneration
from ..format import shardrule, tensorfile
from ..format.manifest import MAX_DCP_METADATA_BYTES
from ..storage.verify import read_json_file
from .diffread import Side, TensorDiff, TensorReader, _Accumulator

RANK_PREFIX = "rank-"


@dataclass
class Item:
    """One DCP item of a generation: a tensor cut into pieces (offsets -> stored entry), or bytes."""

    dtype: torch.dtype | None  # None: a bytes item (a non-tensor value, stored encoded)
    size: tuple[int, ...] = ()
    pieces: dict[tuple[int, ...], tuple[tuple[int, ...], str]] = field(default_factory=dict)  # offsets -> sizes, entry


def register(side: Side) -> None:
    """Add every rank file's and shard file's entries to ``side.entries`` as ``<file>/<entry>``."""
    m = side.manifest
    for record in m.files:
        if record.name.endswith(".safetensors") and record.name.startswith((RANK_PREFIX, "shard-")):
            with side.store.open(m.generation, record.name) as stream:
                layout = tensorfile.parse_header(stream, record.size, f"{m.generation}/{record.name}")
            for entry in layout.entries:
                side.entries[f"{record.name}/{entry.name}"] = (record.name, layout, entry)


def rank_records(side: Side) -> dict[int, dict[str, Any]]:
    """Each rank's ``rank-NNNNN.json`` (raw skeleton), by rank."""
    out = {}
    for record in side.manifest.files:
        name = record.name
        if name.startswith(RANK_PREFIX) and name.endswith(".json"):
            raw = read_json_file(side.store, side.manifest, name)
            out[int(raw.get("rank", name[len(RANK_PREFIX):len(RANK_PREFIX) + 5]))] = raw
    return out


def items(side: Side) -> dict[str, Item]:
    """The DCP items, from ``dcp-metadata.json`` (already verified with the rest of the generation)."""
    raw = read_json_file(side.store, side.manifest, "dcp-metadata.json", MAX_DCP_METADATA_BYTES)
    where = f"{side.manifest.generation}/dcp-metadata.json"
    if type(raw) is dict and "rule" in raw:  # written by rule: every piece listed first
        raw = shardrule.explicit(raw, where)
    out: dict[str, Item] = {}
    for fqn, spec in raw["items"].items():
        out[fqn] = Item(None) if spec == {"bytes": True} else Item(
            tensorfile.torch_dtype(spec["dtype"], where), tuple(spec["size"]),
            {tuple(c[0]): (tuple(c[1]), "") for c in spec["chunks"]})
    for fqn, offsets, file, entry in raw["storage"]:
        item = out.get(fqn)
        if item is None:
            raise CorruptGeneration(where, f"storage names an unknown item {fqn!r:.80}")
        key = () if offsets is None else tuple(offsets)
        sizes = item.pieces.get(key, ((), ""))[0]
        item.pieces[key] = (sizes, f"{file}/{entry}")
    return out


def component_kinds(side: Side) -> dict[str, str]:
    """Sharded component name -> ``"module"`` or ``"optimizer"`` (from ``state.json``)."""
    sharded = side.state.get("sharded") or {}
    return {n: d.get("kind", "") for n, d in (sharded.get("components") or {}).items() if type(d) is dict}


def compare_item(reader: TensorReader, fqn: str, a: Item | None, b: Item | None) -> tuple[str, TensorDiff | None]:
    """How item ``fqn`` differs: ``("", None)`` when bitwise equal, else a message and the tensor figures."""
    if a is None or b is None:
        return ("(absent) vs present" if a is None else "present vs (absent)"), None
    if (a.dtype is None) != (b.dtype is None):
        return "a value on one side, a tensor on the other", None
    if a.dtype is None:  # an encoded value: its bytes decide
        got = reader.compare(a.pieces[()][1], b.pieces[()][1])
        return ("" if not got.differing and not got.mismatch else "value differs"), None
    if a.dtype != b.dtype or a.size != b.size:
        return (f"dtype/shape differ: {tensorfile.dtype_name(a.dtype)}{list(a.size)} vs "
                f"{tensorfile.dtype_name(b.dtype)}{list(b.size)}"), None
    if {k: v[0] for k, v in a.pieces.items()} == {k: v[0] for k, v in b.pieces.items()}:
        got = _piecewise(reader, a, b)
    else:  # cut differently (another world size): compare the full tensors
        got = _assembled(reader, a, b)
    if not got.differing:
        return "", got
    numbers = "" if got.max_abs is None else f", max abs diff {got.max_abs:.6g}, max rel {got.max_rel:.6g}"
    return f"{got.differing} of {got.elements} elements differ (first at flat index {got.first_index}){numbers}", got


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _global_index(local: int, offsets: tuple[int, ...], sizes: tuple[int, ...], full: tuple[int, ...]) -> int:
    coords = []
    for s in reversed(sizes):
        coords.append(local % s)
        local //= s
    flat = 0
    for o, c, d in zip(offsets, reversed(coords), full):
        flat = flat * d + o + c
    return flat


def _piecewise(reader: TensorReader, a: Item, b: Item) -> TensorDiff:
    differing, first, max_abs, max_rel = 0, None, None, None
    for offsets, (sizes, entry_a) in sorted(a.pieces.items()):
        got = reader.compare(entry_a, b.pieces[offsets][1])
        if not got.differing:
            continue
        differing += got.differing
        index = _global_index(got.first_index, offsets, sizes, a.size)
        first = index if first is None else min(first, index)
        if got.max_abs is not None:
            max_abs, max_rel = max(max_abs or 0.0, got.max_abs), max(max_rel or 0.0, got.max_rel)
    return TensorDiff(_numel(a.size), differing, first, max_abs, max_rel)


def _full(reader: TensorReader, side: int, item: Item) -> torch.Tensor:
    out = torch.empty(item.size, dtype=item.dtype)
    for offsets, (sizes, entry) in item.pieces.items():
        file, layout, stored = reader.sides[side].entries[entry]
        piece = tensorfile.read_tensor(reader._stream(side, file), layout, stored, entry)
        view = out
        for dim, (o, s) in enumerate(zip(offsets, sizes)):
            view = view.narrow(dim, o, s)
        view.copy_(piece.view(sizes))
    return out


def _assembled(reader: TensorReader, a: Item, b: Item) -> TensorDiff:
    """Both full tensors in memory (one item at a time), compared by their bits."""
    ta, tb = _full(reader, 0, a), _full(reader, 1, b)
    size = ta.element_size()
    acc = _Accumulator(a.dtype, size)
    ba, bb = tensorfile.byte_view(ta).tobytes(), tensorfile.byte_view(tb).tobytes()
    if ba != bb:
        acc.add(ba, bb, 0)
    return TensorDiff(_numel(a.size), acc.differing, acc.first, acc.max_abs, acc.max_rel)
