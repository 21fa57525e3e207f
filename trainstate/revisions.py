"""Two saves at one update: what a full save becomes when its update already has generations.

A generation is immutable, so a later save at the same update whose state
differs (the epoch advanced, a validation loss, an annealed learning rate)
is published under the next revision name, ``gen-<update>-r001``,
``-r002``..., which supersedes the earlier one: the pointer moves to it,
restore resumes from it, and retention gives the earlier one no slot of its
own (:mod:`trainstate.lifecycle.retention`). The same state again writes
nothing. Called by :meth:`trainstate.publish.Publisher.make_room` (and the
multi-rank commit, on rank 0) under the directory lock, before staging.
"""

from __future__ import annotations

import logging
from typing import Any

from .errors import CorruptGeneration, GenerationExists
from .format.manifest import (FORMAT_VERSION, INCREMENTAL_VERSION, MANIFEST, MAX_REVISION, SPARE_VERSION, STATE,
                              FileRecord, Manifest, generation_name, generation_order, parse_generation_name)
from .records import GenerationInfo
from .state import snapshot
from .storage.verify import Verified, verify_generation

# ``pub`` is the :class:`trainstate.publish.Publisher` and ``p`` the :class:`~trainstate.publish.Pending` being
# published (not imported here: publish imports this module).
log = logging.getLogger("trainstate")


def same_timeline(existing: list, ours: list) -> bool:
    """Whether a generation with timeline record ``existing`` lies on the timeline ``ours`` continues."""
    if not existing or not ours:
        return True  # no record (older format, or weights-only): assume the same, the safe refusal
    return existing[-1][0] == ours[-1][0]


def full_at_update(pub: Any, p: Any) -> GenerationInfo | str | None:
    """A full save at an update that already has full generations (``gen-U``, ``gen-U-r001``, ...).

    - Ones of a timeline this run abandoned (it resumed from an older
      generation, or started a new timeline) are moved aside as evidence,
      unless pinned (then this save becomes a revision after them).
    - If this state descends from one of this timeline's generations at
      this update (``p.parent``, else the one ``latest`` names): the same
      bytes (``state.json``, every tensor's bytes compared by digest, and no
      new metrics) is a no-op; anything else (the epoch advanced, a
      validation loss, an annealed learning rate in ``facts``, weights, a
      buffer, an optimizer moment or a generator's state changed in place)
      is published as the next revision, which supersedes it: the pointer
      moves to it, and retention treats the earlier one as superseded.
      Where the tensor bytes exist only once written (a multi-rank shard),
      the revision is staged and its files' digests decide before the
      commit (``p.unless_same``).
    - Otherwise the newest one left is a leftover of this update: a damaged
      one is moved aside, a pinned one gets a revision after it, and a
      valid one (an interrupted publication, or an older format) is
      replaced under its own name.
    """
    update = p.next_update
    family = [n for n in pub.store.generations() if parse_generation_name(n) == (update, "full")]
    if not family:
        return None
    ours: dict[str, Verified] = {}
    damaged: dict[str, str] = {}
    for name in family:  # newest first
        try:
            verified = verify_generation(pub.store, name, key=pub.key)
        except CorruptGeneration as exc:
            damaged[name] = str(exc)
            continue
        if same_timeline(verified.manifest.lineage, p.extra["lineage"]):
            ours[name] = verified
        elif not pub.pinned(name):  # a pinned one stays where its pin names it
            aside = pub.store.set_aside(name, "abandoned")
            log.warning("moved %s aside to %s: it belongs to a timeline this run abandoned", name, aside)
    committed = pub.committed_name("full")
    base = p.parent if p.parent in ours else committed if committed in ours else None
    if base is not None:
        verified = ours[base]
        if verified.manifest.format_version in (FORMAT_VERSION, INCREMENTAL_VERSION, SPARE_VERSION):
            changed = _changes(pub, p, verified) or p.changed_bytes(verified.manifest, pub.store)
            if changed is None:  # decided by the staged files' digests, just before the commit
                p.unless_same = verified
                return _revision(p, family, base, ["compared by digest before the commit"], quiet=True)
            if not changed:
                log_same(base)
                pub.was_published_as(p.prepared, base)
                return GenerationInfo.from_verified(pub.store, verified)
        else:
            changed = [f"format {verified.manifest.format_version} -> {FORMAT_VERSION}"]
        return _revision(p, family, base, changed)
    left = [n for n in family if n in ours or n in damaged]
    if not left:
        kept = [n for n in family if n in pub.store.generations()]  # pinned, of an abandoned timeline
        if kept:
            return _revision(p, family, kept[0], ["it belongs to a timeline this run abandoned, and is pinned"])
        p.name = generation_name(update)  # every generation at this update was set aside
        return None
    head = left[0]
    if head in damaged:
        aside = pub.store.set_aside(head, "rejected")
        log.warning("moved damaged %s aside to %s before publishing at its update: %s", head, aside,
                    damaged[head])
        p.name = head
        return None
    if pub.pinned(head):
        return _revision(p, family, head, ["not descended from it; it is pinned, so it stays"])
    p.name = head
    log.warning("replacing %s, which is not the committed latest (%s): it is an interrupted or abandoned "
                "publication of the same update", head, committed)
    return pub.store.set_aside(head, "superseded")


