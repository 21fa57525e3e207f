"""Strict, bounded JSON for every file read from a run directory.

The writer emits ``json.dumps(..., allow_nan=False)`` of dicts, so anything
else in a file (even one whose digests match) was not written by a save and is
a :class:`CorruptGeneration`: invalid UTF-8, ``NaN``/``Infinity`` literals or a
number that overflows to infinity, and an object with a duplicate key (which
``json.loads`` would silently resolve to the last value).

Memory: ``json.loads`` builds every object before anything can look at it,
and an empty object costs about 64 bytes for the 2 or 3 bytes of ``{},``, so
a 57 MiB file of empty containers needs gigabytes. Before parsing, a count of
``{`` and ``[`` (an upper bound on the containers: brackets inside strings
count too) is held to :func:`container_limit`: one per ``BYTES_PER_CONTAINER``
bytes of file, and never fewer than ``MIN_CONTAINERS`` (about 75 MB of empty
objects), so that small files are never refused for their shape. Generations
from the test suite use one container per 25 bytes or more. Containers then
cost at most about 9 times the file's size; short unique strings, the worst
case for the rest, about 12 times.

The writer holds itself to the same limit (``snapshot.capture`` refuses a
state beyond it with :class:`~trainstate.errors.UnsupportedValue`), so no
save can publish what this refuses.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import CorruptGeneration

BYTES_PER_CONTAINER = 8
MIN_CONTAINERS = 1 << 20


class _Refused(Exception):
    """Raised inside the parser's hooks; becomes a CorruptGeneration naming the file."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Refused(f"duplicate key {duplicate!r:.60} in an object")
    return value


def _constant(name: str) -> float:
    raise _Refused(f"{name} is not JSON (non-finite floats are written as tagged strings)")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"number {text[:40]} overflows a float")
    return value


def container_limit(size: int) -> int:
    """The most objects and arrays a file of ``size`` bytes may hold."""
    return max(MIN_CONTAINERS, size // BYTES_PER_CONTAINER)


def containers(data: bytes) -> int:
    """An upper bound on the objects and arrays in ``data``, without parsing it."""
    return data.count(b"{") + data.count(b"[")


def loads(data: bytes, where: str) -> Any:
    """Parse ``data`` as the writer's JSON, or raise CorruptGeneration naming ``where``."""
    count = containers(data)
    if count > container_limit(len(data)):
        raise CorruptGeneration(
            where, f"{count} objects and arrays in {len(data)} bytes: more than one per "
            f"{BYTES_PER_CONTAINER} bytes, which no save writes; not parsed (that would take about "
            f"{count * 72 >> 20} MiB)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptGeneration(where, "not valid UTF-8 JSON") from None
    try:
        return json.loads(text, object_pairs_hook=_unique, parse_constant=_constant, parse_float=_finite)
    except _Refused as exc:
        raise CorruptGeneration(where, f"not the JSON a save writes: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise CorruptGeneration(where, f"not valid JSON ({exc.__class__.__name__})") from None
