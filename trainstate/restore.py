"""The restore path: which generation to trust, and loading it into live objects, top to bottom.

1. Choose (:func:`choose`): in the order :mod:`trainstate.lifecycle.candidates`
   gives (``latest`` first, a roll-forward before it, timelines the run left
   last), verify each generation completely (the manifest against the
   pointer's digest and size, then every file's size and digest while
   decoding) until one does, recording each rejection.
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
import logging
from collections.abc import Callable, Iterable
from typing import Any

from .lifecycle.candidates import candidates, check_run, expected_run
from .errors import (CorruptGeneration, NoValidGeneration, Rejection, StateMismatch, StorageUnavailable,
                     WeightsOnlyGeneration)
from .format.digest import is_chunked
from .format.manifest import STATE, Manifest, Pointer, generation_order, parse_generation_name
from .format.signing import SigningKey
from .lifecycle.generations import new_timeline
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
