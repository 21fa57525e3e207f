"""Ranks that need the same bytes of a remote generation download them once, and hand them to each other.

A multi-rank restore from an object store reads, on every rank, the global
files, DCP's metadata and every replicated piece (with DDP: the whole model).
Downloaded by each rank, that is the generation ``world_size`` times over the
network. :func:`fetch_together` is one round of a collective fetch: every rank
says which chunks it needs (to rank 0, which plans); each chunk goes to one rank
that needs it (the one with the fewest bytes so far), which downloads and
verifies it, then sends it point to point to each other rank that needs it; every
receiver verifies each chunk it keeps against the manifest's digests itself: a
peer is never trusted, exactly as the store is not.

Every rank calls every round, also one whose own part failed (it then asks
for nothing and says why), so the collectives stay in step; the caller reports
the failures together (``distributed.load``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import CorruptGeneration, StorageUnavailable
from ..format import tensorfile
from ..format.digest import CHUNK_BYTES
from ..format.manifest import MAX_DCP_METADATA_BYTES, STATE
from ..storage.fetched import Fetched
from ..storage.verify import read_json_file
from .commit import rank_json, rank_tensors
from .group import Ranks, _global_rank, collective
from .planner import LoadPlanner
from .storage import DCP_METADATA, metadata_from_json

Wanted = dict[str, list[int]]  # file -> chunk indices (see Fetched.missing)
UNAVAILABLE = "~"  # starts a rank's problem when the store did not answer (not damage: see raise_unavailable)


def problem_of(exc: BaseException) -> str:
    """A rank's problem with a candidate, as the others learn it: damage, or (marked) a store that did not answer."""
    return f"{UNAVAILABLE}{exc}" if isinstance(exc, StorageUnavailable) else f"{exc}"


def raise_unavailable(reports: list[str] | dict[int, str]) -> None:
    """On every rank, :class:`StorageUnavailable` when the store did not answer some rank (after the client's
    retries): those bytes may be intact, so no candidate is passed over for it (a restore would resume from an
    older generation, or find none and call a transient outage permanent). Nothing live changed yet."""
    items = reports.items() if isinstance(reports, dict) else enumerate(reports)
    down = [(rank, text[len(UNAVAILABLE):]) for rank, text in items if text.startswith(UNAVAILABLE)]
    if down:
        rank, text = down[0]
        raise StorageUnavailable(f"rank {rank}: {text.rstrip('.')}. The restore loaded nothing; call it again once "
                                 "the store answers")


def fetch_together(fetched: Fetched, manifest: Any, ranks: Ranks, wanted: Wanted, problem: str,
                   assigner: Any = None, more: bool = False, whole: tuple[str, ...] = ()) -> tuple[str, bool]:
    """One collective round: every chunk some rank wants is downloaded by one of them and handed to the others.

    Returns this rank's problem ("" when every chunk it wanted is now fetched and verified) and whether every
    rank got what it wanted (the same on every rank: when False, all stop this candidate at this round). A
    rank that arrives with a problem takes part without asking for anything. ``assigner``: who fetches which
    chunk (default :func:`assign`). ``more``: this rank needs the rounds after this one; ``fetched.more_rounds``
    says whether any rank does. ``whole``: files of ``wanted`` (each wanted whole) that this rank may read as it
    loads instead: of each one that no other rank wants any chunk of, only the first chunk is fetched in this
    round, and the file goes to ``fetched.direct`` (:func:`read_as_loaded`).

    The asks are gathered to rank 0, which plans and scatters each rank its own orders (what to download, what to
    send to whom, what to receive from whom): O(1) rounds, and each rank moves only the chunks it needs or serves.
    Every transfer is point to point; a last round agrees on the outcome.
    """
    asks = ranks.gather({"problem": problem, "wanted": {} if problem else wanted, "more": more,
                         "whole": [] if problem else list(whole)}, "fetch")
    order = ranks.scatter(orders(asks, manifest, assigner) if ranks.rank == 0 else None, "fetch")
    fetched.more_rounds = order["more"]
    if order.get("stop"):
        return problem, False  # someone cannot go on with this candidate: everyone stops here
    fetched.read_as_loaded(manifest, set(order.get("direct", ())))
    if "fetch" not in order:
        return "", True  # nothing to download anywhere: the round ends here, every rank alike
    error = _transfer(fetched, manifest, ranks, order)
    failed = ranks.failures(error, "fetch")
    return error, not failed


