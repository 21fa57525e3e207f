"""What an incremental generation's manifest says about the files it shares: pure (de)serialisation.

Format 4 added ``fingerprints`` (per tensor file, each tensor's dtype, shape
and XXH3-128, see :mod:`trainstate.state.changes`) and ``shares`` (the files
that are the very files of an earlier generation, linked rather than
written, by the generation that first wrote them).

Format 5 adds *spares*. A part that does not change is kept in two copies
with the same bytes, ``<part>.safetensors`` and ``<part>.spare``; each save
links the parent's spare as its part and the parent's part as its spare, so
two generations in a row never need the same copy, and a damaged copy leaves
the generation before (or after) whole. A spare is listed with its size and
digests like any file, must equal its twin's record, and is never read by a
restore. A share's value is then the generation that first wrote the bytes,
followed by ``/<file>`` when it wrote them under another name (the spare a
part now is, or the part a spare now is).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..errors import CorruptGeneration
from .names import parse_generation_name

INCREMENTAL_VERSION = 4  # fingerprints and shares
SPARE_VERSION = 5  # spares, and shares first written under another name
TENSOR_SUFFIX = ".safetensors"
SPARE_SUFFIX = ".spare"
_FILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_PRINT_RE = re.compile(r"[0-9a-f]{32}")


def is_spare(file: str) -> bool:
    return file.endswith(SPARE_SUFFIX)


def spare_of(part: str) -> str:
    """The spare copy's name of tensor file ``part``."""
    return part.removesuffix(TENSOR_SUFFIX) + SPARE_SUFFIX


def twin_of(spare: str) -> str:
    """The tensor file whose bytes ``spare`` holds."""
    return spare.removesuffix(SPARE_SUFFIX) + TENSOR_SUFFIX


def origin(generation: str, shares: Mapping[str, str], file: str) -> tuple[str, str]:
    """Where the bytes of ``file`` of ``generation`` (whose manifest records ``shares``) were first written: the
    generation and the name they were written under."""
    value = shares.get(file)
    if value is None:
        return generation, file
    first, _, name = value.partition("/")
    return first, name or file


def share_value(first: tuple[str, str], file: str) -> str:
    """The ``shares`` value of ``file`` whose bytes were first written as ``first`` (generation, name)."""
    return first[0] if first[1] == file else f"{first[0]}/{first[1]}"


def version(prints: Mapping[str, Any], shares: Mapping[str, str], files: Any) -> int | None:
    """The format an incremental generation with these fields and ``files`` (names) needs; ``None`` without
    fingerprints (a whole generation)."""
    if not prints:
        return None
    renamed = any("/" in value for value in shares.values())
    return SPARE_VERSION if renamed or any(is_spare(f) for f in files) else INCREMENTAL_VERSION


def check(where: str, raw: dict, files: Mapping[str, Any]) -> None:
    """Formats 4 and 5: fingerprints of listed tensor files, each tensor in one file; each spare the copy of a
    listed tensor file with fingerprints (same size, same digests); shares of listed tensor files and spares, each
    from an older generation. ``files``: the manifest's records by name."""
    prints, shares, fmt = raw.get("fingerprints", {}), raw.get("shares", {}), raw["format_version"]
    spares = [name for name in files if is_spare(name)]
    if (prints or shares or spares) and fmt < INCREMENTAL_VERSION:
        raise CorruptGeneration(where, f"fingerprints, shares and spares need format_version {INCREMENTAL_VERSION}")
    if (spares or any(type(v) is str and "/" in v for v in shares.values())) and fmt < SPARE_VERSION:
        raise CorruptGeneration(where, f"spares and renamed shares need format_version {SPARE_VERSION}")
    seen: set[str] = set()
    for name, tensors in prints.items():
        if name not in files or not name.endswith(TENSOR_SUFFIX) or type(tensors) is not dict:
            raise CorruptGeneration(where, f"fingerprints of {name!r:.60}, which is not a listed tensor file")
        for tensor, value in tensors.items():
            if tensor in seen or not (type(value) is list and len(value) == 3 and type(value[0]) is str
                                      and type(value[1]) is list and all(type(n) is int and n >= 0 for n in value[1])
                                      and type(value[2]) is str and _PRINT_RE.fullmatch(value[2])):
                raise CorruptGeneration(where, f"malformed fingerprint of tensor {tensor!r:.60} in {name!r:.60}")
            seen.add(tensor)
    for spare in spares:
        twin = files.get(twin_of(spare))
        if twin is None or twin.name not in prints or (twin.size, twin.digest) != (files[spare].size,
                                                                                  files[spare].digest):
            raise CorruptGeneration(where, f"spare {spare!r:.60} is not a copy of a listed tensor file")
    own = parse_generation_name(raw["generation"])
    for name, value in shares.items():
        first, _, renamed = value.partition("/") if type(value) is str else ("", "", "")
        theirs = parse_generation_name(first)
        if (name not in files or not (name in prints or is_spare(name)) or theirs is None or own is None
                or theirs[0] > own[0] or (renamed and not _FILE_RE.fullmatch(renamed))):
            raise CorruptGeneration(where, f"share of {name!r:.60} from {value!r:.60} is not an older tensor file")
