"""An object store's linked files: references to the object that holds the bytes, not copies (issue 51).

An incremental generation links the parts that did not change. On an object
store a link is a *reference*: the generation's file is the object its
bytes were first uploaded as (``attempts/<origin>/<name>``), so a part is
stored once however many generations name it. While a save is staged each
link is a small object ``refs/<attempt>/<file>`` (every rank of a multi-rank
save writes its own); the commit record carries them all (``refs``: file ->
[object, size]), and a reader resolves a generation's file through the
record it reads anyway.

Retention by reachability, never by counts: removing a generation deletes
its commit record first (the generation is gone at once), then sweeps. An
object under ``attempts/`` stays while its attempt is live (named by a
commit or aside record, or begun and not abandoned: a ``staging/`` marker)
or a live attempt's reference names it; everything else goes, the staged
references of dead attempts included. The sweep derives all of it from what
it lists, each time, so a crash at any point leaves at most objects the next
sweep deletes, and never a reference to a deleted object.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import CorruptGeneration

REFS = "refs/"
_TARGET_RE = re.compile(r"attempts/[A-Za-z0-9][A-Za-z0-9._-]{0,79}-[0-9a-f]{16}/[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

Refs = dict[str, tuple[str, int]]  # file -> (the object holding its bytes, its size)


def encode(target: str, size: int) -> bytes:
    return json.dumps({"format": "trainstate-ref", "object": target, "size": size}).encode()


def decode(data: bytes, where: str) -> tuple[str, int]:
    try:
        raw = json.loads(data)
        if raw.get("format") != "trainstate-ref":
            raise ValueError
        return _checked(raw["object"], raw["size"], where)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CorruptGeneration(where, "is not a trainstate reference") from None


def _checked(target: object, size: object, where: str) -> tuple[str, int]:
    if not isinstance(target, str) or not _TARGET_RE.fullmatch(target) or type(size) is not int or size < 0:
        raise CorruptGeneration(where, "names no object of a save attempt")
    return target, size


def from_record(raw: Mapping[str, Any], where: str) -> Refs:
    """The references a commit (or aside) record carries (none in a record written before them)."""
    value = raw.get("refs", {})
    if not isinstance(value, dict):
        raise CorruptGeneration(where, "malformed references")
    out: Refs = {}
    for file, entry in value.items():
        if not isinstance(entry, list) or len(entry) != 2:
            raise CorruptGeneration(where, "malformed references")
        out[file] = _checked(entry[0], entry[1], where)
    return out


def to_record(refs: Mapping[str, tuple[str, int]]) -> dict[str, Any]:
    return {"refs": {file: [target, size] for file, (target, size) in sorted(refs.items())}} if refs else {}


def staged(client: Any, attempt: str) -> Refs:
    """The references staged for ``attempt`` (every rank's), read from their objects."""
    out: Refs = {}
    prefix = f"{REFS}{attempt}/"
    for key in client.listing(prefix):
        data = client.get_small(key)
        if data is not None:
            out[key[len(prefix):]] = decode(data, key)
    return out


def sweep(client: Any, uploads: Any, live: set[str], kept: Iterable[str]) -> list[str]:
    """Delete every object of an attempt not in ``live`` that no reference in ``kept`` (the objects live
    attempts' references name) holds, their open multipart uploads and the staged references of dead
    attempts; the dead attempts whose objects are all gone now."""
    keep = set(kept)
    for key in client.listing(REFS):
        attempt = key.split("/", 2)[1]
        if attempt in live:
            data = client.get_small(key)  # (a live attempt's staged reference: not committed yet)
            if data is not None:
                keep.add(decode(data, key)[0])
        else:
            client.delete(key)
    for key, upload_id in uploads.listed("attempts/"):
        if key.split("/", 2)[1] not in live:
            uploads.abort(key, upload_id)
    dead: set[str] = set()
    held: set[str] = set()
    for key in client.listing("attempts/"):
        attempt = key.split("/", 2)[1]
        if attempt in live:
            continue
        if key in keep:
            held.add(attempt)
        else:
            client.delete(key)
            dead.add(attempt)
    return sorted(dead - held)


def retained(objects: Iterable[str], live: set[str], kept: Iterable[str]) -> set[str]:
    """Of the attempts whose ``objects`` are listed, those no record names whose objects live attempts still
    reference (what a sweep keeps)."""
    keep = set(kept)
    return {key.split("/", 2)[1] for key in objects if key in keep and key.split("/", 2)[1] not in live}
