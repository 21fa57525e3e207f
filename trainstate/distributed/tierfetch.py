"""One candidate of a tiered restore as the nodes hold it: each chunk read where it is nearest, verified, handed over.

:class:`Holdings` is the :class:`~trainstate.storage.fetched.Fetched` view a
tiered restore reads through (:mod:`.tierload`). Every fetch round of the
multi-rank restore (:func:`.share.fetch_share`) runs through
:meth:`Holdings.together`:

- a rank whose node holds a file reads the chunks it needs from its own
  disk (its node's own tier, else its replicas): nothing crosses nodes when
  every node still holds its part;
- a chunk its node lacks is read by one rank of a node that holds it (a rank
  that reads it anyway, else the least loaded), or, where no node holds it,
  downloaded from the remote by one rank that needs it; then sent point to
  point to each rank that needs it, one message per chunk. Every receive is
  posted before any rank waits, and a rank that reads a chunk only to hand it
  over sends it as it is read, while it reads what it keeps: the hand-over
  overlaps the reads on both sides;
- every chunk is checked against the manifest's chunk digest by the rank
  that keeps it, wherever it came from, before it is kept (a chunk read only
  to be handed over is checked by its receivers, not twice). A copy that
  fails (a flipped bit on a node's disk, a truncated file), found by the rank
  that read it or by one that received it, is dropped from the holders and
  the round runs again for what is still missing, from another holder, until
  none is left.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CorruptGeneration, StorageUnavailable, TrainStateError
from ..format.digest import CHUNK_BYTES
from ..format import tensorfile
from ..format.manifest import MANIFEST
from ..storage.fetched import Fetched
from .group import Ranks, _global_rank, collective
from .share import UNAVAILABLE, chunk_bytes, chunk_tensor, problem_of
from .tiers import Tier

log = logging.getLogger("trainstate")
Chunk = tuple[str, int]  # (file, chunk index)


class _NodeDisk:
    """What one node holds of one generation, read like a store: the files of both tiers, the full manifest; a file
    the node lacks comes from the remote when the remote holds it."""

    def __init__(self, tier: Tier, manifest: Any, holders: dict[Any, dict], names: list[str]):
        self.tier, self.manifest, self.names = tier, manifest, names
        self.holders = holders  # shared with Holdings, which drops a copy found damaged
        self.location = tier.own.location
        self.digest_algorithm = manifest.digest_algorithm
        self.sizes = {f.name: f.size for f in manifest.files}

    def _store(self, file: str) -> Any:
        held = self.holders.get(self.tier.topology.node, {}).get(file)
        if held is not None:
            return self.tier.stores()[held[1]]
        if file in self.holders.get("remote", {}):
            return self.tier.remote.store
        raise FileNotFoundError(f"{self.location}: this node holds no {self.manifest.generation}/{file}")

    def files(self, generation: str) -> dict[str, int]:
        return dict(self.sizes)

    def open(self, generation: str, file: str) -> Any:
        return self._store(file).open(generation, file)

    def read_ranges(self, generation: str, file: str, spans: list[tuple[int, int]]) -> list[memoryview]:
        store = self._store(file)
        if getattr(store, "remote", False):  # bounded ranged GETs, several at once
            return store.read_ranges(generation, file, spans)
        out = []
        with store.open(generation, file) as stream:
            for begin, end in spans:
                stream.seek(begin)
                view = memoryview(bytearray(end - begin))
                out.append(view[:tensorfile.fill(stream, view)])
        return out

    def read_pointer(self, name: str) -> bytes | None:
        return self.tier.own.read_pointer(name)

    def generations(self) -> list[str]:
        """Every generation some node holds (a restore from an older one forks the timeline)."""
        return list(self.names)


class Holdings(Fetched):
    """One candidate as the nodes (and the remote) hold it; see the module docstring."""

    def __init__(self, tier: Tier, manifest: Any, manifest_bytes: bytes, holders: dict[Any, dict], names: list[str],
                 *, direct: bool = False):
        super().__init__(_NodeDisk(tier, manifest, holders, names))
        self._small[(manifest.generation, MANIFEST)] = manifest_bytes
        self.tier, self.holders = tier, holders
        self.loaded = {"local": 0, "peer": 0, "remote": 0}  # bytes read, received, downloaded (sources())
        self.damaged: set[tuple[int, str, str]] = set()  # (node, file, tier) found not to match the manifest
        self.allow_direct = direct  # (self.direct: the shards DCP reads straight from this node's disk)

    def loads_direct(self, manifest: Any, name: str) -> bool:
        """Whether this rank loads the shard ``name`` (one it reads whole) straight from its node's disk while DCP
        loads it, each chunk verified on its way into the live tensors (one pass, as a restore from one disk),
        rather than into memory in a fetch round first. A damaged copy then fails the load, and the tiered
        restore runs the candidate again without direct reads (the fetch rounds read past the copy)."""
        held = self.holders.get(self.tier.topology.node, {}).get(name)
        if not self.allow_direct or held is None or not manifest.file(name).chunks:
            return False
        self.direct.add(name)
        self.loaded["local"] += manifest.file(name).size
        return True

    def sources(self) -> dict[str, int]:
        """Bytes this rank read from its node's disk, received from another node, downloaded from the remote."""
        return dict(self.loaded)

    def read_unverified(self, manifest: Any, name: str, chunks: list[int]) -> dict[Chunk, torch.Tensor]:
        """Chunks this rank reads only to hand over, as read: never kept here, so never trusted here (each
        receiver checks them against the manifest before keeping them)."""
        spans = [(i * CHUNK_BYTES, i * CHUNK_BYTES + chunk_bytes(manifest, name, i)) for i in chunks]
        store = self._store._store(name)
        end = max((e for _, e in spans), default=0)
        if getattr(store, "remote", False) or not end:
            views = self._store.read_ranges(manifest.generation, name, spans)
            return {(name, i): chunk_tensor(view) for i, view in zip(chunks, views)}
        with store.open(manifest.generation, name) as stream:  # mapped, not copied: sent from the page cache
            size = os.fstat(stream.fileno()).st_size
            if size < end:  # (a mapping past the end would fault)
                raise CorruptGeneration(f"{manifest.generation}/{name}", f"file ends {end - size} bytes early")
            mapped = memoryview(mmap.mmap(stream.fileno(), end, access=mmap.ACCESS_COPY))
        return {(name, i): torch.frombuffer(mapped[b:e], dtype=torch.uint8) if e > b else
                torch.empty(0, dtype=torch.uint8) for i, (b, e) in zip(chunks, spans)}

    def together(self, fetched: Fetched, manifest: Any, ranks: Ranks, wanted: dict, problem: str,
                 more: bool = False) -> tuple[str, bool]:
        """One collective round: every rank gets the chunks it wants, verified; (problem, every rank's ok).
        ``more``: as :func:`.share.fetch_together`'s. The asks are gathered to rank 0, which plans and scatters
        each rank its own part (O(1) rounds; each rank moves only what it needs or serves); the outcome is
        gathered to rank 0 and its verdict broadcast, with the copies found damaged when there are any."""
        while True:
            asks = ranks.gather({"problem": problem, "wanted": {} if problem else wanted, "more": more}, "fetch")
            order = ranks.scatter(self._orders(asks) if ranks.rank == 0 else None, "fetch")
            fetched.more_rounds = order["more"]
            if order.get("stop"):
                return problem, False
            if "reads" not in order:
                return "", True  # nothing to hand over: the round ends here, every rank alike
            bad, error = _exchange(self, fetched, manifest, ranks, order["reads"], order["relays"], order["sends"])
            reports = ranks.gather({"bad": bad, "error": error}, "fetch")
            verdict = ranks.broadcast(self._judge(reports, manifest) if ranks.rank == 0 else None, "fetch")
            if verdict.get("unavailable"):
                return error, False  # the remote did not answer: no copy is to blame, and none is passed over
            if not verdict.get("bad"):
                return "", True
            reports = verdict["bad"]
            if ranks.rank != 0:  # (rank 0 dropped them as it judged: it alone holds every node's holdings)
                self._drop(verdict["copies"], manifest)
            gone = verdict["gone"]
            if gone and self._consult_remote(manifest, ranks):
                gone = [name for name in gone if name not in self.holders["remote"]]
            if gone:
                return reports[0]["error"] + f"; no other source holds {gone[0]}", False
            missing = {name: set(fetched.missing(manifest, name)) for name in wanted}  # again, from the copies left
            wanted = {name: kept for name, chunks in wanted.items()
                      if (kept := [i for i in chunks if i in missing[name]])}

    def _orders(self, asks: list[dict]) -> list[dict]:
        """Rank 0: each rank's part of one round (what to read to keep, what to read only to send, the transfers it
        takes part in, in the plan's order), from every rank's ask."""
        more = any(a["more"] for a in asks)
        if any(a["problem"] for a in asks):
            return [{"more": more, "stop": True}] * len(asks)
        if not any(a["wanted"] for a in asks):
            return [{"more": more}] * len(asks)
        reads, relays, sends = self._plan([a["wanted"] for a in asks])
        out = [{"more": more, "reads": r, "relays": rel, "sends": []} for r, rel in zip(reads, relays)]
        for source, receiver, chunks in sends:
            out[source]["sends"].append([source, receiver, chunks])
            out[receiver]["sends"].append([source, receiver, chunks])
        return out

    def _plan(self, wants: list[dict]) -> tuple[list[dict], list[dict], list[tuple[int, int, list[tuple]]]]:
        """Who reads which chunk to keep (``reads``, verified), who reads one only to send it (``relays``, verified
        by each receiver), and the (source, receiver, [(file, chunk, relayed)]) transfers, each pair's relayed
        chunks first; the same answer on every rank."""
        node = self.tier.topology.node_of
        needers: dict[Chunk, list[int]] = {}
        for rank, wanted in enumerate(wants):
            for name, chunks in wanted.items():
                for index in chunks:
                    needers.setdefault((name, index), []).append(rank)
        load = [0] * len(wants)
        reads: list[dict] = [{} for _ in wants]
        relays: list[dict] = [{} for _ in wants]
        sends: dict[tuple[int, int], list[tuple]] = {}
        for (name, index), ranks_ in sorted(needers.items()):
            holding = {n for n, files in self.holders.items() if name in files and n != "remote"}
            local = [r for r in ranks_ if node[r] in holding]
            for rank in local:  # a node's own copy is read where it is
                reads[rank].setdefault(name, []).append(index)
            rest = [r for r in ranks_ if node[r] not in holding]
            if not rest:
                continue
            pool = local or [r for r in range(len(wants)) if node[r] in holding] or rest
            source = min(pool, key=lambda r: (load[r], r))
            load[source] += CHUNK_BYTES
            relayed = source not in ranks_
            if relayed:
                relays[source].setdefault(name, []).append(index)
            elif source not in local:  # a rank that needs it downloads it from the remote, for itself and the rest
                reads[source].setdefault(name, []).append(index)
            for receiver in rest:
                if receiver != source:
                    sends.setdefault((source, receiver), []).append((name, index, relayed))
        return reads, relays, [(s, r, sorted(chunks, key=lambda c: (not c[2], c[0], c[1])))
                               for (s, r), chunks in sorted(sends.items())]

    def _consult_remote(self, manifest: Any, ranks: Ranks) -> bool:
        """Collective, once per candidate: when the nodes held the whole generation the remote was not listed; now
        that a copy turned out damaged, rank 0 asks the remote for the same generation (the same manifest bytes) and
        every rank learns what it holds. Whether the remote is a source now."""
        if self.tier.remote is None or "remote" in self.holders:
            return "remote" in self.holders
        files = None
        if ranks.rank == 0:
            try:
                with self.tier.remote.store.open(manifest.generation, MANIFEST) as stream:
                    same = stream.read() == self._small[(manifest.generation, MANIFEST)]
                files = {f.name: [f.size, "remote"] for f in manifest.files} if same else {}
            except (OSError, TrainStateError) as exc:
                log.warning("the remote %s has no readable %s (%s)", self.tier.remote.store.location,
                            manifest.generation, exc)
                files = {}
        self.holders["remote"] = ranks.broadcast(files, "fetch") or {}
        return bool(self.holders["remote"])

    def _judge(self, reports: list[dict], manifest: Any) -> dict:
        """Rank 0: the round's verdict (:func:`_verdict`); where copies were found damaged, which copies they are
        (the node's of the rank that read one, else the remote's: only rank 0 holds every node's holdings), each
        dropped here, and the files no source holds now (the same answer for every rank)."""
        verdict = _verdict(reports)
        if verdict.get("bad"):
            node = self.tier.topology.node_of
            copies = {}
            for report in verdict["bad"]:
                for rank, name in report["bad"]:
                    where = node[rank] if name in self.holders.get(node[rank], {}) else "remote"
                    copies.setdefault((where, name), report["error"])
            verdict["copies"] = [[where, name, error] for (where, name), error in sorted(copies.items(), key=str)]
            self._drop(verdict["copies"], manifest)
            verdict["gone"] = sorted({name for _, name in copies if not any(name in f for f in self.holders.values())})
        return verdict

    def _drop(self, copies: list[list], manifest: Any) -> None:
        """Forget each copy found damaged (it no longer counts as held), where this rank holds its record (rank 0:
        every node's; another rank: its own node's and the remote's)."""
        for where, name, error in copies:
            log.warning("%s: %s; reading it from another source", manifest.generation, error)
            held = self.holders.get(where, {}).pop(name, None)
            if held is not None and where != "remote":
                self.damaged.add((where, name, held[1]))


