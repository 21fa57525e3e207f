"""DCP's global metadata by rule: which rank wrote which chunk, derived instead of listed.

DCP's metadata lists every rank's chunk of every tensor and where it went: items x N
records (7 M for a 7B model with AdamW at 8,192 ranks), built and written by rank 0 and
read whole by every rank at restore. Yet when every tensor is a DTensor placed by
``Shard``/``Replicate`` on a device mesh, or a value one rank writes for all, each record
follows from the tensor's global shape, its placements and the mesh. A save then writes
the rule (O(items + N)) and a reader derives the records: all of them
(:func:`explicit`, what every older reader of ``dcp-metadata.json`` parses), or only
those a rank's load needs (:func:`overlapping`).

The rule, under ``"rule"`` in ``dcp-metadata.json``::

    {"world_size": N, "small_bytes": S,
     "meshes": [{"shape": [d0, d1, ...], "ranks": [global ranks, row-major]}],
     "items": {fqn: {"dtype", "requires_grad", "size", "mesh": i, "placements": [["shard", dim] | ["replicate"]]}
                  | {"dtype", "requires_grad", "size", "writer": r, "small": bool}
                  | {"bytes": true, "writer": r, "small": bool}}}

A mesh-placed tensor's chunk at a mesh coordinate is torch's even split (``torch.chunk``:
``ceil(n / k)`` rows per piece, the last ones shorter or empty), applied mesh dimension
by mesh dimension in order, as DTensor computes a rank's local shard. It is written by
the rank at that coordinate whose coordinate is 0 on every replicate dimension; an
empty chunk is not written. Its file is ``shard-<writer>-small.safetensors`` when it is
the whole tensor and holds at most ``small_bytes`` bytes, else
``shard-<writer>.safetensors``; its entry ``<fqn>@<offsets>``. Any other item is written
whole by its ``writer`` (entry offsets all 0; ``<fqn>@`` for bytes) into the small file
or the shard file as ``small`` says.

Pure logic, no ``torch.distributed``: :mod:`trainstate.tools.exportread` reads a
generation without it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

from ..errors import CorruptGeneration
from .tensorfile import DTYPES


def shard_file(rank: int) -> str:
    return f"shard-{rank:05d}.safetensors"


def small_file(rank: int) -> str:
    return f"shard-{rank:05d}-small.safetensors"


def writer_of(file: str) -> int | None:
    """The rank whose shard or small file ``file`` is, else ``None``."""
    for suffix in (".safetensors", "-small.safetensors"):
        head = file[len("shard-"):-len(suffix)] if file.startswith("shard-") and file.endswith(suffix) else ""
        if len(head) >= 5 and head.isdigit():
            return int(head)
    return None


def entry_name(fqn: str, offsets: Any) -> str:
    return f"{fqn}@{'' if offsets is None else ','.join(str(int(o)) for o in offsets)}"


def even_split(n: int, k: int, i: int) -> tuple[int, int]:
    """``torch.chunk``'s piece ``i`` of ``k`` along ``n`` rows: (offset, length); an empty piece's offset is ``n``."""
    full = -(-n // k) if k else 0
    start = full * i
    return (start, full) if n % k == 0 else ((start, min(n, start + full) - start) if start < n else (n, 0))


def chunk(size: list[int], mesh_shape: list[int], coordinate: list[int], placements: list) -> tuple[list, list]:
    """(offsets, sizes) of the chunk a mesh ``coordinate`` holds of a tensor of global ``size``."""
    offsets, sizes = [0] * len(size), list(size)
    for mesh_dim, placement in enumerate(placements):
        if placement[0] == "shard":
            dim = placement[1]
            start, length = even_split(sizes[dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
            offsets[dim] += start
            sizes[dim] = length
    return offsets, sizes


def _writers(mesh: dict, placements: list) -> Iterator[tuple[int, list[int]]]:
    """(writer rank, coordinate) of each distinct chunk: coordinate 0 on every replicate dimension."""
    shape = mesh["shape"]
    ranges = [range(d) if p[0] == "shard" else range(1) for d, p in zip(shape, placements)]
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    for coordinate in itertools.product(*ranges):
        yield mesh["ranks"][sum(c * s for c, s in zip(coordinate, strides))], list(coordinate)


def _element_size(dtype: str) -> int:
    return DTYPES[dtype].itemsize


def _file(item: dict, sizes: list[int], writer: int, small_bytes: int) -> str:
    whole = sizes == item["size"]
    small = whole and math.prod(sizes) * _element_size(item["dtype"]) <= small_bytes
    return small_file(writer) if small else shard_file(writer)


def records(rule: dict, fqn: str) -> Iterator[tuple[list | None, list | None, str, str]]:
    """Every stored piece of ``fqn``: (offsets, sizes, file, entry); bytes items (None, None, file, entry)."""
    item = rule["items"][fqn]
    if "mesh" not in item:
        offsets = None if item.get("bytes") else [0] * len(item["size"])
        sizes = None if item.get("bytes") else list(item["size"])
        writer = item["writer"]
        yield offsets, sizes, small_file(writer) if item["small"] else shard_file(writer), entry_name(fqn, offsets)
        return
    mesh = rule["meshes"][item["mesh"]]
    for writer, coordinate in _writers(mesh, item["placements"]):
        offsets, sizes = chunk(item["size"], mesh["shape"], coordinate, item["placements"])
        if math.prod(sizes):
            yield offsets, sizes, _file(item, sizes, writer, rule["small_bytes"]), entry_name(fqn, offsets)


def written_by(rule: dict, rank: int) -> Iterator[tuple[str, list | None, list | None, str, str]]:
    """What ``rank`` writes under ``rule``: (fqn, offsets, sizes, file, entry), in ``rule``'s item order."""
    for fqn, item in rule["items"].items():
        if "mesh" not in item:
            if item["writer"] == rank:
                yield (fqn, *next(records(rule, fqn)))
            continue
        mesh = rule["meshes"][item["mesh"]]
        if rank not in mesh["index"]:
            continue
        coordinate = mesh["index"][rank]
        if any(c and p[0] == "replicate" for c, p in zip(coordinate, item["placements"])):
            continue
        offsets, sizes = chunk(item["size"], mesh["shape"], coordinate, item["placements"])
        if math.prod(sizes):
            yield fqn, offsets, sizes, _file(item, sizes, rank, rule["small_bytes"]), entry_name(fqn, offsets)