def orders(asks: list[dict], manifest: Any, assigner: Any = None) -> list[dict]:
    """Rank 0: each rank's orders for one round of :func:`fetch_together`, from every rank's ask."""
    more = any(a["more"] for a in asks)
    if any(a["problem"] for a in asks):
        return [{"more": more, "stop": True}] * len(asks)
    direct = read_as_loaded(asks)
    if not any(a["wanted"] for a in asks):
        return [{"more": more, "direct": sorted(d)} for d in direct]
    plan = (assigner or assign)([a["wanted"] for a in asks], manifest)
    out = [{"more": more, "direct": sorted(d), "fetch": p, "send": [], "receive": []} for d, p in zip(direct, plan)]
    for source, served in enumerate(plan):
        for name, chunks in sorted(served.items()):
            for index in chunks:
                to = [r for r, a in enumerate(asks) if r != source and index in a["wanted"].get(name, ())]
                if to:
                    out[source]["send"].append([name, index, to])
                    for receiver in to:
                        out[receiver]["receive"].append([name, index, source])
    return out


def _transfer(fetched: Fetched, manifest: Any, ranks: Ranks, order: dict) -> str:
    """This rank's part of one round: post every receive, download and verify its own chunks, send each to the
    ranks that want it (zeros for one it could not fetch, which each receiver then rejects: no transfer waits on
    another), then verify each chunk received as it arrives. Returns this rank's problem ("" for none)."""
    problem = ""
    peer = lambda rank: _global_rank(ranks.group, rank)  # noqa: E731
    with collective("fetch", ranks):
        receiving = []
        for name, index, source in order["receive"]:
            buffer = torch.empty(chunk_bytes(manifest, name, index), dtype=torch.uint8)
            receiving.append((name, index, source, buffer, dist.irecv(buffer, src=peer(source), group=ranks.group)
                              if len(buffer) else None))
        try:
            for name, chunks in order["fetch"].items():
                fetched.fetch_chunks(manifest, name, chunks)
        except (CorruptGeneration, OSError) as exc:
            problem = problem_of(exc)
        sending = []
        for name, index, to in order["send"]:
            try:
                data = chunk_tensor(fetched.chunk(manifest, name, index))
            except KeyError:  # not fetched (the failure above): zeros, which the receivers reject
                data = torch.zeros(chunk_bytes(manifest, name, index), dtype=torch.uint8)
            for receiver in to if len(data) else ():
                sending.append((dist.isend(data, dst=peer(receiver), group=ranks.group), data))
        for name, index, source, buffer, work in receiving:
            if work is not None:
                work.wait()
            try:
                fetched.put_chunk(manifest, name, index, memoryview(buffer.numpy()))
            except CorruptGeneration as exc:
                problem = problem or f"{exc} (as rank {source} handed it over)"
        for work, _ in sending:
            work.wait()
    return problem


def read_as_loaded(asks: list[dict]) -> list[set[str]]:
    """Per rank, the files it offered to read as it loads (``whole``) that no other rank wants (the same answer
    on every rank). Of each, only the first chunk (the header's) stays in ``asks``: fetched in this round beside
    the other files, so that the load starts with it. A file two ranks want is downloaded once and handed over."""
    out: list[set[str]] = [set() for _ in asks]
    for rank, ask in enumerate(asks):
        for name in ask["whole"]:
            if not any(name in other["wanted"] for r, other in enumerate(asks) if r != rank):
                out[rank].add(name)
    for ask, names in zip(asks, out):
        for name in names:
            ask["wanted"][name] = [i for i in ask["wanted"][name] if i == 0]
    return out


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
        load[rank] += chunk_bytes(manifest, name, index)
        plan[rank].setdefault(name, []).append(index)
    return plan


