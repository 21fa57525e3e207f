"""Which generations to keep: pure planning, no I/O.

Only names the library writes (``gen-<12 digits>[-weights]``) are ever
considered; ordering is by parsed update number, never lexical.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from .manifest import parse_generation_name


@dataclass(frozen=True)
class Plan:
    keep: tuple[str, ...]
    prune: tuple[str, ...]
    above_newest: tuple[str, ...]  # newer than what was just published: left alone
    off_lineage: tuple[str, ...] = ()  # not ancestors of the newest: neither counted nor pruned


def keep_last(names: list[str], *, newest: str, kind: str, keep: int,
              lineage: Collection[str] | None = None) -> Plan:
    """Keep ``newest`` and the ``keep - 1`` generations of ``kind`` just below it.

    With ``lineage`` (the newest generation's ancestors, by the ``parent`` link
    in each manifest), only ancestors are counted and pruned. A generation below
    the newest that is not an ancestor was skipped by restore (damaged) or
    belongs to an abandoned timeline: it never takes the slot of a restorable
    generation, and it is never deleted automatically.
    """
    if keep < 1:
        raise ValueError("keep must be at least 1")
    top = parse_generation_name(newest)
    if top is None or top[1] != kind:
        raise ValueError(f"{newest!r} is not a {kind} generation name")
    same_kind = sorted(((p[0], n) for n in names if (p := parse_generation_name(n)) and p[1] == kind), reverse=True)
    above = tuple(n for u, n in same_kind if u > top[0])
    below = [n for u, n in same_kind if u < top[0]]
    ancestors = [n for n in below if lineage is None or n in lineage]
    off = tuple(n for n in below if lineage is not None and n not in lineage)
    return Plan((newest, *ancestors[: keep - 1]), tuple(ancestors[keep - 1:]), above, off)
