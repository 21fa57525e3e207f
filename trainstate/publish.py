"""The write path: how one generation is published, top to bottom.

``prepare`` takes everything a generation holds from the live state at one
update boundary (on the training thread). :class:`Publisher` then runs the
publication protocol, on the caller's thread for a blocking save or on the
writer thread for a background one:

1. take the directory lock;
2. decide what happens to an existing generation of the same name
   (:meth:`Publisher.make_room`);
3. remove leftovers of interrupted saves;
4. preflight: refuse before staging when the disk cannot hold it;
5. stage, write and fsync every file, write the manifest last, commit
   (rename, fsync the parent): :meth:`Publisher.stage_and_commit`;
6. verify the committed generation against the manifest just written;
7. optionally rehearse a restart from it into fresh objects;
8. replace the pointer atomically;
9. only then prune by the retention policy.

The fsync and rename calls themselves live in the storage backend
(:mod:`trainstate.storage.local`); this module orders them.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import CorruptGeneration, GenerationExists, InsufficientSpace, PendingGradients
from .format import tensorfile
from .format.manifest import (MANIFEST, POINTER, STATE, WEIGHTS_POINTER, Manifest, Pointer, check_name,
                              generation_name, parse_generation_name, parse_pointer)
from .format.signing import SigningKey
from .lifecycle.generations import Lifecycle, new_timeline
from .lifecycle.rehearsal import Factory, rehearse
from .lifecycle.retention import Retention
from .records import GenerationInfo
from .state import contract as contract_mod
from .state import snapshot
from .state.train_state import TrainState
from .storage.base import Store
from .storage.verify import verify_generation

log = logging.getLogger("trainstate")
TENSORS = "tensors.safetensors"


@dataclass
class Pending:
    """A generation prepared at one update boundary, waiting to be published."""

    name: str
    kind: str
    next_update: int
    parent: str | None
    skeleton: dict
    tensors: dict
    extra: dict

    @property
    def estimated_bytes(self) -> int:
        """The generation's size as the preflight estimates it (tensors, headers, state JSON)."""
        return (sum(t.nbytes for t in self.tensors.values()) + 128 * len(self.tensors)
                + len(snapshot.state_json(self.skeleton)))


def check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    out = {}
    for name, value in (metrics or {}).items():
        check_name("metric", name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"metric {name!r} must be a finite number, got {value!r}")
        out[name] = float(value)
    return out


def policy_record(policy: Retention) -> dict[str, Any]:
    record = dataclasses.asdict(policy)
    record["best"] = list(policy.best) if policy.best else None
    return record


def prepare(state: TrainState, retention: Retention, *, weights_only: bool, include_grads: bool,
            metrics: Mapping[str, float] | None) -> Pending:
    """Everything a generation holds, taken from the live state at one boundary.

    A full generation becomes the state's parent at once, so the next one
    descends from it even while it is being written; :func:`roll_back` undoes
    that if the publication fails.
    """
    kind = "weights" if weights_only else "full"
    recorded = check_metrics(metrics)
    if kind == "full" and state.pending_gradients and not include_grads:
        raise PendingGradients(
            "gradients are pending: a backward pass accumulated into .grad since the last optimizer.step(). "
            "A checkpoint here would lose them. Save after optimizer.step() (and zero_grad), or pass "
            "include_grads=True to save the gradients too, with your microbatch cursor in state.counters.")
    skeleton, tensors = snapshot.capture(state, kind=kind, include_grads=include_grads)
    positions = {n: c.data_position() for n, c in state.data_positions().items()} if kind == "full" else {}
    name = generation_name(state.next_update, kind)
    if state.lineage is None:
        state.lineage = [[new_timeline(), None]]
    pending = Pending(name, kind, state.next_update, state.parent, skeleton, tensors, {
        "data": positions, "metrics": recorded, "retention": policy_record(retention),
        "lineage": [list(e) for e in state.lineage] if kind == "full" else []})
    if kind == "full":
        state.parent = name
    return pending


