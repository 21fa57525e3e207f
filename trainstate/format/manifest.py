"""Generation names, the manifest and the ``latest`` pointer: pure (de)serialisation.

A generation is a directory ``gen-<12-digit update>`` (``-weights`` appended for
weights-only generations, ``-r001``... for a later save at the same update
that supersedes it) holding ``manifest.json`` and the files it lists.
The manifest gives every file's size and digest; the pointer names the
generation and carries the manifest's own digest and size, so a reader can
check the chain pointer -> manifest -> files before trusting any byte.
Parsing is strict: unknown versions, missing or mistyped fields are a
:class:`CorruptGeneration`, never a guess.

Format versions: 2 added the ``$odict`` tag and encodes ``facts`` with the
codec (format 1 kept them as plain JSON). Writers write ``FORMAT_VERSION``;
readers accept every version in ``READABLE_VERSIONS``, so a run directory may
hold generations of both, while a reader that predates a version refuses it
rather than misreading ``{"$odict": ...}`` as a dict. 3 added the
``blake3-chunked`` digest (see :mod:`trainstate.format.digest`): each file
record then lists its chunk digests, which must combine into its digest.
4 added incremental generations (``fingerprints`` and ``shares``), 5 their
spare copies (see :mod:`trainstate.format.sharing`). An incremental
generation is still self-describing: it lists every file it needs, each
present in its own directory, with its own digests.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

from .digest import ALGORITHMS, CRYPTOGRAPHIC, chunk_count, chunk_hex_length, chunked_top, digest_bytes, is_chunked
from ..errors import CorruptGeneration, InvalidArgument
from . import sharing
from .names import (MAX_REVISION, generation_name, generation_order, newest_first,  # noqa: F401 (re-exported)
                    parse_generation_name)
from .sharing import INCREMENTAL_VERSION, SPARE_VERSION
from .signing import SigningKey
from .strictjson import loads

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3, INCREMENTAL_VERSION, SPARE_VERSION)
MANIFEST = "manifest.json"
STATE = "state.json"
POINTER = "latest"
WEIGHTS_POINTER = "latest-weights"
PINS = "pins"
RUN = "run-identity"  # the run directory's identity, bound into every manifest
MAX_JSON_BYTES = 64 << 20
# DCP's metadata lists every rank's chunk of every item: ~140 KB per rank for a 7B model under FSDP2, so 1.1 GB at
# 8,192 ranks. Its size is the digest-checked manifest's record; this only bounds what a reader allocates.
MAX_DCP_METADATA_BYTES = 4 << 30
KINDS = ("full", "weights")

_FILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HEX_RE = re.compile(r"[0-9a-f]{16,128}")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class FileRecord:
    name: str
    size: int
    digest: str
    chunks: tuple[str, ...] = ()  # blake3-chunked: the digest of each 4 MiB chunk, in order


@dataclass(frozen=True)
class Manifest:
    generation: str
    kind: str
    next_update: int
    digest_algorithm: str
    files: tuple[FileRecord, ...]
    created: str  # ISO 8601, UTC
    contract_fingerprint: str
    versions: dict = field(default_factory=dict)
    parent: str | None = None
    format_version: int = FORMAT_VERSION
    data: dict = field(default_factory=dict)  # data positions by component name; omitted when empty
    metrics: dict = field(default_factory=dict)  # save(metrics=...): finite floats by name; omitted when empty
    retention: dict = field(default_factory=dict)  # the policy in force when saved (read by `trainstate prune`)
    lineage: list = field(default_factory=list)  # timelines: [[id, last update inherited or None], ...]
    run: str = ""  # the identity of the run directory it was published into (see RUN); "" before format 2
    world_size: int = 1  # ranks that wrote it; omitted for a single process
    ranks: list = field(default_factory=list)  # per rank, the files it wrote (multi-rank generations)
    compute: dict = field(default_factory=dict)  # {"devices": [...], "wall_s": float}; omitted when empty
    fingerprints: dict = field(default_factory=dict)  # {tensor file: {tensor: [dtype, shape, xxh3]}} (format 4)
    shares: dict = field(default_factory=dict)  # {file: the generation it was linked from} (format 4)

    def to_bytes(self, key: SigningKey | None = None) -> bytes:
        """JSON, one space of indent, keys sorted, with its self-digest (and signature); encoded once, each file
        record taken field by field (``asdict`` copied every record: half a second at 8,192 ranks)."""
        data: dict = {"format": "trainstate", **{item.name: getattr(self, item.name) for item in fields(self)}}
        data["files"] = [{"name": f.name, "size": f.size, "digest": f.digest} | ({"chunks": list(f.chunks)}
                                                                              if f.chunks else {}) for f in self.files]
        for optional in ("data", "metrics", "retention", "lineage", "run", "ranks", "compute", "fingerprints",
                         "shares"):
            if not data[optional]:
                del data[optional]
        if data["world_size"] == 1 and "ranks" not in data:
            del data["world_size"]
        body = json.dumps(data, indent=1, sort_keys=True)
        data["self_digest"] = digest_bytes(self.digest_algorithm, body.encode())
        own = {"self_digest": data["self_digest"]}
        if key is not None:
            own["signature"] = key.sign(data)
        return _with_top_level(body, own).encode() + b"\n"

    def file(self, name: str) -> FileRecord:
        """The record of ``name`` (the first, should two share it). By a name index built at the first call: a
        restore at another world size reads every rank's records, 2N lookups among ~3N files, which scanned the
        list took 3 s at 8,192 ranks (``benchmarks/bench_protocol_scale.py``)."""
        by_name = self.__dict__.get("_by_name")
        if by_name is None:
            by_name = {}
            for record in self.files:
                by_name.setdefault(record.name, record)
            object.__setattr__(self, "_by_name", by_name)  # ``files`` is a tuple of frozen records: never stale
        record = by_name.get(name)
        if record is None:
            raise CorruptGeneration(self.generation, f"manifest lists no {name}")
        return record


@dataclass(frozen=True)
class Pointer:
    generation: str
    manifest_digest: str
    manifest_size: int
    digest_algorithm: str
    next_update: int
    kind: str = "full"
    format_version: int = FORMAT_VERSION

    def to_bytes(self, key: SigningKey | None = None) -> bytes:
        data = {"format": "trainstate-pointer", **asdict(self)}
        if key is not None:
            data["signature"] = key.sign(data)
        return json.dumps(data, sort_keys=True).encode() + b"\n"


def _self_digest(data: dict, algorithm: str) -> str:
    """Digest of the manifest's canonical JSON without this field.

    The pointer protects the latest manifest; this protects every manifest,
    so an edited older generation is caught too. Like every digest here it
    detects corruption, it does not authenticate.
    """
    body = {k: v for k, v in data.items() if k not in ("self_digest", "signature")}
    return digest_bytes(algorithm, json.dumps(body, indent=1, sort_keys=True).encode())


_TOP_KEY = re.compile(r'\n "((?:[^"\\]|\\.)*)": ')


def _with_top_level(body: str, own: dict[str, str]) -> str:
    """``body`` (``json.dumps(..., indent=1, sort_keys=True)`` of an object) with the string fields ``own`` where
    that call on the whole puts them, byte for byte: a top-level key is the only line starting with one space and
    a quote."""
    for name, value in sorted(own.items()):
        line = f" {json.dumps(name)}: {json.dumps(value)}"
        after = next((m.start() for m in _TOP_KEY.finditer(body) if json.loads(f'"{m.group(1)}"') > name), None)
        body = body[:-2] + ",\n" + line + "\n}" if after is None else body[:after] + "\n" + line + "," + body[after:]
    return body


_OWN_FIELDS = re.compile(rb'\n "(?:self_digest|signature)": "[^"\\\n]*",')


def _self_digest_holds(data: bytes, raw: dict) -> bool:
    """Whether the manifest matches its self-digest. As written (:meth:`Manifest.to_bytes`) its bytes are the
    canonical JSON the digest covers plus two top-level lines and a newline: the digest of those bytes without
    them is checked first (no re-encoding, which for a large manifest costs milliseconds); bytes laid out any
    other way are re-encoded and checked as before. A match of the first kind proves the bytes are the canonical
    encoding of what they parse to, so both checks accept and refuse the same manifests."""
    claimed, algorithm = raw["self_digest"], raw["digest_algorithm"]
    if isinstance(data, (bytes, bytearray, memoryview)):
        body = _OWN_FIELDS.sub(b"", bytes(data))
        if body.endswith(b"\n") and digest_bytes(algorithm, body[:-1]) == claimed:
            return True
    return claimed == _self_digest(raw, algorithm)


def load_json(data: bytes, where: str, limit: int = MAX_JSON_BYTES) -> dict:
    """A metadata file (state.json, a manifest, a pointer, pins): strict, bounded JSON holding an object."""
    if len(data) > limit:
        raise CorruptGeneration(where, f"{len(data)} bytes exceeds the {limit}-byte limit for metadata")
    value = loads(data, where)
    if type(value) is not dict:
        raise CorruptGeneration(where, "expected a JSON object")
    return value


def _check(where: str, data: dict, spec: dict[str, type | tuple], optional: dict[str, type] | None = None) -> None:
    optional = optional or {}
    for key, kind in optional.items():
        if key in data and type(data[key]) is not kind:
            raise CorruptGeneration(where, f"field {key!r} has the wrong type")
    extra = set(data) - set(spec) - set(optional)
    if extra:
        raise CorruptGeneration(where, f"unknown fields {sorted(extra)!r:.200}")
    for key, types in spec.items():
        if key not in data:
            raise CorruptGeneration(where, f"missing field {key!r}")
        if type(data[key]) not in (types if isinstance(types, tuple) else (types,)):
            raise CorruptGeneration(where, f"field {key!r} has the wrong type")


def check_version(where: str, version: object) -> None:
    """``version`` is one this reader understands (an int in ``READABLE_VERSIONS``)."""
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise CorruptGeneration(
            where, f"format_version {version!r:.20} is not one of {READABLE_VERSIONS}; it was written by "
            "another trainstate version")


def _check_common(where: str, data: dict, fmt: str) -> None:
    if data.get("format") != fmt:
        raise CorruptGeneration(where, f"not a {fmt} file")
    check_version(where, data.get("format_version"))
    if data.get("digest_algorithm") not in ALGORITHMS:
        raise CorruptGeneration(where, f"unknown digest algorithm {data.get('digest_algorithm')!r:.40}")
    if data.get("kind") not in KINDS:
        raise CorruptGeneration(where, f"unknown kind {data.get('kind')!r:.40}")
    if type(data.get("next_update")) is not int or not 0 <= data["next_update"] < 10**12:
        raise CorruptGeneration(where, "next_update is not a valid update number")


def parse_manifest(data: bytes, where: str, key: SigningKey | None = None) -> Manifest:
    """Parse and check a manifest; with ``key``, also require a valid signature."""
    raw = load_json(data, where)
    _check(where, raw, {
        "format": str, "format_version": int, "generation": str, "kind": str, "next_update": int,
        "digest_algorithm": str, "files": list, "created": str, "contract_fingerprint": str,
        "versions": dict, "parent": (str, type(None)), "self_digest": str,
    }, {"signature": str, "data": dict, "metrics": dict, "retention": dict, "lineage": list, "run": str,
        "world_size": int, "ranks": list, "compute": dict, "fingerprints": dict, "shares": dict})
    _check_common(where, raw, "trainstate")
    _check_compute(where, raw.get("compute", {}))
    if "run" in raw and not _HEX_RE.fullmatch(raw["run"]):
        raise CorruptGeneration(where, "malformed run identity")
    _check_data(where, raw.get("data", {}))
    for name, value in raw.get("metrics", {}).items():
        if not _NAME_RE.fullmatch(name) or type(value) is not float or not math.isfinite(value):
            raise CorruptGeneration(where, f"invalid metric {name!r:.60}")
    _check_retention(where, raw.get("retention", {}))
    _check_lineage(where, raw.get("lineage", []), raw["next_update"])
    if not _self_digest_holds(data, raw):
        raise CorruptGeneration(where, "content does not match its self-digest (the manifest was altered)")
    if key is not None:
        key.check(raw, raw.get("signature"), where)
        if raw["digest_algorithm"] not in CRYPTOGRAPHIC:  # a valid signature over digests anyone can match
            raise CorruptGeneration(where, f"signed over {raw['digest_algorithm']} digests, which do not authenticate "
                                           "file contents (trainstate signs only over blake3-chunked, blake3 or sha256)")
    if parse_generation_name(raw["generation"]) != (raw["next_update"], raw["kind"]):
        raise CorruptGeneration(where, f"generation name {raw['generation']!r:.60} disagrees with its update/kind")
    files = []
    for item in raw["files"]:
        if type(item) is not dict:
            raise CorruptGeneration(where, "file records must be objects")
        _check(where, item, {"name": str, "size": int, "digest": str}, {"chunks": list})
        if not _FILE_RE.fullmatch(item["name"]) or item["name"] == MANIFEST or not _HEX_RE.fullmatch(item["digest"]):
            raise CorruptGeneration(where, f"invalid file record {item['name']!r:.60}")
        if item["size"] < 0:
            raise CorruptGeneration(where, f"negative size for {item['name']!r:.60}")
        files.append(FileRecord(item["name"], item["size"], item["digest"],
                                _chunks(where, item, raw["digest_algorithm"])))
    if len({f.name for f in files}) != len(files) or STATE not in {f.name for f in files}:
        raise CorruptGeneration(where, f"file list must be unique and include {STATE}")
    _check_ranks(where, raw, {f.name for f in files})
    sharing.check(where, raw, {f.name: f for f in files})
    del raw["format"], raw["self_digest"]
    raw.pop("signature", None)
    return Manifest(**{**raw, "files": tuple(files)})


def _chunks(where: str, item: dict, algorithm: str) -> tuple[str, ...]:
    """A file record's chunk digests: present exactly under a chunked algorithm, one per chunk, and
    combining into the file's digest (so a reader may trust each one on its own)."""
    chunks = item.get("chunks")
    if not is_chunked(algorithm):
        if chunks is not None:
            raise CorruptGeneration(where, f"{item['name']!r:.60} lists chunk digests under a whole-file digest")
        return ()
    if chunks is None or len(chunks) != chunk_count(item["size"]) or not all(
            type(c) is str and _HEX_RE.fullmatch(c) and len(c) == chunk_hex_length(algorithm) for c in chunks):
        raise CorruptGeneration(where, f"malformed chunk digests for {item['name']!r:.60}")
    if chunked_top(item["size"], chunks, algorithm) != item["digest"]:
        raise CorruptGeneration(where, f"the chunk digests of {item['name']!r:.60} do not combine into its digest")
    return tuple(chunks)


