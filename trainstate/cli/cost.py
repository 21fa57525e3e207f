"""``trainstate cost DIR --rates FILE``: what keeping this run's checkpoints costs per storage tier.

Registered by :mod:`trainstate.cli.main` through :func:`add_parser`. This
module does the reading: the run's generations through the same verifying
reader as ``ls`` and ``plan`` (sizes and ``created`` times from the
manifests, the policy the run recorded, its pins) and the rates file the
user supplies. The arithmetic is :mod:`trainstate.lifecycle.costs`; no price
is built in.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shutil
from pathlib import Path
from typing import Any

from . import lifecycle as cli_lifecycle
from ..errors import InvalidArgument, TrainStateError
from ..format.manifest import Manifest, parse_generation_name
from ..lifecycle import costs
from ..lifecycle.generations import Lifecycle
from ..distributed import tiertimes
from ..format.manifest import POINTER, generation_order
from ..lifecycle import tiercosts
from ..lifecycle.retention import Retention
from ..storage.base import Store
from ..storage.local import LocalStore
from ..storage.verify import read_manifest, read_pointed
from ..tools.nodes import is_node_directory, read_node


def _generation_bytes(store: Store, life: Lifecycle, generation: str) -> tuple[int, Manifest]:
    """What one generation stores: every file its manifest lists, and the manifest itself."""
    manifest, _, manifest_size = read_manifest(store, generation, key=life.key)
    return manifest_size + sum(f.size for f in manifest.files), manifest


def _created(manifest: Manifest) -> datetime.datetime | None:
    """A manifest's ``created`` time (UTC); ``None`` if it does not parse."""
    try:
        when = datetime.datetime.fromisoformat(manifest.created)
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)


def _kind(store: Store, life: Lifecycle, kind: str, manifests: list[Manifest], keep: int,
          args: argparse.Namespace) -> costs.KindFigures | str:
    """The figures of one kind of generation, or why its cadence cannot be measured."""
    newest = max(manifests, key=lambda m: m.next_update)
    size, _ = _generation_bytes(store, life, newest.generation)
    size_source = f"{newest.generation}'s manifest: {len(newest.files)} files + the manifest"
    if kind == "full" and args.size_bytes is not None:
        size, size_source = args.size_bytes, "--size-bytes"
    points = [(m.next_update, when) for m in manifests if (when := _created(m)) is not None]
    measured = costs.measure_cadence(points)
    if kind == "full" and args.interval_s is not None:
        interval, source = args.interval_s, "--interval-s"
        every = args.every if args.every is not None else measured.updates_per_save if measured else None
    elif measured is not None:
        interval, every = measured.interval_s, measured.updates_per_save
        source = (f"manifests' `created` times: median of {measured.pairs} gap{'s' if measured.pairs != 1 else ''} "
                  f"between consecutive {kind} generations {measured.updates_per_save} updates apart")
        if kind == "full" and args.every is not None:
            every = args.every
    elif kind == "full":
        return (f"{store.location} holds {len(manifests)} full generation{'s' if len(manifests) != 1 else ''} "
                "on its timeline: measuring a save interval needs at least 2 (the time between consecutive "
                "saves' manifests). Pass --interval-s SECONDS (and --every UPDATES for milestones)")
    else:
        return (f"{len(manifests)} weights-only generation{'s' if len(manifests) != 1 else ''}: no cadence to "
                "measure, so weights-only saves are left out of the estimate")
    return costs.KindFigures(kind=kind, size_bytes=size, files=len(newest.files), interval_s=interval,
                             updates_per_save=every, keep=keep, size_source=size_source, interval_source=source)


