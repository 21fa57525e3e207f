"""The restore path: which generation to trust, and loading it into live objects, top to bottom.

1. Choose (:func:`choose`): read ``latest``; verify the manifest it names
   against the pointer's digest and size, then every file's size and digest
   while decoding. If the pointer is missing or garbage, or its generation is
   damaged, fall back to the newest full generation that verifies completely,
   by parsed update number, recording each rejection.
2. Check (:func:`restore`): the experiment contract and the component set,
   before any live object changes.
3. Load: either from the fresh tensors the verifying read produced, or, for
   large states, in place: the first pass kept only meta placeholders, and a
   second pass reads each tensor straight into the live tensor it matches.
4. Record: contract changes go into the run's history, the lineage continues
   (or forks, when resuming from an older generation).

The trusted reading itself (pointer, manifest, digests, strict decoding) is
:mod:`trainstate.storage.verify`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from .errors import CorruptGeneration, NoValidGeneration, Rejection, StateMismatch, WeightsOnlyGeneration
from .format.manifest import POINTER, Manifest, Pointer, parse_generation_name, parse_pointer
from .format.signing import SigningKey
from .lifecycle.generations import new_timeline
from .records import GenerationInfo, RestoreInfo
from .state import contract as contract_mod
from .state import snapshot
from .state.train_state import TrainState
from .storage.base import Store
from .storage.verify import Verified, decode_verified, verify_generation

log = logging.getLogger("trainstate")
IN_PLACE_BYTES = 256 << 20  # restore(in_place=None) loads in place above this much tensor data

Chosen = tuple[Verified, dict[str, Any], bool]  # the generation, its decoded payload, whether it is a preview


def restore(store: Store, state: TrainState, *, key: SigningKey | None, generation: str | None = None,
            allow_changes: Iterable[str] = (), statistical_cuda: bool = False, in_place: bool | None = None
            ) -> tuple[RestoreInfo | None, tuple[Rejection, ...]]:
    """Continue ``state`` from the chosen generation; returns the report and every rejection on the way.

    See :meth:`trainstate.CheckpointManager.restore` for the semantics.
    """
    allow = [allow_changes] if isinstance(allow_changes, str) else list(allow_changes)
    chosen, rejected = choose(store, key, generation, preview=in_place)
    if chosen is None:
        return None, rejected
    verified, payload, previewed = chosen
    name = verified.manifest.generation
    accepted = contract_mod.check(payload["contract"]["fields"], state.contract_fields(), name, allow)
    snapshot.check_components(state, payload, name)
    checked = None
    if previewed:  # every check on the preview, then the second pass writes into live tensors
        checked = snapshot.check_before_load(state, payload, statistical_cuda=statistical_cuda)
        payload = load_in_place(store, state, verified)
    warnings = snapshot.apply(state, payload, statistical_cuda=statistical_cuda, checked=checked)
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


def choose(store: Store, key: SigningKey | None, generation: str | None, preview: bool | None = False
           ) -> tuple[Chosen | None, tuple[Rejection, ...]]:
    """The generation to restore, verified and decoded, and the rejections on the way to it.

    ``(None, ())`` when the directory holds nothing to resume from; raises
    :class:`NoValidGeneration` when generations exist but none verifies.
    """
    if generation is not None:
        parsed = parse_generation_name(generation)
        if parsed is not None and parsed[1] == "weights":
            raise WeightsOnlyGeneration(
                f"{generation} holds weights only: restoring it is a warm start, not a resume. "
                "Use warm_start() to load its weights, or restore a full generation.")
        return load(store, key, generation, None, preview), ()
    rejected: list[Rejection] = []
    names = store.generations()
    candidates = [n for n in names if parse_generation_name(n)[1] == "full"]
    pointer, pointer_problem = read_pointer(store, key, bool(candidates))
    if pointer_problem:
        rejected.append(Rejection(POINTER, pointer_problem))
    if not candidates and len(names) and pointer is None:
        log.warning("%s holds only weights-only generations: nothing to resume, starting fresh "
                    "(use warm_start() to initialise from them)", store.location)
    if pointer is not None:
        candidates = [pointer.generation] + [n for n in candidates if n != pointer.generation]
    for name in candidates:
        try:
            chosen = load(store, key, name, pointer if pointer and name == pointer.generation else None, preview)
        except CorruptGeneration as exc:
            rejected.append(Rejection(name, str(exc)))
            log.warning("rejected %s: %s", name, exc)
            continue
        return chosen, tuple(rejected)
    if not candidates and pointer is None and not pointer_problem:
        return None, ()
    raise NoValidGeneration(store.location, rejected)


def read_pointer(store: Store, key: SigningKey | None, generations_exist: bool
                 ) -> tuple[Pointer | None, str | None]:
    """The ``latest`` pointer, or why it cannot be used."""
    try:
        data = store.read_pointer(POINTER)
        if data is None:
            return None, ("missing, but generations exist" if generations_exist else None)
        pointer = parse_pointer(data, POINTER, key)
    except CorruptGeneration as exc:
        return None, exc.reason
    if pointer.kind != "full":
        return None, "names a weights-only generation"
    return pointer, None


def load(store: Store, key: SigningKey | None, name: str, pointer: Pointer | None, preview: bool | None) -> Chosen:
    """Verify a generation completely while decoding it; any defect is a CorruptGeneration.

    With ``preview`` (``None``: when the tensor files exceed ``IN_PLACE_BYTES``)
    large tensors are digested but not kept: the payload has meta tensors.
    """
    verified = verify_generation(store, name, pointer, content=False, key=key)
    manifest = verified.manifest
    if preview is None:
        preview = sum(f.size for f in manifest.files if f.name.endswith(".safetensors")) > IN_PLACE_BYTES
    return verified, decode_verified(store, manifest, preview=preview), preview


def load_in_place(store: Store, state: TrainState, verified: Verified) -> dict[str, Any]:
    """Second pass of an in-place restore: everything already verified and checked against the live objects."""
    try:
        return decode_verified(store, verified.manifest, into=snapshot.destinations(state))
    except CorruptGeneration as exc:
        raise StateMismatch(
            f"{verified.manifest.generation} changed on disk between its verification and the in-place load "
            f"({exc}); live tensors may now hold part of it. Rebuild the live objects before restoring again, "
            "and find what is writing to the run directory.") from exc


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
             and p[0] > update]
    if not newer:
        return record
    return record[:-1] + [[record[-1][0], update], [new_timeline(), None]]
