"""The tiered restore: the newest generation the surviving nodes can serve whole, from the nearest source.

1. **report**: each node's leader lists what its node holds, in both tiers
   (:func:`.tiers.holdings`: generation, manifest digest, files present at
   their recorded sizes), to rank 0, which chooses the candidates and sends
   each rank its own node's holdings of them: O(1) bytes per rank (rank 0
   plans every fetch round, :meth:`.tierfetch.Holdings.together`).
2. **choose**: candidates newest first (or only ``generation=``), on the
   run's identity. A candidate whose holders report different manifests is
   passed over; so is one that no set of surviving holdings covers whole
   (named: which file no node holds).
3. **fetch**: one holder hands the manifest to every rank, which checks it
   against the digest the holders reported (and the signature, when
   signed). Then the multi-rank restore's four fetch rounds run
   (:func:`.share.fetch_share`), with one difference: each chunk a rank
   needs is read by the rank itself when its node holds the file, else by a
   rank on a node that holds it, and handed over the checkpoint group. Every
   receiver checks every chunk against the manifest's chunk digests before
   keeping it, and a chunk read from its own disk is checked the same way:
   a flipped bit on any node makes that candidate fail on every rank
   together, and the next one is tried.
4. **load**: exactly the multi-rank restore's checks and load
   (:func:`.load._load`), from the verified bytes. A shard a rank loads
   whole and its own node holds is not fetched in step 3: DCP reads it from
   that disk in one pass, each chunk verified before it reaches a live
   tensor (:meth:`.tierfetch.Holdings.loads_direct`). A damaged copy fails
   the load on every rank; the candidate then runs again with every shard
   through step 3, which passes over the copy to another holder.
5. **refill**: a node that lacks its holding of the restored generation (a
   replacement machine with an empty directory), or a replica it must keep,
   gets the files from the other nodes (verified the same way), commits
   them and moves its pointers, before the restore returns: the tiers
   protect the restored generation again before training goes on, and a
   refill that fails raises :class:`CheckpointFailed` (phase ``refill``)
   on every rank, the state restored and usable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from ..errors import CheckpointFailed, CorruptGeneration, NoValidGeneration, Rejection, TrainStateError
from ..format.digest import CHUNK_BYTES
from ..format.manifest import MANIFEST, POINTER, RUN, generation_order, parse_generation_name, run_to_bytes
from ..records import RestoreInfo
from ..restore import continue_lineage
from ..state.train_state import TrainState
from . import load
from .group import Ranks
from .tierfetch import Holdings
from .tiers import (Tier, broadcast_bytes, holdings, node_files, parse_shared_manifest, placement, pointed,
                    rank_files, verified_from)
from .tierbegin import recorded_run
from .tiersave import _point, _write_checked, check_holding

log = logging.getLogger("trainstate")


def restore(state: TrainState, ranks: Ranks, tier: Tier, key: Any, *, generation: str | None = None,
            allow_changes: Iterable[str] = (), statistical_cuda: bool = False, refill: Any = None,
            one_pass: bool = True) -> tuple[RestoreInfo | None, tuple[Rejection, ...]]:
    """Every rank calls it; see the module docstring. ``refill``: called with the refill (a function of the ranks
    it runs its collectives on) to run it later, off the restore (the manager's writer thread); by default it runs
    here, before this returns. ``one_pass=False`` (``restore(in_place=False)``): every shard is fetched and
    verified before anything loads, its node's own ones too."""
    refill = refill if refill is not None else (lambda job: job(ranks))
    allow = [allow_changes] if isinstance(allow_changes, str) else list(allow_changes)
    topo = tier.topology
    report = {"holds": holdings(tier.stores(), key), "run": recorded_run(tier, key), "latest": _latest(tier, key),
              "where": f"{os.uname().nodename}:{tier.own.location}"} if topo.is_leader else {}
    # every leader's report to rank 0, which chooses the candidates and sends each rank its own node's holdings of
    # them: O(1) bytes per rank (rank 0 alone holds every node's, and plans every fetch round, Holdings.together)
    every = ranks.gather(report, "report")
    held_all = decided = None
    failed: BaseException | None = None
    if ranks.rank == 0:
        try:
            held_all, decided = _choose_candidates(every, tier, generation)
        except Exception as exc:  # noqa: BLE001 - every rank learns it in this round, none waits for a timeout
            failed, decided = exc, [{"failed": f"{type(exc).__name__}: {exc}"[:1000]}] * len(every)
    mine = ranks.scatter(decided, "report")
    if "failed" in mine:
        if failed is not None:
            raise failed
        raise CheckpointFailed("report", {0: mine["failed"]})
    held = held_all if ranks.rank == 0 else {topo.node: mine["holds"], **({"remote": mine["remote"]}
                                                                         if "remote" in mine else {})}
    with load.untouched_unless_loaded(state) as loading:
        try:
            return _restore(state, ranks, tier, key, held, mine, allow, statistical_cuda, loading, refill, one_pass)
        except NoValidGeneration as exc:  # named with every node's directory, to be read together
            nodes = ranks.broadcast([every[r]["where"] for r in _leaders(topo)] if ranks.rank == 0 else None,
                                    "report")
            raise NoValidGeneration(exc.directory, exc.rejections, unusable=exc.unusable, nodes=nodes) from None


def _leaders(topo: Any) -> list[int]:
    """Each node's leader (its lowest rank), in node order: one pass (``Topology.leader`` lists a node's ranks)."""
    first: dict[int, int] = {}
    for rank, node in enumerate(topo.node_of):
        first.setdefault(node, rank)
    return [first[n] for n in range(topo.nodes)]


def _choose_candidates(every: list[dict], tier: Tier, generation: str | None) -> tuple[dict, list[dict]]:
    """Rank 0, from every leader's report: every node's holdings (and the remote's, read only when the nodes cannot
    serve the newest generation whole), and what each rank restores from: the candidates in order (name, digest,
    the rank that hands its manifest over and from which tier), those passed over, every name held, and its own
    node's holdings of the candidates (with the remote's, when read)."""
    topo = tier.topology
    leaders = _leaders(topo)
    held: dict[Any, dict] = {n: every[leaders[n]]["holds"] for n in range(topo.nodes)}
    run = next((every[r]["run"] for r in leaders if every[r]["run"]), None)
    pointers = [every[r]["latest"] for r in leaders]
    if tier.remote is not None and _needs_remote(held):  # else not one request to the object store
        held["remote"] = _remote_holdings(tier.remote)
    rejected: list[Rejection] = []
    candidates = []
    for name, digest in _candidates(held, run, generation, rejected, pointers):
        nodes = [n for n, h in held.items() if n != "remote" and h.get(name, {}).get("digest") == digest]
        first = leaders[min(nodes)] if nodes else 0
        candidates.append([name, digest, first, held[topo.node_of[first]][name]["tier"] if nodes else "remote"])
    names = sorted({n for h in held.values() for n in h}, key=generation_order, reverse=True)
    common = {"run": run, "candidates": candidates, "rejected": [[r.generation, r.reason] for r in rejected],
              "names": names}
    chosen = {c[0] for c in candidates}
    remote = {"remote": {n: h for n, h in held["remote"].items() if n in chosen}} if "remote" in held else {}
    mine = [{**common, **remote, "holds": {n: h for n, h in held[node].items() if n in chosen}}
            for node in topo.node_of]
    return held, mine


def _restore(state: TrainState, ranks: Ranks, tier: Tier, key: Any, held: dict[Any, dict], mine: dict,
             allow: list[str], statistical_cuda: bool, loading: Any, refill: Any,
             one_pass: bool = True) -> tuple[RestoreInfo | None, tuple[Rejection, ...]]:
    templates = load._templates(state)
    rejected: list[Rejection] = [Rejection(name, reason) for name, reason in mine["rejected"]]
    names, run = mine["names"], mine["run"]
    for name, digest, first, first_tier in mine["candidates"]:
        holders = {n: h[name]["files"] for n, h in held.items() if h.get(name, {}).get("digest") == digest}
        data = _shared_manifest(name, first, first_tier, tier, ranks)
        for direct in dict.fromkeys((one_pass, False)):  # again without direct reads if one found damage
            view, problem = None, ""
            try:
                manifest = parse_shared_manifest(data, name, digest, key)
                # rank 0 holds every node's holdings: it alone can tell a file no node holds
                lacking = [f.name for f in manifest.files if not any(f.name in files for files in holders.values())] \
                    if ranks.rank == 0 else []
                if lacking:
                    raise CorruptGeneration(name, f"no surviving node holds {lacking[0]} (nor {len(lacking) - 1} "
                                            "other files)" + (", nor the remote" if tier.remote is not None else ""))
                view = Holdings(tier, manifest, data, holders, names, direct=direct)
            except CorruptGeneration as exc:
                problem = f"{exc}"
            reports_ = ranks.failures(problem, "choose")  # (the texts cross only where some rank has one)
            if reports_:
                rejected.append(Rejection(name, "; ".join(sorted(set(reports_.values())))))
                if view is not None:
                    view.close()
                break
            try:
                verified, parts, problem = load._check_candidate(view, name, None, run, ranks, key, templates)
                failed = load.agree_on(ranks, problem, lambda: continue_lineage(view, verified.manifest), parts)
                if failed:
                    rejected.append(Rejection(name, "; ".join(f"rank {r}: {t}" for r, t in failed.items())))
                    break
                loading()
                try:
                    info = load._load(state, (verified, parts), tuple(rejected), view, ranks, allow,
                                      statistical_cuda, templates)
                except load.Damaged as exc:  # (only a shard read directly is verified while it loads)
                    load._loaded_damage(state, name, exc, rejected, again=direct)
                    continue
                _log_sources(name, info.sources, ranks.rank)
                later = Holdings(tier, manifest, data, view.holders, names)  # what the refill reads, afresh
                later.damaged = set(view.damaged)
                refill(lambda group: _refill_closing(later, manifest, data, group, tier, key))
                return info, tuple(rejected)
            finally:
                view.close()
    if not rejected:
        return None, ()
    raise NoValidGeneration(tier.own.location, rejected)


def _needs_remote(held: dict[Any, dict]) -> bool:
    """Whether the remote is read: only when no node holds anything, or the newest generation a node holds is not
    whole on the nodes (every process restarted with its disk: zero requests to the object store)."""
    names = sorted({n for h in held.values() for n in h}, key=generation_order, reverse=True)
    if not names:
        return True
    entries = [h[names[0]] for h in held.values() if names[0] in h]
    covered = {f for e in entries if e["digest"] == entries[0]["digest"] for f in e["files"]}
    return len(covered) < entries[0]["count"]


def _remote_holdings(remote: Any) -> dict[str, dict]:
    """Rank 0: the remote's full generations as holdings (every file, by its manifest); unreadable ones left out."""
    from ..storage.base import pinned
    from ..storage.verify import read_manifest

    out: dict[str, dict] = {}
    try:
        with pinned(remote.store):
            for name in remote.store.generations():
                if parse_generation_name(name)[1] != "full":
                    continue
                try:
                    manifest, digest, _ = read_manifest(remote.store, name, None, remote.key)
                except (CorruptGeneration, OSError) as exc:
                    log.warning("remote %s/%s is unreadable (%s)", remote.store.location, name, exc)
                    continue
                out[name] = {"digest": digest, "run": manifest.run, "update": manifest.next_update, "tier": "remote",
                             "count": len(manifest.files), "lineage": manifest.lineage,
                             "files": {f.name: [f.size, "remote"] for f in manifest.files}}
    except (TrainStateError, OSError) as exc:
        log.error("cannot list the remote %s (%s); restoring from the nodes only", remote.store.location, exc)
    return out


def _shared_manifest(name: str, first: int, first_tier: str, tier: Tier, ranks: Ranks) -> bytes:
    """The candidate's manifest on every rank, from ``first`` (the leader of the first node that holds it, reading
    its ``first_tier``; rank 0 reads the remote's where no node holds it)."""
    data = None
    if ranks.rank == first:
        store = tier.remote.store if first_tier == "remote" else tier.stores()[first_tier]
        with store.open(name, MANIFEST) as stream:
            data = stream.read()
    return broadcast_bytes(ranks, data, first, "choose")


def _candidates(held: dict[Any, dict], run: str | None, generation: str | None, rejected: list[Rejection],
                pointers: list[str | None] = ()) -> list[tuple[str, str]]:
    """(name, manifest digest) on the run's current timeline first (:func:`current_first`), each part newest first;
    a name the nodes hold under different manifests, or of another run, is rejected. The remote's copy counts
    only with the digest the nodes hold (or where no node holds it)."""
    names = sorted({n for h in held.values() for n in h}, key=generation_order, reverse=True)
    if generation is not None:
        names = [n for n in names if n == generation]
        if not names:
            rejected.append(Rejection(generation, "no node holds it"))
    else:
        names = current_first(names, held, pointers)
    out = []
    for name in names:
        entries = [h[name] for where, h in held.items() if name in h and where != "remote"]
        entries = entries or [held["remote"][name]]
        if len({e["digest"] for e in entries}) > 1:
            rejected.append(Rejection(name, "nodes hold different manifests under this name"))
            continue
        if run and entries[0]["run"] and entries[0]["run"] != run:
            rejected.append(Rejection(name, f"belongs to run {entries[0]['run'][:16]}, not to this run {run[:16]}"))
            continue
        out.append((name, entries[0]["digest"]))
    return out


def current_first(names: list[str], held: dict[Any, dict], pointers: list[str | None]) -> list[str]:
    """``names`` (newest first) with the generations of a timeline the run abandoned last.

    The newest generation a node's ``latest`` names is where the run stands
    (every save moves each node's pointer once its commit holds everywhere).
    Newer generations that descend from it (a save whose pointers had not
    all moved) come first, then it, then the older ones; a newer generation
    that does not descend from it lies on a timeline the run left (it
    resumed from an older generation, then saved): tried last, and never
    before the current timeline, whatever update it reached. Without any
    pointer (or lineage records), newest first."""
    named = sorted({p for p in pointers if p in names}, key=generation_order)
    if not named:
        return names
    pointer = named[-1]
    base = _holding(held, pointer)
    lineage = base.get("lineage") or []
    if not lineage:
        return names
    own, update = lineage[-1][0], base["update"]

    def descends(name: str) -> bool:
        return any(t == own and (end is None or update <= end) for t, end in _holding(held, name).get("lineage", []))

    newer = [n for n in names if generation_order(n) > generation_order(pointer)]
    ahead = [n for n in newer if descends(n)]
    left = [n for n in newer if n not in ahead]
    if left:
        log.info("trying %s last: newer than %s, which the nodes' latest names, but on a timeline the run left (it "
                 "resumed from an older generation and saved)", ", ".join(left), pointer)
    return ahead + [n for n in names if n not in newer] + left


def _holding(held: dict[Any, dict], name: str) -> dict:
    return next((h[name] for h in held.values() if name in h), {})


def _latest(tier: Tier, key: Any) -> str | None:
    """The generation this node's ``latest`` names, if it reads."""
    try:
        pointer = pointed(tier.own, key)
    except (TrainStateError, OSError):
        return None
    return pointer.generation if pointer is not None else None


def _log_sources(name: str, total: dict, rank: int) -> None:
    if rank == 0:
        log.info("restored %s: %s bytes from each rank's own node, %s from peers, %s from the remote", name,
                 *(f"{total[w]:,}" for w in ("local", "peer", "remote")))


# 5. refill ---------------------------------------------------------------------------------------------------
def _refill_closing(view: Holdings, manifest: Any, manifest_bytes: bytes, ranks: Ranks, tier: Tier, key: Any) -> None:
    try:
        _refill(view, manifest, manifest_bytes, ranks, tier, key)
    finally:
        view.close()


def _refill(view: Holdings, manifest: Any, manifest_bytes: bytes, ranks: Ranks, tier: Tier, key: Any) -> None:
    """Every node holds its part of the restored generation again, in both tiers; then the pointers name it."""
    topo = tier.topology
    name = manifest.generation
    targets = placement(topo.domains, tier.replicas)
    writes: dict[str, list[str]] = {}
    replicas: list[str] = []
    mine = dict(view.holders.get(topo.node, {}))
    if topo.is_leader:
        for tier_name in sorted({t for n, _, t in view.damaged if n == topo.node}):
            _set_aside(tier.stores()[tier_name], name)  # kept as evidence; refilled below from verified bytes
            mine = {f: held for f, held in mine.items() if held[1] != tier_name}
        if name not in tier.own.generations():
            writes["own"] = node_files(manifest, topo.ranks_on(topo.node))
        replicas = [f for s, ts in enumerate(targets) if topo.node in ts for r in topo.ranks_on(s)
                    if r < len(manifest.ranks) for f in rank_files(manifest, r)]
        if replicas and name not in tier.replica.generations():
            writes["replica"] = replicas
    wanted = {f: view.missing(manifest, f) for files in writes.values() for f in files if f not in mine}
    problem, ok = view.together(view, manifest, ranks, {f: c for f, c in wanted.items() if c}, "")
    error: BaseException | None = None if ok else CheckpointFailed("refill", {ranks.rank: problem or "a peer failed"})
    for tier_name, files in writes.items():
        if error is not None:
            break
        store = tier.stores()[tier_name]
        staging = store.begin(name)
        try:
            for file in files:
                _write_checked(staging, manifest, file, _bytes_of(view, tier, manifest, file, mine))
            staging.write(MANIFEST, [manifest_bytes])
            staging.commit()
            check_holding(store, manifest, manifest_bytes, files, key)
            log.info("refilled %s on this node (%s tier): %d files", name, tier_name, len(files))
        except (TrainStateError, OSError) as exc:
            staging.abort()
            error = CheckpointFailed("refill", {ranks.rank: f"{type(exc).__name__}: {exc}"})
            error.__cause__ = exc
    ranks.check("refill", error)
    if topo.is_leader and manifest.run and recorded_run(tier, key) is None:  # a replacement node joins the run
        tier.own.write_pointer(RUN, run_to_bytes(manifest.run, key))
    verified = verified_from(manifest, manifest_bytes)
    _point(verified, ranks, tier, key)
    whole = True
    if topo.is_leader and replicas:
        try:
            check_holding(tier.replica, manifest, manifest_bytes, replicas, key)
        except (TrainStateError, OSError):
            whole = False  # a replica holding from another placement: the next save replicates afresh
    if tier.replicas > 1 and not ranks.sum([int(not whole)], "refill")[0]:
        _point(verified, ranks, tier, key, POINTER, tier.replica)


def _set_aside(store: Any, name: str) -> None:
    try:
        if name in store.generations():
            log.warning("%s/%s holds a damaged file: set aside as %s", store.location, name,
                        store.set_aside(name, "rejected"))
    except OSError as exc:
        log.error("could not set aside the damaged %s/%s (%r)", store.location, name, exc)


def _bytes_of(view: Holdings, tier: Tier, manifest: Any, file: str, mine: dict) -> Iterable[bytes | memoryview]:
    """A file's bytes for a refill: from this node's disk when it holds it (checked as written), else the chunks
    fetched from peers (checked as they arrived)."""
    if file in mine:
        with tier.stores()[mine[file][1]].open(manifest.generation, file) as stream:
            while True:
                block = stream.read(16 << 20)
                if not block:
                    return
                yield block
    record = manifest.file(file)
    if record.size == 0:
        return
    with view.open(manifest.generation, file) as stream:
        while True:
            block = stream.read(CHUNK_BYTES)
            if not block:
                return
            yield block
