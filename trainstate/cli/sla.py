"""``trainstate cadence --run NODE_DIR``: intervals, lost work and recovery per failure class, from measurements.

Called by :func:`trainstate.cli.lifecycle.cmd_cadence` when ``--run`` is
given. This module does the reading and the printing: the node directory's
``tier-timings.json`` (:mod:`trainstate.distributed.tiertimes`: the blocking
save, replication, upload and each kind of restore, as the run measured
them) and its generations' manifests (``next_update`` and ``created``: the
save cadence, as :func:`trainstate.lifecycle.costs.measure_cadence` measures
it). The arithmetic is :mod:`trainstate.lifecycle.sla`. The failure rates
are the user's: a run directory cannot measure them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path
from typing import Any

from ..distributed import tiertimes
from ..errors import InvalidArgument, TrainStateError
from ..format import signing
from ..format.manifest import parse_generation_name
from ..lifecycle import costs, sla
from ..storage.local import LocalStore
from ..storage.verify import read_manifest

MODEL = ("a model computed from the measurements below (medians, n = samples) and the failure rates you gave; "
         "not a guarantee: failures are modelled as independent and exponential")
KIND_WHAT = {"save_local": "blocking save (local tier's commit)", "replicate": "replication (background)",
             "upload": "upload to the remote (background)", "restore_local": "restore from own disks",
             "restore_peer": "restore with peers' replicas", "restore_remote": "restore from the object store"}
SHORT = {"process": "process crash", "domain": "one domain lost", "every_node": "every node lost"}


def _store(directory: str) -> LocalStore:
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory (pass one node's directory of a tiered run)")
    if parse_generation_name(path.name):
        raise InvalidArgument(f"{directory} is one generation; pass the node directory that holds it ({path.parent})")
    return LocalStore(path, create=False)


def _created(text: str) -> datetime.datetime | None:
    try:
        when = datetime.datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None
    return when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)


def _saves(store: LocalStore) -> tuple[costs.SaveCadence | None, int]:
    """The save cadence from the node's full generations' manifests, and how many manifests read."""
    key = signing.resolve(None, store.location)
    points = []
    for name in store.generations():
        parsed = parse_generation_name(name)
        if parsed is None or parsed[1] != "full":
            continue
        try:
            manifest = read_manifest(store, name, None, key)[0]
        except (TrainStateError, OSError):  # a damaged holding says nothing about the cadence
            continue
        when = _created(manifest.created)
        if when is not None:
            points.append((manifest.next_update, when))
    return costs.measure_cadence(points), len(points)


def _timings(store: LocalStore) -> dict[str, list[list[float]]]:
    samples = tiertimes.read(store)
    if samples["save_local"]:
        return samples
    path = store.root / tiertimes.TIMINGS
    state = "is missing" if not path.exists() else "holds no save_local sample (damaged, or no save finished yet)"
    raise InvalidArgument(f"{path} {state}: no measured save cost to compute from. It is written by runs with "
                          f"node-local tiers; {sla.HOW['save_local']}, then pass that node's directory. For a "
                          "single-directory run use the explicit mode: --save-cost S --mtbf S --step-time S")


def cadence(store: LocalStore, samples: dict[str, list[list[float]]], figs: dict[str, sla.Figure | None],
            args: argparse.Namespace) -> sla.Cadence:
    """Updates per save, seconds per update and saves per upload: measured, or the flags that override them."""
    measured, manifests = _saves(store)
    sources = []
    every = args.every if args.every is not None else measured.updates_per_save if measured else None
    if every is None:
        raise InvalidArgument(f"{store.location} holds {manifests} full generation manifest(s) that read: measuring "
                              "the updates between saves needs 2 or more (keep_last >= 2, two saves); or pass "
                              "--every UPDATES and --step-time SECONDS")
    sources.append(f"a save every {every} updates [" + ("--every]" if args.every is not None else
                   f"manifests: smallest gap between {manifests} generations]"))
    if args.step_time is not None:
        step, step_source = args.step_time, "--step-time"
    elif measured is not None:
        step = sla.step_time(measured.interval_s, measured.updates_per_save, figs["save_local"].seconds)
        step_source = (f"manifests: (median of {measured.pairs} gap(s) between saves, {measured.interval_s:.3g} s, "
                       f"- the blocking save) / {measured.updates_per_save}")
    else:
        raise InvalidArgument(f"{store.location}: fewer than 2 generation manifests, so the seconds per update "
                              "cannot be measured; pass --step-time SECONDS")
    sources.append(f"{step:.4g} s of compute per update [{step_source}]")
    inferred = sla.mirror_every([s[2] for s in samples["save_local"]], [s[2] for s in samples["upload"]])
    if args.mirror_every is not None:
        mirror, mirror_source = args.mirror_every, "--mirror-every"
    elif inferred is not None:
        mirror, mirror_source = inferred[0], f"saves between uploads: most common of {inferred[1]} gap(s)"
    else:
        mirror, mirror_source = None, "not known: fewer than 2 uploads timed here (--mirror-every K)"
    sources.append(f"the remote every {mirror if mirror else '?'} saves [{mirror_source}]")
    return sla.Cadence(every, step, mirror, tuple(sources), measured.interval_s if measured else None,
                       measured.updates_per_save if measured else None)


def compute(args: argparse.Namespace) -> tuple[LocalStore, sla.Report]:
    """Read the node directory and compute the report."""
    for flag in ("every", "mirror_every"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise InvalidArgument(f"--{flag.replace('_', '-')} must be a positive number of "
                                  f"{'updates' if flag == 'every' else 'saves'}, got {value}")
    if args.step_time is not None and not (math.isfinite(args.step_time) and args.step_time > 0):
        raise InvalidArgument(f"--step-time must be a positive number of seconds, got {args.step_time!r}")
    rates = sla.Rates(args.process_mtbf, args.node_mtbf, args.all_mtbf, args.restart)
    store = _store(args.run)
    samples = _timings(store)
    figs = sla.figures(samples)
    return store, sla.report(figs, rates, cadence(store, samples, figs, args))


def run(args: argparse.Namespace) -> int:
    """``cadence --run``: print the report (or its JSON)."""
    store, found = compute(args)
    if args.json:
        print(json.dumps({"directory": str(store.root), "model": MODEL, **costs.to_json(found)}, indent=1))
        return 0
    for line in lines(str(store.root), found):
        print(line)
    return 0


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h" if seconds < 172800 else f"{seconds / 86400:.3g} d"


def _u(updates: float | None) -> str:
    return "-" if updates is None else f"{updates:.3g} upd" if updates < 1000 else f"{updates:,.0f} upd"


def lines(directory: str, report: sla.Report) -> list[str]:
    """The report as text: measured inputs, intervals, the SLA as run and at the recommended cadence."""
    out = [f"{directory}: {MODEL}", "measured [median over n samples of tier-timings.json]:"]
    for kind, fig in report.figures.items():
        out.append(f"  {kind:<15} {_s(fig.seconds):>9}  {fig.bytes:>13,} B  n={fig.samples:<3} {KIND_WHAT[kind]}"
                   if fig else f"  {kind:<15} {'-':>9}  {sla.not_measured(kind)}")
    out += [f"  cadence: {part}" for part in report.cadence.sources]
    rates = report.rates
    given = ", ".join(f"{sla.CLASSES[f][3]} {_s(rates.mtbf(f))}" for f in sla.CLASSES if rates.mtbf(f))
    out.append(f"given, not measured: {given}; restart {_s(rates.restart_s)} (relaunch, rendezvous, replacement: "
               f"{'given' if rates.restart_s else 'not counted; pass --restart S once you have measured it'})")
    out += ["", "intervals (Young sqrt(2CM) / Daly), each tier's cost C against its failure class's MTBF M:"]
    for i in report.intervals:
        head = f"  {i.tier:<10} C = {i.cost} {_s(i.cost_s)} (n={i.cost_samples})"
        if i.missing:
            out.append(f"{head}: {i.missing}")
            continue
        every = f"every {i.daly_every} {i.unit}" + (" as run (mirror_every)" if i.unit == "saves" else "")
        against = " + ".join(SHORT[f] for f in i.against)
        out.append(f"{head}, M = {_s(i.mtbf_s)} [{against}]: Young {_s(i.young_s)}, Daly {_s(i.daly_s)} = {every}")
    out.append("  (`saves` is the interval to save at: every save serves the local and the replicated tier)")
    for table in (report.as_run, report.recommended):
        if table is not None:
            out += [""] + _table(table)
    if report.recommended is None:
        out += ["", "no recommended cadence: give --process-mtbf or --node-mtbf for a save interval"]
    out += [f"note: {n}" for n in report.notes]
    out += ["", "not promised: times outside these measurements (scheduling, relaunch, a replacement node, unless "
            "--restart), figures on other hardware or sizes, and any row marked not measured"]
    return out


def _table(t: sla.SLA) -> list[str]:
    remote = f", the remote every {t.mirror_every} saves" if t.mirror_every else ""
    out = [f"SLA {t.label}: a save every {t.updates_per_save} updates ({_s(t.period_s)} apart){remote}",
           f"  {'failure':<16} {'tier':<10} {'lost, expected':<22} {'lost, worst':<22} {'restore (n)':<14} "
           f"{'back, expected':<15} {'back, worst':<12} overhead"]
    for r in t.rows:
        lost = ["-", "-"] if r.expected_lost_s is None else [f"{_s(r.expected_lost_s)} = {_u(r.expected_lost_updates)}",
                                                             f"{_s(r.worst_lost_s)} = {_u(r.worst_lost_updates)}"]
        restore = "-" if r.restore_s is None else f"{_s(r.restore_s)} ({r.restore_samples})"
        share = "-" if r.overhead is None else f"{r.overhead:.3%}"
        out.append(f"  {SHORT[r.failure]:<16} {r.tier:<10} {lost[0]:<22} {lost[1]:<22} {restore:<14} "
                   f"{_s(r.back_s):<15} {_s(r.worst_back_s):<12} {share}")
        out += [f"      {m}" for m in r.missing]
    out.append(f"  {'blocking saves':<16} {'':<10} {'':<22} {'':<22} {'':<14} {'':<15} {'':<12} {t.save_overhead:.3%}")
    if t.overhead is None:
        out.append("  total expected overhead: not computed (no class has both an MTBF and its measurements)")
    else:
        left = f"; leaves out {', '.join(SHORT[f] for f in t.overhead_leaves_out)} (not measured)" \
            if t.overhead_leaves_out else ""
        out.append(f"  total expected overhead: {t.overhead:.3%} (first order: blocking saves + "
                   f"{' + '.join(SHORT[f] for f in t.overhead_covers)}{left})")
    return out


def add_flags(p: Any) -> None:
    """The measured mode's flags on the ``cadence`` parser."""
    p.add_argument("--run", metavar="NODE_DIR", default=None,
                   help="measured mode: one node's directory of a tiered run (its tier-timings.json and manifests; "
                   "rank 0's node also holds the upload timings)")
    p.add_argument("--process-mtbf", type=float, default=None, metavar="S",
                   help="mean seconds between process crashes (the local tier serves them)")
    p.add_argument("--node-mtbf", type=float, default=None, metavar="S",
                   help="mean seconds between losses of one failure domain (a node, a rack: peers serve them)")
    p.add_argument("--all-mtbf", type=float, default=None, metavar="S",
                   help="mean seconds between losses of every node (the remote tier serves them)")
    p.add_argument("--every", type=int, default=None, metavar="UPDATES",
                   help="with --run: evaluate a save every UPDATES updates instead of the measured cadence")
    p.add_argument("--mirror-every", type=int, default=None, metavar="K",
                   help="with --run: the remote tier every K saves (default: as measured)")
