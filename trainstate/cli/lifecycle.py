"""Command line for the generation lifecycle: ``prune``, ``pin``, ``unpin``, ``plan``, ``cadence``.

Registered by :mod:`trainstate.cli.main`. The retention policy comes from the
newest full generation's manifest (the policy the run was saving under);
flags override it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from . import sla as cli_sla
from ..lifecycle import cadence as cadence_mod
from ..format import signing
from ..errors import InvalidArgument, TrainStateError
from ..lifecycle import keyless
from ..lifecycle.generations import Lifecycle
from ..storage.base import Store
from ..storage.locate import open_existing
from ..format.manifest import generation_name, parse_generation_name
from ..lifecycle.retention import Retention, plan
from ..storage.verify import read_manifest


def _lifecycle(directory: str, writing: str | None = None) -> tuple[Store, Lifecycle]:
    """The run's lifecycle, its key from the environment; ``writing`` (what for): a signed run refuses it keyless."""
    store = open_existing(directory)
    life = Lifecycle(store, signing.resolve(None, store.location))
    if writing is not None:
        keyless.refuse(life, writing, command=True)
    return store, life


def _policy(life: Lifecycle, args: argparse.Namespace) -> tuple[Retention, str]:
    """The run's own policy (from its newest full manifest), with flags applied on top."""
    recorded, generation = life.recorded_policy()
    record: dict[str, Any] = _policy_json(recorded) if recorded is not None else {}
    if recorded is not None:
        source = f"{generation}'s manifest"
    else:
        source = "defaults" if generation is None else "defaults (the run recorded no policy)"
    if record.get("best") is not None:
        record["best"] = tuple(record["best"])
    for flag in ("keep_last", "keep_last_weights", "milestone_every"):
        if getattr(args, flag, None) is not None:
            record[flag] = getattr(args, flag)
            source += " + flags"
    if getattr(args, "best", None):
        metric, _, mode = args.best.partition(":")
        record["best"] = (metric, mode or "min")
    return Retention(**record), source


def cmd_prune(args: argparse.Namespace) -> int:
    store, life = _lifecycle(args.directory)
    policy, source = _policy(life, args)
    if args.dry_run:
        decided = life.plan(policy)
    else:
        store.lock()  # a live run prunes its own directory; refuse to race it
        try:
            decided = life.prune(policy)
        finally:
            store.unlock()
    if args.json:
        print(json.dumps({"policy": _policy_json(policy), "policy_source": source, "dry_run": args.dry_run,
                          "note": decided.note,
                          "decisions": [{"generation": d.generation, "keep": d.keep, "reasons": list(d.reasons)}
                                        for d in decided.decisions]}, indent=1))
        return 0
    print(f"policy ({source}): {_policy_json(policy)}")
    print(decided.describe() or "no generations")
    verb = "would prune" if args.dry_run else "pruned"
    print(f"{verb} {len(decided.prune)}, kept {len(decided.keep)}")
    return 0


def _policy_json(policy: Retention) -> dict[str, Any]:
    return {"keep_last": policy.keep_last, "keep_last_weights": policy.keep_last_weights,
            "milestone_every": policy.milestone_every, "best": list(policy.best) if policy.best else None}


def cmd_pin(args: argparse.Namespace) -> int:
    _, life = _lifecycle(args.directory, "pinning")
    life.pin(args.name, args.generation)
    print(json.dumps({"pinned": args.name, "generation": args.generation}) if args.json
          else f"pinned {args.generation} as {args.name!r}")
    return 0


def cmd_unpin(args: argparse.Namespace) -> int:
    _, life = _lifecycle(args.directory, "unpinning")
    generation = life.unpin(args.name)
    print(json.dumps({"unpinned": args.name, "generation": generation}) if args.json
          else f"unpinned {args.name!r} ({generation} is pruned by the next prune unless another rule keeps it)")
    return 0