def measure(args: argparse.Namespace) -> tuple[costs.Measured, list[str]]:
    """The run's figures (with the flags' overrides applied) and notes on what was left out."""
    _check_flags(args)
    path = Path(args.directory)
    if path.is_dir() and parse_generation_name(path.name):
        raise InvalidArgument(f"{args.directory} is one generation; pass the run directory that holds it "
                              f"({path.parent})")
    store, life = cli_lifecycle._lifecycle(args.directory)
    names = store.generations()
    if not names:
        raise InvalidArgument(f"{store.location} holds no generations: nothing to measure (is it the run "
                              "directory? a save creates gen-<update> directories in it)")
    if is_node_directory(path):  # one node of a tiered run holds part of each generation: manifests alone
        manifests, newest = _node_manifests(store, life, names)
    else:
        manifests, newest = life.manifests(names), life.newest_full()
    if newest is None:
        raise InvalidArgument(f"{store.location} holds no full generation that verifies: nothing to size a "
                              f"restart from (`trainstate verify {store.location}` says why)")
    policy, policy_source = cli_lifecycle._policy(life, args)
    timeline = Lifecycle.lineage(newest.generation, manifests)
    full = _kind(store, life, "full", [manifests[n] for n in timeline], policy.keep_for("full"), args)
    if isinstance(full, str):
        raise InvalidArgument(full)
    notes = []
    weights: costs.KindFigures | None = None
    weight_manifests = [m for m in manifests.values() if m.kind == "weights"]
    if weight_manifests:
        found = _kind(store, life, "weights", weight_manifests, policy.keep_for("weights"), args)
        if isinstance(found, str):
            notes.append(found)
        else:
            weights = found
    pinned_bytes, pinned = 0, 0
    for generation in sorted(set(life.pins().values())):
        try:
            pinned_bytes += _generation_bytes(store, life, generation)[0]
            pinned += 1
        except (TrainStateError, OSError) as exc:  # a pin naming what no longer reads stores nothing
            notes.append(f"pinned {generation} left out: {exc}")
    if policy.milestone_every and full.updates_per_save is None:
        notes.append("milestones left out: the updates between saves is not known (pass --every UPDATES)")
    return costs.Measured(full=full, weights=weights, policy=policy, policy_source=policy_source,
                          pinned_bytes=pinned_bytes, pinned=pinned,
                          restore=restore_reads(store, newest) if args.size_bytes is None else None), notes


def _node_manifests(store: Store, life: Lifecycle, names: list[str]) -> tuple[dict[str, Manifest], Manifest | None]:
    """A node's manifests that read, and the one its ``latest`` names (else the newest full): sizes and times come
    from the manifests; whether the nodes' holdings serve them is ``trainstate nodes``' to check."""
    manifests = {}
    for name in names:
        try:
            manifests[name] = read_manifest(store, name, key=life.key)[0]
        except (TrainStateError, OSError):
            continue
    pointer = read_pointed(store, POINTER, life.key)
    full = sorted((n for n, m in manifests.items() if m.kind == "full"), key=generation_order)
    newest = manifests.get(pointer.generation) if pointer else None
    return manifests, newest or (manifests[full[-1]] if full else None)


def restore_reads(store: Store, manifest: Manifest) -> costs.RestoreReads:
    """What restoring ``manifest``'s generation reads: every file once (with several ranks, each byte is
    downloaded by one rank and handed to the others that need it), from ``world_size`` processes."""
    return costs.restore_reads([(f.size, 1) for f in manifest.files], len(manifest.ranks) or 1)


def _check_flags(args: argparse.Namespace) -> None:
    for flag, value, zero_ok in (("--interval-s", args.interval_s, False), ("--size-bytes", args.size_bytes, True),
                                 ("--every", args.every, False), ("--months", args.months, False),
                                 ("--restores-per-month", args.restores_per_month, True),
                                 ("--max-age-days", args.max_age_days, True)):
        if value is not None and not (value >= 0 if zero_ok else value > 0):
            raise InvalidArgument(f"{flag} must be {'zero or more' if zero_ok else 'positive'}, got {value}")


def read_rates(path: str) -> costs.Rates:
    """The rates file, read and checked (TOML or JSON by its extension)."""
    return costs.parse_rates(Path(path).read_bytes(), path)


