"""The restore path: which generation to trust, and loading it into live objects, top to bottom.

1. Choose (:func:`choose`): read ``latest``; verify the manifest it names
   against the pointer's digest and size, then every file's size and digest
   while decoding. If the pointer is missing or garbage, or its generation is
   damaged, fall back to the newest full generation that verifies completely,
   by parsed update number, recording each rejection.
2. Check (:func:`restore`): the experiment contract and the component set,
   before any live object changes.
3. Load. A ``blake3-chunked`` generation (format 3, the default) is read
   once: the choice read only its manifest, ``state.json``, the tensor-file
   headers and the RNG tensors, each from verified chunks; then every chunk
   is read, digested on every core, and copied into the live tensor it
   belongs to only after it verified (:mod:`trainstate.storage.chunked`).
   No unverified byte reaches a live tensor. A chunk that fails late leaves
   earlier, verified chunks in live tensors: the state is then *unusable*
   (:func:`unusable`; every save refuses it with :class:`StateUnusable`)
   until a fallback generation loads completely over it, which restore tries
   next. Older generations (one digest per file) load as before: fresh
   tensors from the verifying read, or, above ``IN_PLACE_BYTES``, a verifying
   pass keeping meta placeholders and a second pass into the live tensors.
4. Record: contract changes go into the run's history, the lineage continues
   (or forks, when resuming from an older generation).

The trusted reading itself (pointer, manifest, digests, strict decoding) is
:mod:`trainstate.storage.verify`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .errors import (CorruptGeneration, NoValidGeneration, PointerRollback, Rejection, StateMismatch,
                     StorageUnavailable, WeightsOnlyGeneration)
from .format.digest import is_chunked
from .format.manifest import (POINTER, RUN, STATE, Manifest, Pointer, generation_order, parse_generation_name,
                              parse_pointer, parse_run)
from .format.signing import SigningKey
from .lifecycle.generations import Lifecycle, new_timeline
from .progress import Bar, optional
from .records import GenerationInfo, RestoreInfo
from .state import contract as contract_mod
from .state import snapshot
from .state.train_state import TrainState
from .state.usable import mark_unusable, mark_usable, telling_unusable, unusable
from .storage.base import Store, pinned
from .storage.streams import Rewindable, spooled
from .storage.chunked import Progress
from .storage.verify import Verified, decode_verified, preview_headers, tensor_files, verify_generation

log = logging.getLogger("trainstate")
IN_PLACE_BYTES = 256 << 20  # restore(in_place=None) loads in place above this much tensor data

WholeCheck = Callable[[Store, Manifest, SigningKey | None], dict]  # checks a multi-rank generation whole
Chosen = tuple[Verified, dict[str, Any], str]  # the generation, its decoded payload, how it loads (see load)
def restore(store: Store, state: TrainState, *, key: SigningKey | None, generation: str | None = None,
            allow_changes: Iterable[str] = (), statistical_cuda: bool = False, in_place: bool | None = None,
            progress: bool | None = False) -> tuple[RestoreInfo | None, tuple[Rejection, ...]]:
    """Continue ``state`` from the chosen generation; returns the report and every rejection on the way.

    See :meth:`trainstate.CheckpointManager.restore` for the semantics; ``progress``: a byte bar on stderr
    for the loading pass (``None``: when stderr is a terminal).
    """
    allow = [allow_changes] if isinstance(allow_changes, str) else list(allow_changes)
    held = HeldFiles(store)  # the second, in-place pass reads the very files the first pass verified
    meter = optional(None, "restore", progress, deferred=True)  # drawn once a generation is chosen
    try:
        return _restore(held, state, key=key, generation=generation, allow=allow,
                        statistical_cuda=statistical_cuda, in_place=in_place, meter=meter)
    except StorageUnavailable as exc:  # not damage: no generation was passed over (storage.verify.unreadable)
        raise StorageUnavailable(f"{str(exc).rstrip('.')}. The restore " + (
            "left the state unusable (ts.unusable_reason says why)" if unusable(state) else "loaded nothing") +
            "; call it again once the store answers") from exc
    finally:
        held.close()
        if meter is not None:
            meter.close()


def _restore(store: Store, state: TrainState, *, key: SigningKey | None, generation: str | None, allow: list[str],
             statistical_cuda: bool, in_place: bool | None, meter: Bar | None = None
             ) -> tuple[RestoreInfo | None, tuple[Rejection, ...]]:
    failed: list[Rejection] = []  # generations whose one-pass load found damage after the choice
    while True:
        with telling_unusable(state, failed, store.location):
            chosen, rejected = choose(store, key, generation, preview=in_place, skip=failed, meter=meter)
        rejected = tuple(failed) + rejected
        if chosen is None:
            return None, rejected
        verified, payload, mode = chosen
        name = verified.manifest.generation
        state.settle_contract(payload["contract"]["fields"], allow)
        accepted = contract_mod.check(payload["contract"]["fields"], state.contract_fields(), name, allow)
        snapshot.check_components(state, payload, name)
        checked = None
        if mode != "fresh":  # every check on the preview, then the load pass writes into live tensors
            checked = snapshot.check_before_load(state, payload, statistical_cuda=statistical_cuda)
        if mode == "stream":
            progress = Progress()
            on_bytes = _metered(meter, verified.manifest, "restore")
            try:
                payload = decode_verified(store, verified.manifest, into=snapshot.destinations(state),
                                          progress=progress, on_bytes=on_bytes)
            except CorruptGeneration as exc:
                failed.append(Rejection(name, str(exc)))
                if progress.live_changed:
                    mark_unusable(state, f"restoring {name} failed after {progress.chunks} verified chunks were "
                                        f"loaded into live tensors ({exc})")
                log.warning("rejected %s while loading it (%s); %s", name, exc,
                            "live tensors hold part of it: the state is unusable unless another generation "
                            "loads completely" if progress.live_changed else "no live tensor had changed")
                if generation is not None:
                    raise NoValidGeneration(store.location, failed, unusable=unusable(state)) from None
                continue
            except BaseException as exc:  # a read that failed halfway (the store went away): no rejection
                if progress.live_changed:
                    mark_unusable(state, f"restoring {name} failed after {progress.chunks} verified chunks were "
                                        f"loaded into live tensors ({type(exc).__name__}: {exc})")
                raise
        elif mode == "preview":
            payload = load_in_place(store, state, verified, _metered(meter, verified.manifest, "load"))
        break
    warnings = snapshot.apply(state, payload, statistical_cuda=statistical_cuda, checked=checked)
    mark_usable(state)  # every component loaded completely from one verified generation
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
    state.lineage = continue_lineage(store, verified.manifest)
    return RestoreInfo(GenerationInfo.from_verified(store, verified), rejected, tuple(accepted),
                       tuple(warnings)), rejected


def choose(store: Store, key: SigningKey | None, generation: str | None, preview: bool | None = False,
           skip: list[Rejection] = (), meter: Bar | None = None, reader: WholeCheck | None = None
           ) -> tuple[Chosen | None, tuple[Rejection, ...]]:
    """The generation to restore, verified and decoded, and the rejections on the way to it (see
    :func:`candidates`).

    ``(None, ())`` when the directory holds nothing to resume from; raises
    :class:`NoValidGeneration` when generations exist but none verifies.
    A generation that disappears while it is read (pruned by a live writer)
    is not damage: the choice starts again from the pointer, a bounded
    number of times. ``skip``: generations this restore already rejected
    (damage found while loading them), passed over. ``meter``: counts the bytes each read decodes.
    ``reader``: see :func:`load` (a multi-rank generation is checked, not refused).
    """
    skipped = {r.generation for r in skip}
    if generation is not None:
        parsed = parse_generation_name(generation)
        if parsed is not None and parsed[1] == "weights":
            raise WeightsOnlyGeneration(
                f"{generation} holds weights only: restoring it is a warm start, not a resume. "
                "Use warm_start() to load its weights, or restore a full generation.")
        return load(store, key, generation, None, preview, run=expected_run(store, key), meter=meter,
                    reader=reader), ()
    for _ in range(VANISHED_RETRIES):
        order = candidates(store, key)
        rejected = list(order.rejected)
        vanished = False
        for name in order.names:
            if name in skipped:
                continue
            try:
                chosen = load(store, key, name, order.pointer if name == order.pointer_generation else None, preview,
                              run=order.run, meter=meter, reader=reader)
            except CorruptGeneration as exc:
                if name in order.listed and name not in store.generations():
                    vanished = True  # pruned under us by a live writer: not damage, start over
                    log.info("%s disappeared while being read (pruned by a writer); choosing again", name)
                    break
                rejected.append(Rejection(name, str(exc)))
                log.warning("rejected %s: %s", name, exc)
                continue
            return chosen, tuple(rejected)
        if vanished:
            continue
        if not order.names and order.pointer is None and not order.rejected:
            return None, ()
        raise NoValidGeneration(store.location, list(skip) + rejected)
    raise NoValidGeneration(store.location, [Rejection(store.location, f"generations kept disappearing while "
                                                                       f"read ({VANISHED_RETRIES} attempts)")])


VANISHED_RETRIES = 8


@dataclass(frozen=True)
class Candidates:
    """The order in which restore tries full generations, and why it passed over the pointer, if it did."""

    names: tuple[str, ...]
    pointer: Pointer | None
    rejected: tuple[Rejection, ...]
    listed: frozenset[str] = frozenset()  # the generations present when the order was made
    run: str | None = None  # the directory's run identity: a generation of another run is refused

    @property
    def pointer_generation(self) -> str | None:
        return self.pointer.generation if self.pointer is not None else None


def candidates(store: Store, key: SigningKey | None) -> Candidates:
    """Full generations in the order restore tries them (reads only manifests, never tensor data).

    The pointer's generation first, then every other full generation newest
    first by parsed update number. A valid generation newer than the
    pointer's on the pointer's own timeline goes before it: the pointer
    was left behind, by a crash between a commit and the pointer move or by
    a ``latest`` copied back into place, and the newest such generation that
    verifies is restored (rolled forward), reported as a rejection of the
    pointer. One step ahead (a single newer generation whose parent is the
    pointer's) is what a crash between commit and pointer move leaves: it is
    complete, so rolling forward loses nothing, signed or not, and a pointer
    replayed one step back gains an attacker nothing. Further ahead, in a
    signed run, means a pointer replayed further back: :class:`PointerRollback`.
    A pointer left at a fork point has two timelines ahead: only the one the
    run saved to last counts (:func:`current_branch`), never the abandoned one.
    """
    names, run, (pointer, problem) = _listing_run_pointer(store, key)
    full = [n for n in names if parse_generation_name(n)[1] == "full"]
    if problem == _MISSING and not full:
        problem = None  # no pointer and nothing it could name: nothing is amiss
    rejected = [Rejection(POINTER, problem)] if problem else []
    if not full and names and pointer is None:
        log.warning("%s holds only weights-only generations: nothing to resume, starting fresh "
                    "(use warm_start() to initialise from them)", store.location)
    if pointer is None:
        return Candidates(tuple(full), None, tuple(rejected), frozenset(full), run=run)
    rest = [n for n in full if n != pointer.generation]
    ahead, abandoned = _descendants_ahead(store, key, pointer, rest, run)
    if ahead:
        rejected.append(Rejection(POINTER, _left_behind(store, key, pointer, ahead, abandoned)))
        first = [name for name, _ in ahead]
        return Candidates(tuple(first + [pointer.generation] + [n for n in rest if n not in first]), pointer,
                          tuple(rejected), frozenset(full), run=run)
    return Candidates(tuple([pointer.generation] + rest), pointer, tuple(rejected), frozenset(full), run=run)


def _left_behind(store: Store, key: SigningKey | None, pointer: Pointer, ahead: list[tuple[str, Manifest]],
                 abandoned: list[str]) -> str:
    """Why restore rolls forward past ``latest`` to ``ahead[0]`` (logged); a signed run's pointer rolled back
    further than one step raises :class:`PointerRollback`. ``abandoned``: newer descendants it does not resume."""
    newest = ahead[0][0]
    one_step = len(ahead) == 1 and ahead[0][1].parent == pointer.generation
    passed = "" if not abandoned else (
        f"; {', '.join(abandoned)}, newer but on a timeline the run abandoned after {pointer.generation} (it resumed "
        f"from an older generation, and {newest} was written after {'it' if len(abandoned) == 1 else 'them'}), "
        f"{'is' if len(abandoned) == 1 else 'are'} not resumed")
    if key is not None and not one_step:
        raise PointerRollback(
            f"{store.location}: latest names {pointer.generation}, but {newest}, a newer validly signed "
            f"generation of the same timeline, exists ({len(ahead)} newer in all{passed}): the pointer was rolled "
            "back. Nothing was loaded. Find out who replaced the pointer; to resume deliberately from a generation, "
            "pass restore(state, generation=...).")
    if one_step:
        reason = (f"names {pointer.generation}, but {newest}, committed after it and descending from it, is "
                  "complete: a save interrupted between its commit and the pointer move (or latest replayed one "
                  f"step back); rolling forward to {newest}{passed}")
        log.warning("%s: latest %s", store.location, reason)
    else:
        reason = (f"names {pointer.generation}, but {newest} and {len(ahead) - 1} more are newer generations of "
                  "the same timeline: the pointer was rolled back (copied back into place?); restoring the "
                  f"newest valid generation instead{passed}")
        log.error("%s: latest %s", store.location, reason)
    return reason


def _descendants_ahead(store: Store, key: SigningKey | None, pointer: Pointer, others: list[str],
                       run: str | None) -> tuple[list[tuple[str, Manifest]], list[str]]:
    """Structurally valid full generations newer than the pointer's that descend from it on the timeline the run
    saved to last, newest first, and those on a timeline it abandoned (:func:`current_branch`)."""
    newer = [n for n in others if generation_order(n) > generation_order(pointer.generation)]
    if not newer:
        return [], []
    try:
        base = verify_generation(store, pointer.generation, pointer, content=False, key=key).manifest
    except CorruptGeneration:
        return [], []  # the pointer's own generation is damaged: the ordinary fallback handles it
    if not base.lineage:
        return [], []  # written before timelines were recorded: no way to tell a descendant
    own = base.lineage[-1][0]
    out = []
    for name in newer:
        try:
            manifest = verify_generation(store, name, content=False, key=key).manifest
            check_run(manifest, run)
        except CorruptGeneration:
            continue
        if any(t == own and (end is None or base.next_update <= end) for t, end in manifest.lineage):
            out.append((name, manifest))
    return current_branch(out)


def current_branch(descendants: list[tuple[str, Manifest]]) -> tuple[list[tuple[str, Manifest]], list[str]]:
    """Of a generation's descendants (newest first), those on the timeline the run saved to last, and the names
    of the others (newest first).

    A fork (a restore from an older generation, then saves) leaves the
    timeline it abandoned in place, and both descend from the fork point:
    a ``latest`` rolled back there has two timelines ahead of it. Every save
    moved ``latest`` to what it wrote, so the timeline the pointer last named
    is the one whose newest generation was written last: that tip (by its
    manifest's ``created`` time, among descendants no other one continues)
    and its ancestors. Update numbers cannot tell: the abandoned timeline
    often reached further. Lineage records, not times, say what continues what.
    """
    if len(descendants) < 2:
        return descendants, []
    manifests = dict(descendants)
    below = {name: Lifecycle.lineage(name, manifests) for name in manifests}
    tips = [name for name in manifests if not any(name in below[other] for other in manifests if other != name)]
    tip = max(tips, key=lambda name: (_created(manifests[name]), generation_order(name)))
    return ([(name, manifest) for name, manifest in descendants if name in below[tip]],
            [name for name, _ in descendants if name not in below[tip]])


def _created(manifest: Manifest) -> datetime.datetime:
    """When ``manifest``'s generation was written (an unreadable time sorts first)."""
    try:
        created = datetime.datetime.fromisoformat(manifest.created)
    except ValueError:
        return datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
    return created if created.tzinfo else created.replace(tzinfo=datetime.timezone.utc)


def recovery_point(store: Store, key: SigningKey | None) -> str | None:
    """The generation a restore would start from, judged by structure (manifests and sizes, no tensor data).

    ``None`` when there is none, or when a signed run's pointer was rolled
    back (restore refuses then). A generation whose bytes were altered passes
    this check and fails restore's full verification; ``trainstate verify``
    reads every byte.
    """
    try:
        order = candidates(store, key)
    except PointerRollback:
        return None
    for name in order.names:
        try:
            check_run(verify_generation(store, name, order.pointer if name == order.pointer_generation else None,
                                        content=False, key=key).manifest, order.run)
            return name
        except CorruptGeneration:
            continue
    return None


_MISSING = "missing, but generations exist"


def _listing_run_pointer(store: Store, key: SigningKey | None) -> tuple[list[str], str | None, tuple]:
    """The generations, the run identity and the ``latest`` pointer: on an object store read side by side (three
    requests in the time of one); locally one after another (threads would only add to the restore's fixed cost)."""
    if not getattr(store, "remote", False):
        return store.generations(), expected_run(store, key), read_pointer(store, key, True)
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="trainstate-choose") as pool:
        run = pool.submit(expected_run, store, key)
        pointer = pool.submit(read_pointer, store, key, True)
        names = store.generations()
        return names, run.result(), pointer.result()


def read_pointer(store: Store, key: SigningKey | None, generations_exist: bool
                 ) -> tuple[Pointer | None, str | None]:
    """The ``latest`` pointer, or why it cannot be used."""
    try:
        data = store.read_pointer(POINTER)
        if data is None:
            return None, (_MISSING if generations_exist else None)
        pointer = parse_pointer(data, POINTER, key)
    except CorruptGeneration as exc:
        return None, exc.reason
    if pointer.kind != "full":
        return None, "names a weights-only generation"
    return pointer, None


def expected_run(store: Store, key: SigningKey | None) -> str | None:
    """The run identity the directory records, or ``None`` (none recorded yet, or the record is unusable)."""
    try:
        data = store.read_pointer(RUN)
        return None if data is None else parse_run(data, RUN, key)
    except CorruptGeneration as exc:
        log.warning("%s: the run identity record is unusable (%s); generations are not checked against it",
                    store.location, exc)
        return None


def check_run(manifest: Manifest, run: str | None) -> None:
    """A generation published into another run directory (copied in, or a transplanted pointer) is refused."""
    if run and manifest.run and manifest.run != run:
        raise CorruptGeneration(manifest.generation, f"belongs to run {manifest.run[:16]}, not to this directory's "
                                f"run {run[:16]}: it was copied in from another run directory")


def load(store: Store, key: SigningKey | None, name: str, pointer: Pointer | None, preview: bool | None,
         run: str | None = None, meter: Bar | None = None, reader: WholeCheck | None = None) -> Chosen:
    """Verify a generation completely while decoding it; any defect is a CorruptGeneration.

    The payload and how it loads: ``"stream"`` for a ``blake3-chunked``
    generation unless ``preview`` is False (a preview read from headers only;
    the one load pass verifies each chunk before copying it into live
    tensors); ``"preview"`` for an older generation when ``preview`` is true
    (``None``: when its tensor files exceed ``IN_PLACE_BYTES``; every byte
    digested, large tensors kept as meta placeholders, a second pass loads
    in place); else ``"fresh"``: every tensor verified into fresh memory.
    ``reader``: the caller only reads the run (``trainstate ls``) and passes how a
    multi-rank generation is checked whole
    (:func:`trainstate.distributed.load.check_whole`); it is then returned as
    ``"multi-rank"``, where a single-process restore refuses it.
    """
    verified = verify_generation(store, name, pointer, content=False, key=key)
    manifest = verified.manifest
    check_run(manifest, run)
    if manifest.ranks and reader is not None:  # a recovery point needs no ranks, only the checks they would make
        return verified, reader(store, manifest, key), "multi-rank"
    if manifest.ranks:
        raise StateMismatch(
            f"{name} was written by {manifest.world_size} ranks (torch.distributed): restore it under torchrun, "
            "where the manager runs collectively (a different world size needs allow_changes=['world_size'])")
    if is_chunked(manifest.digest_algorithm) and preview is not False:
        return verified, preview_headers(store, manifest), "stream"
    if preview is None:  # a second pass over an object store would download everything again
        preview = (not getattr(store, "remote", False)
                   and sum(f.size for f in manifest.files if f.name.endswith(".safetensors")) > IN_PLACE_BYTES)
    on_bytes = _metered(meter, manifest, "verify" if preview else "restore")
    return verified, decode_verified(store, manifest, preview=preview, on_bytes=on_bytes), \
        "preview" if preview else "fresh"


def _metered(meter: Bar | None, manifest: Manifest, verb: str) -> Any:
    """``meter`` counting from zero towards the bytes one decoding pass of ``manifest`` reads, or None."""
    if meter is None:
        return None
    meter.restart(sum(f.size for f in manifest.files if f.name == STATE or f.name in tensor_files(manifest)),
                  f"{verb} {manifest.generation}")
    return meter.update


def load_in_place(store: Store, state: TrainState, verified: Verified, on_bytes: Any = None) -> dict[str, Any]:
    """Second pass of an in-place restore: everything already verified and checked against the live objects."""
    try:
        return decode_verified(store, verified.manifest, into=snapshot.destinations(state), on_bytes=on_bytes)
    except CorruptGeneration as exc:
        raise StateMismatch(
            f"{verified.manifest.generation} changed on disk between its verification and the in-place load "
            f"({exc}); live tensors may now hold part of it. Rebuild the live objects before restoring again, "
            "and find what is writing to the run directory.") from exc


class HeldFiles:
    """A view of a store that keeps open every file it opens, until :meth:`close`.

    Published generations are immutable and only ever removed, so a file
    held open reads the same bytes even after a concurrent prune unlinks it:
    the in-place pass then loads exactly what the verifying pass checked,
    and a header verified by the first pass is not read again by the second.
    From an object store each file is read through a :class:`Rewindable`, or
    with ``spool`` (a reader that reads every file twice, such as ``export``)
    downloaded once into a temporary local file and read from there.
    """

    def __init__(self, store: Store, *, spool: bool = False):
        self._store = store
        self._spool = spool and getattr(store, "remote", False)
        self._held: dict[tuple[str, str], Any] = {}
        self._pin = pinned(store)  # each commit record read once while the files are held
        self._pin.__enter__()
        self.layouts: dict[tuple[str, str, str], Any] = {}  # tensor-file headers verified once, for this restore

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def open(self, generation: str, file: str) -> Any:
        stream = self._held.get((generation, file))
        if stream is None:
            stream = self._store.open(generation, file)
            if self._spool:
                stream = spooled(stream)
            elif getattr(self._store, "remote", False):
                stream = Rewindable(stream)
            self._held[(generation, file)] = stream
        stream.seek(0)
        return _Borrowed(stream)

    def close(self) -> None:
        for stream in self._held.values():
            stream.close()
        self._held.clear()
        self._pin.__exit__(None, None, None)
        self._pin = contextlib.nullcontext()


class _Borrowed:
    """A held stream lent to one reader: closing it (or leaving ``with``) leaves it open for the next pass."""

    def __init__(self, stream: Any):
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __enter__(self) -> _Borrowed:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def close(self) -> None:
        pass


def continue_lineage(store: Store, manifest: Manifest) -> list[list]:
    """The timelines a run restored from ``manifest`` continues.

    Resuming from the newest full generation continues its timeline.
    Resuming from an older one (a fallback past a damaged latest, or an
    explicit ``generation=``) forks: full generations above it then belong
    to an abandoned timeline, which retention never counts as ancestors.
    """
    record = [list(e) for e in manifest.lineage] or [["legacy", None]]
    update = manifest.next_update
    newer = [n for n in store.generations() if (p := parse_generation_name(n)) and p[1] == "full"
             and generation_order(n) > generation_order(manifest.generation)]
    if not newer:
        return record
    return record[:-1] + [[record[-1][0], update], [new_timeline(), None]]