def _check_ranks(where: str, raw: dict, files: set[str]) -> None:
    """A multi-rank manifest: ``world_size`` ranks, each listing files the manifest lists."""
    world, ranks = raw.get("world_size", 1), raw.get("ranks", [])
    if not 1 <= world <= 1 << 20 or (world > 1 and not ranks) or (ranks and len(ranks) != world):
        raise CorruptGeneration(where, f"world_size {world!r:.20} and the per-rank file lists disagree")
    for listed in ranks:
        if type(listed) is not list or not all(type(f) is str and f in files for f in listed):
            raise CorruptGeneration(where, "a per-rank file list names files the manifest does not list")


_DATA_FIELDS = {"epoch": int, "cursor": int, "batches_per_epoch": int, "samples_seen": int, "tokens_seen": int,
                "next_batch": str}


def _check_data(where: str, data: dict) -> None:
    """Data positions: ``{component: {epoch, cursor, batches_per_epoch, samples_seen, tokens_seen, next_batch}}``."""
    for name, position in data.items():
        if not _FILE_RE.fullmatch(name) or type(position) is not dict:
            raise CorruptGeneration(where, f"invalid data position {name!r:.60}")
        _check(where, position, _DATA_FIELDS)
        if any(position[k] < 0 for k in _DATA_FIELDS if _DATA_FIELDS[k] is int):
            raise CorruptGeneration(where, f"negative count in data position {name!r:.60}")
        if not _HEX_RE.fullmatch(position["next_batch"]):
            raise CorruptGeneration(where, f"malformed next-batch fingerprint in {name!r:.60}")