def _revision(p: Any, family: list[str], supersedes: str, changed: list[str], quiet: bool = False) -> None:
    """Name ``p`` as the next revision at its update, superseding ``supersedes`` (``quiet``: logged by
    whoever decides, once the staged bytes are known)."""
    revision = max(generation_order(n)[1] for n in family) + 1
    if revision > MAX_REVISION:
        raise GenerationExists(
            f"{supersedes}: {revision} different states were saved at update {p.next_update}; does the loop "
            "advance state.next_update after each update? Generations are immutable.")
    p.name = generation_name(p.next_update, "full", revision)
    if quiet:
        return
    log_revision(p, supersedes, changed)


def log_revision(p: Any, supersedes: str, changed: list[str]) -> None:
    revision = generation_order(p.name)[1]
    log.info("%s supersedes %s: a later save at update %d whose state differs (%s); a restart resumes from "
             "%s, and retention treats %s as superseded", p.name, supersedes, p.next_update,
             ", ".join(changed), p.name, supersedes)
    if revision >= 3:
        log.warning("%s is save number %d at update %d with a different state each time: if every update "
                    "saves, advance state.next_update after each one", p.name, revision + 1, p.next_update)


def same_files(staged: list[FileRecord] | tuple[FileRecord, ...], manifest: Manifest) -> bool:
    """Whether staged file records hold the same bytes as a committed generation's (by size and digest)."""
    def key(records: Any) -> set[tuple[str, int, str]]:
        return {(f.name, f.size, f.digest) for f in records if f.name != MANIFEST}
    return key(staged) == key(manifest.files)


def log_same(base: str) -> None:
    log.info("%s already holds this state (the same update on the same timeline, the same bytes by digest): "
             "nothing written", base)


def _changes(pub: Any, p: Any, verified: Verified) -> list[str]:
    """What a save at the same update changes from ``verified`` in ``state.json`` and metrics (empty: nothing
    there; the tensors' bytes are compared next, by :meth:`~trainstate.publish.Pending.changed_bytes`)."""
    existing = verified.manifest
    with pub.store.open(existing.generation, STATE) as stream:
        saved_state = stream.read(existing.file(STATE).size + 1)
    new_state = snapshot.state_json(p.skeleton)
    changed = [] if saved_state == new_state else snapshot.changed_parts(saved_state, p.skeleton)
    new_metrics = p.extra["metrics"]
    if new_metrics and new_metrics != existing.metrics:
        changed.append("metrics")
    return changed
