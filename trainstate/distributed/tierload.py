"""The tiered restore: the newest generation the surviving nodes can serve whole, from the nearest source.

1. **report**: each node's leader lists what its node holds, in both tiers
   (:func:`.tiers.holdings`: generation, manifest digest, files present at
   their recorded sizes); every rank learns every node's report.
2. **choose**: candidates newest first (or only ``generation=``), on the
   run's identity. A candidate whose holders report different manifests is
   passed over; so is one that no set of surviving holdings covers whole
   (named: which file no node holds).
3. **fetch**: one holder hands the manifest to every rank, which checks it
   against the digest the holders reported (and the signature, when
   signed). Then the multi-rank restore's four fetch rounds run
   (:func:`.load._fetch_share`), with one difference: each chunk a rank
   needs is read by the rank itself when its node holds the file, else by a
   rank on a node that holds it, and handed over the checkpoint group. Every
   receiver checks every chunk against the manifest's chunk digests before
   keeping it, and a chunk read from its own disk is checked the same way:
   a flipped bit on any node makes that candidate fail on every rank
   together, and the next one is tried.
4. **load**: exactly the multi-rank restore's checks and load
   (:func:`.load._load`), from the verified bytes.
5. **refill**: a node that lacks its holding of the restored generation (a
   replacement machine with an empty directory), or a replica it must keep,
   gets the files from the other nodes (verified the same way), commits
   them and moves its pointers: the tiers protect the restored generation
   again before training goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ..errors import CheckpointFailed, CorruptGeneration, NoValidGeneration, Rejection, StateMismatch, TrainStateError
from ..format.digest import CHUNK_BYTES, digest_bytes
from ..format.manifest import MANIFEST, POINTER, generation_order
from ..records import RestoreInfo
from ..state.train_state import TrainState
from ..storage.fetched import Fetched
from ..storage.verify import Verified
from . import load
from .group import Ranks
from .share import _share
from .tiers import Tier, broadcast_bytes, holdings, parse_shared_manifest, placement, rank_files
from .tiersave import _point, _recorded_run, _write_checked, check_holding, node_files

log = logging.getLogger("trainstate")


def restore(state: TrainState, ranks: Ranks, tier: Tier, key: Any, *, generation: str | None = None,
            allow_changes: Iterable[str] = (), statistical_cuda: bool = False
            ) -> tuple[RestoreInfo | None, tuple[Rejection, ...]]:
    """Every rank calls it; see the module docstring."""
    allow = [allow_changes] if isinstance(allow_changes, str) else list(allow_changes)
    topo = tier.topology
    report = {"holds": holdings(tier.stores(), key), "run": _recorded_run(tier, key)} if topo.is_leader else {}
    reports = ranks.all_gather(report, "report")
    nodes = [reports[topo.leader(n)] for n in range(topo.nodes)]
    run = next((r["run"] for r in nodes if r["run"]), None)
    templates = load._templates(state)
    rejected: list[Rejection] = []
    names = sorted({n for r in nodes for n in r["holds"]}, key=generation_order, reverse=True)
    for name, digest in _candidates(nodes, run, generation, rejected):
        holders = {n: nodes[n]["holds"][name]["files"] for n in range(topo.nodes)
                   if nodes[n]["holds"].get(name, {}).get("digest") == digest}
        first = topo.leader(min(holders))
        data = None
        if ranks.rank == first:
            with tier.stores()[nodes[topo.node]["holds"][name]["tier"]].open(name, MANIFEST) as stream:
                data = stream.read()
        data = broadcast_bytes(ranks, data, first, "choose")
        view, problem = None, ""
        try:
            manifest = parse_shared_manifest(data, name, digest, key)
            lacking = [f.name for f in manifest.files if not any(f.name in files for files in holders.values())]
            if lacking:
                raise CorruptGeneration(name, f"no surviving node holds {lacking[0]} (nor {len(lacking) - 1} other "
                                        "files): not servable from the local tiers")
            view = Holdings(tier, manifest, data, holders, names)
        except CorruptGeneration as exc:
            problem = f"{exc}"
        reports_ = ranks.all_gather(problem, "choose")
        if any(reports_):
            rejected.append(Rejection(name, "; ".join(sorted({t for t in reports_ if t}))))
            if view is not None:
                view.close()
            continue
        try:
            verified, parts, problem = load._check_candidate(view, name, None, run, ranks, key, templates)
            reports_ = ranks.all_gather(problem, "verify")
            fatal = [r[1:] for r in reports_ if r.startswith("!")]
            if fatal:
                raise StateMismatch(fatal[0])
            failed = {r: text for r, text in enumerate(reports_) if text}
            if failed:
                rejected.append(Rejection(name, "; ".join(f"rank {r}: {t}" for r, t in failed.items())))
                continue
            info = load._load(state, (verified, parts), tuple(rejected), view, ranks, allow, statistical_cuda)
            sources = ranks.all_gather(view.sources(), "sources")
            _log_sources(name, sources, ranks.rank)
            _refill(view, manifest, data, ranks, tier, key)
            return _with_sources(info, sources), tuple(rejected)
        finally:
            view.close()
    if not rejected:
        return None, ()
    raise NoValidGeneration(tier.own.location, rejected)


def _candidates(nodes: list[dict], run: str | None, generation: str | None,
                rejected: list[Rejection]) -> list[tuple[str, str]]:
    """(name, manifest digest) newest first; a name whose holders disagree, or of another run, is rejected."""
    names = sorted({n for r in nodes for n in r["holds"]}, key=generation_order, reverse=True)
    if generation is not None:
        names = [n for n in names if n == generation]
        if not names:
            rejected.append(Rejection(generation, "no node holds it"))
    out = []
    for name in names:
        entries = [r["holds"][name] for r in nodes if name in r["holds"]]
        if len({e["digest"] for e in entries}) > 1:
            rejected.append(Rejection(name, "nodes hold different manifests under this name"))
            continue
        if run and entries[0]["run"] and entries[0]["run"] != run:
            rejected.append(Rejection(name, f"belongs to run {entries[0]['run'][:16]}, not to this run {run[:16]}"))
            continue
        out.append((name, entries[0]["digest"]))
    return out


def _chunk_bytes(manifest: Any, name: str, index: int) -> int:
    record = manifest.file(name)
    return record.size if not record.chunks else min(CHUNK_BYTES, record.size - index * CHUNK_BYTES)


def _spans(chunks: list[int]) -> list[tuple[int, int]]:
    return [(i * CHUNK_BYTES, i * CHUNK_BYTES + 1) for i in chunks]


class _NodeDisk:
    """What one node holds of one generation, read like a store: the files of both tiers, the full manifest."""

    def __init__(self, tier: Tier, manifest: Any, manifest_bytes: bytes, holders: dict[int, dict], names: list[str]):
        self.tier, self.manifest, self.manifest_bytes, self.names = tier, manifest, manifest_bytes, names
        self.mine = holders.get(tier.topology.node, {})
        self.location = tier.own.location
        self.digest_algorithm = manifest.digest_algorithm
        self.sizes = {f.name: f.size for f in manifest.files}

    def _store(self, file: str) -> Any:
        held = self.mine.get(file)
        if held is None:
            raise FileNotFoundError(f"{self.location}: this node holds no {self.manifest.generation}/{file}")
        return self.tier.stores()[held[1]]

    def files(self, generation: str) -> dict[str, int]:
        return dict(self.sizes)

    def open(self, generation: str, file: str) -> Any:
        return self._store(file).open(generation, file)

    def read_ranges(self, generation: str, file: str, spans: list[tuple[int, int]]) -> list[memoryview]:
        out = []
        with self.open(generation, file) as stream:
            for begin, end in spans:
                stream.seek(begin)
                buffer = bytearray(end - begin)
                view = memoryview(buffer)
                got = 0
                while got < len(buffer):
                    n = stream.readinto(view[got:])
                    if not n:
                        break
                    got += n
                out.append(view[:got])
        return out

    def read_pointer(self, name: str) -> bytes | None:
        return self.tier.own.read_pointer(name)

    def generations(self) -> list[str]:
        """Every generation some node holds (a restore from an older one forks the timeline)."""
        return list(self.names)


class Holdings(Fetched):
    """One candidate as the nodes hold it: every chunk read from a node's disk and verified before it is kept."""

    def __init__(self, tier: Tier, manifest: Any, manifest_bytes: bytes, holders: dict[int, dict], names: list[str]):
        super().__init__(_NodeDisk(tier, manifest, manifest_bytes, holders, names))
        self._small[(manifest.generation, MANIFEST)] = manifest_bytes
        self.tier, self.holders = tier, holders
        self.loaded = {"local": 0, "peer": 0}  # bytes this rank asked for, by source
        self.damaged: set[tuple[int, str, str]] = set()  # (node, file, tier) found not to match the manifest

    def together(self, fetched: Fetched, manifest: Any, ranks: Ranks, wanted: dict, problem: str) -> tuple[str, bool]:
        """One collective fetch round (as :func:`.share.fetch_together`), where a holding found damaged is
        dropped and its chunks read again from another node that holds the file, until no holder is left."""
        topo = self.tier.topology
        asked = {} if problem else dict(wanted)
        while True:
            asks = ranks.all_gather({"problem": problem, "wanted": {} if problem else wanted}, "fetch")
            if any(a["problem"] for a in asks):
                return problem, False
            plan = self._assign([a["wanted"] for a in asks], manifest)
            bad, error = [], ""
            for name, chunks in plan[ranks.rank].items():
                try:
                    fetched.fetch_chunks(manifest, name, chunks)
                except (CorruptGeneration, OSError) as exc:
                    bad.append(name)
                    error = error or f"{exc} (on node {topo.node}, {self.tier.own.location})"
            reports = ranks.all_gather({"bad": bad, "error": error}, "fetch")
            if not any(r["bad"] for r in reports):
                break
            for rank, report in enumerate(reports):
                for name in report["bad"]:
                    log.warning("%s: %s; reading it from another node", manifest.generation, report["error"])
                    held = self.holders.get(topo.node_of[rank], {}).pop(name, None)
                    if held is not None:
                        self.damaged.add((topo.node_of[rank], name, held[1]))
            gone = sorted({n for r in reports for n in r["bad"]
                           if not any(n in files for files in self.holders.values())})
            if gone:
                return next(r["error"] for r in reports if r["bad"]) + (
                    f"; no other node holds {gone[0]}"), False
            wanted = {name: fetched.missing(manifest, name, _spans(chunks)) for name, chunks in wanted.items()}
            wanted = {name: chunks for name, chunks in wanted.items() if chunks}
        error = ""
        for source in range(ranks.world_size):
            error = _share(fetched, manifest, ranks, source, plan[source], asks) or error
        mine = self.holders.get(topo.node, {})  # without any copy found damaged: those chunks came from a peer
        for name, chunks in asked.items():
            self.loaded["local" if name in mine else "peer"] += sum(_chunk_bytes(manifest, name, i) for i in chunks)
        return error, not any(ranks.all_gather(error, "fetch"))

    def _assign(self, wants: list[dict], manifest: Any) -> list[dict]:
        """Each wanted chunk to one rank: the asking rank itself when its node holds the file, else the least
        loaded rank of a node that holds it (the same answer on every rank)."""
        topo = self.tier.topology
        load_ = [0] * len(wants)
        plan: list[dict] = [{} for _ in wants]
        needers: dict[tuple[str, int], list[int]] = {}
        for rank, wanted in enumerate(wants):
            for name, chunks in wanted.items():
                for index in chunks:
                    needers.setdefault((name, index), []).append(rank)
        for (name, index), ranks_ in sorted(needers.items()):
            holding = [n for n, files in self.holders.items() if name in files]
            local = [r for r in ranks_ if topo.node_of[r] in holding]
            pool = local or [r for n in holding for r in topo.ranks_on(n)]
            rank = min(pool, key=lambda r: (load_[r], r))
            load_[rank] += CHUNK_BYTES
            plan[rank].setdefault(name, []).append(index)
        return plan

    def sources(self) -> dict[str, int]:
        """Bytes this rank asked for, by where they came from: its own node's disk, or another node's."""
        return dict(self.loaded)


def _log_sources(name: str, sources: list[dict], rank: int) -> None:
    if rank == 0:
        local, peer = sum(s["local"] for s in sources), sum(s["peer"] for s in sources)
        log.info("restored %s from the local tiers: %s bytes from each rank's own node, %s from peers", name,
                 f"{local:,}", f"{peer:,}")


def _with_sources(info: RestoreInfo, sources: list[dict]) -> RestoreInfo:
    import dataclasses

    total = {"local": sum(s["local"] for s in sources), "peer": sum(s["peer"] for s in sources), "remote": 0}
    return dataclasses.replace(info, sources=total)


# 5. refill ---------------------------------------------------------------------------------------------------
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
            error = exc
    ranks.check("refill", error)
    verified = Verified(manifest, digest_bytes(manifest.digest_algorithm, manifest_bytes), len(manifest_bytes))
    _point(verified, ranks, tier, key)
    whole = True
    if topo.is_leader and replicas:
        try:
            check_holding(tier.replica, manifest, manifest_bytes, replicas, key)
        except (TrainStateError, OSError):
            whole = False  # a replica holding from another placement: the next save replicates afresh
    if tier.replicas > 1 and all(ranks.all_gather(whole, "refill")):
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