_TIMELINE_RE = re.compile(r"[0-9a-f]{16}|legacy")


def _check_compute(where: str, compute: dict) -> None:
    """``compute``: ``devices`` (1 to 64 short device-kind strings) and ``wall_s`` (finite, >= 0), both optional."""
    _check(where, compute, {}, {"devices": list, "wall_s": float})
    devices = compute.get("devices", ["absent"])
    if not 0 < len(devices) <= 64 or any(type(d) is not str or not 0 < len(d) <= 200 for d in devices):
        raise CorruptGeneration(where, "compute.devices must list 1 to 64 device kinds")
    if "wall_s" in compute and not (math.isfinite(compute["wall_s"]) and compute["wall_s"] >= 0):
        raise CorruptGeneration(where, "compute.wall_s must be a finite number of seconds >= 0")


def _check_lineage(where: str, lineage: list, next_update: int) -> None:
    """``[[timeline, end], ...]``: every entry but the last ends at the update it was forked from."""
    if len(lineage) > 4096:
        raise CorruptGeneration(where, "lineage too long")
    for i, entry in enumerate(lineage):
        last = i == len(lineage) - 1
        if (type(entry) is not list or len(entry) != 2 or type(entry[0]) is not str
                or not _TIMELINE_RE.fullmatch(entry[0])
                or (entry[1] is not None if last else (type(entry[1]) is not int or not 0 <= entry[1] <= next_update))):
            raise CorruptGeneration(where, f"invalid lineage entry {i}")


