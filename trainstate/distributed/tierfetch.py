"""One candidate of a tiered restore as the nodes hold it: each chunk read where it is nearest, verified, handed over.

:class:`Holdings` is the :class:`~trainstate.storage.fetched.Fetched` view a
tiered restore reads through (:mod:`.tierload`). Every fetch round of the
multi-rank restore (:func:`.load._fetch_share`) runs through
:meth:`Holdings.together`:

- a rank whose node holds a file reads the chunks it needs from its own
  disk (its node's own tier, else its replicas): nothing crosses nodes when
  every node still holds its part;
- a chunk its node lacks is read by one rank of a node that holds it (a rank
  that reads it anyway, else the least loaded), or, where no node holds it,
  downloaded from the remote by one rank that needs it; then sent point to
  point to each rank that needs it, in one global order (the earliest
  unfinished transfer always has both ends ready: no deadlock);
- every chunk is checked against the manifest's chunk digest by the rank
  that keeps it, wherever it came from, before it is kept. A copy that fails
  (a flipped bit on a node's disk, a truncated file) is dropped from the
  holders and the round runs again from another holder, until none is left.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy
import torch
import torch.distributed as dist

from ..errors import CorruptGeneration
from ..format.digest import CHUNK_BYTES
from ..format.manifest import MANIFEST
from ..storage.fetched import Fetched
from .group import Ranks, _global_rank, collective
from .tiers import Tier

log = logging.getLogger("trainstate")
Chunk = tuple[str, int]  # (file, chunk index)


def chunk_bytes(manifest: Any, name: str, index: int) -> int:
    record = manifest.file(name)
    return record.size if not record.chunks else min(CHUNK_BYTES, record.size - index * CHUNK_BYTES)


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
                buffer = bytearray(end - begin)
                view, got = memoryview(buffer), 0
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
    """One candidate as the nodes (and the remote) hold it; see the module docstring."""

    def __init__(self, tier: Tier, manifest: Any, manifest_bytes: bytes, holders: dict[Any, dict], names: list[str]):
        super().__init__(_NodeDisk(tier, manifest, holders, names))
        self._small[(manifest.generation, MANIFEST)] = manifest_bytes
        self.tier, self.holders = tier, holders
        self.loaded = {"local": 0, "peer": 0, "remote": 0}  # bytes read, received, downloaded (sources())
        self.damaged: set[tuple[int, str, str]] = set()  # (node, file, tier) found not to match the manifest

    def sources(self) -> dict[str, int]:
        """Bytes this rank read from its node's disk, received from another node, downloaded from the remote."""
        return dict(self.loaded)

    def together(self, fetched: Fetched, manifest: Any, ranks: Ranks, wanted: dict, problem: str) -> tuple[str, bool]:
        """One collective round: every rank gets the chunks it wants, verified; (problem, every rank's ok)."""
        topo = self.tier.topology
        while True:
            asks = ranks.all_gather({"problem": problem, "wanted": {} if problem else wanted}, "fetch")
            if any(a["problem"] for a in asks):
                return problem, False
            reads, sends = self._plan([a["wanted"] for a in asks])
            bad, error = [], ""
            for name, chunks in sorted(reads[ranks.rank].items()):
                try:
                    fetched.fetch_chunks(manifest, name, chunks)
                except (CorruptGeneration, OSError) as exc:
                    bad.append(name)
                    error = error or f"{exc} (read on node {topo.node}, {self.tier.own.location})"
            reports = ranks.all_gather({"bad": bad, "error": error}, "fetch")
            if not any(r["bad"] for r in reports):
                break
            gone = self._drop_damaged(reports, manifest)
            if gone:
                return next(r["error"] for r in reports if r["bad"]) + f"; no other source holds {gone[0]}", False
        for name, chunks in reads[ranks.rank].items():
            where = "local" if name in self.holders.get(topo.node, {}) else "remote"
            self.loaded[where] += sum(chunk_bytes(manifest, name, i) for i in chunks)
        error = _hand_over(fetched, manifest, ranks, sends, self.loaded, topo.node_of)
        return error, not any(ranks.all_gather(error, "fetch"))

    def _plan(self, wants: list[dict]) -> tuple[list[dict], list[tuple[int, int, list[Chunk]]]]:
        """Who reads which chunk, and the (source, receiver, chunks) transfers; the same answer on every rank."""
        node = self.tier.topology.node_of
        needers: dict[Chunk, list[int]] = {}
        for rank, wanted in enumerate(wants):
            for name, chunks in wanted.items():
                for index in chunks:
                    needers.setdefault((name, index), []).append(rank)
        load = [0] * len(wants)
        reads: list[dict] = [{} for _ in wants]
        sends: dict[tuple[int, int], list[Chunk]] = {}
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
            if source not in local:
                reads[source].setdefault(name, []).append(index)
            for receiver in rest:
                if receiver != source:
                    sends.setdefault((source, receiver), []).append((name, index))
        return reads, [(s, r, chunks) for (s, r), chunks in sorted(sends.items())]

    def _drop_damaged(self, reports: list[dict], manifest: Any) -> list[str]:
        """Forget each copy a rank found damaged (it no longer counts as held); the files no source holds now."""
        node = self.tier.topology.node_of
        for rank, report in enumerate(reports):
            for name in report["bad"]:
                log.warning("%s: %s; reading it from another source", manifest.generation, report["error"])
                where = node[rank] if name in self.holders.get(node[rank], {}) else "remote"
                held = self.holders.get(where, {}).pop(name, None)
                if held is not None and where != "remote":
                    self.damaged.add((where, name, held[1]))
        return sorted({n for r in reports for n in r["bad"] if not any(n in f for f in self.holders.values())})


def _hand_over(fetched: Fetched, manifest: Any, ranks: Ranks, sends: list, loaded: dict, node_of: tuple) -> str:
    """Every transfer, point to point in one global order, one message per chunk: the receiver verifies each chunk
    before keeping it, while the next ones are still on the way."""
    problem = ""
    for source, receiver, chunks in sends:
        if ranks.rank not in (source, receiver):
            continue
        sizes = [chunk_bytes(manifest, name, index) for name, index in chunks]
        if ranks.rank == source:
            with collective("fetch", ranks):
                works = []
                for (name, index), size in zip(chunks, sizes):  # a copy per chunk (gloo sends a tensor), sent at once
                    if not size:
                        continue
                    data = torch.empty(size, dtype=torch.uint8)
                    data.numpy()[:] = numpy.frombuffer(fetched.chunk(manifest, name, index), dtype=numpy.uint8)
                    works.append((dist.isend(data, dst=_global_rank(ranks.group, receiver), group=ranks.group), data))
                for work, _ in works:
                    work.wait()
            continue
        buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        view, offset, pending = memoryview(buffer.numpy()), 0, []
        with collective("fetch", ranks):
            for size in sizes:
                pending.append(dist.irecv(buffer[offset:offset + size], src=_global_rank(ranks.group, source),
                                          group=ranks.group) if size else None)
                offset += size
            offset = 0
            for (name, index), size, work in zip(chunks, sizes, pending):
                if work is not None:
                    work.wait()
                try:
                    fetched.put_chunk(manifest, name, index, view[offset:offset + size])
                except CorruptGeneration as exc:
                    problem = problem or f"{exc} (as rank {source} handed it over)"
                offset += size
        if node_of[source] != node_of[receiver]:
            loaded["peer"] += sum(sizes)
    return problem