def _verdict(reports: list[dict]) -> dict:
    """Rank 0: the outcome of one round from every rank's report: the remote did not answer, or the reports that
    name damaged copies (every rank drops them, so the holdings stay the same everywhere), or done."""
    if any(r["error"].startswith(UNAVAILABLE) for r in reports):
        return {"unavailable": True}
    return {"bad": [r for r in reports if r["bad"]]}


def _exchange(view: Holdings, fetched: Fetched, manifest: Any, ranks: Ranks, reads: dict, relays: dict,
              sends: list) -> tuple[list[list], str]:
    """This rank's part of one round, every transfer point to point and one message per chunk: post every receive;
    read what only other ranks need and send it as it is read (unverified: each receiver verifies what it keeps);
    read and verify what this rank keeps; send what it kept and others need; then verify each chunk received, while
    the next ones are still on the way. Returns the copies found damaged, as ``[rank that read it, file]`` (its
    node's copy, else the remote's), and the first such error.

    Every receive is posted before this rank waits on anything, and a source sends each chunk it owes, read or not
    (zeros for one it could not read, which its receiver then rejects): no transfer waits on another, no deadlock.
    """
    me, node_of = ranks.rank, view.tier.topology.node_of
    bad: list[list] = []
    error = ""

    def failed(rank: int, name: str, exc: BaseException, how: str) -> None:
        nonlocal error
        if isinstance(exc, StorageUnavailable):  # not damage: the restore stops (share.raise_unavailable)
            error = problem_of(exc)
            return
        if [rank, name] not in bad:
            bad.append([rank, name])
        error = error or f"{exc} ({how})"

    peer = lambda rank: _global_rank(ranks.group, rank)  # noqa: E731
    with collective("fetch", ranks):
        receiving = []
        for source, receiver, chunks in sends:
            if receiver != me:
                continue
            for name, index, _ in chunks:
                buffer = torch.empty(chunk_bytes(manifest, name, index), dtype=torch.uint8)
                work = dist.irecv(buffer, src=peer(source), group=ranks.group) if len(buffer) else None
                receiving.append((source, name, index, buffer, work))
        relayed: dict[Chunk, torch.Tensor] = {}
        for name, chunks in sorted(relays.items()):
            try:
                relayed.update(view.read_unverified(manifest, name, chunks))
            except (CorruptGeneration, OSError) as exc:
                failed(me, name, exc, f"read on node {node_of[me]}, {view.tier.own.location}")
        sending = []

        def send(relays_first: bool) -> None:
            for source, receiver, chunks in sends:
                for name, index, was_relayed in chunks if source == me else ():
                    if was_relayed == relays_first:
                        data = relayed.get((name, index)) if was_relayed else _verified(fetched, manifest, name, index)
                        if data is None:  # unreadable here: zeros, which the receiver rejects (unless they are right)
                            data = torch.zeros(chunk_bytes(manifest, name, index), dtype=torch.uint8)
                        if len(data):
                            sending.append((dist.isend(data, dst=peer(receiver), group=ranks.group), data))

        send(True)
        for name, chunks in sorted(reads.items()):
            try:
                fetched.fetch_chunks(manifest, name, chunks)
            except (CorruptGeneration, OSError) as exc:
                failed(me, name, exc, f"read on node {node_of[me]}, {view.tier.own.location}")
        send(False)
        for source, name, index, buffer, work in receiving:
            if work is not None:
                work.wait()
            try:
                fetched.put_chunk(manifest, name, index, memoryview(buffer.numpy()))
            except CorruptGeneration as exc:
                failed(source, name, exc, f"as rank {source} handed it over from node {node_of[source]}")
                continue
            if node_of[source] != node_of[me]:
                view.loaded["peer"] += len(buffer)
        for work, _ in sending:
            work.wait()
    for name, chunks in (*reads.items(), *relays.items()):
        where = "local" if name in view.holders.get(node_of[me], {}) else "remote"
        view.loaded[where] += sum(chunk_bytes(manifest, name, i) for i in chunks)
    return bad, error


def _verified(fetched: Fetched, manifest: Any, name: str, index: int) -> torch.Tensor | None:
    """A chunk this rank read and verified, as a tensor over the same bytes (gloo sends tensors); None if absent."""
    try:
        chunk = fetched.chunk(manifest, name, index)
    except KeyError:
        return None
    return chunk_tensor(chunk)