def _check_retention(where: str, policy: dict) -> None:
    if not policy:
        return
    _check(where, policy, {"keep_last": int, "keep_last_weights": (int, type(None)),
                           "milestone_every": (int, type(None)), "best": (list, type(None))})
    counts = [policy[k] for k in ("keep_last", "keep_last_weights", "milestone_every") if policy[k] is not None]
    best = policy["best"]
    if any(c < 1 for c in counts) or (best is not None and (
            len(best) != 2 or type(best[0]) is not str or not _NAME_RE.fullmatch(best[0]) or best[1] not in ("min", "max"))):
        raise CorruptGeneration(where, "invalid retention policy")


def parse_pointer(data: bytes, where: str, key: SigningKey | None = None) -> Pointer:
    """Parse and check a pointer; with ``key``, also require a valid signature."""
    raw = load_json(data, where)
    _check(where, raw, {
        "format": str, "format_version": int, "generation": str, "manifest_digest": str,
        "manifest_size": int, "digest_algorithm": str, "next_update": int, "kind": str,
    }, {"signature": str})
    if key is not None:
        key.check(raw, raw.get("signature"), where)
    raw.pop("signature", None)
    _check_common(where, raw, "trainstate-pointer")
    if parse_generation_name(raw["generation"]) != (raw["next_update"], raw["kind"]):
        raise CorruptGeneration(where, f"pointer names {raw['generation']!r:.60}, which disagrees with its update/kind")
    if not _HEX_RE.fullmatch(raw["manifest_digest"]) or raw["manifest_size"] < 0:
        raise CorruptGeneration(where, "malformed manifest digest or size")
    del raw["format"]
    return Pointer(**raw)


