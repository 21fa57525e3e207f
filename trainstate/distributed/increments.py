"""One rank's incremental shard: what it links from the parent generation and what it writes (issue 32).

With ``CheckpointManager(..., full_every=N)`` under a process group, each
rank's sharded items are laid out by what changes, as a single process's
tensors are (:mod:`trainstate.state.parts`): ``shard-<rank>.safetensors``
holds what changed since the parent, ``shard-<rank>-part-<id>.safetensors``
what did not. A part of the parent is *linked* into the new generation (a
hard link on a filesystem, node-local tiers included; a server-side copy on
an object store) when every item in it has the same fingerprint now
(:mod:`trainstate.state.changes`: its bytes, never a cheap signal) and the
file still holds what was recorded
(:func:`trainstate.lifecycle.incremental.intact`). Anything else is written.

Each rank compares its items with its own shard files in the parent. A
parent written at another world size names other items (DCP names them by
offset), so the first save after a resharding restore writes everything.
Small replicated items (``shard-<rank>-small.safetensors``) are always
written: they cost nothing.

Whether a generation may link at all is decided from the parent's manifest,
so every rank decides alike: the generation after ``full_every - 1`` in a
row that linked files links nothing (``full_every=0``, the default: every
8th), which leaves a self-contained generation to fall back to when a shared
file is damaged. A shard's parts are kept in one copy: the spares a single
process keeps (:mod:`trainstate.format.sharing`) are not laid out per rank. Each rank keeps
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

from dataclasses import dataclass
from typing import Any

import torch

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

    def write(self, staging: Any, rank: int, tensors: dict[str, torch.Tensor]) -> tuple[list[FileRecord], dict]:
        """Link and write this rank's shard items into ``staging`` (:func:`.incremental.write`); the files'
        records, and the format-4 fields of this rank's files (each file's items with their fingerprints, and
        where each linked file was first written)."""
        plan = incremental.lay_out(tensors, self.parent, self.link, self.depth, self.probe, main=shard_file(rank),
                                   prefix=part_prefix(rank))
        # stable: CPU memory nobody changes while this runs (see Writer.write_data)
        return incremental.write(staging, plan, tensors, lambda chunks: chunks, True, self.store, write_empty=False)


class RankIncrements:
    """One rank's incremental saves: the parent's manifest and depth, kept from the last commit."""

    def __init__(self, full_every: int):
        self.full_every = full_every or incremental.SHARDS_FULL_EVERY  # (a shard's parts have no spares yet)
        self.known: dict[str, tuple[Manifest, int]] = {}
        self.saves = 0  # plans begun: every full_every-th probes (incremental.take)

    def begin(self, store: Any, key: Any, parent: str | None) -> ShardPlan:
        """The plan of the next save descending from ``parent`` (read from ``store`` unless kept)."""
        manifest, chain, link = incremental.parent_of(store, key, parent, self.full_every, self.known)
        self.saves += 1
        return ShardPlan(store, manifest, link, chain, incremental.probing(self.saves - 1, self.full_every))

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