def roll_back(pending: Pending, state: TrainState) -> bool:
    """After a failed publication, the state again descends from what was actually published.

    Returns whether the state's parent changed back.
    """
    if pending.kind == "full" and state.parent == pending.name:
        state.parent = pending.parent
        return True
    return False


def _same_timeline(existing: list, ours: list) -> bool:
    """Whether a generation with timeline record ``existing`` lies on the timeline ``ours`` continues."""
    if not existing or not ours:
        return True  # no record (older format, or weights-only): assume the same, the safe refusal
    return existing[-1][0] == ours[-1][0]


class Publisher:
    """Runs the publication protocol (see the module docstring) against one store."""

    def __init__(self, store: Store, lifecycle: Lifecycle, retention: Retention, *, key: SigningKey | None,
                 verify_mode: str, rehearse_factory: Factory | None, preflight: bool, headroom: float):
        self.store = store
        self.lifecycle = lifecycle
        self.retention = retention
        self.key = key
        self.verify_mode = verify_mode
        self.rehearse_factory = rehearse_factory
        self.preflight = preflight
        self.headroom = headroom

    def publish(self, p: Pending) -> GenerationInfo:
        """Publish ``p``: durable, verified and named by its pointer when this returns."""
        self.store.lock()
        self.make_room(p.name, p.extra["lineage"])
        for leftover in self.store.clean_leftovers():
            log.info("removed leftover %s from an interrupted save", leftover)
        if self.preflight:
            self.check_space(p.name, p.estimated_bytes)
        manifest_bytes = self.stage_and_commit(p)
        try:
            verified = verify_generation(self.store, p.name, content=self.verify_mode == "full", key=self.key)
            if verified.manifest.to_bytes(self.key) != manifest_bytes:
                raise CorruptGeneration(p.name, "committed manifest differs from the one written")
        except CorruptGeneration:
            self.store.remove(p.name)  # committed but not what we wrote: never let it become latest
            raise
        if p.kind == "full" and self.rehearse_factory is not None:
            self.rehearse_new(p.name)
        pointer = Pointer(p.name, verified.manifest_digest, verified.manifest_size,
                          verified.manifest.digest_algorithm, p.next_update, p.kind)
        self.store.write_pointer(POINTER if p.kind == "full" else WEIGHTS_POINTER, pointer.to_bytes(self.key))
        self.prune({p.kind: p.name})
        return GenerationInfo.from_verified(self.store, verified)

    # 2. an existing generation of the same name --------------------------------
    def make_room(self, name: str, lineage: list) -> None:
        """Decide what happens to an existing generation with the name about to be published.

        A damaged one (restore fell back past it) is moved aside under a name
        restore ignores, keeping the evidence. A pinned one is never replaced.
        The committed latest is never replaced by the same timeline (saving
        the same update twice is an error); one from a timeline this run
        abandoned (it resumed from an older generation) is moved aside as
        evidence. A valid generation that the pointer does not name is an
        interrupted or abandoned publication of this update, superseded. The
        latest weights-only generation is superseded too: weights-only files are
        not restart protection, and a resumed run reaches their update again.
        """
        if name not in self.store.generations():
            return
        kind = parse_generation_name(name)[1]
        committed = self.committed_name(kind)
        try:
            existing = verify_generation(self.store, name, key=self.key).manifest
        except CorruptGeneration as exc:
            aside = self.store.set_aside(name, "rejected")
            log.warning("moved damaged %s aside to %s before publishing over it: %s", name, aside, exc)
            return
        try:
            pinned = sorted(p for p, g in self.lifecycle.pins().items() if g == name)
        except CorruptGeneration:
            pinned = ["? (the pins file is unreadable)"]
        if pinned:
            raise GenerationExists(f"{name} exists and is pinned ({', '.join(pinned)}); a pinned generation is "
                                   "never replaced. Unpin it first, or save at another update.")
        if kind == "weights" and committed == name:
            log.warning("replacing %s, the latest weights-only generation: the run resumed from an earlier full "
                        "generation and reached this update again", name)
            self.store.remove(name)
            return
        if kind == "full" and not _same_timeline(existing.lineage, lineage):
            aside = self.store.set_aside(name, "abandoned")
            log.warning("moved %s aside to %s: it belongs to a timeline this run abandoned when it resumed from an "
                        "older generation", name, aside)
            return
        if committed is None or committed == name:
            raise GenerationExists(
                f"{name} is already published{' as latest' if committed else ''}; generations are immutable. "
                "Advance state.next_update between saves.")
        log.warning("replacing %s, which is not the committed latest (%s): it is an interrupted or "
                    "abandoned publication of the same update", name, committed)
        self.store.remove(name)

    def committed_name(self, kind: str) -> str | None:
        """The generation the pointer of ``kind`` names (unverified), if the pointer parses."""
        try:
            data = self.store.read_pointer(POINTER if kind == "full" else WEIGHTS_POINTER)
            return None if data is None else parse_pointer(data, POINTER, self.key).generation
        except CorruptGeneration:
            return None

    # 4. preflight ---------------------------------------------------------------
    def check_space(self, name: str, live_bytes: int) -> None:
        """Refuse before staging when the generation cannot fit, after pruning what policy allows."""
        estimate = live_bytes + (64 << 10)  # the manifest, and a block of slack per file
        needed = int(estimate * (1 + self.headroom))
        free = self.store.free_bytes()
        if free is None or free >= needed:
            return
        plan = self.lifecycle.prune(self.retention)
        if plan.prune:
            log.warning("pruned %s before saving %s to make room", ", ".join(plan.prune), name)
            free = self.store.free_bytes() or 0
        if free < needed:
            raise InsufficientSpace(self.store.location, name, needed, free)

    # 5. stage, write, commit ------------------------------------------------------
    def stage_and_commit(self, p: Pending) -> bytes:
        """Write every file into a staging area, the manifest last, then commit; returns the manifest's bytes."""
        staging = self.store.begin(p.name)
        try:
            layout = tensorfile.plan(p.tensors)
            files = [staging.write(STATE, [snapshot.state_json(p.skeleton)]),
                     staging.write(TENSORS, tensorfile.chunks(layout, p.tensors),
                                   stable=all(t.device.type == "cpu" for t in p.tensors.values()))]
            manifest = Manifest(
                generation=p.name, kind=p.kind, next_update=p.next_update,
                digest_algorithm=self.store.digest_algorithm, files=tuple(files),
                created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds"),
                contract_fingerprint=contract_mod.digest(p.skeleton["contract"]["fields"]),
                versions=p.skeleton["contract"]["versions"], parent=p.parent, **p.extra)
            manifest_bytes = manifest.to_bytes(self.key)
            staging.write(MANIFEST, [manifest_bytes])
            staging.commit()
        except BaseException:
            staging.abort()
            raise
        return manifest_bytes

    # 7. rehearsal ---------------------------------------------------------------
    def rehearse_new(self, name: str) -> None:
        try:
            rehearse(self.store, name, self.rehearse_factory, key=self.key)
        except Exception:
            aside = self.store.set_aside(name, "rejected")
            log.error("%s failed its restart rehearsal; moved aside to %s, the pointer was not moved", name, aside)
            raise

    # 9. prune -------------------------------------------------------------------
    def prune(self, published: dict[str, str]) -> None:
        """Prune by policy, anchored on what was just published (and the other kind's verified pointer)."""
        anchors = {**self.lifecycle.anchors(), **published}
        try:
            self.lifecycle.prune(self.retention, anchors)
        except CorruptGeneration as exc:  # a damaged pins file: prune nothing rather than guess what it pinned
            log.error("not pruning: %s. Remove the damaged pins file, then pin again what should be kept", exc)