def run_to_bytes(run: str, key: SigningKey | None = None) -> bytes:
    """The run directory's identity record (signed with ``key``)."""
    data = {"format": "trainstate-run", "format_version": FORMAT_VERSION, "run": run}
    if key is not None:
        data["signature"] = key.sign(data)
    return json.dumps(data, sort_keys=True).encode() + b"\n"


def parse_run(data: bytes, where: str, key: SigningKey | None = None) -> str:
    """The run identity a run directory's record names; with ``key``, also require a valid signature."""
    raw = load_json(data, where)
    _check(where, raw, {"format": str, "format_version": int, "run": str}, {"signature": str})
    if raw["format"] != "trainstate-run":
        raise CorruptGeneration(where, "not a trainstate-run file")
    check_version(where, raw["format_version"])
    if key is not None:
        key.check(raw, raw.get("signature"), where)
    if not _HEX_RE.fullmatch(raw["run"]):
        raise CorruptGeneration(where, "malformed run identity")
    return raw["run"]


def check_name(kind: str, name: object) -> str:
    """A pin or metric name: 1-64 of letters, digits, ``.``, ``_``, ``-``, starting with a letter or digit."""
    if type(name) is not str or not _NAME_RE.fullmatch(name):
        raise InvalidArgument(f"{kind} name {name!r} must be 1-64 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return name


def check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    """The metrics a manifest records (``save(..., metrics=)``): named as pins are, each a finite number."""
    out = {}
    for name, value in (metrics or {}).items():
        check_name("metric", name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidArgument(f"metric {name!r} must be a finite number, got {value!r}")
        out[name] = float(value)
    return out


def pins_to_bytes(pins: dict[str, str], key: SigningKey | None = None) -> bytes:
    """The ``pins`` file: pin name -> generation name."""
    data = {"format": "trainstate-pins", "format_version": FORMAT_VERSION, "pins": dict(sorted(pins.items()))}
    if key is not None:
        data["signature"] = key.sign(data)
    return json.dumps(data, indent=1, sort_keys=True).encode() + b"\n"


def parse_pins(data: bytes, where: str, key: SigningKey | None = None) -> dict[str, str]:
    raw = load_json(data, where)
    _check(where, raw, {"format": str, "format_version": int, "pins": dict}, {"signature": str})
    if key is not None:
        key.check(raw, raw.get("signature"), where)
    if raw["format"] != "trainstate-pins":
        raise CorruptGeneration(where, "not a trainstate pins file")
    check_version(where, raw["format_version"])
    for name, generation in raw["pins"].items():
        if not _NAME_RE.fullmatch(name) or type(generation) is not str or parse_generation_name(generation) is None:
            raise CorruptGeneration(where, f"invalid pin {name!r:.60}")
    return dict(raw["pins"])
