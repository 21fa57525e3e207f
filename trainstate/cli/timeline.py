"""``trainstate ls --timeline``: a run's lineage as text (pure rendering of :func:`listing.gather`'s report).

Each timeline is drawn newest first with its generations: update, name, what
the retention policy decides (keep, and by which rule; or prune, and why) and
the marks ``ls`` gives (latest, recovery point, best, pinned, milestone,
supersedes / superseded by). A timeline that began with a resume from an
older generation (a fallback past a damaged latest, or ``restore(...,
generation=...)``) says where it forked from; the timeline it left shows
what stayed behind. Weights-only generations, damaged ones and set-aside
evidence follow.
"""

from __future__ import annotations

from typing import Any

from .listing import ASIDE_WHY, aligned, recovery_lines


def _origin(rows: list[dict[str, Any]]) -> tuple[str, int] | None:
    for r in rows:
        lineage = r.get("lineage") or []
        if len(lineage) > 1:
            parent, end = lineage[-2]
            return parent, end
    return None


def _retention(row: dict[str, Any]) -> tuple[str, str]:
    decision = row.get("retention")
    if decision is None:
        return "-", "no retention plan (damaged pins file, or nothing to anchor it)"
    return ("keep" if decision["keep"] else "prune"), "; ".join(decision["reasons"])


def _line(prefix: str, row: dict[str, Any]) -> list[str]:
    verdict, why = _retention(row)
    marks = ", ".join(m for m in row.get("marks", ()) if not m.startswith("superseded by"))
    return [prefix, str(row["update"]), row["generation"], verdict, why, f"[{marks}]" if marks else ""]


def timeline(report: dict[str, Any]) -> list[str]:
    """The report's lineage, drawn."""
    rows = report["generations"]
    full = [r for r in rows if r.get("kind") == "full" and "timeline" in r]
    weights = [r for r in rows if r.get("kind") == "weights"]
    damaged = [r for r in rows if r.get("kind") in ("full", "weights") and r["state"].startswith("INVALID")]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in full:
        groups.setdefault(r["timeline"] or "legacy", []).append(r)
    current = next((r["timeline"] or "legacy" for r in full if r["generation"] == report["recovery_point"]), None)
    origins = {t: _origin(g) for t, g in groups.items()}
    order = []
    walk = current
    while walk is not None and walk not in order:  # the current timeline, then the ones it descends from
        order.append(walk)
        walk = origins.get(walk, None) and origins[walk][0]
    order += sorted((t for t in groups if t not in order), key=lambda t: -max(r["update"] for r in groups[t]))
    policy = report["policy"]
    lines = [f"{report['directory']}: {len(groups)} timeline{'s' if len(groups) != 1 else ''}; retention policy "
             f"({policy['source']}): keep_last={policy['keep_last']}, keep_last_weights={policy['keep_last_weights']}, "
             f"milestone_every={policy['milestone_every']}, best={policy['best']}"]
    if report.get("note"):
        lines.append(f"note: {report['note']}")
    cells: list[list[str]] = []
    texts: list[tuple[int, str]] = []  # (position among cells, a full-width line placed before that row)
    for t in order:
        children = [c for c, o in origins.items() if o and o[0] == t]
        role = "current: the recovery point's" if t == current else (
            "an ancestor of the current timeline" if t in order[:order.index(t)] or t in _ancestors(current, origins)
            else "left behind")
        texts.append((len(cells), ""))
        texts.append((len(cells), f"timeline {t} ({role})"))
        for child in children:
            texts.append((len(cells), f"|   continued by timeline {child} after update {origins[child][1]}"))
        for r in sorted(groups.get(t, []), key=lambda r: (r["update"], r["generation"]), reverse=True):
            cells.append(_line("|", r))
        origin = origins.get(t)
        if origin:
            texts.append((len(cells), f"+-- forked from timeline {origin[0]} after update {origin[1]} (a resume "
                                      "from an older generation: a fallback past a damaged one, or "
                                      "restore(generation=...))"))
        else:
            texts.append((len(cells), "+-- the first timeline of this run"))
    if weights:
        texts.append((len(cells), ""))
        texts.append((len(cells), "weights-only (evaluation artifacts, not on any timeline)"))
        cells += [_line("|", r) for r in weights]
    rendered = aligned(["", "update", "generation", "retention", "", "marks"], cells, right={1}) if cells else [""]
    body, header = rendered[1:], rendered[0]
    out = lines + ([header] if cells else [])
    at = 0
    for i, row in enumerate(body + [None]):
        while at < len(texts) and texts[at][0] == i:
            out.append(texts[at][1])
            at += 1
        if row is not None:
            out.append(row)
    for r in damaged:
        out.append(f"damaged (never restored, kept as evidence): {r['generation']}: {r['state']}")
    for e in report["set_aside"]:
        out.append(f"set aside ({ASIDE_WHY.get(e['reason'], e['reason'])}): {e['name']}")
    return out + [""] + recovery_lines(report)


def _ancestors(current: str | None, origins: dict[str, tuple[str, int] | None]) -> set[str]:
    out: set[str] = set()
    walk = current
    while walk is not None and walk not in out:
        out.add(walk)
        origin = origins.get(walk)
        walk = origin[0] if origin else None
    return out
