"""Ranks that need the same bytes of a remote generation download them once, and hand them to each other.

A multi-rank restore from an object store reads, on every rank, the global
files, DCP's metadata and every replicated piece (with DDP: the whole model).
Downloaded by each rank, that is the generation ``world_size`` times over the
network. :func:`fetch_together` is one round of a collective fetch: every rank
says which chunks it needs; each chunk goes to one rank that needs it (the one
with the fewest bytes so far), which downloads and verifies it; then each rank
broadcasts what it downloaded to the others over the checkpoint group, and
every receiver verifies each chunk it keeps against the manifest's digests
itself: a peer is never trusted, exactly as the store is not.

Every rank calls every round, also one whose own part failed (it then asks
for nothing and says why), so the collectives stay in step; the caller reports
the failures together (``distributed.load``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import CorruptGeneration
from ..format.digest import CHUNK_BYTES
from ..storage.fetched import Fetched
from .group import Ranks, _global_rank, collective

Wanted = dict[str, list[int]]  # file -> chunk indices (see Fetched.missing)


def fetch_together(fetched: Fetched, manifest: Any, ranks: Ranks, wanted: Wanted, problem: str,
                   assigner: Any = None) -> tuple[str, bool]:
    """One collective round: every chunk some rank wants is downloaded by one of them and shared.

    Returns this rank's problem ("" when every chunk it wanted is now fetched and verified) and whether every
    rank got what it wanted (the same on every rank: when False, all stop this candidate at this round). A
    rank that arrives with a problem takes part without asking for anything. ``assigner``: who fetches which
    chunk (default :func:`assign`; a tiered restore assigns each chunk to a rank whose node holds the file).
    """
    asks = ranks.all_gather({"problem": problem, "wanted": {} if problem else wanted}, "fetch")
    if any(a["problem"] for a in asks):
        return problem, False  # someone cannot go on with this candidate: everyone stops here
    plan = (assigner or assign)([a["wanted"] for a in asks], manifest)
    error = ""
    try:
        for name, chunks in plan[ranks.rank].items():
            fetched.fetch_chunks(manifest, name, chunks)
    except (CorruptGeneration, OSError) as exc:
        error = f"{exc}"
    if any(ranks.all_gather(error, "fetch")):
        return error, False
    for source in range(ranks.world_size):
        error = _share(fetched, manifest, ranks, source, plan[source], asks) or error
    return error, not any(ranks.all_gather(error, "fetch"))


def assign(wants: list[Wanted], manifest: Any) -> list[Wanted]:
    """Which rank downloads which chunk: each to one of the ranks that want it, balancing the bytes (the same
    answer on every rank: a pure function of what every rank asked for)."""
    needers: dict[tuple[str, int], list[int]] = {}
    for rank, wanted in enumerate(wants):
        for name, chunks in wanted.items():
            for index in chunks:
                needers.setdefault((name, index), []).append(rank)
    load = [0] * len(wants)
    plan: list[Wanted] = [{} for _ in wants]
    for (name, index), ranks in sorted(needers.items()):
        rank = min(ranks, key=lambda r: (load[r], r))
        load[rank] += _chunk_size(manifest, name, index)
        plan[rank].setdefault(name, []).append(index)
    return plan


def _chunk_size(manifest: Any, name: str, index: int) -> int:
    size = manifest.file(name).size
    return size if not manifest.file(name).chunks else min(CHUNK_BYTES, size - index * CHUNK_BYTES)


def _share(fetched: Fetched, manifest: Any, ranks: Ranks, source: int, served: Wanted, asks: list[dict]) -> str:
    """``source`` broadcasts the chunks it downloaded that another rank wants; the others keep theirs, verified."""
    wanted_by_others = [(name, index) for name, chunks in sorted(served.items()) for index in chunks
                        if any(index in a["wanted"].get(name, ()) for r, a in enumerate(asks) if r != source)]
    if not wanted_by_others:
        return ""
    sizes = [_chunk_size(manifest, name, index) for name, index in wanted_by_others]
    with collective("fetch", ranks):
        if ranks.rank == source:
            buffer = torch.frombuffer(bytearray(b"".join(fetched.chunk(manifest, n, i) for n, i in wanted_by_others)),
                                      dtype=torch.uint8)
        else:
            buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        dist.broadcast(buffer, src=_global_rank(ranks.group, source), group=ranks.group)
    if ranks.rank == source:
        return ""
    mine = asks[ranks.rank]["wanted"]
    view, offset, problem = memoryview(buffer.numpy()), 0, ""
    for (name, index), size in zip(wanted_by_others, sizes):
        if index in mine.get(name, ()):
            try:
                fetched.put_chunk(manifest, name, index, view[offset:offset + size])
            except CorruptGeneration as exc:
                problem = problem or f"{exc} (as rank {source} handed it over)"
        offset += size
    return problem
