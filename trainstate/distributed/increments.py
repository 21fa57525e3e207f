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
row that linked files links nothing, which leaves a self-contained
generation to fall back to when a shared file is damaged. Each rank keeps
the manifest of the last generation it published (every rank parses it at
the commit), so a steady save reads nothing from the store to decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..format import tensorfile
from ..format.manifest import INCREMENTAL_VERSION, FileRecord, Manifest
from ..lifecycle import incremental
from ..state import changes, parts


def shard_file(rank: int) -> str:
    return f"shard-{rank:05d}.safetensors"


def part_prefix(rank: int) -> str:
    return f"shard-{rank:05d}-part-"


@dataclass(frozen=True)
class Stored:
    """One of this rank's shard files in the new generation: its items, record, and where it was linked from."""

    file: str
    names: tuple[str, ...]
    record: FileRecord
    share: str | None  # the generation that first wrote these bytes, when linked


@dataclass
class ShardPlan:
    """What one save of this rank's shard may link: the parent's manifest (with fingerprints) and whether to link."""

    store: Any
    parent: Manifest | None
    link: bool
    depth: int  # generations in a row that link files, ending with the parent
    checked: dict

    def write(self, staging: Any, rank: int, tensors: dict[str, torch.Tensor]) -> tuple[list[Stored], dict]:
        """Link and write this rank's shard items into ``staging``; the files, and every item's fingerprint."""
        now = changes.fingerprints(tensors)
        main, prefix = shard_file(rank), part_prefix(rank)
        previous = None
        if self.parent is not None:
            previous = {f: p for f, p in incremental.fingerprints_of(self.parent).items()
                        if f == main or f.startswith(prefix)}
        layout = parts.plan(now, {n: t.nbytes for n, t in tensors.items()}, previous, link=self.link, main=main,
                            prefix=prefix)
        stored: list[Stored] = []
        written = dict(layout.written)
        for file in layout.linked:
            assert self.parent is not None and previous is not None
            record = None
            if incremental.intact(self.store, self.parent, file, self.checked):
                record = staging.link(file, self.parent.generation, self.parent.file(file))
            if record is None:  # gone, damaged, or a backend that cannot link: written after all
                written[file] = tuple(previous[file])
                continue
            stored.append(Stored(file, tuple(previous[file]), record,
                                 self.parent.shares.get(file, self.parent.generation)))
        for file, names in written.items():
            if not names:
                continue
            chosen = {n: tensors[n] for n in names}
            plan = tensorfile.plan(chosen)
            # stable: CPU memory nobody changes while this runs (see Writer.write_data)
            stored.append(Stored(file, names, staging.write(file, tensorfile.chunks(plan, chosen), stable=True,
                                                            size_hint=plan.size), None))
        return stored, now


class RankIncrements:
    """One rank's incremental saves: the parent's manifest and depth, kept from the last commit."""

    def __init__(self, full_every: int):
        self.full_every = full_every
        self.known: dict[str, tuple[Manifest, int]] = {}
        self.checked: dict[tuple[int, int], tuple[int, int]] = {}  # part files found intact (incremental.intact)

    def begin(self, store: Any, key: Any, parent: str | None) -> ShardPlan:
        """The plan of the next save descending from ``parent`` (read from ``store`` unless kept)."""
        if parent is not None and parent in self.known:
            manifest, chain = self.known[parent]
        else:
            manifest = incremental._manifest(store, key, parent)
            chain = incremental.depth(store, key, manifest, self.full_every) if manifest is not None else 0
        if manifest is not None and not manifest.fingerprints:  # an older format, or saved without full_every
            manifest = None
        link = manifest is not None and chain + 1 < self.full_every
        return ShardPlan(store, manifest, link, chain, self.checked)

    def published(self, manifest: Manifest | None, plan: ShardPlan | None, prepared: str | None = None) -> None:
        """Keep ``manifest`` (just committed, every rank parsed it) for the next save's plan, also under the name
        the save was prepared as (``prepared``: a revision is published as ``gen-U-r001``, and the state's parent
        still names ``gen-U``)."""
        if manifest is None or plan is None or not manifest.fingerprints:
            return
        kept = (manifest, plan.depth + 1 if manifest.shares else 0)
        self.known = {manifest.generation: kept, **({prepared: kept} if prepared else {})}


def manifest_fields(prints: dict[str, dict], shares: dict[str, str]) -> dict[str, Any]:
    """The format-4 fields of a multi-rank generation whose ranks recorded ``prints`` (none: not incremental)."""
    if not prints:
        return {}
    return {"fingerprints": prints, "shares": shares, "format_version": INCREMENTAL_VERSION}
