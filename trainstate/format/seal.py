"""The seal of a folder another program wrote: pure (de)serialisation.

A framework (Hugging Face Trainer's ``checkpoint-N/``, say) writes its own
checkpoint folder: trainstate cannot choose its files, but it can make the
folder a verified generation afterwards. The seal, ``trainstate-seal.json``
inside the folder, lists every file's relative path, size and digest and the
folder's own name; it is committed last, by rename, so a folder without one
was never committed and a folder whose files differ from it is damaged. The
seal pointer (``trainstate-latest`` beside the folders) names the last sealed
folder with its seal's digest and size, as the ``latest`` pointer does for
generations.

Parsing is strict, as for manifests: unknown versions, missing, extra or
mistyped fields are a :class:`CorruptGeneration`, never a guess.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..errors import CorruptGeneration, InvalidArgument
from .digest import ALGORITHMS, digest_bytes
from .manifest import FileRecord, load_json

SEAL = "trainstate-seal.json"
SEAL_POINTER = "trainstate-latest"
SEAL_VERSION = 1
MAX_FILES = 1 << 16
_PART_RE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9._+=-]{0,254}")
_HEX_RE = re.compile(r"[0-9a-f]{16,128}")
_META_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")


def check_path(path: str, where: str = "") -> str:
    """A relative POSIX path of plain names (no ``..``, no spaces, none of trainstate's own temp names)."""
    parts = path.split("/")
    plain = all(_PART_RE.fullmatch(p) and p not in (".", "..") and not p.startswith(".trainstate-") for p in parts)
    if not path or len(parts) > 16 or not plain or path == SEAL:
        message = (f"file {path!r:.120} cannot be sealed: each part of a path must be 1-255 letters, digits, "
                   "'.', '_', '+', '=' or '-', not starting with '-' (and not '.', '..' or '.trainstate-...')")
        if where:
            raise CorruptGeneration(where, message)
        raise InvalidArgument(message + "; rename the file, or keep it out of the checkpoint folder")
    return path


@dataclass(frozen=True)
class Seal:
    """What a sealed folder holds: its name, and each file's path, size and digest."""

    name: str
    digest_algorithm: str
    files: tuple[FileRecord, ...]
    created: str  # ISO 8601, UTC
    meta: dict = field(default_factory=dict)  # small facts from the framework: {"global_step": 12}
    format_version: int = SEAL_VERSION

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def to_bytes(self) -> bytes:
        data = {"format": "trainstate-seal", "format_version": self.format_version, "name": self.name,
                "digest_algorithm": self.digest_algorithm, "created": self.created, "meta": self.meta,
                "files": [{"name": f.name, "size": f.size, "digest": f.digest} for f in self.files]}
        data["self_digest"] = _self_digest(data, self.digest_algorithm)
        return json.dumps(data, indent=1, sort_keys=True, allow_nan=False).encode() + b"\n"


@dataclass(frozen=True)
class SealPointer:
    """The last sealed folder, and its seal's digest and size."""

    name: str
    seal_digest: str
    seal_size: int
    digest_algorithm: str

    def to_bytes(self) -> bytes:
        data = {"format": "trainstate-seal-pointer", "format_version": SEAL_VERSION, "name": self.name,
                "seal_digest": self.seal_digest, "seal_size": self.seal_size,
                "digest_algorithm": self.digest_algorithm}
        return json.dumps(data, sort_keys=True).encode() + b"\n"


def _self_digest(data: dict, algorithm: str) -> str:
    body = {k: v for k, v in data.items() if k != "self_digest"}
    return digest_bytes(algorithm, json.dumps(body, indent=1, sort_keys=True).encode())


def _fields(where: str, raw: dict, spec: dict[str, type]) -> None:
    if set(raw) != set(spec):
        raise CorruptGeneration(where, f"fields {sorted(raw)!r:.200} are not {sorted(spec)!r}")
    for key, kind in spec.items():
        if type(raw[key]) is not kind:
            raise CorruptGeneration(where, f"field {key!r} has the wrong type")


def _common(where: str, raw: dict, fmt: str) -> None:
    if raw.get("format") != fmt:
        raise CorruptGeneration(where, f"not a {fmt} file")
    if raw.get("format_version") != SEAL_VERSION:
        raise CorruptGeneration(where, f"format_version {raw.get('format_version')!r:.20} is not {SEAL_VERSION}; "
                                       "it was written by another trainstate version")
    if raw.get("digest_algorithm") not in ALGORITHMS:
        raise CorruptGeneration(where, f"unknown digest algorithm {raw.get('digest_algorithm')!r:.40}")


def check_meta(meta: dict, where: str = "") -> dict:
    """``meta`` maps short names to ints or strings (under 256 characters)."""
    ok = type(meta) is dict and len(meta) <= 64 and all(
        type(k) is str and _META_KEY_RE.fullmatch(k) and (type(v) is int or (type(v) is str and len(v) < 256))
        for k, v in meta.items())
    if not ok:
        if where:
            raise CorruptGeneration(where, "invalid meta")
        raise InvalidArgument(f"seal meta must map up to 64 short names to ints or short strings, got {meta!r:.200}")
    return meta


def parse_seal(data: bytes, where: str) -> Seal:
    raw = load_json(data, where)
    _fields(where, raw, {"format": str, "format_version": int, "name": str, "digest_algorithm": str, "created": str,
                         "meta": dict, "files": list, "self_digest": str})
    _common(where, raw, "trainstate-seal")
    if raw["self_digest"] != _self_digest(raw, raw["digest_algorithm"]):
        raise CorruptGeneration(where, "content does not match its self-digest (the seal was altered)")
    check_meta(raw["meta"], where)
    if len(raw["files"]) > MAX_FILES:
        raise CorruptGeneration(where, f"more than {MAX_FILES} files")
    files = []
    for item in raw["files"]:
        if type(item) is not dict:
            raise CorruptGeneration(where, "file records must be objects")
        _fields(where, item, {"name": str, "size": int, "digest": str})
        check_path(item["name"], where)
        if item["size"] < 0 or not _HEX_RE.fullmatch(item["digest"]):
            raise CorruptGeneration(where, f"invalid file record {item['name']!r:.60}")
        files.append(FileRecord(item["name"], item["size"], item["digest"]))
    if len({f.name for f in files}) != len(files):
        raise CorruptGeneration(where, "a file is listed twice")
    return Seal(raw["name"], raw["digest_algorithm"], tuple(files), raw["created"], raw["meta"],
                raw["format_version"])


def parse_seal_pointer(data: bytes, where: str) -> SealPointer:
    raw = load_json(data, where)
    _fields(where, raw, {"format": str, "format_version": int, "name": str, "seal_digest": str, "seal_size": int,
                         "digest_algorithm": str})
    _common(where, raw, "trainstate-seal-pointer")
    name = raw["name"]
    if not _PART_RE.fullmatch(name) or name in (".", "..") or not _HEX_RE.fullmatch(raw["seal_digest"]) \
            or raw["seal_size"] < 0:
        raise CorruptGeneration(where, "malformed name, seal digest or size")
    return SealPointer(raw["name"], raw["seal_digest"], raw["seal_size"], raw["digest_algorithm"])