def cmd_cost(args: argparse.Namespace) -> int:
    """Measure the run, price it on every tier of the rates file, print the estimate."""
    measured, notes = measure(args)
    rates = read_rates(args.rates)
    today = datetime.date.today()
    warning = costs.staleness(rates, today, args.max_age_days)
    local = None
    if is_node_directory(args.directory):  # node-local tiers: the object store holds every mirror_every-th save
        local, measured, rates = _node_tiers(args, measured, rates)
    elif args.replication_tier is not None:
        raise InvalidArgument(f"--replication-tier prices the replicas of a run with node-local tiers; "
                              f"{args.directory} is not one node's directory of such a run (no replicas/ in it)")
    result = costs.estimate(measured, rates, restores_per_month=args.restores_per_month, months=args.months)
    report = _report(args, measured, rates, result, today, warning, notes)
    if local is not None:
        report["node_tiers"] = local
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        if local is not None:
            _print_node_tiers(local)
        _print(report, measured, result)
    return 0


def _node_tiers(args: argparse.Namespace, measured: costs.Measured, rates: costs.Rates
                ) -> tuple[dict[str, Any], costs.Measured, costs.Rates]:
    """A node's directory of a tiered run: its capacity and the replicas' traffic, priced on
    ``--replication-tier``; the rest of the rates then price the remote tier at its own cadence."""
    config = tiertimes.read_config(LocalStore(args.directory, create=False))
    if not config:
        raise InvalidArgument(f"{Path(args.directory) / tiertimes.TIMINGS} does not record how the run is tiered "
                              "(written at each start of a run with node-local tiers, by this version or later): "
                              "restart the run once, then price it")
    tiering = tiercosts.Tiering(**{k: config.get(k, 0) for k in tiertimes.CONFIG_KEYS})
    node, _ = read_node(args.directory, content=False)
    newest = node.pointers.get("local") or max(node.held, key=generation_order, default=None)
    held = node.held.get(newest, {}).get("files", {}) if newest else {}
    manifest = {f.name: f.size for f in measured_manifest(args.directory, newest).files} if newest else {}
    own = sum(manifest.get(f, 0) for f, tier in held.items() if tier == "own")
    replicas = sum(manifest.get(f, 0) for f, tier in held.items() if tier == "replica")
    volumes = tiercosts.node_volumes(tiering, measured.full, own, replicas)
    replication = None
    names = [t.name for t in rates.tiers]
    if args.replication_tier is not None:
        if args.replication_tier not in names:
            raise InvalidArgument(f"--replication-tier {args.replication_tier}: no such tier in {args.rates} "
                                  f"(it has {', '.join(names)})")
        replication = tiercosts.replication_cost(volumes, rates.tiers[names.index(args.replication_tier)])
        rates = dataclasses.replace(rates, tiers=tuple(t for t in rates.tiers if t.name != args.replication_tier))
    local = {"generation": newest, "tiering": costs.to_json(tiering), "per_month": costs.to_json(volumes),
             "replication": costs.to_json(replication), "free_bytes": shutil.disk_usage(args.directory).free}
    if tiering.mirror_every:
        measured = dataclasses.replace(measured, full=tiercosts.remote_figures(tiering, measured.full),
                                       policy=Retention(keep_last=max(1, tiering.remote_keep)),
                                       policy_source=f"the remote tier's retention, {tiertimes.TIMINGS}")
    elif rates.tiers:
        raise InvalidArgument(f"{args.directory}: this run has no remote tier (no mirror=), so nothing of it is "
                              f"stored on {', '.join(t.name for t in rates.tiers)}; price its replicas alone with "
                              "--replication-tier NAME and a rates file of that one tier")
    return local, measured, rates


def measured_manifest(directory: str, generation: str) -> Manifest:
    store, life = cli_lifecycle._lifecycle(directory)
    return read_manifest(store, generation, key=life.key)[0]


