"""Which generations to keep: pure planning, no I/O.

Only names the library writes (``gen-<12 digits>[-weights]``) are ever
considered; ordering is by parsed update number, never lexical.
"""

from __future__ import annotations

from dataclasses import dataclass

from .manifest import parse_generation_name


@dataclass(frozen=True)
class Plan:
    keep: tuple[str, ...]
    prune: tuple[str, ...]
    above_newest: tuple[str, ...]  # newer than what was just published: left alone


def keep_last(names: list[str], *, newest: str, kind: str, keep: int) -> Plan:
    """Keep ``newest`` and the ``keep - 1`` generations of ``kind`` just below it."""
    if keep < 1:
        raise ValueError("keep must be at least 1")
    top = parse_generation_name(newest)
    if top is None or top[1] != kind:
        raise ValueError(f"{newest!r} is not a {kind} generation name")
    same_kind = sorted(((p[0], n) for n in names if (p := parse_generation_name(n)) and p[1] == kind), reverse=True)
    above = tuple(n for u, n in same_kind if u > top[0])
    at_or_below = [n for u, n in same_kind if u <= top[0]]
    if newest not in at_or_below:
        at_or_below.insert(0, newest)
    return Plan(tuple(at_or_below[:keep]), tuple(at_or_below[keep:]), above)
