"""Mutators for corruption fuzzing: value strategies, byte, JSON-tree and safetensors-header edits, sealing.

Pure data manipulation shared by ``tests/test_fuzz.py`` (hypothesis) and
usable from other harnesses. Functions taking ``draw`` take hypothesis'
``data.draw``, so every choice they make shrinks; ``sweep`` and ``retag``
take a seed instead and make cheap, reproducible one-step variants, so that
one drawn example yields several parser cases.

``seal`` is what anyone who can write a run directory can do: recompute the
file records, the manifest's self-digest and the pointer, so that an edit
reaches the layers behind the digests. (``tests/test_hostile.reseal`` leaves
the self-digest stale, so its sealed files stop at the self-digest check.)
"""

from __future__ import annotations

import collections
import copy
import hashlib
import json
import math
import random
import struct
from pathlib import Path

import blake3
import torch
from hypothesis import strategies as st

from trainstate.format import tensorfile
from trainstate.format.digest import CHUNKED_ALGORITHMS, ChunkedHasher

G1, G2, G3 = (f"gen-{u:012d}" for u in (1, 2, 3))
MANIFEST, POINTER = "manifest.json", "latest"


# --- value strategies ------------------------------------------------------------------------------

TAGS = ("$t", "$nd", "$np", "$int", "$float", "$tuple", "$map", "$odict", "$dtype", "$device", "$bytes")
ST_DTYPES = tuple(tensorfile._ST_DTYPES)
TORCH_DTYPES = sorted(n for n, v in vars(torch).items() if isinstance(v, torch.dtype))  # vars: no lazy imports
STRING_POOL = TAGS + ST_DTYPES + tuple(TORCH_DTYPES[:12]) + (
    "", "nan", "inf", "-inf", "1e309", "cpu", "cuda:0", "meta", "<i8", "<f2", "|b1", "V1", "O", "<M8[ns]", "S9",
    "QUFBQQ==", "====", "full", "weights", "trainstate", "trainstate-state", "blake3", "sha256", G2, "state.json",
    "model.0.weight", "model.4.bias", "optimizer.state[0].exp_avg", "optimizer.state[0].step", "rng.torch_cpu",
    "float8_e8m0fnu", "qint8", "uint1", "load", "Tensor")
EDGE_INTS = (0, 1, -1, 7, 8, 2**31, 2**53 + 1, 2**62, 2**63, 2**64 + 1, -(2**63) - 1, 10**30)

strings = st.one_of(st.sampled_from(STRING_POOL), st.text(max_size=10))
numbers = st.one_of(st.integers(-3, 20), st.sampled_from(EDGE_INTS), st.floats(allow_nan=True, allow_infinity=True))
leaves = st.one_of(st.none(), st.booleans(), numbers, strings)


def extend_json(children):
    """Lists, dicts and single-tag dicts of ``children``: the recursive step of ``json_values``."""
    return st.one_of(st.lists(children, max_size=4), st.dictionaries(strings, children, max_size=3),
                     st.tuples(st.sampled_from(TAGS + ("$T", "$", "$tuple ")), children).map(lambda kv: {kv[0]: kv[1]}))


json_values = st.recursive(leaves, extend_json, max_leaves=8)
dims = st.one_of(st.integers(0, 6),
                 st.sampled_from([0, 1, 2**31, 2**32 + 1, 2**40, 2**61, 2**62 - 1, 2**62, 2**63, -1]))
ABSURD_SHAPES = ([0, 2**40, 2**40], [2**40, 2**40], [2**31, 2**31, 0], [0, 2**62, 2**62, 2**62], [2**63], [1] * 64,
                 [0] * 65, [2**62 - 1, 2], [-1, -4])
shapes = st.one_of(st.sampled_from(ABSURD_SHAPES), st.lists(dims, max_size=4),
                   st.lists(dims, min_size=62, max_size=66), json_values)


# --- mutators (draw is hypothesis' data.draw) ------------------------------------------------------


