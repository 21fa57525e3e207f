"""Retention of node-local tiers: what each node's two stores keep after a save.

Every node decides from its own disk, where it holds its part of every
generation it keeps, with the manager's retention policy, as a single
directory does (:meth:`.Lifecycle.plan`): the newest ``keep_last`` full
generations along ``latest``'s lineage, milestones, the best by the policy's
metric (each manifest carries the metrics, the same on every node), and
every pinned generation. Pins live in each node's directory: the save
gathers every node's pins first, so that a generation pinned on one node
(``if rank == 0: ckpt.pin(...)``) is kept whole on all of them. Besides the
plan, a node keeps what ``replicas/latest`` names, a generation chosen for
upload that is not on the remote yet, and anything newer than its
``latest`` (still being published). The replica store keeps the same names.
A node that cannot read its pins stops every node's pruning for this save
rather than guess; a removal that fails is retried by the next save.
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import CorruptGeneration, TrainStateError
from ..format.manifest import POINTER, generation_order, parse_generation_name
from ..lifecycle.generations import Lifecycle
from ..lifecycle.retention import Decision, Plan, Retention
from ..storage.verify import read_manifest, read_pointed
from .group import Ranks
from .tiers import Tier, node_files

log = logging.getLogger("trainstate")


def prune(tier: Tier, key: Any, ranks: Ranks, dry_run: bool = False) -> Plan | None:
    """Collective (every rank calls it, each node's leader prunes its node); on a leader, its node's plan (the
    generations of both its stores, each kept or removed; with ``dry_run`` nothing is removed)."""
    leader = tier.topology.is_leader
    pins, error = {}, ""
    if leader:
        if tier.lifecycle is None:  # kept: it re-reads only the manifests of generations new since the last save
            tier.lifecycle = Lifecycle(tier.own, key)
            tier.lifecycle.structure_check = holding_check(tier, key)
        try:
            pins = tier.lifecycle.pins()
        except (TrainStateError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    # every node's pins to rank 0, merged, and back to every rank: O(1) per rank where nodes hold no pins (the usual
    # case), O(pins) where they do, never a frame from every rank to every rank
    every = ranks.gather({"pins": pins, "error": error}, "prune")
    merged = None
    if ranks.rank == 0:
        merged = {"unreadable": [f"rank {r}: {e['error']}" for r, e in enumerate(every) if e["error"]][:64],
                  "pinned": {f"{rank}/{name}": generation for rank, e in enumerate(every)
                             for name, generation in e["pins"].items()}}
    merged = ranks.broadcast(merged, "prune")
    if not leader:
        return None
    if merged["unreadable"]:
        log.error("not pruning: the pins of a node are unreadable (%s); fix or remove that pins file",
                  "; ".join(merged["unreadable"]))
        return Plan((), "not pruned: the pins of a node are unreadable")
    return _prune_node(tier, key, merged["pinned"], dry_run)


def prune_now(tier: Tier, key: Any, ranks: Ranks, dry_run: bool) -> Plan:
    """``ckpt.prune()`` in a tiered run (collective): every node prunes both its stores, by every node's pins, as
    after a save; each rank returns its own node's plan."""
    plan = prune(tier, key, ranks, dry_run)
    every = ranks.gather(None if plan is None else {"note": plan.note, "decisions": [
        [d.generation, d.keep, list(d.reasons), d.left_for_a_human] for d in plan.decisions]}, "prune-plan")
    if ranks.rank == 0:  # each rank its node's plan (its leader's), O(1) per rank
        first: dict[int, int] = {}
        for rank, node in enumerate(tier.topology.node_of):
            first.setdefault(node, rank)
        every = [every[first[node]] for node in tier.topology.node_of]
    mine = ranks.scatter(every if ranks.rank == 0 else None, "prune-plan")
    return Plan(tuple(Decision(g, k, tuple(r), h) for g, k, r, h in mine["decisions"]), mine["note"])


def holding_check(tier: Tier, key: Any) -> Any:
    """How a node checks a generation's structure: its manifest read and checked (digest, signature), and this
    node's part of it (the global files and its ranks' files) present at the recorded sizes."""
    def check(name: str) -> Any:
        manifest = read_manifest(tier.own, name, None, key)[0]
        present = tier.own.files(name)
        for file in node_files(manifest, tier.topology.ranks_on(tier.topology.node)):
            if present.get(file) != manifest.file(file).size:
                raise CorruptGeneration(f"{tier.own.location}/{name}/{file}",
                                        "missing" if file not in present else "has the wrong size")
        return manifest
    return check


def _prune_node(tier: Tier, key: Any, pinned: dict[str, str], dry_run: bool = False) -> Plan:
    local = read_pointed(tier.own, POINTER, key)
    if local is None:
        return Plan((), "nothing published on this node")
    replicated = read_pointed(tier.replica, POINTER, key) if tier.replicas > 1 else None
    newest = generation_order(local.generation)
    names = tier.own.generations()
    weights = next((n for n in names if parse_generation_name(n)[1] == "weights"
                    and generation_order(n) <= newest), None)
    policy = tier.policy if tier.policy is not None else Retention(keep_last=tier.keep_last)
    try:
        decided = tier.lifecycle.plan(policy, {"full": local.generation, "weights": weights}, pins=pinned)
    except (TrainStateError, OSError) as exc:
        log.error("not pruning %s: %s; the next save retries", tier.own.location, exc)
        return Plan((), f"not pruned: {exc}")
    reasons = {d.generation: d.reasons for d in decided.decisions if d.keep}
    extra = {local.generation: "latest", **({replicated.generation: "replicas/latest"} if replicated else {})}
    if tier.remote is not None and tier.remote.pending:  # chosen for upload, not on the remote yet
        extra[tier.remote.pending] = "chosen for upload, not on the remote yet"
    for name, why in extra.items():
        reasons[name] = (*reasons.get(name, ()), why)
    decisions: dict[str, Decision] = {}
    for store in tier.stores().values():
        for name in store.generations():
            if name in reasons or generation_order(name) > newest:
                decisions[name] = Decision(name, True, reasons.get(name, ("newer than latest (publishing)",)))
                continue
            decisions.setdefault(name, Decision(name, False, ("not kept by the policy",)))
            if dry_run:
                continue
            try:
                store.remove(name)
            except OSError as exc:
                log.error("could not prune %s from %s (%r); the next save retries", name, store.location, exc)
    return Plan(tuple(sorted(decisions.values(), key=lambda d: generation_order(d.generation), reverse=True)))


__all__ = ["holding_check", "prune", "prune_now"]
