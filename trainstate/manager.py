"""CheckpointManager: saves and restores TrainState through a Store.

``save`` checks policy, then runs the publication protocol in order:
stage -> write and fsync files -> commit (rename, fsync parent) -> verify ->
replace the pointer -> prune. ``restore`` reads pointer -> manifest -> files,
falls back to the newest generation that verifies, checks the contract, and
only then loads into the live objects.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import contract as contract_mod
from . import retention, signing, snapshot, tensorfile
from .errors import (ContractMismatch, CorruptGeneration, FieldChange, GenerationExists, NoValidGeneration,
                     PendingGradients, Rejection, WeightsOnlyGeneration)
from .localfs import LocalStore
from .manifest import (MANIFEST, POINTER, STATE, WEIGHTS_POINTER, Manifest, Pointer, generation_name,
                       parse_generation_name, parse_pointer)
from .signing import SigningKey
from .state import TrainState
from .storage import Store
from .verify import Verified, load_verified, read_manifest, verify_generation

log = logging.getLogger("trainstate")
TENSORS = "tensors.safetensors"


@dataclass(frozen=True)
class GenerationInfo:
    """A published generation."""

    name: str
    location: str
    kind: str
    next_update: int
    created: str
    size: int
    manifest_digest: str
    digest_algorithm: str

    @classmethod
    def from_verified(cls, store: Store, v: Verified) -> GenerationInfo:
        m = v.manifest
        return cls(m.generation, f"{store.location}/{m.generation}", m.kind, m.next_update, m.created,
                   v.manifest_size + sum(f.size for f in m.files), v.manifest_digest, m.digest_algorithm)


@dataclass(frozen=True)
class RestoreInfo:
    """What ``restore`` loaded, what it skipped and what it accepted."""

    generation: GenerationInfo
    rejected: tuple[Rejection, ...] = ()
    contract_changes: tuple[FieldChange, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def identical_continuation(self) -> bool:
        """False when a contract change was accepted or some randomness continues only statistically."""
        return not self.contract_changes and not self.warnings


class CheckpointManager:
    """Durable, verified checkpoints of a :class:`TrainState` in one run directory.

    >>> with CheckpointManager("runs/exp1", keep_last=3) as ckpt:
    ...     ckpt.restore(state)          # None on a fresh run
    ...     ...
    ...     ckpt.save(state)             # returns once durable and published

    ``keep_last`` full generations are kept (weights-only generations are
    counted separately); pruning runs only after a new generation has
    verified and the pointer has moved. ``digest`` names the content hash
    (``"blake3"`` or ``"sha256"``). Every file's bytes are read back and
    checked against their digest while its fsync runs, before the rename;
    ``verify`` chooses the check after the rename: ``"fast"`` (default)
    checks the manifest's digest, the file set and every size, ``"full"``
    also re-reads and re-hashes every byte (it costs a full read).
    ``signing_key`` (or ``TRAINSTATE_SIGNING_KEY``/``TRAINSTATE_SIGNING_KEY_FILE``
    in the environment) signs every manifest and pointer with HMAC-SHA256, and
    restore then refuses unsigned or forged generations.
    The manager holds an exclusive lock on the directory while open.
    """

    def __init__(self, directory: str | Path, *, keep_last: int = 3, digest: str = "blake3",
                 verify: str = "fast", signing_key: SigningKey | bytes | str | None = None,
                 store: Store | None = None):
        if type(keep_last) is not int or keep_last < 1:
            raise ValueError(f"keep_last must be a positive int, got {keep_last!r}")
        if verify not in ("full", "fast"):
            raise ValueError(f"verify must be 'full' or 'fast', got {verify!r}")
        self.store: Store = store if store is not None else LocalStore(directory, digest)
        self.key = signing.resolve(signing_key, directory)
        self.keep_last = keep_last
        self.verify_mode = verify
        self.last_rejections: tuple[Rejection, ...] = ()

    # lifecycle ---------------------------------------------------------------
    def __enter__(self) -> CheckpointManager:
        self.store.lock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.store.unlock()

    # saving ------------------------------------------------------------------
    def save(self, state: TrainState, *, weights_only: bool = False, include_grads: bool = False) -> GenerationInfo:
        """Publish a generation of ``state``; returns once it is durable, verified and latest.

        Refuses while gradients are pending (a backward pass since the last
        optimizer step) unless ``include_grads=True``, which also saves them so
        the accumulation resumes bitwise (keep your microbatch cursor in
        ``state.counters``).
        """
        kind = "weights" if weights_only else "full"
        if kind == "full" and state.pending_gradients and not include_grads:
            raise PendingGradients(
                "gradients are pending: a backward pass accumulated into .grad since the last optimizer.step(). "
                "A checkpoint here would lose them. Save after optimizer.step() (and zero_grad), or pass "
                "include_grads=True to save the gradients too, with your microbatch cursor in state.counters.")
        skeleton, tensors = snapshot.capture(state, kind=kind, include_grads=include_grads)
        positions = {n: c.data_position() for n, c in state.data_positions().items()} if kind == "full" else {}
        name = generation_name(state.next_update, kind)
        self.store.lock()
        self._make_room_for(name)
        for leftover in self.store.clean_leftovers():
            log.info("removed leftover %s from an interrupted save", leftover)
        manifest_bytes = self._stage_and_commit(name, state, skeleton, tensors, positions)
        try:
            verified = verify_generation(self.store, name, content=self.verify_mode == "full", key=self.key)
            if verified.manifest.to_bytes(self.key) != manifest_bytes:
                raise CorruptGeneration(name, "committed manifest differs from the one written")
        except CorruptGeneration:
            self.store.remove(name)  # committed but not what we wrote: never let it become latest
            raise
        pointer = Pointer(name, verified.manifest_digest, verified.manifest_size,
                          verified.manifest.digest_algorithm, state.next_update, kind)
        self.store.write_pointer(POINTER if kind == "full" else WEIGHTS_POINTER, pointer.to_bytes(self.key))
        if kind == "full":
            state.parent = name
        self._prune(name, kind)
        return GenerationInfo.from_verified(self.store, verified)

    def _make_room_for(self, name: str) -> None:
        """Decide what happens to an existing generation with the name about to be published.

        The committed latest, when valid, is never replaced: saving the same update
        twice is an error. A damaged one (restore fell back past it) is moved aside
        under a name restore ignores, keeping the evidence. A valid generation that
        the pointer does not name is an interrupted or abandoned publication of this
        update; the new publication supersedes it.
        """
        if name not in self.store.generations():
            return
        committed = self._committed_name(parse_generation_name(name)[1])
        try:
            verify_generation(self.store, name, key=self.key)
        except CorruptGeneration as exc:
            aside = self.store.set_aside(name, "rejected")
            log.warning("moved damaged %s aside to %s before publishing over it: %s", name, aside, exc)
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

    def _stage_and_commit(self, name: str, state: TrainState, skeleton: dict, tensors: dict,
                          positions: dict[str, dict]) -> bytes:
        staging = self.store.begin(name)
        try:
            layout = tensorfile.plan(tensors)
            files = [staging.write(STATE, [snapshot.state_json(skeleton)]),
                     staging.write(TENSORS, tensorfile.chunks(layout, tensors))]
            manifest = Manifest(
                generation=name, kind=skeleton["kind"], next_update=state.next_update,
                digest_algorithm=self.store.digest_algorithm, files=tuple(files),
                created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds"),
                contract_fingerprint=contract_mod.digest(skeleton["contract"]["fields"]),
                versions=skeleton["contract"]["versions"], parent=state.parent, data=positions)
            manifest_bytes = manifest.to_bytes(self.key)
            staging.write(MANIFEST, [manifest_bytes])
            staging.commit()
        except BaseException:
            staging.abort()
            raise
        return manifest_bytes

    def _prune(self, newest: str, kind: str) -> None:
        names = self.store.generations()
        lineage = self._lineage(newest, names) if kind == "full" else None
        plan = retention.keep_last(names, newest=newest, kind=kind, keep=self.keep_last, lineage=lineage)
        if plan.off_lineage:
            log.warning("generations that are not ancestors of %s (skipped by restore, or from an abandoned "
                        "timeline) are kept and not counted by keep_last: %s", newest, ", ".join(plan.off_lineage))
        if plan.above_newest:
            log.warning("generations newer than the just-published %s are left in place (from an abandoned "
                        "or interrupted run): %s", newest, ", ".join(plan.above_newest))
        for name in plan.prune:
            self.store.remove(name)

    def _lineage(self, newest: str, names: list[str]) -> set[str]:
        """``newest`` and its ancestors through each manifest's ``parent`` link, as far as they exist."""
        lineage, name, existing = set(), newest, set(names)
        while name in existing and name not in lineage:
            lineage.add(name)
            try:
                name = read_manifest(self.store, name, key=self.key)[0].parent
            except CorruptGeneration:
                break
        return lineage

    # restoring ---------------------------------------------------------------
    def restore(self, state: TrainState, *, generation: str | None = None, allow_changes: Iterable[str] = (),
                rng_statistical_cuda: bool = False) -> RestoreInfo | None:
        """Continue ``state`` from the latest verified full generation (or ``generation``).

        Returns ``None`` when the directory holds no generation at all. Raises
        :class:`NoValidGeneration` when generations exist but none verifies,
        and :class:`ContractMismatch` (loading nothing) when the experiment
        contract differs, unless each differing field is in ``allow_changes``.
        """
        allow = [allow_changes] if isinstance(allow_changes, str) else list(allow_changes)
        chosen, rejected = self._choose(generation)
        if chosen is None:
            return None
        verified, payload = chosen
        name = verified.manifest.generation
        accepted = self._check_contract(state, payload, name, allow)
        snapshot.check_components(state, payload, name)
        warnings = snapshot.apply(state, payload, statistical_cuda=rng_statistical_cuda)
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
        return RestoreInfo(GenerationInfo.from_verified(self.store, verified), rejected, tuple(accepted),
                           tuple(warnings))

    def _load(self, name: str, pointer: Pointer | None) -> tuple[Verified, dict[str, Any]]:
        """Verify a generation completely while decoding it; any defect is a CorruptGeneration."""
        return load_verified(self.store, name, pointer, key=self.key)

    def _choose(self, generation: str | None) -> tuple[tuple[Verified, dict] | None, tuple[Rejection, ...]]:
        if generation is not None:
            parsed = parse_generation_name(generation)
            if parsed is not None and parsed[1] == "weights":
                raise WeightsOnlyGeneration(
                    f"{generation} holds weights only: restoring it is a warm start, not a resume. "
                    "Use warm_start() to load its weights, or restore a full generation.")
            return self._load(generation, None), ()
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
                chosen = self._load(name, pointer if pointer and name == pointer.generation else None)
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

    def _check_contract(self, state: TrainState, payload: dict[str, Any], name: str,
                        allow: list[str]) -> list[FieldChange]:
        changes = contract_mod.compare(payload["contract"]["fields"], state.contract_fields())
        refused = [c for c in changes if not contract_mod.allowed(c, allow)]
        if refused:
            raise ContractMismatch(name, refused)
        return changes

    # inspection --------------------------------------------------------------
    def latest(self) -> str | None:
        """The generation the ``latest`` pointer names (unverified), if any."""
        return self._committed_name("full")

    def generations(self) -> list[str]:
        return self.store.generations()
