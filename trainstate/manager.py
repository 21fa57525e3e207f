"""CheckpointManager: the public face over the write path and the read path.

``save`` checks policy and then hands a snapshot taken at the update boundary
to :mod:`trainstate.publish`, which runs the publication protocol (stage ->
write and fsync -> commit -> verify -> pointer -> prune). ``restore`` hands
the choice and the loading to :mod:`trainstate.restore` (pointer, then the
newest generation that verifies; contract and structure checks before
anything is loaded). Retention, cadence and status are thin entry points over
:mod:`trainstate.lifecycle`.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from . import publish, restore as restore_mod
from .lifecycle import incremental, keyless, runs
from .asyncsave import SaveHandle, Ticket, Writer, report_at_exit
from .progress import log_rate
from .errors import InvalidArgument, NoValidGeneration, ReadOnlyDirectory, Rejection
from .format import signing
from .format.manifest import parse_generation_name
from .format.digest import default_algorithm
from .format.signing import SigningKey, check_signable
from .lifecycle import cadence as cadence_mod
from .lifecycle.compute import Compute
from .lifecycle import done as done_mod
from .lifecycle import mirror as mirror_mod
from .lifecycle.cadence import Cadence, Clock
from .lifecycle.generations import Lifecycle, new_timeline
from .lifecycle.rehearsal import Factory, Rehearsal, rehearse
from .lifecycle.retention import Plan, Retention
from .records import GenerationInfo, RestoreInfo, Status
from .lifecycle.candidates import recovery_point
from .restore import IN_PLACE_BYTES
from .state import snapshot, usable
from .state.train_state import TrainState
from .storage.base import Store, pinned
from .storage.locate import open_store

__all__ = ["Cadence", "CheckpointManager", "GenerationInfo", "IN_PLACE_BYTES", "RestoreInfo", "Status"]
log = logging.getLogger("trainstate")


def _session(process_group: Any, timeout_s: float, full_every: int | None) -> Any:
    """Multi-rank mode when a process group is given or initialized; every rank builds the manager together."""
    import torch.distributed as dist

    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    from .distributed.session import Session  # DCP is imported only by multi-rank runs

    return Session(process_group, timeout_s, full_every)


class CheckpointManager:
    """Durable, verified checkpoints of a :class:`TrainState` in one run directory.

    >>> with CheckpointManager("runs/exp1", keep_last=3) as ckpt:
    ...     ckpt.restore(state)          # None on a fresh run
    ...     ...
    ...     ckpt.save(state)             # returns once durable and published

    Retention: ``keep_last`` full generations (the run's recorded policy when reopened), or
    ``retention=Retention(...)`` with milestones, a best by metric and a weights-only count; pins (:meth:`pin`).
    ``digest``: per 4 MiB chunk (restore verifies on every core), ``"xxh3-chunked"`` or, signed,
    ``"blake3-chunked"`` by default; ``"blake3"``, ``"sha256"``: per file. ``verify`` after the rename: ``"fast"``
    (manifest digest, file set, sizes; every byte was already read back during its fsync) or ``"full"`` (re-hash
    everything). ``rehearse``: a function returning a fresh :class:`TrainState`, restored into before each new full
    generation's pointer moves. ``signing_key`` (or ``TRAINSTATE_SIGNING_KEY[_FILE]``): HMAC-SHA256 of manifests and
    pointers; a signed run opened without its key raises :class:`SigningKeyRequired` (``signing_key=False``: go on
    unsigned, on purpose). ``preflight``/``headroom``: refuse before staging when the disk is short.
    ``cadence=Cadence(mtbf_s=...)``: :meth:`due` picks the interval. Under ``torch.distributed`` (an initialized
    default group, or ``process_group=``) every method is collective and the generation is sharded through
    ``torch.distributed.checkpoint``; checkpoint collectives time out after ``collective_timeout_s``. The manager
    holds an exclusive lock on the directory while open (rank 0, in a multi-rank run). ``directory`` may be an
    object-store URL (``s3://``, ``gs://``, ``az://``; ``storage_options`` for endpoint, region and keys);
    ``mirror=URL`` keeps saves local and uploads each generation in the background (its own ``mirror_options``,
    ``mirror_retention``; ``close`` waits up to ``mirror_timeout_s`` for uploads), and ``restore`` takes the remote
    copy when the local directory is empty or behind. ``progress=True`` shows a byte bar on stderr (tqdm) while a
    save writes and a restore loads (``None``: only when stderr is a terminal; off by default). ``replicas=N``
    (multi-node): a node-local ``directory``, each node's files also on ``N - 1`` peers by ``failure_domain`` label
    (docs/concepts/tiers.md). Incremental by default: unchanged tensor files linked, each in two copies linked
    crosswise; ``full_every=N``: also every N-th whole; ``None``: every one whole (docs/guides/incremental.md)."""

    def __init__(self, directory: str | Path, *, keep_last: int | None = None, retention: Retention | None = None,
                 digest: str | None = None, verify: str = "fast",
                 signing_key: SigningKey | bytes | str | bool | None = None,
                 store: Store | None = None, rehearse: Factory | None = None, preflight: bool = True,
                 headroom: float = 0.05, cadence: Cadence | None = None, max_in_flight: int = 1,
                 process_group: Any = None, collective_timeout_s: float = 600.0,
                 storage_options: dict[str, Any] | None = None, mirror: str | None = None,
                 mirror_options: dict[str, Any] | None = None, mirror_retention: Retention | None = None,
                 mirror_timeout_s: float = 600.0, progress: bool | None = False, replicas: int | None = None,
                 node: str | int | None = None, failure_domain: str | None = None, wait_replicas: bool = False,
                 mirror_every: int = 1, full_every: int | None = incremental.DEFAULT_FULL_EVERY):
        runs.check_policy(keep_last, retention)
        publish.check_options(verify=verify, rehearse=rehearse, headroom=headroom)
        self.key = signing.resolve(signing_key, directory)
        self.store: Store = store if store is not None else open_store(
            directory, default_algorithm(self.key is not None) if digest is None else digest,
            storage_options=storage_options)
        check_signable(self.store.digest_algorithm, self.key)
        self.store.defer_removals()  # pruned files are deleted off the save path
        self.rehearse_factory = rehearse
        self.cadence = cadence
        self.lifecycle = Lifecycle(self.store, self.key)
        keyless.check(self.lifecycle, signing_key)  # a signed run without its key: refused (False: go on unsigned)
        with pinned(self.store):  # an object store reads each commit record once here
            self.retention = runs.effective_policy(self.lifecycle, keep_last, retention)
        self._new_timelines: set[str] = set()  # declared by start_new_timeline()
        self._same_run: set[str] = set()  # timelines already checked against the directory's run
        self._publisher = publish.Publisher(self.store, self.lifecycle, self.retention, key=self.key,
                                            verify_mode=verify, rehearse_factory=rehearse, preflight=preflight,
                                            headroom=headroom)
        self._publisher.progress = self.progress = progress  # byte bars on stderr (None: when it is a tty)
        self.last_rejections: tuple[Rejection, ...] = ()
        self._clock = Clock()
        self._compute = Compute()  # device kinds and wall time summed over the lineage (lifecycle.compute)
        self._last_full_update: int | None = None
        self._origin: int | None = None  # where the cadence started counting (first due() call)
        self._writer = Writer(max_in_flight)
        weakref.finalize(self, report_at_exit, self._writer, str(directory))
        self._publisher.full_every = incremental.check_full_every(full_every)
        self._session = _session(process_group, collective_timeout_s, full_every)  # multi-rank mode, or None
        tiered = replicas is not None or node is not None or failure_domain is not None
        if tiered or mirror_every != 1:  # node-local tiers; mirror= is then their remote tier
            from .distributed.tieroptions import attach
            attach(self, dict(replicas=replicas, node=node, failure_domain=failure_domain, retention=retention,
                              wait_replicas=wait_replicas, mirror=mirror, mirror_options=mirror_options,
                              mirror_retention=mirror_retention, mirror_every=mirror_every, preflight=preflight,
                              headroom=headroom))
        self._mirror = None if mirror is None or tiered else mirror_mod.attach(self, mirror, mirror_options,
                                                                               mirror_retention)
        self.mirror_timeout_s = mirror_timeout_s
        self._started: str | None = None  # last generation prepared (captured at a boundary)
        self._staged: str | None = None  # last background save whose owned copy exists
        self._committed: str | None = None  # last generation published by this manager

    keep_last = property(lambda self: self.retention.keep_last, doc="Full generations kept (``retention.keep_last``).")

    # lifecycle ---------------------------------------------------------------
    def __enter__(self) -> CheckpointManager:
        if self._session is not None and not self._session.owns_directory:
            return self  # rank 0 holds the directory for the run (with tiers: each node's lowest rank, its own)
        try:
            self.store.lock()
        except ReadOnlyDirectory as exc:  # restore and inspection need no lock; a save raises this again
            log.info("%s", exc)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Finish every background save, release the directory and the checkpoint groups, then raise any
        unreported failure. Called while an exception propagates (``with``, a ``finally``, an ``except``), it lets
        that exception surface (a background failure is logged and added to it as a note), and in a multi-rank
        run it runs no collective: other ranks may be waiting for this one in a training collective
        (:meth:`Session.leave <trainstate.distributed.session.Session.leave>`)."""
        failing = sys.exc_info()[1]
        if self._session is not None and self._session.closed:  # closed already: nothing left to release
            return
        if failing is not None and self._session is not None:
            return self._session.leave(self, failing)
        try:
            self._writer.shutdown()
            if self._session is not None:
                self._session.barrier("close")  # every rank's background saves are finished
        except BaseException:  # interrupted (Ctrl-C), or a peer lost: what this rank holds is released all the same
            self._release(self._writer.in_flight() > 0, clean=False)
            raise
        if self._mirror is not None:
            mirror_mod.finish(self._mirror, self.mirror_timeout_s)
        self._release(False, clean=True)
        if failing is not None:
            self._writer.note_unreported(failing)
        else:
            self._writer.raise_unreported()

    def _release(self, writing: bool, clean: bool) -> None:
        """The directory (kept while a save of this process is still ``writing``: it must not be taken over under
        it) and the checkpoint groups (local; the writer's kept while a save uses it; see ``Session.release``)."""
        if not writing:
            self.store.unlock()
        if self._session is not None:
            self._session.release(writing, clean)

    # saving ------------------------------------------------------------------
    def save(self, state: TrainState, *, weights_only: bool = False, include_grads: bool = False,
             metrics: Mapping[str, float] | None = None, blocking: bool = True) -> GenerationInfo | SaveHandle:
        """Publish a generation of ``state``; returns once it is durable, verified and latest.

        Refuses while gradients are pending unless ``include_grads=True`` (which saves them too). ``metrics`` are
        recorded in the manifest for the retention policy's ``best``. :class:`InsufficientSpace` is raised before
        anything is written when the disk cannot hold the generation. With ``blocking=False`` it returns a
        :class:`SaveHandle` once an owned copy exists (the live objects may change at once); at most
        ``max_in_flight`` saves run, and a background failure is raised once, by ``handle.wait()`` or the next
        ``save``, ``wait`` or ``close``."""
        self._writer.raise_unreported()
        usable.refuse_unusable(state)  # a restore that failed midway left it half loaded
        if not blocking and self.rehearse_factory is not None:
            raise InvalidArgument("rehearse= builds objects (and may draw global RNG) while training runs; it cannot "
                             "run beside a background save. Use blocking saves, or rehearse out of process with "
                             "`trainstate verify DIR --rehearse module:function`.")
        started = time.monotonic()
        if blocking:
            self._writer.drain()  # publish in order behind any background save
            self._writer.raise_unreported()
            undo = state.parent, self._last_full_update
            try:
                pending = self._prepare(state, weights_only, include_grads, metrics, started)
                info = self._publish_or_roll_back(pending, state)
            except BaseException:
                self._unprepare(state, undo)  # interrupted before the publication could roll it back
                self._compute.saved(started, published=False)
                raise
            self._clock.saved(time.monotonic() - started)
            self._compute.saved(started, state.parent)
            return info
        # Ctrl-C may land anywhere from here to the hand-off: settle() tells whose slot it is.
        ticket, undo = Ticket(), None
        try:
            buffers = self._writer.reserve(ticket)  # backpressure: waits while max_in_flight saves are in flight
            self._writer.raise_unreported()  # one may have failed while we waited
            undo = state.parent, self._last_full_update
            pending = self._prepare(state, weights_only, include_grads, metrics, started)
            if self._session is not None:
                self._session.stage(pending, buffers)
            else:
                pending.tensors = buffers.stage(pending.tensors)
            self._writer.hand_off(ticket, pending.name, lambda: self._publish_or_roll_back(pending, state, True))
        except BaseException:
            if not self._writer.settle(ticket) and undo is not None:  # not handed off: nothing will publish
                self._unprepare(state, undo)
            self._compute.saved(started, published=False)
            raise
        self._staged = pending.name
        self._clock.saved(time.monotonic() - started)  # the stall is what blocks training
        self._compute.saved(started)
        return ticket.handle

    def preallocate(self, state: TrainState) -> int:
        """Allocate and fault in the buffers a background save of ``state`` copies into (their bytes); call it
        once, e.g. after ``restore``, and the first ``save(blocking=False)`` stalls as briefly as later ones."""
        if self._session is not None:  # each rank its own share: DCP's sharded state dicts (call it on every rank)
            return self._session.preallocate(self._writer, state)
        return self._writer.preallocate(snapshot.capture(state, kind="full")[1])

    def wait(self) -> None:
        """Wait for every background save; raise the first failure not yet reported."""
        self._writer.drain()
        self._writer.raise_unreported()

    def _prepare(self, state: TrainState, weights_only: bool, include_grads: bool,
                 metrics: Mapping[str, float] | None, started: float) -> publish.Pending:
        if self._session is not None:
            pending = self._session.prepare(self, state, weights_only, include_grads, metrics)
        else:
            self.store.lock()  # before anything else: a vanished or read-only directory is named as such
            self._check_same_run(state)
            state.parent = self._publisher.renamed.get(state.parent, state.parent)  # a background save's revision
            pending = publish.prepare(state, self.retention, weights_only=weights_only, include_grads=include_grads,
                                      metrics=metrics)
        self._compute.record(state, pending, self._publisher.renamed, started)
        self._started = pending.name
        if pending.kind == "full":
            self._last_full_update = state.next_update
        return pending

    def _unprepare(self, state: TrainState, undo: tuple[str | None, int | None]) -> None:
        """A save that publishes nothing: the state again descends from what was published before it."""
        parent, last_full = undo
        if state.parent not in (parent, self._committed):  # not already rolled back, not published
            state.parent, self._last_full_update = parent, last_full

    def _check_same_run(self, state: TrainState) -> None:
        self._same_run.add(runs.check_same_run(self.lifecycle, state.lineage, self._same_run | self._new_timelines))

    def start_new_timeline(self, state: TrainState) -> None:
        """Declare that ``state`` starts a new timeline in this directory instead of continuing its run.

        Nothing is deleted: generations of the old timeline are never counted or pruned automatically, and one at an
        update the new timeline reaches is set aside as ``abandoned``. Use it for a deliberate restart from scratch
        in the same directory; to continue the run, ``restore`` instead."""
        state.lineage = [[new_timeline(), None]]
        state.parent = None
        self._new_timelines.add(state.lineage[-1][0])
        self._compute.restart(None, 0.0)  # a deliberate restart from scratch: its training starts now

    def _publish_or_roll_back(self, p: publish.Pending, state: TrainState, background: bool = False
                              ) -> GenerationInfo:
        """Publish; if that fails, the state again descends from what was actually published."""
        started = time.monotonic()
        try:
            info = self._session.publish(self, p, background) if self._session else self._publisher.publish(p)
        except BaseException:
            if self._publisher.published == p.name:  # interrupted after the pointer moved: it is published
                self._committed = p.name
            elif publish.roll_back(p, state):
                self._last_full_update = parse_generation_name(p.parent)[0] if p.parent else self._origin
            raise
        self._committed = info.name
        log_rate("saved", info, time.monotonic() - started, "in the background" if background else "")
        if not background and state.parent == p.prepared:
            state.parent = info.name  # a revision, or the generation that already held this state
        return info

    # retention ---------------------------------------------------------------
    def plan(self) -> Plan:
        """What a prune would keep and remove now, with the reason for each generation (changes nothing)."""
        return self.lifecycle.plan(self.retention)

    def prune(self, *, dry_run: bool = False) -> Plan:
        """Apply the retention policy now (it also runs after every save); returns the plan (with tiers: collective,
        each node's plan for its stores)."""
        if self._session is not None and self._session.tier is not None:
            return self._session.prune_tiers(self, dry_run)
        self.store.lock()
        return self.lifecycle.prune(self.retention, dry_run=dry_run)

    def pin(self, name: str, generation: str) -> None:
        """Keep ``generation`` until unpinned, under a name such as ``"final"`` or ``"release-candidate"``."""
        self.lifecycle.pin(name, generation)

    def unpin(self, name: str) -> str:
        """Drop a pin; the generation is pruned by a later prune if no other rule keeps it."""
        return self.lifecycle.unpin(name)

    def pins(self) -> dict[str, str]:
        """Pinned generations: pin name -> generation name."""
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
            raise InvalidArgument("due() needs CheckpointManager(..., cadence=Cadence(mtbf_s=...))")
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
        return cadence_mod.measured_advice(self._clock, self.cadence, mtbf_s)

    def _interval(self) -> int | None:
        return cadence_mod.interval(self._clock, self.cadence)

    def status(self) -> Status:
        """The recovery point (where a restore would resume), weights-only latest, pins, best, measurements."""
        anchors = self.lifecycle.anchors()
        full = recovery_point(self.store, self.key)
        return Status(self.store.location, full, parse_generation_name(full)[0] if full else None,
                      anchors.get("weights"), len(self.store.generations()), self.lifecycle.pins(), self.best(),
                      self._clock.saves[-1] if self._clock.saves else None, self._clock.mean(self._clock.saves),
                      self._clock.mean(self._clock.updates), self._interval() if self.cadence else None,
                      self._started, self._staged, self._committed, self._writer.in_flight(), tuple(self._writer.unreported()),
                      self._mirror.status(full and parse_generation_name(full)[0]) if self._mirror else None,
                      self._session.tier_status(self) if self._session is not None else None,
                      *self._writer.held())

    # restoring ---------------------------------------------------------------
    def restore(self, state: TrainState, *, generation: str | None = None, allow_changes: Iterable[str] = (),
                rng_statistical_cuda: bool = False, in_place: bool | None = None) -> RestoreInfo | None:
        """Continue ``state`` from the latest verified full generation (or ``generation``).

        Returns ``None`` when the directory holds no generation at all. Raises :class:`NoValidGeneration` when
        generations exist but none verifies, and :class:`ContractMismatch` (loading nothing) when the experiment
        contract differs, unless each differing field is in ``allow_changes``.

        Tensors land in the live ones that match by name, shape and dtype, so peak memory stays near the live state.
        A format-3 generation is read once: every check runs first, then each 4 MiB chunk is digested (on every
        core) before it is copied; a chunk that fails after others were copied makes restore fall back, and if
        nothing loads completely the state is unusable (:func:`trainstate.unusable_reason`; saves refuse it).
        ``in_place=False`` reads into fresh tensors instead and loads them only once all verified (twice the
        memory). Older generations: see docs/concepts/restore.md."""
        started = time.monotonic()
        self._writer.drain()  # a background save in flight publishes first
        self._publisher.renamed.clear()  # the restored state names real generations
        if self._mirror is not None and generation is None:
            self._mirror.pull()  # the remote copy, when the local directory is empty or behind
        try:
            if self._session is not None:  # the sharded part loads in place through DCP
                info, self.last_rejections = self._session.restore(self, state, generation, allow_changes,
                                                                   rng_statistical_cuda, in_place)
            else:
                info, self.last_rejections = restore_mod.restore(
                    self.store, state, key=self.key, generation=generation, allow_changes=allow_changes,
                    statistical_cuda=rng_statistical_cuda, in_place=in_place, progress=self.progress)
        except NoValidGeneration as exc:
            self.last_rejections = tuple(exc.rejections)
            raise
        if self._mirror is not None and info is not None:  # uploaded, if an earlier process stopped before it was
            info = self._mirror.restored(info)  # and what the pull passed over, among the rejections
        if info is not None:  # rank 0's verdict on every rank: they stop or go on together
            log_rate("restored", info.generation, time.monotonic() - started,
                      f"passing over {', '.join(r.generation for r in info.rejected)}" if info.rejected else "")
            record = done_mod.on_rank0(self._session, lambda: done_mod.for_restore(self.store, self.key, info, state),
                                      "done")
            info = dataclasses.replace(info, done=record)
        self._compute.restart(info and info.generation.name, info.generation.wall_s if info else 0.0)
        return info

    def finish(self, state: TrainState, *, metrics: Mapping[str, float] | None = None) -> done_mod.DoneRecord:
        """Publish the final full generation (or reuse the one at this update), then write the DONE record
        binding the run, its manifest digest, clocks, contract fingerprint and ``metrics`` (see ``ts.done``)."""
        reuse = state.parent is not None and parse_generation_name(state.parent) == (state.next_update, "full")
        info = self.save(state, metrics=None if reuse else metrics)
        if self._session is not None and self._session.tier is not None:  # on every node, each its own holding
            return self._session.write_done(self, info.name, state.tokens_seen, metrics)
        return done_mod.on_rank0(self._session,
                                lambda: done_mod.write(self.store, self.key, info.name, state.tokens_seen, metrics),
                            "finish")

    # inspection --------------------------------------------------------------
    def latest(self) -> str | None:
        """The generation the ``latest`` pointer names (unverified), if any."""
        return self._publisher.committed_name("full")

    def generations(self) -> list[str]:
        """Every published generation of the run, newest first (by parsed update)."""
        return self.store.generations()