def chunk_bytes(manifest: Any, name: str, index: int) -> int:
    """The bytes of chunk ``index`` of file ``name`` (of an older format's unchunked file: the whole file)."""
    record = manifest.file(name)
    return record.size if not record.chunks else min(CHUNK_BYTES, record.size - index * CHUNK_BYTES)


def chunk_tensor(view: memoryview) -> torch.Tensor:
    """A verified chunk as a tensor over the same memory, for gloo to send (a read-only buffer, such as a
    download's bytes, copied)."""
    view = memoryview(view).cast("B")
    if not len(view):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)


# what each rank reads, in four rounds -----------------------------------------------------------------------------
def fetch_share(fetched: Fetched, manifest: Any, ranks: Ranks, templates: dict | None,
                 problem: str) -> tuple[str, bool]:
    """Everything each rank reads, downloaded once over all ranks and verified by each: the global files, its
    rank records (every rank's at another world size), DCP's metadata, and of each shard only the chunks holding
    the pieces its load plan reads (a shard it reads every entry of, whole). Up to four collective rounds
    (:func:`.share.fetch_together`), every rank in each; one where no rank wants anything ends after its asks, and
    the last two (a shard's header, then its pieces) run only when some rank reads part of a shard.

    A shard that one rank alone reads, and reads whole, is not fetched here when ``fetched.offers_direct`` (a
    one-pass restore): that rank reads it while DCP loads it (``fetched.direct``), in parallel ranged GETs, each
    chunk verified before it reaches a live tensor, so that the download overlaps the copy and the shard is never
    held in memory."""
    state: dict[str, Any] = {"needed": None, "partial": True, "whole": ()}
    fetched.direct.clear()  # (chosen again for each candidate)
    for step in (_want_records, _want_header_starts, _want_headers, _want_pieces):
        wanted: dict[str, list[int]] = {}
        if not problem:
            try:
                wanted = {name: chunks for name, chunks in step(fetched, manifest, ranks, templates, state).items()
                          if chunks}
            except (CorruptGeneration, OSError) as exc:
                problem = problem_of(exc)
        header_starts = step is _want_header_starts
        more = not header_starts or state["partial"]  # after the header starts: partial shards only
        offered = tuple(n for n in state["whole"] if n in wanted) if header_starts and not problem else ()
        whole = {"whole": offered} if offered else {}  # (a tiered view decides on its own: it offers none)
        problem, ok = getattr(fetched, "together", fetch_together)(fetched, manifest, ranks, wanted, problem,
                                                                   more=bool(more), **whole)
        if not ok:
            return problem, False
        for name in fetched.direct if header_starts else ():
            (state["needed"] or {}).pop(name, None)  # read as it loads: nothing of it in the rounds that follow
        if header_starts and not fetched.more_rounds:
            # every rank reads its shards whole: the header rounds would only gather empty asks. Their check stays
            # (each header parsed, every entry the plan reads present); a problem goes to the candidate's next gather
            try:
                if any(_want_pieces(fetched, manifest, ranks, templates, state).values()):
                    problem = f"{manifest.generation}: a shard read whole is not whole in memory"
            except (CorruptGeneration, OSError) as exc:
                problem = problem_of(exc)
            break
    return problem, True


def _want_records(fetched: Fetched, manifest: Any, ranks: Ranks, templates: dict | None,
                  state: dict) -> dict[str, list[int]]:
    saved_world = len(manifest.ranks)
    own = [ranks.rank] if saved_world == ranks.world_size else list(range(saved_world))
    present = {f.name for f in manifest.files}
    names = [STATE, "tensors.safetensors", DCP_METADATA, *(f(r) for r in own for f in (rank_json, rank_tensors))]
    return {name: fetched.missing(manifest, name) for name in names if name in present}