def damage_bytes(draw, blob: bytes, hot: int = 0) -> bytes:
    """1-3 of: bit flip, truncation, zero-filled range, inserted bytes; positions biased below ``hot``."""
    out = bytearray(blob)
    for _ in range(draw(st.integers(1, 3))):
        end = max(len(out) - 1, 0)
        at = draw(st.one_of(st.integers(0, min(hot, end)), st.integers(0, end)))
        op = draw(st.sampled_from(("flip", "truncate", "zero", "insert")))
        if op == "flip" and out:
            out[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del out[at:]
        elif op == "zero":
            n = draw(st.integers(1, 4096))
            out[at:at + n] = bytes(len(out[at:at + n]))
        else:
            out[at:at] = draw(st.binary(min_size=1, max_size=12))
    return bytes(out)


def node_slots(tree) -> list[tuple[object, object]]:
    """(container, key) of every node below the root, shallowest first."""
    out, queue = [], collections.deque([tree])
    while queue:
        node = queue.popleft()
        items = node.items() if type(node) is dict else enumerate(node) if type(node) is list else ()
        for key, child in items:
            out.append((node, key))
            queue.append(child)
    return out


TREE_OPS = ("replace", "splice", "delete", "insert", "wrap", "wrap-section", "unwrap", "re-encode", "number", "retype",
            "root")


def re_encode(node):
    """Another encoding the decoder accepts for ``node``: a dict as $map, a list as $tuple, an int as $int."""
    if type(node) is dict:
        return {"$map": [[k, v] for k, v in node.items()]}
    if type(node) is list:
        return {"$tuple": node}
    if type(node) is int:
        return {"$int": str(node)}
    return {"$tuple": [node]}


def edit_tree(draw, tree, keys=()):
    """1-3 grammar-aware edits of a JSON tree: replace, splice in another node, delete, insert, (un)wrap a tag."""
    tree = copy.deepcopy(tree)
    key_strategy = st.one_of(st.sampled_from(tuple(keys) + TAGS), strings) if keys else strings
    for _ in range(draw(st.integers(1, 3))):
        slots = node_slots(tree)
        op = draw(st.sampled_from(TREE_OPS))
        if op == "root" or not slots:
            tree = draw(json_values)
            continue
        if op == "wrap-section" and type(tree) is dict and tree:  # a whole top-level section behind a tag
            section = draw(st.sampled_from(sorted(tree, key=str)))
            tree[section] = {draw(st.sampled_from(TAGS)): tree[section]}
            continue
        last = len(slots) - 1  # slots are shallowest first: two thirds of the edits land where the schema looks
        container, key = slots[draw(st.one_of(st.integers(0, min(12, last)), st.integers(0, min(60, last)),
                                              st.integers(0, last)))]
        node = container[key]
        if op == "replace":
            container[key] = draw(json_values)
        elif op == "splice":
            source, skey = draw(st.sampled_from(slots))
            container[key] = copy.deepcopy(source[skey])
        elif op == "delete":
            del container[key]
        elif op == "insert" and type(node) is dict:
            node[draw(key_strategy)] = draw(st.one_of(json_values, st.sampled_from(slots).map(
                lambda s: copy.deepcopy(s[0][s[1]]))))
        elif op == "insert" and type(node) is list:
            node.insert(draw(st.integers(0, len(node))), draw(json_values))
        elif op == "wrap":
            container[key] = {draw(st.sampled_from(TAGS)): node}
        elif op == "unwrap" and type(node) is dict and len(node) == 1:
            container[key] = next(iter(node.values()))
        elif op == "re-encode":
            container[key] = re_encode(node)
        elif op == "number":
            container[key] = draw(numbers)
        elif op == "retype":
            container[key] = draw(st.sampled_from((str(node)[:40], [node], {"x": node}, None, True)))
    return tree


def split_safetensors(blob: bytes) -> tuple[dict, bytes]:
    length = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + length]), blob[8 + length:]


def join_safetensors(header: object, data: bytes, length: int | None = None) -> bytes:
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", (len(body) if length is None else length) % 2**64) + body + data


def _relayout(header: dict, data: bytes) -> bytes | None:
    """Make data_offsets contiguous again from each entry's dtype and shape; None if any entry is too odd."""
    new_data, offset = bytearray(), 0
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            itemsize = tensorfile._ST_DTYPES[spec["dtype"]].itemsize
            shape, old = spec["shape"], spec["data_offsets"][0]
        except (KeyError, TypeError, IndexError):
            return None
        if type(shape) is not list or not all(type(d) is int for d in shape) or type(old) is not int:
            return None
        nbytes = math.prod(shape) * itemsize
        if not 0 <= nbytes <= 1 << 20:
            return None
        chunk = data[max(old, 0):max(old, 0) + nbytes]
        new_data += chunk + bytes(nbytes - len(chunk))
        spec["data_offsets"] = [offset, offset + nbytes]
        offset += nbytes
    return bytes(new_data)


