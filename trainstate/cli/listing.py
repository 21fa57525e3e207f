"""``trainstate ls``: what a run directory holds, said only as far as it was checked.

:func:`gather` reads (pointers, manifests, the retention plan, and the
recovery point chosen exactly as :func:`trainstate.restore.choose` chooses,
every digest of it read) into one report; :func:`table` and :func:`timeline`
render it. The recovery point is named only after its digests were checked;
with ``quick`` it is judged by structure alone and the report says so, and how
to check it.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptGeneration, NoValidGeneration, PointerRollback, TrainStateError
from ..format.manifest import POINTER, WEIGHTS_POINTER, Manifest, generation_order, parse_generation_name
from ..format.signing import SigningKey
from ..lifecycle.generations import Lifecycle, policy_from_record
from ..lifecycle.retention import Plan, Retention, superseded_by
from ..distributed.load import check_whole
from ..lifecycle.candidates import recovery_point
from ..restore import choose
from ..storage.base import Store
from ..storage.verify import verify_generation

ASIDE_WHY = {"rejected": "damaged, kept as evidence", "abandoned": "a timeline the run left, kept as evidence",
             "superseded": "being replaced; the next save finishes that"}


@dataclass
class Recovery:
    """Where a restart resumes, and how far that was checked."""

    generation: str | None
    checked: str  # "digests": chosen as restore chooses, every byte read; "structure": manifests and sizes only
    rejected: list[dict[str, str]] = field(default_factory=list)  # passed over on the way, and why
    problem: str = ""  # why there is none (a signed pointer rolled back, nothing verifies)


def find_recovery(store: Store, key: SigningKey | None, quick: bool) -> Recovery:
    """The generation a restore would resume from: with every digest checked, as restore checks them,
    or (``quick``) by structure only."""
    if quick:
        return Recovery(recovery_point(store, key), "structure")
    quiet = _Quiet()  # what restore would log is in the report instead
    logging.getLogger("trainstate").addFilter(quiet)
    try:
        chosen, rejected = choose(store, key, None, preview=True, reader=check_whole)
    except NoValidGeneration as exc:
        return Recovery(None, "digests", [{"generation": r.generation, "reason": r.reason} for r in exc.rejections],
                        "no full generation verifies")
    except PointerRollback as exc:
        return Recovery(None, "digests", [], str(exc))
    finally:
        logging.getLogger("trainstate").removeFilter(quiet)
    name = chosen[0].manifest.generation if chosen is not None else None
    return Recovery(name, "digests", [{"generation": r.generation, "reason": r.reason} for r in rejected])


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def human_size(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def _short_time(created: str | None) -> str:
    if not created:
        return "-"
    try:
        moment = datetime.datetime.fromisoformat(created).astimezone(datetime.timezone.utc)
    except ValueError:
        return created
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def _policy(life: Lifecycle) -> tuple[Retention, str]:
    manifest = life.newest_full()
    if manifest is not None and manifest.retention:
        return policy_from_record(manifest.retention), f"recorded in {manifest.generation}"
    return Retention(), "defaults (no policy recorded)"


def gather(store: Store, names: list[str], key: SigningKey | None, *, full: bool, quick: bool) -> dict[str, Any]:
    """Everything ``ls`` says about ``names`` (the generations listed) in ``store``."""
    life = Lifecycle(store, key)
    pointers = read_pointers(store, key)
    latest = {v["generation"]: k for k, v in pointers.items() if v["ok"]}
    recovery = find_recovery(store, key, quick)
    rejected = {r["generation"]: r["reason"] for r in recovery.rejected}
    pins: dict[str, str] = {}
    pins_error = None
    try:
        pins = life.pins()
    except CorruptGeneration as exc:
        pins_error = str(exc)
    everything = store.generations()
    manifests = life.manifests(everything)
    policy, policy_source = _policy(life)
    decided = _plan(life, policy, pins_error)
    anchors = life.anchors()
    lineage = life.lineage(anchors.get("full"), manifests)
    full_anchor = anchors.get("full")
    forks = {end for _, end in manifests[full_anchor].lineage[:-1]} if full_anchor in manifests else set()
    superseded = superseded_by(everything, full_anchor, lineage, forks)
    supersedes = {head: old for old, head in sorted(superseded.items(), key=lambda kv: generation_order(kv[0]))}
    best = life.best(policy) if policy.best else None
    rows = []
    for name in names:
        row = _row(store, key, name, full, recovery, rejected, manifests.get(name))
        row["latest"] = latest.get(name)
        row["pins"] = sorted(p for p, g in pins.items() if g == name)
        row["superseded_by"] = superseded.get(name)
        row["supersedes"] = supersedes.get(name)
        row["marks"] = _marks(row, recovery.generation, policy, best)
        row["retention"] = _decision(decided, name)
        rows.append(row)
    if pins_error:
        rows.append({"generation": "pins", "update": 0, "kind": "-", "latest": None, "size": None, "created": None,
                     "state": f"INVALID: {pins_error}", "pins": [], "marks": [], "retention": None})
    evidence = [{"name": n, "reason": n.split(".", 1)[1].rsplit("-", 1)[0]} for n in store.aside()]
    return {"directory": store.location, "generations": rows, "leftovers": store.leftovers(), "set_aside": evidence,
            "recovery_point": recovery.generation, "recovery_point_checked": recovery.checked,
            "rejected": recovery.rejected, "recovery_problem": recovery.problem, "pins": pins,
            "policy": {"keep_last": policy.keep_last, "keep_last_weights": policy.keep_last_weights,
                       "milestone_every": policy.milestone_every,
                       "best": list(policy.best) if policy.best else None, "source": policy_source},
            "best": best, "note": decided.note if decided else "",
            "pointers": {k: {kk: vv for kk, vv in v.items() if kk != "pointer"} for k, v in pointers.items()}}


def _plan(life: Lifecycle, policy: Retention, pins_error: str | None) -> Plan | None:
    if pins_error:
        return None  # pruning stops on a damaged pins file: no plan to show
    try:
        return life.plan(policy)
    except (CorruptGeneration, OSError):
        return None


def _decision(decided: Plan | None, name: str) -> dict[str, Any] | None:
    if decided is None:
        return None
    for d in decided.decisions:
        if d.generation == name:
            return {"keep": d.keep, "reasons": list(d.reasons)}
    return None


def _row(store: Store, key: SigningKey | None, name: str, full: bool, recovery: Recovery, rejected: dict[str, str],
         manifest: Manifest | None) -> dict[str, Any]:
    update, kind = parse_generation_name(name)
    row: dict[str, Any] = {"generation": name, "update": update, "kind": kind}
    if name in rejected:  # restore read it and passed over it: say why, and do not read it again
        row.update(size=None, created=None, state=f"INVALID: {rejected[name]}")
        return row
    digests = full or (name == recovery.generation and recovery.checked == "digests")
    try:
        v = verify_generation(store, name, content=full, key=key)
        row.update(size=v.manifest_size + sum(f.size for f in v.manifest.files), created=v.manifest.created,
                   state="verified" if digests else "structure ok",
                   shared=sum(f.size for f in v.manifest.files if f.name in v.manifest.shares))
        manifest = v.manifest
    except (TrainStateError, OSError) as exc:
        row.update(size=None, created=None, state=f"INVALID: {exc}")
        manifest = None
    if manifest is not None:
        row.update(parent=manifest.parent, metrics=dict(manifest.metrics),
                   timeline=manifest.lineage[-1][0] if manifest.lineage else None,
                   lineage=[list(e) for e in manifest.lineage])
    return row


def _marks(row: dict[str, Any], recovery: str | None, policy: Retention, best: str | None) -> list[str]:
    marks = []
    if row.get("latest"):
        marks.append(row["latest"])
    if row["generation"] == recovery:
        marks.append("recovery point")
    if row["generation"] == best and policy.best:
        marks.append(f"best {policy.best[0]} ({policy.best[1]})")
    if row.get("pins"):
        marks.append("pinned: " + ", ".join(row["pins"]))
    if row["kind"] == "full" and policy.milestone_every and row["update"] % policy.milestone_every == 0 \
            and not row.get("superseded_by"):
        marks.append("milestone")
    if row.get("supersedes"):
        marks.append(f"supersedes {row['supersedes']}")
    if row.get("superseded_by"):
        marks.append(f"superseded by {row['superseded_by']}")
    return marks


def read_pointers(store: Store, key: SigningKey | None) -> dict[str, dict[str, Any]]:
    """``latest`` and ``latest-weights``: the generation each names, or why it is unusable."""
    from ..format.manifest import parse_pointer

    out = {}
    for name in (POINTER, WEIGHTS_POINTER):
        try:
            data = store.read_pointer(name)
            if data is None:
                continue
            p = parse_pointer(data, name, key)
            out[name] = {"generation": p.generation, "ok": True, "pointer": p}
        except CorruptGeneration as exc:
            out[name] = {"generation": None, "ok": False, "error": str(exc)}
    return out


# rendering ---------------------------------------------------------------------------------------------


def aligned(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    out = []
    for r in [header] + rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def table(report: dict[str, Any]) -> list[str]:
    """The generations as an aligned table (newest first), then what the directory says besides."""
    header = ["generation", "update", "kind", "size", "created (UTC)", "marks", "state"]
    rows = [[r["generation"], str(r["update"]), r["kind"],
             human_size(r["size"]) + (f" ({human_size(r['shared'])} shared)" if r.get("shared") else ""),
             _short_time(r["created"]),
             ", ".join(r["marks"]), r["state"]] for r in report["generations"]]
    rows += [[e["name"], "-", "-", "-", "-", "", f"set aside: {ASIDE_WHY.get(e['reason'], e['reason'])}"]
             for e in report["set_aside"]]
    lines = aligned(header, rows, right={1, 3})
    lines += recovery_lines(report)
    for name, p in report["pointers"].items():
        if not p["ok"]:
            lines.append(f"pointer {name}: INVALID: {p['error']}")
    for name in report["leftovers"]:
        lines.append(f"leftover from an interrupted save (removed by the next save): {name}")
    for entry in report["set_aside"]:
        lines.append(f"set aside ({ASIDE_WHY.get(entry['reason'], entry['reason'])}): {entry['name']}; "
                     f"after review: trainstate discard {report['directory']} {entry['name']}")
    return lines


def recovery_lines(report: dict[str, Any]) -> list[str]:
    """Where a restart resumes, in words that say how far it was checked."""
    recovery, latest = report["recovery_point"], report["pointers"].get(POINTER, {}).get("generation")
    lines = []
    for r in report["rejected"]:
        lines.append(f"restore would reject {r['generation']}: {r['reason']}")
    if recovery is None:
        why = report["recovery_problem"] or "no valid full generation"
        lines.append(f"recovery point: none ({why}; weights-only generations are not restart protection)")
        return lines
    passes = f"; latest names {latest}, which it passes over" if latest not in (None, recovery) else ""
    if report["recovery_point_checked"] == "digests":
        lines.append(f"recovery point: {recovery} (a restart resumes here{passes}; every digest checked)")
    else:
        lines.append(f"recovery point (by structure only, digests NOT checked): {recovery} (a restart resumes here "
                     f"if its bytes are intact{passes}; `trainstate ls` without --quick, or `trainstate verify "
                     f"{report['directory']}`, checks them)")
    return lines