def _print_node_tiers(local: dict[str, Any]) -> None:
    t, v, r = local["tiering"], local["per_month"], local["replication"]
    remote = f"every {t['mirror_every']} saves to the remote, which keeps {t['remote_keep']}" if t["mirror_every"] \
        else "no remote tier"
    print(f"node-local tiers: {t['nodes']} nodes in {t['domains']} failure domain(s), {t['ranks']} ranks, "
          f"replicas={t['replicas']}, keep_last={t['keep_last']}, {remote}")
    fits = "fits" if local["free_bytes"] >= v["node_capacity_bytes"] else "DOES NOT FIT"
    print(f"  this node holds {v['own_bytes']:,} B of its own and {v['replica_bytes']:,} B of replicas of "
          f"{local['generation']}; capacity needed (keep_last + 1 being written): {v['node_capacity_bytes']:,} B "
          f"({fits}: {local['free_bytes']:,} B free here now)")
    cost = f"; priced on {r['tier']}: {_money(r['transfer'])} per month" if r else \
        " (not priced: --replication-tier NAME prices it per GB in and out)"
    print(f"  replication: {_num(v['replicated_gb'])} GB per month to replicas, {_num(v['cross_domain_gb'])} GB "
          f"of it between failure domains{cost}")
    if t["mirror_every"]:
        print(f"  the object-store tiers below are priced for {_num(v['uploads_per_month'])} uploads per month "
              "(each restore counted below reads the remote: only when the nodes cannot serve)")


def _report(args: argparse.Namespace, measured: costs.Measured, rates: costs.Rates, result: costs.Estimate,
            today: datetime.date, warning: str | None, notes: list[str]) -> dict[str, Any]:
    age = rates.age_days(today)
    tiers = []
    for tier in result.tiers:
        row = costs.to_json(tier)
        row["horizon_total"] = tier.total * result.months
        tiers.append(row)
    return {
        "directory": args.directory,
        "measured": {"full": costs.to_json(measured.full), "weights": costs.to_json(measured.weights),
                     "policy": cli_lifecycle._policy_json(measured.policy), "policy_source": measured.policy_source,
                     "best_bytes": measured.best_bytes, "pinned_bytes": measured.pinned_bytes,
                     "pinned": measured.pinned},
        "rates": {"file": args.rates, "date": rates.date.isoformat(), "age_days": age, "currency": rates.currency,
                  "source": rates.source},
        "stale": age > args.max_age_days, "max_age_days": args.max_age_days,
        "warnings": [warning] if warning else [], "notes": notes,
        "months": result.months, "restores_per_month": result.restores_per_month,
        "per_month": costs.to_json(result.volumes), "tiers": tiers,
        "assumptions": list(costs.ASSUMPTIONS),
    }


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _money(x: float) -> str:
    return f"{x:,.2f}" if abs(x) >= 1 or x == 0 else f"{x:.4g}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.3g} s" if seconds < 120 else f"{seconds / 60:.3g} min" if seconds < 7200 \
        else f"{seconds / 3600:.3g} h"


def _print(report: dict[str, Any], measured: costs.Measured, result: costs.Estimate) -> None:
    """The measured inputs with their sources, then the estimate."""
    full, weights, volume = measured.full, measured.weights, result.volumes
    print(f"run {report['directory']}: measured inputs [source]")
    print(f"  full generation        {full.size_bytes:,} B  [{full.size_source}]")
    if weights:
        print(f"  weights-only           {weights.size_bytes:,} B  [{weights.size_source}]")
    for kind in (full, weights):
        if kind:
            every = f", {kind.updates_per_save} updates per save" if kind.updates_per_save else ""
            print(f"  {kind.kind + ' save interval':<23}{_duration(kind.interval_s)}{every}  [{kind.interval_source}]")
    policy = ", ".join(f"{k}={v}" for k, v in report["measured"]["policy"].items())
    print(f"  policy                 {policy}  [{measured.policy_source}]")
    kept = [f"{full.keep} full"] + ([f"{weights.keep} weights-only"] if weights else []) + (
        ["the best"] if measured.policy.best else []) + ([f"{measured.pinned} pinned"] if measured.pinned else [])
    milestones = ""
    if volume.milestones_at_end:
        months = f"{result.months:g} month" + ("s" if result.months != 1 else "")
        milestones = f"; {_num(volume.milestones_at_end)} milestones after {months}"
    print(f"  generations kept       {' + '.join(kept)}: {volume.retained_bytes:,} B{milestones}")
    print(f"  restores per month     {result.restores_per_month:g}  [--restores-per-month]")
    _print_estimate(report, measured, result)


