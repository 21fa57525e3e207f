"""One rank's incremental shard: what it links from the parent generation and what it writes (issues 32, 51).

Under a process group (``full_every`` not ``None``: the default), each
rank's sharded items are laid out by what changes, as a single process's
tensors are (:mod:`trainstate.state.parts`): ``shard-<rank>.safetensors``
holds what changed since the parent, ``shard-<rank>-part-<id>.safetensors``
what did not. A part of the parent is *linked* into the new generation (a
hard link on a filesystem, node-local tiers included; a reference to the
object on an object store) when every item in it has the same fingerprint now
(:mod:`trainstate.state.changes`: its bytes, never a cheap signal) and the
file still holds what was recorded
(:func:`trainstate.lifecycle.incremental.intact`). Anything else is written.

Each rank compares its items with its own shard files in the parent. A
parent written at another world size names other items (DCP names them by
offset), so the first save after a resharding restore writes everything.
Small replicated items (``shard-<rank>-small.safetensors``) are always
written: they cost nothing.

Each part is kept in two copies, as a single process's are
(:mod:`trainstate.format.sharing`): ``shard-<rank>-part-<id>.safetensors``
and ``shard-<rank>-part-<id>.spare``, linked crosswise from save to save, so
two generations in a row need no copy in common and no generation has to be
written whole again (``full_every=0``, the default, forces none;
``full_every=N`` still makes every N-th link nothing, decided from the
parent's manifest so that every rank decides alike). The first save lays
out the parameters that do not require gradients in parts already
(:func:`.capture.frozen_names`: a guide, never proof). Each rank keeps
its view of the last generation it published (its own files, their
fingerprints and shares, and rank 0's word on whether any rank linked: the
manifest itself, O(N), never crosses ranks), so a steady save reads nothing
from the store to decide. A generation whose every rank wrote its shard as one
file is saved by rule (:func:`.saveplan.by_rule`) and its manifest records no
fingerprints: they live only in each rank's view, and the first save of a
restarted process, which has none, writes its shard whole (as it would
anyway: it probes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..format import sharing
from ..format.manifest import FileRecord, Manifest
from ..format.shardrule import shard_file
from ..lifecycle import incremental


def part_prefix(rank: int) -> str:
    return f"shard-{rank:05d}-part-"


@dataclass
class ShardPlan:
    """What one save of this rank's shard may link: the parent's manifest (with fingerprints) and whether to link."""

    store: Any
    parent: Manifest | None
    link: bool
    depth: int  # generations in a row that link files, ending with the parent
    probe: bool = True  # fingerprint every item (incremental.take)
    frozen: frozenset[str] = frozenset()  # DCP names of parameters not requiring gradients (the first layout's guide)

    def write(self, staging: Any, rank: int, tensors: dict[str, torch.Tensor]) -> tuple[list[FileRecord], dict]:
        """Link and write this rank's shard items into ``staging`` (:func:`.incremental.write`), each part with its
        spare; the files' records (spares included), and the format-4/5 fields of this rank's files (each file's
        items with their fingerprints, and where each linked file was first written)."""
        frozen = [n for n in tensors if n.rpartition("@")[0] in self.frozen] if self.frozen else ()
        plan = incremental.lay_out(tensors, self.parent, self.link, self.depth, self.probe, main=shard_file(rank),
                                   prefix=part_prefix(rank), frozen=frozen, spares=True)
        # stable: CPU memory nobody changes while this runs (see Writer.write_data)
        return incremental.write(staging, plan, tensors, lambda chunks: chunks, True, self.store, write_empty=False,
                                 main=shard_file(rank))


class RankIncrements:
    """One rank's incremental saves: the parent's manifest and depth, kept from the last commit."""

    def __init__(self, full_every: int):
        self.full_every = full_every
        self.known: dict[str, tuple[Manifest, int]] = {}
        self.saves = 0  # plans begun: every full_every-th probes (incremental.take)

    def begin(self, store: Any, key: Any, parent: str | None, frozen: frozenset[str] = frozenset()) -> ShardPlan:
        """The plan of the next save descending from ``parent`` (read from ``store`` unless kept); ``frozen``: the
        DCP names of parameters not requiring gradients."""
        manifest, chain, link = incremental.parent_of(store, key, parent, self.full_every, self.known)
        self.saves += 1
        return ShardPlan(store, manifest, link, chain, incremental.probing(self.saves - 1, self.full_every), frozen)

    def published(self, manifest: Manifest | None, plan: ShardPlan | None, prepared: str | None = None,
                  linked: bool | None = None) -> None:
        """Keep ``manifest`` (just committed: the whole, or this rank's view of it, :func:`rank_view`) for the next
        save's plan, also under the name the save was prepared as (``prepared``: a revision is published as
        ``gen-U-r001``, and the state's parent still names ``gen-U``). ``linked``: whether any rank's file in it is
        linked (default: read from ``manifest``, which a view cannot tell)."""
        if manifest is None or plan is None or not manifest.fingerprints:
            return
        linked = bool(manifest.shares) if linked is None else linked
        kept = (manifest, plan.depth + 1 if linked else 0)
        self.known = {manifest.generation: kept, **({prepared: kept} if prepared else {})}


def rank_view(generation: str, algorithm: str, own: dict[str, dict]) -> Manifest:
    """This rank's part of a committed generation, from what it wrote (``Writer.own``): its shard files' records,
    fingerprints and shares; enough for its next save to link against (:class:`ShardPlan`), nothing else."""
    return Manifest(generation=generation, kind="full", next_update=0, digest_algorithm=algorithm,
                    files=tuple(FileRecord(*f["record"]) for f in own.values()), created="", contract_fingerprint="",
                    fingerprints={n: f["prints"] for n, f in own.items() if "prints" in f},
                    shares={n: f["share"] for n, f in own.items() if f.get("share")})


# what crosses to rank 0 (DCP's WriteResults) ---------------------------------------------------------------------
def carried(records: list[FileRecord], fields: dict) -> dict[str, dict]:
    """What the first write result of each of this rank's incremental files carries to rank 0 (by file): its
    record, its items' fingerprints and its share; a part's spare (record, share) rides with it, as DCP places no
    item in a spare."""
    prints, shares = fields.get("fingerprints", {}), fields.get("shares", {})
    out = {r.name: {"record": dataclasses.astuple(r), "share": shares.get(r.name), "prints": prints[r.name]}
           for r in records if not sharing.is_spare(r.name)}
    for r in records:
        if sharing.is_spare(r.name):
            out[sharing.twin_of(r.name)]["spare"] = {"record": dataclasses.astuple(r), "share": shares.get(r.name)}
    return out


def own_files(carried: dict[str, dict]) -> dict[str, dict]:
    """This rank's files as it wrote them, each spare on its own (what :func:`rank_view` takes)."""
    own = {}
    for file, fields in carried.items():
        own[file] = {k: v for k, v in fields.items() if k != "spare"}
        if "spare" in fields:
            own[sharing.spare_of(file)] = dict(fields["spare"])
    return own


def collect(data: dict, records: list[FileRecord], prints: dict, shares: dict) -> None:
    """Rank 0: add what one write result carries (:func:`carried`) to every file's ``records``, ``prints`` and
    ``shares``."""
    if "record" in data:
        records.append(FileRecord(*data["record"]))
    if "prints" in data:
        prints[data["file"]] = data["prints"]
    if data.get("share"):
        shares[data["file"]] = data["share"]
    if "spare" in data:
        records.append(FileRecord(*data["spare"]["record"]))
        if data["spare"].get("share"):
            shares[sharing.spare_of(data["file"])] = data["spare"]["share"]
