"""The write path: how one generation is published, top to bottom.

``prepare`` takes everything a generation holds from the live state at one
update boundary (on the training thread). :class:`Publisher` then runs the
publication protocol, on the caller's thread for a blocking save or on the
writer thread for a background one:

1. take the directory lock;
2. decide about an existing generation of the name (:meth:`Publisher.make_room`);
3. remove leftovers of interrupted saves;
4. preflight: refuse before staging when the disk cannot hold what the save
   writes (an incremental save's plan is made first: a linked file writes nothing);
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

import datetime
import logging
import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import (CorruptGeneration, GenerationExists, InsufficientSpace, InvalidArgument, InvalidType,
                     PendingGradients, TrainStateError)
from .format import tensorfile
from .format.digest import new_hasher
from .format.manifest import (MANIFEST, POINTER, RUN, STATE, WEIGHTS_POINTER, Manifest, check_metrics,
                              generation_name, generation_order, parse_run, run_to_bytes)
from .format.signing import SigningKey
from .lifecycle import incremental
from .lifecycle.generations import Lifecycle, new_timeline
from .lifecycle.rehearsal import Factory, rehearse
from .lifecycle.retention import Retention
from . import progress, revisions
from .records import GenerationInfo
from .state import changes
from .state import contract as contract_mod
from .state import snapshot
from .state.train_state import TrainState
from .storage.base import Store, listings_held
from .storage.verify import Verified, point_at, read_pointed, verify_generation

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

    def __post_init__(self) -> None:
        self.prepared = self.name  # ``name`` may become a revision (gen-U-r001) when it is published
        self.unless_same: Verified | None = None  # a generation whose bytes, if the staged ones match, make
        # this save a no-op (decided before the commit; see trainstate.revisions)
        self.fingerprints: dict | None = None  # each tensor's, once taken (incremental saves)
        self.frozen: frozenset[str] = frozenset()  # tensors of parameters not requiring gradients (a layout guide)

    def changed_bytes(self, manifest: Manifest, store: Store | None = None) -> list[str] | None:
        """Whether the tensor file this would write differs from ``manifest``'s, by digest: ``["tensor bytes"]``
        or ``[]``; ``None`` where the bytes are known only once written (a multi-rank share). Proof by content,
        not by a signal that a tensor was touched (an update under ``no_grad``, a write through ``.data`` or a
        NumPy view, an EMA swap, a generator's new state all show); digested in memory, in its own algorithm."""
        if manifest.fingerprints:  # format 4: the tensors are spread over files; compare their fingerprints
            if self.fingerprints is None:
                self.fingerprints = changes.fingerprints(self.tensors)
            return [] if incremental.unchanged(self.fingerprints, manifest, store) else ["tensor bytes"]
        record = manifest.file(TENSORS)
        layout = tensorfile.plan(self.tensors)
        if layout.size != record.size:
            return ["tensor bytes"]
        hasher = new_hasher(manifest.digest_algorithm)
        for chunk in tensorfile.chunks(layout, self.tensors):
            hasher.update(chunk)
        return [] if hasher.hexdigest() == record.digest else ["tensor bytes"]

    @property
    def estimated_bytes(self) -> int:
        """The generation's size as the preflight estimates it (tensors, headers, state JSON)."""
        return (sum(t.nbytes for t in self.tensors.values()) + 128 * len(self.tensors)
                + len(snapshot.state_json(self.skeleton)))

    def estimate(self, plan: incremental.Plan) -> int:
        """The bytes an incremental save writes, as the preflight estimates them: the tensors of the files it
        does not link (a hard link takes no data blocks), spares included, their headers, the state JSON."""
        return incremental.written_bytes(plan, self.tensors) + len(snapshot.state_json(self.skeleton))


def check_options(*, verify: str, rehearse: Factory | None, headroom: float) -> None:
    """The manager's publication options, checked when it is built rather than at the first save."""
    if verify not in ("full", "fast"):
        raise InvalidArgument(f"verify must be 'full' or 'fast', got {verify!r}")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not (
            math.isfinite(headroom) and 0 <= headroom <= 10):
        raise InvalidArgument(f"headroom must be a fraction in [0, 10], got {headroom!r}")
    if rehearse is not None and not callable(rehearse):
        raise InvalidType("rehearse must be a function returning a fresh TrainState")


def prepare(state: TrainState, retention: Retention, *, weights_only: bool, include_grads: bool,
            metrics: Mapping[str, float] | None) -> Pending:
    """Everything a generation holds, taken from the live state at one boundary. A full generation becomes the
    state's parent at once, so the next one descends from it even while it is written (:func:`roll_back` undoes
    that if the publication fails)."""
    kind = "weights" if weights_only else "full"
    recorded = check_metrics(metrics)
    if kind == "full" and state.pending_gradients and not include_grads:
        raise PendingGradients(
            "gradients are pending: a backward pass accumulated into .grad since the last optimizer.step(). "
            "A checkpoint here would lose them. Save after optimizer.step() (and zero_grad), or pass "
            "include_grads=True to save the gradients too, with your microbatch cursor in state.counters.")
    unaccounted = state.unaccounted_gradients() if kind == "full" and not include_grads else {}
    if unaccounted and not state._grads.unaccounted_logged:
        state._grads.unaccounted_logged = True
        names = [f"{m}.{p}" for m, grads in unaccounted.items() for p in grads]
        log.info("recording the gradients of %d parameters that no registered optimizer steps (%s): nothing can "
                 "tell whether a hand-written update consumed them. To leave them out, set them to None first "
                 "(model.zero_grad(set_to_none=True))", len(names), ", ".join(names[:5] + ["..."][:len(names) > 5]))
    skeleton, tensors = snapshot.capture(state, kind=kind, include_grads=include_grads, unaccounted=unaccounted)
    positions = {n: c.data_position() for n, c in state.data_positions().items()} if kind == "full" else {}
    name = generation_name(state.next_update, kind)
    if state.lineage is None:
        state.lineage = [[new_timeline(), None]]
    pending = Pending(name, kind, state.next_update, state.parent, skeleton, tensors, {
        "data": positions, "metrics": recorded, "retention": retention.record(),
        "lineage": [list(e) for e in state.lineage] if kind == "full" else []})
    if kind == "full":
        state.parent, pending.frozen = name, snapshot.frozen(state, tensors)
    return pending


def roll_back(pending: Pending, state: TrainState) -> bool:
    """After a failed publication, the state again descends from what was published; whether its parent changed."""
    if pending.kind == "full" and state.parent == pending.prepared:
        state.parent = pending.parent
        return True
    return False


class Publisher:
    """Runs the publication protocol (see the module docstring) against one store."""

    def __init__(self, store: Store, lifecycle: Lifecycle, retention: Retention, *, key: SigningKey | None,
                 verify_mode: str, rehearse_factory: Factory | None, preflight: bool, headroom: float):
        self.store, self.lifecycle, self.retention, self.key = store, lifecycle, retention, key
        self.verify_mode, self.rehearse_factory, self.preflight, self.headroom = (verify_mode, rehearse_factory,
                                                                                  preflight, headroom)
        self.published: str | None = None  # the last generation whose pointer move completed
        self.renamed: dict[str, str] = {}  # prepared name -> the generation it was published as, or found in
        self.after_publish: Callable[[str], None] | None = None  # told each published name (a mirror's uploader)
        self.progress: bool | None = False  # a byte bar on stderr while the tensors are written (None: on a tty)
        self.full_every: int | None = None  # incremental generations (see incremental.check_full_every), or None
        self.known: dict[str, tuple[Manifest, int]] = {}  # the last generation staged here, for the next save
        self.incremental_saves = 0  # incremental saves planned here: some probe (incremental.probing)
        self.fresh = False  # the next incremental save links nothing: the last one's verification failed
        self.clean_due = True  # an object store's leftovers: looked for at the first save, and after a failed one

    def publish(self, p: Pending) -> GenerationInfo:
        """Publish ``p``: durable, verified and named by its pointer when this returns.

        Saving again at an update that already has a generation of this
        timeline holding the same state writes nothing and returns that
        generation's info; a different state at that update is published
        as a revision that supersedes it (:meth:`make_room`).
        """
        self.store.lock()
        with listings_held(self.store):  # an object store: the steps before the first write list the records once
            try:
                return self._publish(p)
            except BaseException:
                self.clean_due = True  # a failed save may leave its staging behind: the next one looks
                raise

    def _publish(self, p: Pending) -> GenerationInfo:  # (see publish)
        self.finish_interrupted_replacements()
        existing = self.make_room(p)
        if isinstance(existing, GenerationInfo):
            if p.kind == "full":
                self.point_if_behind(existing.name)
            return existing
        if p.kind == "full" and p.parent is not None:
            self.point_if_behind(p.parent, ahead_only=True)  # restore rolled forward to it; latest is behind
        superseded = existing  # the old generation of this name, set aside until the pointer has moved
        try:
            info = self._publish_new(p)
        except BaseException:
            if superseded is not None:
                self._put_back(superseded, p.name)
            raise
        try:  # published: a failure from here on is logged, never raised as a failed save
            if superseded is not None:
                self.store.remove(superseded)
            if self.after_publish is not None:
                self.after_publish(p.name)
            self.prune({p.kind: p.name})
        except Exception as exc:
            self.clean_due = True  # (a prune that stopped halfway leaves objects no record names)
            log.error("%s is published, but cleaning up after it failed (%r); the next save retries", p.name, exc)
        return info

    def clean_if_due(self) -> None:
        """Remove what interrupted saves left: in a local directory at every save (one system call), in an object
        store (several listings) at the first save and after a failed one: while this process holds the lease, no
        other writes the run."""
        if self.clean_due or not getattr(self.store, "remote", False):
            for leftover in self.store.clean_leftovers():
                log.info("removed leftover %s from an interrupted save", leftover)
            self.clean_due = False

    def _publish_new(self, p: Pending) -> GenerationInfo:
        """Steps 3 to 8: everything up to and including the pointer move."""
        self.clean_if_due()
        p.extra["run"] = self.run_identity()
        plan = self.plan_increment(p)
        if self.preflight:
            self.check_space(p.name, p.estimated_bytes if plan is None else p.estimate(plan),
                             linked=0 if plan is None else incremental.linked_bytes(plan))
        manifest_bytes = self.stage_and_commit(p, plan)
        try:
            verified = verify_generation(self.store, p.name, content=self.verify_mode == "full", key=self.key)
            if verified.manifest.to_bytes(self.key) != manifest_bytes:
                raise CorruptGeneration(p.name, "committed manifest differs from the one written")
        except CorruptGeneration:
            self.distrust()
            self.store.remove(p.name)  # committed but not what we wrote: never let it become latest
            raise
        if plan is not None:
            self.fresh = False  # (a weights-only save links nothing either way)
        if p.kind == "full" and self.rehearse_factory is not None:
            self.rehearse_new(p.name)
        try:
            point_at(self.store, verified, self.key)
        except BaseException:
            self.withdraw(p.name, p.kind)
            raise
        self.published = p.name  # durably: from here on the save has succeeded, whatever happens next
        self.was_published_as(p.prepared, p.name)
        return GenerationInfo.from_verified(self.store, verified)

    def withdraw(self, name: str, kind: str) -> None:
        """The pointer move failed: a save that raises publishes nothing, so the committed generation goes,
        unless the pointer names it after all (the rename landed, a later step failed). Best effort: left
        behind, it is complete and verified, and a restart rolls forward to it (see lifecycle.candidates)."""
        try:
            if self.committed_name(kind) != name:
                self.store.remove(name)
        except Exception as exc:  # the failure that brought us here is what the caller must see
            log.error("could not remove %s after its pointer move failed (%r); it is complete and verified, and a "
                      "restart may resume from it", name, exc)

    def was_published_as(self, prepared: str, name: str) -> None:
        """A save prepared as ``prepared`` ended up as ``name``: a save prepared before this was known (a
        background save in flight) names ``prepared`` as its parent, and gets ``name`` instead."""
        if prepared == name:
            self.renamed.pop(prepared, None)
            return
        self.renamed[prepared] = name
        while len(self.renamed) > 16:
            del self.renamed[next(iter(self.renamed))]

    def _put_back(self, superseded: str, name: str) -> None:
        """A replacement failed: the generation it was to replace goes back under its name."""
        try:
            if name in self.store.generations():
                self.store.remove(name)  # committed, then failed verification or rehearsal
            self.store.reinstate(superseded, name)
            log.warning("publishing the replacement of %s failed; the previous %s is back in place", name, name)
        except Exception as exc:  # the original failure is what the caller must see
            log.error("could not put %s back as %s (%r); the next save will", superseded, name, exc)

    def finish_interrupted_replacements(self) -> None:
        """Complete what a crash in the middle of a replacement left.

        A superseded generation whose name is free again was being replaced
        when the process died: it goes back. One whose name holds a
        committed replacement has been replaced: it is removed.
        """
        generations = set(self.store.generations())
        for aside in self.store.aside():
            name, _, rest = aside.partition(".")
            if not rest.startswith("superseded-"):
                continue
            if name in generations:
                log.info("removing %s: an interrupted replacement had already published %s", aside, name)
                self.store.remove(aside)
            else:
                log.warning("putting %s back as %s: its replacement never completed", aside, name)
                self.store.reinstate(aside, name)
                generations.add(name)

    # 2. an existing generation of the same name --------------------------------
    def make_room(self, p: Pending) -> GenerationInfo | str | None:
        """Decide what happens to existing generations at the update about to be published.

        Returns ``None`` when ``p.name`` is free (``p.name`` may have become
        a revision, ``gen-<update>-r001``...), the name an old generation was
        set aside under when it is to be replaced under its own name (removed
        only after the pointer has moved), or the existing generation's info
        when it already holds this state.

        Full generations (:func:`trainstate.revisions.full_at_update`): a
        second save at an update this timeline already published is a no-op
        when the state and metrics are the same, and otherwise publishes a
        revision that supersedes the earlier one. A weights-only generation of the same
        name is replaced (a damaged one moved aside as evidence first; a
        pinned one never replaced).
        """
        p.parent = self.renamed.get(p.parent, p.parent)  # an earlier save published under another name
        if p.kind == "full":
            return revisions.full_at_update(self, p)
        name = p.name
        if name not in self.store.generations():
            return None
        try:
            verify_generation(self.store, name, key=self.key)
        except CorruptGeneration as exc:
            aside = self.store.set_aside(name, "rejected")
            log.warning("moved damaged %s aside to %s before publishing over it: %s", name, aside, exc)
            return None
        self._refuse_pinned(name)
        if self.committed_name("weights") == name:
            log.info("replacing %s, the latest weights-only generation: the run resumed from an earlier full "
                     "generation and reached this update again", name)
        else:
            log.warning("replacing %s, which is not the latest weights-only generation: it is an interrupted or "
                        "abandoned publication of the same update", name)
        return self.store.set_aside(name, "superseded")

    def pinned(self, name: str) -> list[str]:
        try:
            return sorted(pin for pin, g in self.lifecycle.pins().items() if g == name)
        except CorruptGeneration:
            return ["? (the pins file is unreadable)"]

    def _refuse_pinned(self, name: str) -> None:
        pinned = self.pinned(name)
        if pinned:
            raise GenerationExists(f"{name} exists and is pinned ({', '.join(pinned)}); a pinned generation is "
                                   "never replaced. Unpin it first, or save at another update.")

    def run_identity(self) -> str:
        """The run directory's identity, bound into every manifest; recorded (durably) before the first commit.

        A damaged record is rewritten with the identity the newest full
        generation carries, so the run's own generations keep matching.
        """
        try:
            data = self.store.read_pointer(RUN)
            if data is not None:
                return parse_run(data, RUN, self.key)
        except CorruptGeneration as exc:
            log.error("the run identity record is damaged (%s); rewriting it", exc)
        newest = self.lifecycle.newest_full()
        run = newest.run if newest is not None and newest.run else secrets.token_hex(16)
        self.store.write_pointer(RUN, run_to_bytes(run, self.key))
        return run

    def point_if_behind(self, name: str, ahead_only: bool = False) -> None:
        """A save found ``name`` already holding this state (a no-op save): make ``latest`` name it, as publishing
        it would have, if it names another generation. That completes a publication a crash cut between its
        commit and the pointer move (restore rolled forward to it, and a run killed in its final save then saves
        nothing new); a ``latest`` that already names it is not written. ``ahead_only`` (``name`` is the parent of
        a new save): only a ``latest`` that names an older generation moves, so that a crash in this save leaves
        ``latest`` one step behind, never two (which restore would take for a rolled-back pointer)."""
        try:
            pointer = read_pointed(self.store, POINTER, self.key)
        except (OSError, TrainStateError):
            pointer = None  # unreadable (a symlink, a directory): replaced as a publication replaces it
        if pointer is not None and pointer.generation == name or ahead_only and (
                pointer is None or generation_order(name) <= generation_order(pointer.generation)
                or name not in self.store.generations()):
            return
        point_at(self.store, verify_generation(self.store, name, content=False, key=self.key), self.key)
        self.published = name
        log.info("latest now names %s (it named %s)", name, pointer.generation if pointer else "nothing readable")

    def committed_name(self, kind: str) -> str | None:
        """The generation the pointer of ``kind`` names (unverified), if the pointer parses."""
        pointer = read_pointed(self.store, POINTER if kind == "full" else WEIGHTS_POINTER, self.key)
        return None if pointer is None else pointer.generation

    # 4. preflight ---------------------------------------------------------------
    def check_space(self, name: str, live_bytes: int, *, linked: int = 0) -> None:
        """Refuse before staging when the ``live_bytes`` the save writes cannot fit, after pruning what policy
        allows (``linked``: the bytes of the files it links, which take no space, named in the refusal)."""
        estimate = live_bytes + (64 << 10)  # the manifest, and a block of slack per file
        needed = int(estimate * (1 + self.headroom))
        free = self.store.free_bytes()
        if free is None or free >= needed:
            return
        join_removals = self.store.join_removals
        if join_removals():  # generations pruned earlier may still be being deleted in the background
            free = self.store.free_bytes() or 0
            if free >= needed:
                return
        plan = self.lifecycle.prune(self.retention)
        if plan.prune:
            log.warning("pruned %s before saving %s to make room", ", ".join(plan.prune), name)
            join_removals()
            free = self.store.free_bytes() or 0
        if free < needed:
            raise InsufficientSpace(self.store.location, name, needed, free, linked=linked)

    def distrust(self) -> None:
        """A committed generation failed its verification: whatever it linked or copied, the retry writes every
        file afresh from the live tensors (a retry that linked again would copy the same damage), and an object
        store proves again every object it took as proven."""
        self.fresh = True
        forget = getattr(self.store, "forget_proven", None)
        if forget is not None:
            forget()

    # 5. stage, write, commit ------------------------------------------------------
    def plan_increment(self, p: Pending) -> incremental.Plan | None:
        """What an incremental save links and writes (``None``: one tensor file), proven (:func:`.incremental.prove`)
        before the preflight, which counts only what is written."""
        if self.full_every is None or p.kind != "full":
            return None
        plan = incremental.plan(self.store, self.key, p.tensors, p.parent, self.full_every, p.fingerprints,
                                self.known, probe=incremental.probing(self.incremental_saves, self.full_every),
                                fresh=self.fresh, frozen=p.frozen)
        self.incremental_saves += 1
        return incremental.prove(self.store, plan)

    def stage_and_commit(self, p: Pending, plan: incremental.Plan | None = None) -> bytes:
        """Write every file into a staging area, the manifest last, then commit; returns the manifest's bytes.
        ``plan``: an incremental save's (:meth:`plan_increment`), written by what changed, the rest linked."""
        staging = self.store.begin(p.name)
        meter = None
        try:
            stable = all(t.device.type == "cpu" for t in p.tensors.values())
            state_json = snapshot.state_json(p.skeleton)
            extra: dict[str, Any] = {}
            if plan is not None:
                meter = progress.optional(None, f"save {p.name}", self.progress, deferred=True)
                files, extra = incremental.write(
                    staging, plan, p.tensors, lambda chunks: progress.counted(chunks, meter), stable, self.store,
                    total=lambda n: meter and meter.restart(len(state_json) + n, f"save {p.name}"))
                files.insert(0, staging.write(STATE, progress.counted([state_json], meter)))
            else:
                layout = tensorfile.plan(p.tensors)
                meter = progress.optional(len(state_json) + layout.size, f"save {p.name}", self.progress)
                files = [staging.write(STATE, progress.counted([state_json], meter)),
                         staging.write(TENSORS, progress.counted(tensorfile.chunks(layout, p.tensors), meter),
                                       stable=stable, size_hint=layout.size)]
            manifest = Manifest(
                generation=p.name, kind=p.kind, next_update=p.next_update,
                digest_algorithm=self.store.digest_algorithm, files=tuple(files),
                created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds"),
                contract_fingerprint=contract_mod.digest(p.skeleton["contract"]["fields"]),
                versions=p.skeleton["contract"]["versions"], parent=p.parent, **p.extra, **extra)
            manifest_bytes = manifest.to_bytes(self.key)
            staging.write(MANIFEST, [manifest_bytes])
            staging.commit()
            if extra and plan is not None:  # the next save's parent, most likely: no read
                self.known = {p.name: (manifest, plan.depth + 1 if manifest.shares else 0)}
        except BaseException:
            staging.abort()
            raise
        finally:
            if meter is not None:
                meter.close()
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
        """Prune by policy, anchored on what was just published (and the other kind's verified pointer, read
        here). Runs only once the pointer has moved; the caller logs rather than raises its failures."""
        anchors = {**self.lifecycle.anchors([k for k in ("full", "weights") if k not in published]), **published}
        try:
            self.lifecycle.prune(self.retention, anchors)
        except CorruptGeneration as exc:  # a damaged pins file: prune nothing rather than guess what it pinned
            log.error("not pruning: %s. Remove the damaged pins file, then pin again what should be kept", exc)