def disk_plan(policy: Retention, *, total_updates: int, every: int, size: int, pinned_bytes: int = 0,
              weights_every: int | None = None, weights_size: int = 0, shared: int = 0) -> dict[str, Any]:
    """Simulate a run's saves through the retention plan: peak and final bytes, milestones (pure).

    ``shared``: bytes an incremental generation links rather than owns (``size`` is then what it owns). They
    are stored once per span between self-contained generations; counted twice (the current span's and the
    one before), plus once per milestone kept, plus the bytes of the fallback retention keeps beside
    ``keep_last`` (a generation that shares no file with the newest).
    """
    if total_updates < 1 or every < 1 or size < 0:
        raise InvalidArgument("total_updates and every must be positive, size non-negative")
    saves = [(u, "full") for u in range(every, total_updates + 1, every)]
    if weights_every:
        saves += [(u, "weights") for u in range(weights_every, total_updates + 1, weights_every)
                  if u % every]  # a full save at the same update covers it
    saves.sort()
    names: list[str] = []
    newest: dict[str, str | None] = {"full": None, "weights": None}
    peak = 0
    best_slot = size if policy.best else 0  # the best may be any older full generation
    cost = {"full": size, "weights": weights_size}
    for update, kind in saves:
        name = generation_name(update, kind)
        staged = sum(cost[parse_generation_name(n)[1]] for n in names) + cost[kind]
        peak = max(peak, staged)
        names.append(name)
        newest[kind] = name
        names = list(plan(names, policy=policy, newest=newest, lineage=None).keep)
    final = sum(cost[parse_generation_name(n)[1]] for n in names)
    milestones = [parse_generation_name(n)[0] for n in names
                  if policy.milestone_every and parse_generation_name(n)[1] == "full"
                  and parse_generation_name(n)[0] % policy.milestone_every == 0]
    spans = (2 + len(milestones)) * shared + (size if shared and policy.keep_last >= 2 else 0)  # + the fallback
    return {"saves": len(saves), "milestones": milestones, "kept_at_end": names,
            "peak_bytes": peak + best_slot + pinned_bytes + spans, "final_bytes": final + best_slot + pinned_bytes
            + spans, "upper_bound_bytes": (policy.keep_last + len(milestones) + 1) * size + best_slot + pinned_bytes
            + spans}


def cmd_plan(args: argparse.Namespace) -> int:
    store, life = _lifecycle(args.directory)
    policy, source = _policy(life, args)
    full = life.anchors().get("full")
    size = args.size
    if size is None:
        if full is None:
            raise FileNotFoundError(f"no verified full generation in {args.directory} to size from; pass --size")
        manifest, _, manifest_size = read_manifest(store, full, key=life.key)
        shared = sum(f.size for f in manifest.files if f.name in manifest.shares)
        size = manifest_size + sum(f.size for f in manifest.files) - shared
    else:
        shared = 0
    pins = life.pins()
    pinned = 0
    for generation in set(pins.values()):
        try:
            manifest, _, manifest_size = read_manifest(store, generation, key=life.key)
            pinned += manifest_size + sum(f.size for f in manifest.files)
        except (TrainStateError, OSError):  # a pinned generation that no longer reads: nothing to plan for
            continue
    report = disk_plan(policy, total_updates=args.total_updates, every=args.every or policy.milestone_every or 1,
                       size=size, pinned_bytes=pinned, weights_every=args.weights_every,
                       weights_size=args.weights_size if args.weights_size is not None else size // 3, shared=shared)
    report.update(policy=_policy_json(policy), policy_source=source, generation_bytes=size, shared_bytes=shared,
                  free_bytes=store.free_bytes())
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"policy ({source}): {_policy_json(policy)}")
    print(f"generation size {size:,} B" + (f" of its own, {shared:,} B shared (stored once per span, counted "
                                           "twice and once per milestone, plus the fallback generation)" if shared else "")
          + f"; {report['saves']} saves over {args.total_updates} updates")
    print(f"milestones kept: {report['milestones'] or 'none'}")
    print(f"peak disk (kept generations + one being staged{', + best' if policy.best else ''}"
          f"{', + pinned' if pinned else ''}): {report['peak_bytes']:,} B")
    terms = "(K+M+1)*S" + (" + S (the best, when it is older than the last K)" if policy.best else "") + (
        " + pinned" if pinned else "")
    print(f"at the end: at most {report['final_bytes']:,} B; bound {terms}: {report['upper_bound_bytes']:,} B")
    if report["free_bytes"] is not None:
        verdict = "fits" if report["peak_bytes"] <= report["free_bytes"] else "DOES NOT FIT"
        print(f"free now: {report['free_bytes']:,} B -> {verdict}")
    return 0