def _print_estimate(report: dict[str, Any], measured: costs.Measured, result: costs.Estimate) -> None:
    """The rates, warnings, the table (one row per tier) and the assumptions."""
    volume, rates = result.volumes, report["rates"]
    about = [f"read {rates['date']}, {rates['age_days']} days ago"] + [rates[k] for k in ("currency", "source")
                                                                          if rates[k]]
    print(f"rates: {rates['file']} ({'; '.join(about)})")
    for line in report["warnings"]:
        print(f"warning: {line}")
    for line in report["notes"]:
        print(f"note: {line}")
    print(f"per month of training: {_num(volume.saves_full)} full saves"
          + (f", {_num(volume.saves_weights)} weights-only" if measured.weights else "")
          + (f" (averaged over {result.months:g} months)" if result.months != 1 else "")
          + (f"; costs in {rates['currency']}" if rates["currency"] else ""))
    header = ["tier", "GB-months", "writes", "reads", "GB in", "GB out", "storage", "requests",
              "transfer", "total/month", "restore"]
    rows = [[t.tier, _num(volume.gb_months + t.early_deletion_gb_months), _num(volume.writes), _num(volume.reads),
             _num(volume.gb_in), _num(volume.gb_out), _money(t.storage), _money(t.requests), _money(t.transfer),
             _money(t.total), _duration(t.restore_s)] for t in result.tiers]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    for t in result.tiers:
        if t.early_deletion_gb_months:
            print(f"{t.tier}: GB-months include {_num(t.early_deletion_gb_months)} billed for generations pruned "
                  "before the tier's minimum retention")
    if result.months != 1:
        print(f"over {result.months:g} months: "
              + "; ".join(f"{t.tier} {_money(t.total * result.months)}" for t in result.tiers))
    print("assumptions:")
    for line in costs.ASSUMPTIONS:
        print(f"  - {line}")


def add_parser(sub: Any) -> None:
    """Register ``trainstate cost`` on the subcommand set (``--json`` is added by the caller for every command)."""
    p = sub.add_parser("cost", help="storage cost per tier from the run's measured sizes and cadence "
                       "(prices from --rates; none built in)")
    p.add_argument("directory", help="the run directory")
    p.add_argument("--rates", required=True, metavar="FILE",
                   help="TOML or JSON price list: date = YYYY-MM-DD, currency, [tiers.NAME] gb_month, "
                   "per_1000_writes, per_1000_reads, per_gb_in, per_gb_out, per_gb_retrieved, "
                   "min_retention_days, read_mb_per_s")
    p.add_argument("--max-age-days", type=int, default=180,
                   help="flag rates read longer ago than this (default 180)")
    p.add_argument("--months", type=float, default=1.0,
                   help="months of training to average milestones over and to total (default 1)")
    p.add_argument("--restores-per-month", type=float, default=4.0,
                   help="expected restores (one per failure) per month (default 4)")
    p.add_argument("--interval-s", type=float, default=None,
                   help="seconds between full saves (default: measured from the manifests; needed with 1 generation)")
    p.add_argument("--every", type=int, default=None, help="updates between full saves (default: measured)")
    p.add_argument("--size-bytes", type=int, default=None,
                   help="bytes per full generation (default: the newest's files and manifest)")
    p.add_argument("--replication-tier", default=None, metavar="NAME",
                   help="a run with node-local tiers (DIRECTORY is one node's): the rates tier whose per_gb_in and "
                   "per_gb_out price the replicas sent between failure domains; the other tiers price the remote")
    cli_lifecycle._policy_flags(p)
    p.set_defaults(func=cmd_cost)
