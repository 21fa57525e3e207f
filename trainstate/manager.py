"""CheckpointManager: saves and restores TrainState through a Store.

``save`` checks policy, then runs the publication protocol in order:
stage -> write and fsync files -> commit (rename, fsync parent) -> verify ->
replace the pointer -> prune. ``restore`` reads pointer -> manifest -> files,
falls back to the newest generation that verifies, checks the contract, and
only then loads into the live objects.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import sys
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from . import cadence as cadence_mod
from .cadence import Cadence, Clock
from . import contract as contract_mod
from . import signing, snapshot, tensorfile
from .errors import (CorruptGeneration, GenerationExists, InsufficientSpace,
                     NoValidGeneration, PendingGradients, Rejection, StateMismatch, WeightsOnlyGeneration)
from .asyncsave import SaveHandle, Writer
from .lifecycle import Lifecycle, new_timeline
from .localfs import LocalStore
from .manifest import (MANIFEST, POINTER, STATE, WEIGHTS_POINTER, Manifest, Pointer, check_name, generation_name,
                       parse_generation_name, parse_pointer)
from .rehearsal import Factory, Rehearsal, rehearse
from .records import GenerationInfo, RestoreInfo, Status
from .retention import Plan, Retention
from .signing import SigningKey
from .state import TrainState
from .storage import Store
from .verify import Verified, decode_verified, verify_generation

log = logging.getLogger("trainstate")
TENSORS = "tensors.safetensors"


def _report_at_exit(writer: Writer, directory: str) -> None:
    """Never lose a background failure silently, even if close() was never called."""
    writer.drain()
    for generation, cause in writer.failures():
        message = (f"trainstate: background save of {generation} in {directory} failed and was never reported "
                   f"(close() or wait() was not called); it was not published. Cause: {cause!r}")
        print(message, file=sys.stderr)  # printed, not logged: logging may already be shut down


def _same_timeline(existing: list, ours: list) -> bool:
    """Whether a generation with timeline record ``existing`` lies on the timeline ``ours`` continues."""
    if not existing or not ours:
        return True  # no record (older format, or weights-only): assume the same, the safe refusal
    return existing[-1][0] == ours[-1][0]


def _metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    out = {}
    for name, value in (metrics or {}).items():
        check_name("metric", name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"metric {name!r} must be a finite number, got {value!r}")
        out[name] = float(value)
    return out


def _policy_record(policy: Retention) -> dict[str, Any]:
    record = dataclasses.asdict(policy)
    record["best"] = list(policy.best) if policy.best else None
    return record


@dataclass
class _Pending:
    """A generation prepared at one update boundary, waiting to be published."""

    name: str
    kind: str
    next_update: int
    parent: str | None
    skeleton: dict
    tensors: dict
    extra: dict


IN_PLACE_BYTES = 256 << 20  # restore(in_place=None) loads in place above this much tensor data


class CheckpointManager:
    """Durable, verified checkpoints of a :class:`TrainState` in one run directory.

    >>> with CheckpointManager("runs/exp1", keep_last=3) as ckpt:
    ...     ckpt.restore(state)          # None on a fresh run
    ...     ...
    ...     ckpt.save(state)             # returns once durable and published

    ``keep_last`` full generations are kept (weights-only generations are
    counted separately); ``retention=Retention(...)`` adds milestones, a
    best-by-metric generation and a separate weights-only count, and pins
    (:meth:`pin`) keep named generations. Pruning runs only after a new
    generation has verified and the pointer has moved. ``digest`` names the
    content hash (``"blake3"`` or ``"sha256"``). Every file's bytes are read
    back and checked against their digest while its fsync runs, before the
    rename; ``verify`` chooses the check after the rename: ``"fast"``
    (default) checks the manifest's digest, the file set and every size,
    ``"full"`` also re-reads and re-hashes every byte. ``rehearse`` (a
    function returning a fresh :class:`TrainState`) additionally restores
    every new full generation into fresh objects before its pointer moves.
    ``signing_key`` (or ``TRAINSTATE_SIGNING_KEY``/``TRAINSTATE_SIGNING_KEY_FILE``
    in the environment) signs every manifest and pointer with HMAC-SHA256, and
    restore then refuses unsigned or forged generations. ``preflight`` checks
    free space before staging (``headroom`` is the fraction of the estimated
    size kept free beyond it). ``cadence=Cadence(mtbf_s=...)`` makes
    :meth:`due` pick the save interval from measurements.
    The manager holds an exclusive lock on the directory while open.
    """

    def __init__(self, directory: str | Path, *, keep_last: int = 3, retention: Retention | None = None,
                 digest: str = "blake3", verify: str = "fast", signing_key: SigningKey | bytes | str | None = None,
                 store: Store | None = None, rehearse: Factory | None = None, preflight: bool = True,
                 headroom: float = 0.05, cadence: Cadence | None = None, max_in_flight: int = 1):
        if type(keep_last) is not int or keep_last < 1:
            raise ValueError(f"keep_last must be a positive int, got {keep_last!r}")
        if retention is not None and keep_last != 3:
            raise ValueError("pass keep_last inside retention=Retention(keep_last=...), not both")
        if verify not in ("full", "fast"):
            raise ValueError(f"verify must be 'full' or 'fast', got {verify!r}")
        if not (math.isfinite(headroom) and 0 <= headroom <= 10):
            raise ValueError(f"headroom must be a fraction in [0, 10], got {headroom!r}")
        if rehearse is not None and not callable(rehearse):
            raise TypeError("rehearse must be a function returning a fresh TrainState")
        self.store: Store = store if store is not None else LocalStore(directory, digest)
        self.key = signing.resolve(signing_key, directory)
        self.retention = retention if retention is not None else Retention(keep_last=keep_last)
        self.verify_mode = verify
        self.rehearse_factory = rehearse
        self.preflight = preflight
        self.headroom = headroom
        self.cadence = cadence
        self.lifecycle = Lifecycle(self.store, self.key)
        self.last_rejections: tuple[Rejection, ...] = ()
        self._clock = Clock()
        self._last_full_update: int | None = None
        self._origin: int | None = None  # where the cadence started counting (first due() call)
        self._writer = Writer(max_in_flight)
        weakref.finalize(self, _report_at_exit, self._writer, str(directory))
        self._started: str | None = None  # last generation prepared (captured at a boundary)
        self._staged: str | None = None  # last background save whose owned copy exists
        self._committed: str | None = None  # last generation published by this manager

    @property
    def keep_last(self) -> int:
        return self.retention.keep_last

    # lifecycle ---------------------------------------------------------------
    def __enter__(self) -> CheckpointManager:
        self.store.lock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Finish every background save, release the directory, then raise any unreported failure."""
        try:
            self._writer.shutdown()
        finally:
            self.store.unlock()
        failed = self._writer.unreported()
        if failed:
            self._writer.raise_unreported()

    # saving ------------------------------------------------------------------
    def save(self, state: TrainState, *, weights_only: bool = False, include_grads: bool = False,
             metrics: Mapping[str, float] | None = None, blocking: bool = True) -> GenerationInfo | SaveHandle:
        """Publish a generation of ``state``; returns once it is durable, verified and latest.

        Refuses while gradients are pending (a backward pass since the last
        optimizer step) unless ``include_grads=True``, which also saves them so
        the accumulation resumes bitwise (keep your microbatch cursor in
        ``state.counters``). ``metrics`` (finite numbers by name) are recorded
        in the manifest; the retention policy's ``best`` metric reads them.
        Raises :class:`InsufficientSpace` before writing anything when the
        disk cannot hold the generation even after pruning what policy allows.

        With ``blocking=False`` it returns a :class:`SaveHandle` as soon as an
        owned copy of the whole state exists; the live objects may change at
        once. At most ``max_in_flight`` saves run at a time (a further save
        waits for one to finish). A background failure is raised once, by the
        handle's ``wait()`` or else by the next ``save``, ``wait`` or ``close``.
        """
        self._writer.raise_unreported()
        if not blocking and self.rehearse_factory is not None:
            raise ValueError("rehearse= builds objects (and may draw global RNG) while training runs; it cannot "
                             "run beside a background save. Use blocking saves, or rehearse out of process with "
                             "`trainstate verify DIR --rehearse module:function`.")
        started = time.monotonic()
        if blocking:
            self._writer.drain()  # publish in order behind any background save
            self._writer.raise_unreported()
            pending = self._prepare(state, weights_only, include_grads, metrics)
            info = self._publish_or_roll_back(pending, state)
            self._clock.saved(time.monotonic() - started)
            return info
        buffers = self._writer.acquire()  # backpressure: waits while max_in_flight saves are in flight
        try:
            self._writer.raise_unreported()  # one may have failed while we waited
            pending = self._prepare(state, weights_only, include_grads, metrics)
            pending.tensors = buffers.stage(pending.tensors)
        except BaseException:
            self._writer.release_unused(buffers)
            raise
        self._staged = pending.name
        handle = self._writer.submit(pending.name, buffers, lambda: self._publish_or_roll_back(pending, state))
        self._clock.saved(time.monotonic() - started)  # the stall is what blocks training
        return handle

    def wait(self) -> None:
        """Wait for every background save; raise the first failure not yet reported."""
        self._writer.drain()
        self._writer.raise_unreported()

    def _prepare(self, state: TrainState, weights_only: bool, include_grads: bool,
                 metrics: Mapping[str, float] | None) -> _Pending:
        """Everything a generation holds, taken from the live state at one boundary."""
        kind = "weights" if weights_only else "full"
        recorded = _metrics(metrics)
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
        pending = _Pending(name, kind, state.next_update, state.parent, skeleton, tensors, {
            "data": positions, "metrics": recorded, "retention": _policy_record(self.retention),
            "lineage": [list(e) for e in state.lineage] if kind == "full" else []})
        self._started = name
        if kind == "full":
            state.parent = name  # the next generation descends from this one, even while it is being written
            self._last_full_update = state.next_update
        return pending

    def _publish_or_roll_back(self, p: _Pending, state: TrainState) -> GenerationInfo:
        """Publish; if that fails, the state again descends from what was actually published."""
        try:
            return self._publish(p)
        except BaseException:
            if p.kind == "full" and state.parent == p.name:
                state.parent = p.parent
                self._last_full_update = parse_generation_name(p.parent)[0] if p.parent else self._origin
            raise

    def _publish(self, p: _Pending) -> GenerationInfo:
        """The publication protocol, from a prepared snapshot (on the caller's or the writer's thread)."""
        self.store.lock()
        self._make_room_for(p.name, p.extra["lineage"])
        for leftover in self.store.clean_leftovers():
            log.info("removed leftover %s from an interrupted save", leftover)
        if self.preflight:
            self._check_space(p.name, sum(t.nbytes for t in p.tensors.values()) + 128 * len(p.tensors)
                              + len(snapshot.state_json(p.skeleton)))
        manifest_bytes = self._stage_and_commit(p)
        try:
            verified = verify_generation(self.store, p.name, content=self.verify_mode == "full", key=self.key)
            if verified.manifest.to_bytes(self.key) != manifest_bytes:
                raise CorruptGeneration(p.name, "committed manifest differs from the one written")
        except CorruptGeneration:
            self.store.remove(p.name)  # committed but not what we wrote: never let it become latest
            raise
        if p.kind == "full" and self.rehearse_factory is not None:
            self._rehearse_new(p.name)
        pointer = Pointer(p.name, verified.manifest_digest, verified.manifest_size,
                          verified.manifest.digest_algorithm, p.next_update, p.kind)
        self.store.write_pointer(POINTER if p.kind == "full" else WEIGHTS_POINTER, pointer.to_bytes(self.key))
        self._committed = p.name
        self._prune({p.kind: p.name})
        return GenerationInfo.from_verified(self.store, verified)

    def _rehearse_new(self, name: str) -> None:
        try:
            rehearse(self.store, name, self.rehearse_factory, key=self.key)
        except Exception:
            aside = self.store.set_aside(name, "rejected")
            log.error("%s failed its restart rehearsal; moved aside to %s, the pointer was not moved", name, aside)
            raise

    def _check_space(self, name: str, live_bytes: int) -> None:
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

    def _make_room_for(self, name: str, lineage: list) -> None:
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
        committed = self._committed_name(kind)
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

    def _committed_name(self, kind: str) -> str | None:
        try:
            data = self.store.read_pointer(POINTER if kind == "full" else WEIGHTS_POINTER)
            return None if data is None else parse_pointer(data, POINTER, self.key).generation
        except CorruptGeneration:
            return None

    def _stage_and_commit(self, p: _Pending) -> bytes:
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

    def _prune(self, published: dict[str, str]) -> None:
        """Prune by policy, anchored on what was just published (and the other kind's verified pointer)."""
        anchors = {**self.lifecycle.anchors(), **published}
        try:
            self.lifecycle.prune(self.retention, anchors)
        except CorruptGeneration as exc:  # a damaged pins file: prune nothing rather than guess what it pinned
            log.error("not pruning: %s. Remove the damaged pins file, then pin again what should be kept", exc)

    # retention ---------------------------------------------------------------
    def plan(self) -> Plan:
        """What a prune would keep and remove now, with the reason for each generation (changes nothing)."""
        return self.lifecycle.plan(self.retention)

    def prune(self, *, dry_run: bool = False) -> Plan:
        """Apply the retention policy now (it also runs after every save); returns the plan."""
        self.store.lock()
        return self.lifecycle.prune(self.retention, dry_run=dry_run)

    def pin(self, name: str, generation: str) -> None:
        """Keep ``generation`` until unpinned, under a name such as ``"final"`` or ``"release-candidate"``."""
        self.lifecycle.pin(name, generation)

    def unpin(self, name: str) -> str:
        """Drop a pin; the generation is pruned by a later prune if no other rule keeps it."""
        return self.lifecycle.unpin(name)

    def pins(self) -> dict[str, str]:
        return self.lifecycle.pins()

    def best(self) -> str | None:
        """The best generation by the retention policy's metric (an evaluation artifact, not the resume point)."""
        return self.lifecycle.best(self.retention) if self.retention.best else None

    def rehearse(self, factory: Factory, generation: str | None = None) -> Rehearsal:
        """Restore ``generation`` (default: latest) into ``factory()``'s fresh objects, touching nothing live."""
        name = generation or self.latest()
        if name is None:
            raise NoValidGeneration(self.store.location, [])
        return rehearse(self.store, name, factory, key=self.key)

    # cadence -----------------------------------------------------------------
    def due(self, state: TrainState) -> bool:
        """Call once per update boundary: True when a full save is due under the configured cadence.

        Also measures the update time (saves excluded) for :meth:`advice` and :meth:`status`.
        """
        if self.cadence is None:
            raise ValueError("due() needs CheckpointManager(..., cadence=Cadence(mtbf_s=...))")
        self._clock.boundary()
        interval = self._interval()
        since = self._last_full_update
        if since is None:  # a fresh run starts one update before its first boundary; a resumed one at its generation
            since = max(state.next_update - 1, 0) if state.parent is None else parse_generation_name(state.parent)[0]
            self._last_full_update = self._origin = since
            if not self._clock.saves:
                interval = self.cadence.first_after
        return state.next_update - since >= (interval or self.cadence.first_after)

    def advice(self, mtbf_s: float | None = None) -> cadence_mod.Advice | None:
        """Young's and Daly's intervals from the measured save cost and update time (None until measured)."""
        mtbf = mtbf_s if mtbf_s is not None else (self.cadence.mtbf_s if self.cadence else None)
        save, step = self._clock.mean(self._clock.saves), self._clock.mean(self._clock.updates)
        if mtbf is None or save is None or step is None:
            return None
        return cadence_mod.advise(save, mtbf, step, self.cadence.restart_s if self.cadence else 0.0)

    def _interval(self) -> int | None:
        advice = self.advice()
        if advice is None:
            return None
        updates = advice.daly_updates if self.cadence.model == "daly" else advice.young_updates
        updates = max(updates, self.cadence.min_updates)
        return updates if self.cadence.max_updates is None else min(updates, self.cadence.max_updates)

    def status(self) -> Status:
        """The recovery point (last full generation), weights-only latest, pins, best and measurements."""
        anchors = self.lifecycle.anchors()
        full = anchors.get("full")
        return Status(self.store.location, full, parse_generation_name(full)[0] if full else None,
                      anchors.get("weights"), len(self.store.generations()), self.lifecycle.pins(), self.best(),
                      self._clock.saves[-1] if self._clock.saves else None, self._clock.mean(self._clock.saves),
                      self._clock.mean(self._clock.updates), self._interval() if self.cadence else None,
                      self._started, self._staged, self._committed, self._writer.in_flight(),
                      tuple(self._writer.unreported()))

    # restoring ---------------------------------------------------------------
    def restore(self, state: TrainState, *, generation: str | None = None, allow_changes: Iterable[str] = (),
                rng_statistical_cuda: bool = False, in_place: bool | None = None) -> RestoreInfo | None:
        """Continue ``state`` from the latest verified full generation (or ``generation``).

        Returns ``None`` when the directory holds no generation at all. Raises
        :class:`NoValidGeneration` when generations exist but none verifies,
        and :class:`ContractMismatch` (loading nothing) when the experiment
        contract differs, unless each differing field is in ``allow_changes``.

        ``in_place`` (default: for generations above ``IN_PLACE_BYTES``) reads
        tensors straight into the live ones that match by name, shape and
        dtype, so peak memory stays near the live state: a first pass verifies
        every digest and checks everything against the live objects while
        keeping no large tensor; a second pass (mostly from the page cache)
        loads, digesting again. Otherwise every byte is read once into fresh
        tensors, which are checked and then loaded (one extra copy of the
        state, briefly).
        """
        self._writer.drain()  # a background save in flight publishes first
        allow = [allow_changes] if isinstance(allow_changes, str) else list(allow_changes)
        chosen, rejected = self._choose(generation, preview=in_place)
        if chosen is None:
            return None
        verified, payload, previewed = chosen
        name = verified.manifest.generation
        accepted = contract_mod.check(payload["contract"]["fields"], state.contract_fields(), name, allow)
        snapshot.check_components(state, payload, name)
        checked = None
        if previewed:  # every check on the preview, then the second pass writes into live tensors
            checked = snapshot.check_before_load(state, payload, statistical_cuda=rng_statistical_cuda)
            payload = self._load_in_place(state, verified)
        warnings = snapshot.apply(state, payload, statistical_cuda=rng_statistical_cuda, checked=checked)
        if accepted:
            state.history.append({"event": "contract_change", "restored_from": name,
                                  "next_update": state.next_update,
                                  "changes": [{"field": c.field, "old": c.old, "new": c.new} for c in accepted]})
        for message in warnings:
            log.warning("%s", message)
        for component in state.components.values():  # already warned by the component itself
            report = getattr(component, "restore_warnings", None)
            warnings += list(report()) if callable(report) else []
        state.parent = name
        state.lineage = self._continue_lineage(verified.manifest)
        return RestoreInfo(GenerationInfo.from_verified(self.store, verified), rejected, tuple(accepted),
                           tuple(warnings))

    def _continue_lineage(self, manifest: Manifest) -> list[list]:
        """The timelines a run restored from ``manifest`` continues.

        Resuming from the newest full generation continues its timeline.
        Resuming from an older one (a fallback past a damaged latest, or an
        explicit ``generation=``) forks: full generations above it then belong
        to an abandoned timeline, which retention never counts as ancestors.
        """
        record = [list(e) for e in manifest.lineage] or [["legacy", None]]
        update = manifest.next_update
        newer = [n for n in self.store.generations() if (p := parse_generation_name(n)) and p[1] == "full"
                 and p[0] > update]
        if not newer:
            return record
        return record[:-1] + [[record[-1][0], update], [new_timeline(), None]]

    def _load(self, name: str, pointer: Pointer | None, preview: bool | None
              ) -> tuple[Verified, dict[str, Any], bool]:
        """Verify a generation completely while decoding it; any defect is a CorruptGeneration.

        With ``preview`` (``None``: when the tensor files exceed ``IN_PLACE_BYTES``)
        large tensors are digested but not kept: the payload has meta tensors.
        """
        verified = verify_generation(self.store, name, pointer, content=False, key=self.key)
        manifest = verified.manifest
        if preview is None:
            preview = sum(f.size for f in manifest.files if f.name.endswith(".safetensors")) > IN_PLACE_BYTES
        return verified, decode_verified(self.store, manifest, preview=preview), preview

    def _load_in_place(self, state: TrainState, verified: Verified) -> dict[str, Any]:
        """Second pass of an in-place restore: everything already verified and checked against the live objects."""
        try:
            return decode_verified(self.store, verified.manifest, into=snapshot.destinations(state))
        except CorruptGeneration as exc:
            raise StateMismatch(
                f"{verified.manifest.generation} changed on disk between its verification and the in-place load "
                f"({exc}); live tensors may now hold part of it. Rebuild the live objects before restoring again, "
                "and find what is writing to the run directory.") from exc

    def _choose(self, generation: str | None, preview: bool | None = False
                ) -> tuple[tuple[Verified, dict, bool] | None, tuple[Rejection, ...]]:
        if generation is not None:
            parsed = parse_generation_name(generation)
            if parsed is not None and parsed[1] == "weights":
                raise WeightsOnlyGeneration(
                    f"{generation} holds weights only: restoring it is a warm start, not a resume. "
                    "Use warm_start() to load its weights, or restore a full generation.")
            return self._load(generation, None, preview), ()
        rejected: list[Rejection] = []
        names = self.store.generations()
        candidates = [n for n in names if parse_generation_name(n)[1] == "full"]
        pointer, pointer_problem = self._read_pointer(bool(candidates))
        if pointer_problem:
            rejected.append(Rejection(POINTER, pointer_problem))
        if not candidates and len(names) and pointer is None:
            log.warning("%s holds only weights-only generations: nothing to resume, starting fresh "
                        "(use warm_start() to initialise from them)", self.store.location)
        if pointer is not None:
            candidates = [pointer.generation] + [n for n in candidates if n != pointer.generation]
        for name in candidates:
            try:
                chosen = self._load(name, pointer if pointer and name == pointer.generation else None, preview)
            except CorruptGeneration as exc:
                rejected.append(Rejection(name, str(exc)))
                log.warning("rejected %s: %s", name, exc)
                continue
            self.last_rejections = tuple(rejected)
            return chosen, tuple(rejected)
        self.last_rejections = tuple(rejected)
        if not candidates and pointer is None and not pointer_problem:
            return None, ()
        raise NoValidGeneration(self.store.location, rejected)

    def _read_pointer(self, generations_exist: bool) -> tuple[Pointer | None, str | None]:
        try:
            data = self.store.read_pointer(POINTER)
            if data is None:
                return None, ("missing, but generations exist" if generations_exist else None)
            pointer = parse_pointer(data, POINTER, self.key)
        except CorruptGeneration as exc:
            return None, exc.reason
        if pointer.kind != "full":
            return None, "names a weights-only generation"
        return pointer, None

    # inspection --------------------------------------------------------------
    def latest(self) -> str | None:
        """The generation the ``latest`` pointer names (unverified), if any."""
        return self._committed_name("full")

    def generations(self) -> list[str]:
        return self.store.generations()
