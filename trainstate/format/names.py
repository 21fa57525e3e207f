"""Generation names: ``gen-<12-digit update>``, ``-weights`` for weights-only, ``-r001``... for a later save at the
same update that supersedes it. Pure: parsing and ordering only."""

from __future__ import annotations

import re

from ..errors import InvalidArgument

_GEN_RE = re.compile(r"gen-(\d{12})(-weights|-r(?!000)\d{3})?")  # -rNNN: a later save at the same update

MAX_REVISION = 999


def generation_name(next_update: int, kind: str = "full", revision: int = 0) -> str:
    """``gen-<12-digit update>``; ``-weights`` for weights-only, ``-r001``... for a full generation that
    supersedes an earlier one at the same update (a later save whose state differs)."""
    if not 0 <= next_update < 10**12:
        raise InvalidArgument(f"next_update must be in [0, 10**12), got {next_update}")
    if not 0 <= revision <= MAX_REVISION or (revision and kind != "full"):
        raise InvalidArgument(f"revision must be in [0, {MAX_REVISION}] (full generations only), got {revision}")
    return f"gen-{next_update:012d}" + ("-weights" if kind == "weights" else f"-r{revision:03d}" if revision else "")


def parse_generation_name(name: str) -> tuple[int, str] | None:
    """``(update, kind)`` for a generation directory name, else ``None``."""
    match = _GEN_RE.fullmatch(name)
    if match is None:
        return None
    return int(match[1]), "weights" if match[2] == "-weights" else "full"


def generation_order(name: str) -> tuple[int, int]:
    """``(update, revision)`` of a generation name: the order of saves (revision 0: the first at its update).

    Call only on names :func:`parse_generation_name` accepts.
    """
    match = _GEN_RE.fullmatch(name)
    if match is None:
        raise InvalidArgument(f"{name!r} is not a generation name")
    tail = match[2] or ""
    return int(match[1]), int(tail[2:]) if tail.startswith("-r") else 0


def newest_first(names: list[str]) -> list[str]:
    """Generation names ordered by parsed update number (then revision), newest first; others dropped."""
    parsed = [(p[0], p[1], generation_order(n)[1], n) for n in names if (p := parse_generation_name(n))]
    return [n for *_, n in sorted(parsed, reverse=True)]