def explicit(raw: dict, where: str) -> dict:
    """The listed form of a rule-form ``dcp-metadata.json`` (``items`` with every chunk, ``storage``), as a save
    without the rule writes it: every older reader parses the result."""
    rule = checked(raw.get("rule"), where)
    items, storage = {}, []
    for fqn, item in rule["items"].items():
        found = list(records(rule, fqn))
        if item.get("bytes"):
            items[fqn] = {"bytes": True}
        else:
            items[fqn] = {"dtype": item["dtype"], "requires_grad": item["requires_grad"], "size": item["size"],
                          "chunks": [[offsets, sizes] for offsets, sizes, _, _ in found]}
        storage += [[fqn, offsets, file, entry] for offsets, _, file, entry in found]
    return {"format": raw["format"], "version": raw["version"], "items": items,
            "planner_data": raw["planner_data"], "storage": storage}


def overlapping(rule: dict, fqn: str, boxes: list[tuple[list[int], list[int]]]
                ) -> list[tuple[list | None, list | None, str, str]]:
    """The stored pieces of ``fqn`` that overlap any of ``boxes`` (offsets, sizes): what a rank's load reads, found
    without listing every rank's chunk when each tensor dimension is sharded by at most one mesh dimension (the
    pieces a box meets along a dimension are a range of coordinates, found by division); otherwise by listing them."""
    item = rule["items"][fqn]
    if "mesh" not in item:
        return list(records(rule, fqn))
    mesh, placements = rule["meshes"][item["mesh"]], item["placements"]
    by_dim: dict[int, int] = {}
    for mesh_dim, p in enumerate(placements):
        if p[0] == "shard":
            if p[1] in by_dim:  # two mesh dimensions cut one tensor dimension: list them all
                return [r for r in records(rule, fqn) if any(_meets(r[0], r[1], *box) for box in boxes)]
            by_dim[p[1]] = mesh_dim
    size, shape = item["size"], mesh["shape"]
    found: dict[tuple, tuple] = {}
    for offsets, sizes in boxes:
        choices = []  # per mesh dimension: the coordinates whose cut overlaps the box
        for mesh_dim, p in enumerate(placements):
            if p[0] != "shard":
                choices.append([0])
                continue
            dim, k = p[1], shape[mesh_dim]
            full = -(-size[dim] // k) if k else 0
            if not full or not sizes[dim]:
                choices.append([])
                continue
            first = offsets[dim] // full
            last = min(k - 1, (offsets[dim] + sizes[dim] - 1) // full)
            choices.append(list(range(first, last + 1)))
        for coordinate in itertools.product(*choices):
            chunk_offsets, chunk_sizes = chunk(size, shape, list(coordinate), placements)
            if math.prod(chunk_sizes) and _meets(chunk_offsets, chunk_sizes, offsets, sizes):
                writer = mesh["ranks"][sum(c * math.prod(shape[i + 1:]) for i, c in enumerate(coordinate))]
                found[tuple(chunk_offsets)] = (chunk_offsets, chunk_sizes, _file(item, chunk_sizes, writer,
                                                                                 rule["small_bytes"]),
                                               entry_name(fqn, chunk_offsets))
    return list(found.values())


def _meets(offsets: list | None, sizes: list | None, box_offsets: list[int], box_sizes: list[int]) -> bool:
    if offsets is None:
        return True
    return all(o < bo + bs and bo < o + s for o, s, bo, bs in zip(offsets, sizes, box_offsets, box_sizes))


def checked(rule: Any, where: str) -> dict:
    """``rule`` with every field checked (a damaged rule is :class:`CorruptGeneration`), meshes indexed by rank."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CorruptGeneration(where, f"malformed rule: {what}")

    def naturals(value: Any, n: int | None = None) -> bool:
        return type(value) is list and all(type(v) is int and v >= 0 for v in value) and (n is None or len(value) == n)

    need(type(rule) is dict and set(rule) == {"world_size", "small_bytes", "meshes", "items"}, "sections")
    world = rule["world_size"]
    need(type(world) is int and world > 0 and type(rule["small_bytes"]) is int and rule["small_bytes"] >= 0,
         "world size")
    need(type(rule["meshes"]) is list and type(rule["items"]) is dict, "sections")
    meshes = []
    for mesh in rule["meshes"]:
        need(type(mesh) is dict and set(mesh) == {"shape", "ranks"} and naturals(mesh["shape"])
             and mesh["shape"] and naturals(mesh["ranks"], math.prod(mesh["shape"]))
             and len(set(mesh["ranks"])) == len(mesh["ranks"]) and max(mesh["ranks"]) < world, "mesh")
        shape = mesh["shape"]
        index = {}
        for flat, rank in enumerate(mesh["ranks"]):
            coordinate, rest = [], flat
            for d in reversed(shape):
                coordinate.append(rest % d)
                rest //= d
            index[rank] = coordinate[::-1]
        meshes.append({"shape": shape, "ranks": mesh["ranks"], "index": index})
    for fqn, item in rule["items"].items():
        need(type(item) is dict, f"item {fqn!r:.80}")
        if item.get("bytes"):
            need(set(item) == {"bytes", "writer", "small"} and item["bytes"] is True, f"item {fqn!r:.80}")
        else:
            need(set(item) in ({"dtype", "requires_grad", "size", "mesh", "placements"},
                               {"dtype", "requires_grad", "size", "writer", "small"})
                 and item["dtype"] in DTYPES and type(item["requires_grad"]) is bool and naturals(item["size"]),
                 f"item {fqn!r:.80}")
        if "mesh" in item:
            need(type(item["mesh"]) is int and 0 <= item["mesh"] < len(meshes), f"mesh of {fqn!r:.80}")
            placements = item["placements"]
            need(type(placements) is list and len(placements) == len(meshes[item["mesh"]]["shape"]) and all(
                p == ["replicate"] or (type(p) is list and len(p) == 2 and p[0] == "shard" and type(p[1]) is int
                                       and 0 <= p[1] < len(item["size"])) for p in placements),
                 f"placements of {fqn!r:.80}")
        else:
            need(type(item["writer"]) is int and 0 <= item["writer"] < world and type(item["small"]) is bool,
                 f"writer of {fqn!r:.80}")
    return {**rule, "meshes": meshes}