def _want_header_starts(fetched: Fetched, manifest: Any, ranks: Ranks, templates: dict | None,
                        state: dict) -> dict[str, list[int]]:
    shards = [f.name for f in manifest.files if f.name.startswith("shard-")]
    metadata = metadata_from_json(read_json_file(fetched, manifest, DCP_METADATA, MAX_DCP_METADATA_BYTES),
                                  f"{manifest.generation}/{DCP_METADATA}", set(shards), lazy=True)
    fetched.metadata = (manifest.generation, metadata)
    state["needed"] = needed = _planned_entries(fetched, manifest.generation, templates, metadata, ranks.rank) \
        if templates is not None else None
    if needed is None:  # not plannable: whole files, so that the checks before loading can say why
        state["partial"] = False
        return {shard: fetched.missing(manifest, shard) for shard in shards}
    held: dict[str, set[str]] = {}  # shard file -> every entry it stores
    if hasattr(metadata, "entries"):  # by rule: the files this rank reads, each listed from the rule
        held = {shard: metadata.entries(shard) for shard in needed}
    for info in metadata.storage_data.values():
        held.setdefault(info["file"], set()).add(info["entry"])
    # a shard this rank loads every entry of (its own, at the same world size) is wanted whole now, in this round
    # (unless a tiered view's node holds it: then DCP reads it from that disk, verified, tierfetch.loads_direct);
    # of any other, the start of its header, then the header, then the pieces (the next rounds)
    out = {}
    state["partial"] = False
    for shard, entries in list(needed.items()):
        if not entries >= held.get(shard, set()):  # (sets: not every entry it stores)
            state["partial"] = True
            out[shard] = fetched.missing(manifest, shard, [(0, min(8, manifest.file(shard).size))])
        elif fetched.loads_direct(manifest, shard):
            del needed[shard]  # nothing of it is fetched in the rounds that follow
        else:
            out[shard] = fetched.missing(manifest, shard)
    if fetched.offers_direct:  # read as it loads if no other rank wants it (fetch_together); a chunked shard only
        state["whole"] = tuple(shard for shard in out if shard in needed and manifest.file(shard).chunks
                               and len(out[shard]) == len(manifest.file(shard).chunks))
    return out


def _want_headers(fetched: Fetched, manifest: Any, ranks: Ranks, templates: dict | None,
                  state: dict) -> dict[str, list[int]]:
    out = {}
    for shard in state["needed"] or {}:
        with fetched.open(manifest.generation, shard) as stream:
            length = int.from_bytes(stream.read(8), "little")
        out[shard] = fetched.missing(manifest, shard, [(0, min(manifest.file(shard).size, 8 + length))])
    return out


def _want_pieces(fetched: Fetched, manifest: Any, ranks: Ranks, templates: dict | None,
                 state: dict) -> dict[str, list[int]]:
    out = {}
    for shard, entries in (state["needed"] or {}).items():
        with fetched.open(manifest.generation, shard) as stream:
            layout = tensorfile.parse_header(stream, manifest.file(shard).size, f"{manifest.generation}/{shard}")
        found = {e.name: e for e in layout.entries}
        missing = sorted(entries - set(found))
        if missing:
            raise CorruptGeneration(f"{manifest.generation}/{shard}", f"has no entry {missing[0]!r:.80}")
        out[shard] = fetched.missing(manifest, shard, [(layout.data_start + found[n].begin,
                                                        layout.data_start + found[n].end) for n in entries])
    return out


def _planned_entries(fetched: Fetched, generation: str, templates: dict, metadata: Any,
                     rank: int) -> dict[str, set[str]] | None:
    """Shard file -> the entries this rank's DCP load reads (DCP's own local planning, no collective). The
    planner is kept on ``fetched`` for the load of that generation to take its plan (``LoadPlanner(reuse=)``)."""
    try:
        planner = LoadPlanner()
        planner.set_up_planner(templates, metadata, rank == 0)
        plan = planner.create_local_plan()
        fetched.planned = (generation, planner)
    except (RuntimeError, ValueError, KeyError, TypeError, AssertionError):
        return None  # the state does not fit this generation: the checks before loading say how
    out: dict[str, set[str]] = {}
    for item in plan.items:
        info = planner.metadata.storage_data.get(item.storage_index)  # (by rule: the planner's view)
        if info is None:
            return None
        out.setdefault(info["file"], set()).add(info["entry"])
    return out