def cmd_cadence(args: argparse.Namespace) -> int:
    measured_flags = [f for f in ("process_mtbf", "node_mtbf", "all_mtbf", "every", "mirror_every")
                      if getattr(args, f) is not None]
    if args.run is not None:
        if args.save_cost is not None or args.mtbf is not None:
            raise InvalidArgument("--save-cost and --mtbf are the explicit mode's; with --run the save cost is "
                                  "measured: give the failure rates as --process-mtbf, --node-mtbf, --all-mtbf")
        return cli_sla.run(args)
    if measured_flags:
        raise InvalidArgument(f"--{measured_flags[0].replace('_', '-')} needs --run NODE_DIR (the measured mode)")
    missing = [flag for flag, value in (("--save-cost", args.save_cost), ("--mtbf", args.mtbf),
                                        ("--step-time", args.step_time)) if value is None]
    if missing:
        raise InvalidArgument(f"{', '.join(missing)} required: pass --save-cost, --mtbf and --step-time (seconds), "
                              "or --run NODE_DIR to measure them from a tiered run")
    advice = cadence_mod.advise(args.save_cost, args.mtbf, args.step_time, args.restart)
    if args.json:
        print(json.dumps(advice.__dict__, indent=1))
    else:
        print(advice.describe())
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("prune", help="apply the retention policy (or show the plan with --dry-run)")
    p.add_argument("directory", help="the run directory")
    p.add_argument("--dry-run", action="store_true", help="show keep/prune and why; change nothing")
    _policy_flags(p)
    p.set_defaults(func=cmd_prune)
    p = sub.add_parser("pin", help="keep a generation under a name until unpinned")
    p.add_argument("directory", help="the run directory")
    p.add_argument("name", help="e.g. final, release-candidate")
    p.add_argument("generation", help="e.g. gen-000000001000")
    p.set_defaults(func=cmd_pin)
    p = sub.add_parser("unpin", help="remove a pin (the generation goes at the next prune)")
    p.add_argument("directory", help="the run directory")
    p.add_argument("name", help="the pin's name, as `trainstate ls` shows it")
    p.set_defaults(func=cmd_unpin)
    p = sub.add_parser("plan", help="disk needed by a run under the retention policy, and its milestones")
    p.add_argument("directory", help="the run directory")
    p.add_argument("--total-updates", type=int, required=True)
    p.add_argument("--every", type=int, default=None, help="full-save interval in updates")
    p.add_argument("--weights-every", type=int, default=None, help="weights-only save interval in updates")
    p.add_argument("--size", type=int, default=None, help="bytes per full generation (default: the newest's)")
    p.add_argument("--weights-size", type=int, default=None, help="bytes per weights-only generation")
    _policy_flags(p)
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("cadence", help="Young's and Daly's checkpoint intervals (a model, not a guarantee); with "
                       "--run, per tier and failure class from a tiered run's measurements")
    p.add_argument("--save-cost", type=float, default=None, help="seconds a save blocks training")
    p.add_argument("--mtbf", type=float, default=None, help="mean time between failures, seconds")
    p.add_argument("--step-time", type=float, default=None, help="seconds per update (with --run: overrides the "
                   "measured figure)")
    p.add_argument("--restart", type=float, default=0.0, help="seconds a restart costs (with --run: added to every "
                   "recovery; the run measures only the restore itself)")
    cli_sla.add_flags(p)
    p.set_defaults(func=cmd_cadence)


def _policy_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--keep-last-weights", type=int, default=None)
    p.add_argument("--milestone-every", type=int, default=None)
    p.add_argument("--best", default=None, help="METRIC:min or METRIC:max")