HEADER_OPS = ("shape", "dtype", "offsets", "relayout", "drop", "dup", "rename", "raw-dtype", "metadata",
              "length", "extra-key", "entry-junk")


def _raw_record(draw, spec: dict) -> list:
    """A raw-dtype record for ``spec``: half the time one whose size fits the entry's bytes exactly."""
    name = draw(st.one_of(st.sampled_from(TORCH_DTYPES), strings))
    offsets = spec.get("data_offsets")
    dtype = vars(torch).get(name) if type(name) is str else None
    if isinstance(dtype, torch.dtype) and _int_pair(offsets) and draw(st.booleans()):
        nbytes = offsets[1] - offsets[0]
        if dtype.itemsize and nbytes % dtype.itemsize == 0:
            return [name, draw(st.sampled_from(([nbytes // dtype.itemsize], [1, nbytes // dtype.itemsize], [0] * 3)))]
    return [name, draw(shapes)]


def _int_pair(value: object) -> bool:
    return type(value) is list and len(value) == 2 and all(type(v) is int for v in value) and value[0] <= value[1]


def edit_header(draw, blob: bytes) -> bytes:
    """1-3 structural edits of a safetensors header, re-serialised so that the JSON stays valid.

    Half the time the data offsets are then laid out again from each entry's
    dtype and shape (the data cut or zero-padded to fit), so the edit passes
    the offset checks and reaches the shape, dtype and decode checks.
    """
    header, data = split_safetensors(blob)
    length = None
    for _ in range(draw(st.integers(1, 3))):
        names = [n for n in header if n != "__metadata__"]
        op = draw(st.sampled_from(HEADER_OPS))
        name = draw(st.sampled_from(names)) if names else None
        spec = header.get(name) if name is not None else None
        if type(spec) is not dict and op in ("shape", "dtype", "offsets", "extra-key", "raw-dtype"):
            op = "length"
        if op == "shape":
            spec["shape"] = draw(shapes)
        elif op == "dtype":
            spec["dtype"] = draw(st.one_of(st.sampled_from(ST_DTYPES), st.sampled_from(("F128", "torch.float32")),
                                           json_values))
        elif op == "offsets":
            ends = st.one_of(st.integers(-2, len(data) + 8), st.sampled_from(EDGE_INTS))
            spec["data_offsets"] = draw(st.one_of(st.lists(ends, max_size=3), json_values))
        elif op == "relayout":
            data = _relayout(header, data) or data
        elif op == "drop" and name is not None:
            del header[name]
        elif op == "dup" and name is not None:
            header[name + draw(strings)] = copy.deepcopy(spec)
        elif op == "rename" and name is not None:
            header[draw(st.one_of(st.sampled_from(names), strings))] = header.pop(name)
        elif op == "raw-dtype":
            text = json.dumps({name: _raw_record(draw, spec)})
            header["__metadata__"] = {"format": "pt", "trainstate.raw_dtypes": draw(st.sampled_from((text,) * 3 + (
                text[:-1], "[]", "\x80\x05")))}
        elif op == "metadata":
            header["__metadata__"] = draw(json_values)
        elif op == "extra-key":
            spec[draw(strings)] = draw(json_values)
        elif op == "entry-junk" and name is not None:
            header[name] = draw(json_values)
        else:
            length = draw(st.sampled_from((0, 7, 2**63, 2**64 - 1, 64 << 20, (64 << 20) + 8, len(blob))))
    if draw(st.booleans()):
        data = _relayout(header, data) or data
    return join_safetensors(header, data, length)


# --- sealing: what a writer with access to the directory can recompute -------------------------------


def digest(algorithm: object, data: bytes) -> str:
    if algorithm in CHUNKED_ALGORITHMS:
        return _chunked(data, algorithm).hexdigest()
    return hashlib.sha256(data).hexdigest() if algorithm == "sha256" else blake3.blake3(data).hexdigest()


def _chunked(data: bytes, algorithm: str) -> ChunkedHasher:
    hasher = ChunkedHasher(algorithm)
    hasher.update(data)
    hasher.hexdigest()
    return hasher


def seal(run: Path, generation: str, *, records: bool = True) -> None:
    """Recompute the generation's file records (unless ``records`` is false), its self-digest and the pointer.

    Unlike ``test_hostile.reseal`` this also recomputes ``self_digest``, so the
    edit reaches the layers behind the manifest. A manifest that is no longer
    a JSON object is left as it is.
    """
    path = run / generation / MANIFEST
    try:
        raw = json.loads(path.read_bytes())
    except (ValueError, OSError):
        return
    if type(raw) is not dict:
        return
    algorithm = raw.get("digest_algorithm")
    for record in raw.get("files", []) if records and type(raw.get("files")) is list else ():
        if type(record) is dict and type(record.get("name")) is str and (run / generation / record["name"]).is_file():
            data = (run / generation / record["name"]).read_bytes()
            record.update(size=len(data), digest=digest(algorithm, data))
            if algorithm in CHUNKED_ALGORITHMS:  # and each chunk's digest, which restore checks on its own
                record["chunks"] = list(_chunked(data, algorithm).chunks)
    body = {k: v for k, v in raw.items() if k != "self_digest"}
    raw["self_digest"] = digest(algorithm, json.dumps(body, indent=1, sort_keys=True).encode())
    data = json.dumps(raw, indent=1, sort_keys=True).encode() + b"\n"
    path.write_bytes(data)
    aim_pointer(run, generation, only_if_named=True)


def aim_pointer(run: Path, generation: str, *, only_if_named: bool = False) -> None:
    """Point ``latest`` at ``generation`` with its manifest's current digest and size."""
    try:
        pointer = json.loads((run / POINTER).read_bytes())
    except (ValueError, OSError):
        return
    if type(pointer) is not dict or (only_if_named and pointer.get("generation") != generation):
        return
    data = (run / generation / MANIFEST).read_bytes()
    update = int(generation[4:16])
    pointer.update(generation=generation, next_update=update, manifest_size=len(data),
                   manifest_digest=digest(pointer.get("digest_algorithm"), data))
    (run / POINTER).write_bytes(json.dumps(pointer).encode())


SWEEP = 8  # cases per parser example: the drawn input and seeded one-step mutations of it


def sweep(blob: bytes, seed: int, hot: int) -> list[bytes]:
    """``blob`` and SWEEP - 1 cheap one-step mutations of it, mostly below ``hot`` (reproducible from ``seed``)."""
    rnd, out = random.Random(seed), [blob]
    for _ in range(SWEEP - 1):
        b = bytearray(blob)
        if b:
            at = rnd.randrange(max(min(hot, len(b)), 1)) if rnd.random() < 0.8 else rnd.randrange(len(b))
            op = rnd.randrange(4)
            if op == 0:
                b[at] ^= 1 << rnd.randrange(8)
            elif op == 1:
                del b[at:]
            elif op == 2:
                n = rnd.randrange(1, 64)
                b[at:at + n] = bytes(len(b[at:at + n]))
            else:
                b[at] = rnd.choice(b'{}[]":,0123456789-eE. \\\x00\xff')
        out.append(bytes(b))
    return out


def header_end(blob: bytes) -> int:
    return 8 + int.from_bytes(blob[:8].ljust(8, b"\0"), "little") % (1 << 16)


def retag(tree, seed: int) -> list:
    """``tree`` and SWEEP - 1 variants with one node wrapped in, unwrapped from or moved to another tag."""
    rnd, out = random.Random(seed), [tree]
    for _ in range(SWEEP - 1):
        variant = copy.deepcopy(tree)
        slots = node_slots(variant)
        if slots:
            container, key = rnd.choice(slots)
            node = container[key]
            if type(node) is dict and len(node) == 1 and rnd.random() < 0.5:
                container[key] = {rnd.choice(TAGS): next(iter(node.values()))}
            else:
                container[key] = {rnd.choice(TAGS): node}
        else:
            variant = {rnd.choice(TAGS): variant}
        out.append(variant)
    return out
