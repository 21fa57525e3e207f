"""The first step of a tiered save (:func:`.tiersave.publish`): what the generation is called and where each node
stages it, decided at rank 0.

Each node's leader takes its directory's lock, removes what an interrupted save left, and reports what its node
holds, its run identity and its free space; rank 0 gathers every rank's report and size and sends each rank its
own decision: the generation's name (a revision when a node already holds one of that name), the run (the one some
node records, else a new one), whether the state equals a generation every node holds at this update, the bytes
its node must have free (its ranks' shares, the global files, the replicas it receives), and a token that names
every node's staging directory, so that a node's other ranks join it without another exchange. Three rounds,
O(1) bytes per rank; rank 0 handles one small record per rank.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from ..errors import CheckpointFailed, CorruptGeneration, ExistingRun, InsufficientSpace, TrainStateError
from ..format.manifest import POINTER, RUN, generation_name, generation_order, parse_generation_name, parse_run, \
    run_to_bytes
from ..publish import Pending
from ..storage.local import staging_name
from ..storage.verify import read_pointed
from .capture import RankSnapshot, sharded_bytes
from .group import Ranks
from .tiers import Tier, placement

log = logging.getLogger("trainstate")


def begin(snap: RankSnapshot, pending: Pending, ranks: Ranks, tier: Tier, publisher: Any,
           key: Any) -> tuple[Any, BaseException | None]:
    """Three rounds, O(1) bytes per rank: every rank's name and size, with each leader's report (its lock,
    leftovers, holdings, run, free space), gathered to rank 0; rank 0's decision scattered, each rank its own (the
    generation's name, the run, the bytes its node must hold, the staging directory's token, rank 0's lineage);
    then each leader's staging directory begun, and one round says whether every node's did. A non-leader joins
    its leader's staging (named by the token) after it; its error (if any) is returned, and reported in the stage
    round."""
    size = sum(t.nbytes for t in snap.rank_tensors.values()) + sum(t.nbytes for t in snap.global_tensors.values())
    size += sum(sharded_bytes(v) for v in snap.dcp.values())
    pending.parent = publisher.renamed.get(pending.parent, pending.parent)  # a background save's revision
    topo = tier.topology
    report: dict[str, Any] = {}
    error = None
    if topo.is_leader:
        try:
            tier.own.lock()
            for store in tier.stores().values():
                for leftover in store.clean_leftovers():
                    log.info("removed leftover %s from an interrupted save", leftover)
            own = tier.own.generations()
            at = read_pointed(tier.own, POINTER, key) if pending.name in own else None  # a second save at an update
            report = {"names": sorted({*own, *tier.replica.generations()}),
                      "run": recorded_run(tier, key), "free": tier.own.free_bytes(),
                      "at": at.generation if at is not None and at.generation in own else None}
        except (TrainStateError, OSError) as exc:
            error = exc
    text = "" if error is None else f"{type(error).__name__}: {error}"[:1000]
    every = ranks.gather({"name": pending.name, "size": size, "report": report, "error": text}, "begin")
    decided = None
    if ranks.rank == 0:
        try:
            decided = decide(every, pending, tier, publisher)
        except Exception as exc:  # noqa: BLE001 - every rank learns it in this round, none waits for a timeout
            error = error or exc
            decided = [{"failed": {0: f"{type(exc).__name__}: {exc}"[:1000]}}] * len(every)
    mine = ranks.scatter(decided, "begin")
    if "failed" in mine:
        if error is not None:
            raise error
        raise CheckpointFailed("begin", {int(r): t for r, t in mine["failed"].items()})
    name, run, same_as = mine["name"], mine["run"], mine["same_as"]
    error, staging = None, None
    if topo.is_leader:
        try:
            if tier.preflight and report["free"] is not None and report["free"] < mine["need"]:
                raise InsufficientSpace(tier.own.location, name, mine["need"], report["free"])
            _adopt_run(tier, run, key, bool(report["names"]))
            staging = tier.own.begin(name, token=mine["token"])
        except (TrainStateError, OSError) as exc:
            error = exc
    try:
        ranks.check("begin", error)
    except BaseException:
        if staging is not None:
            staging.abort()  # another node refused (no space, another run): nothing of this save stays
        raise
    if name != pending.name:
        publisher.was_published_as(pending.prepared, name)
        pending.name = name
    pending.extra["run"] = run
    pending.extra["lineage"] = mine["lineage"]
    joined = None
    if not topo.is_leader:  # the node's ranks write into their leader's staging directory
        try:
            staging = tier.own.join(name, staging_name(name, mine["token"]))
        except (ValueError, OSError) as exc:
            joined = exc
    return staging, joined, same_as


def decide(every: list[dict], pending: Pending, tier: Tier, publisher: Any) -> list[dict]:
    """Rank 0: from every rank's name, size and report (each leader's), what each rank begins with: the failures,
    or the generation's name (a revision when some node holds one of that name), the run (the one some node
    records, else a new one), whether the state equals a generation every node holds at this update
    (``same_as``), the bytes the rank's node must have free (its ranks' shares, the global files, the replicas it
    receives; with headroom), the staging token, and rank 0's lineage."""
    topo = tier.topology
    failed = {r: e["error"] for r, e in enumerate(every) if e["error"]}
    if not failed and len({e["name"] for e in every}) != 1:
        failed = {r: f"saves {e['name']}" for r, e in enumerate(every)}
    if failed:
        return [{"failed": dict(list(failed.items())[:64])}] * len(every)
    sizes, on_node, first = [e["size"] for e in every], [0] * topo.nodes, {}
    for rank, node in enumerate(topo.node_of):  # (one pass: Topology.leader lists a node's ranks each call)
        on_node[node] += sizes[rank]
        first.setdefault(node, rank)
    leaders = [every[first[n]]["report"] for n in range(topo.nodes)]
    run = next((r["run"] for r in leaders if r.get("run")), None) or publisher.run_identity()
    name = _fresh_name(pending.name, [n for r in leaders for n in r.get("names", ())])
    # the state's parent at this update, held and named latest by every node: the same bytes commit nothing
    same_as = pending.parent if name != pending.name and pending.parent is not None \
        and parse_generation_name(pending.parent) == (pending.next_update, "full") \
        and all(r.get("at") == pending.parent for r in leaders) else None
    incoming = [0] * topo.nodes
    for source, targets in enumerate(placement(topo.domains, tier.replicas)):
        for target in targets:
            incoming[target] += on_node[source]
    need = [int((on_node[n] + sizes[0] + incoming[n] + (64 << 10)) * (1 + tier.headroom)) for n in range(topo.nodes)]
    token = secrets.token_hex(8)
    decided = {"name": name, "run": run, "same_as": same_as, "token": token, "lineage": pending.extra["lineage"]}
    return [{**decided, "need": need[node]} for node in topo.node_of]


def _fresh_name(name: str, existing: list[str]) -> str:
    """``name``, or the next revision of it when some node already holds a generation of that name (a later save
    at the same update, or a holding left from a timeline a restore abandoned): a holding is never overwritten."""
    if name not in existing:
        return name
    update, kind = parse_generation_name(name)
    revisions = [generation_order(n)[1] for n in existing if parse_generation_name(n) == (update, kind)]
    return generation_name(update, kind, max(revisions) + 1)


def recorded_run(tier: Tier, key: Any) -> str | None:
    try:
        data = tier.own.read_pointer(RUN)
        return None if data is None else parse_run(data, RUN, key)
    except CorruptGeneration:
        return None


def _adopt_run(tier: Tier, run: str, key: Any, holds_any: bool) -> None:
    """Every node's directory records the same run identity: the one some node already records, else rank 0's."""
    mine = recorded_run(tier, key)
    if mine != run:
        if mine is not None and holds_any:
            raise ExistingRun(f"{tier.own.location} holds generations of another run ({mine[:16]}); this run is "
                              f"{run[:16]}. Give this node an empty directory, or remove the old run's")
        tier.own.write_pointer(RUN, run_to_bytes(run, key))
