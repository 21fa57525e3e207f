"""The generation lifecycle on disk: pins, anchors, metrics, lineage and pruning.

This is the I/O around :mod:`trainstate.lifecycle.retention` (which decides). Pruning
runs under the pins lock, so ``trainstate pin`` from another shell can never
race a prune into deleting what it just pinned; it only removes what the plan
marks, and only generations the library wrote.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Callable, Iterable, Mapping

from ..errors import CorruptGeneration, GenerationNotFound, InvalidArgument, PinNotFound
from ..format.manifest import (PINS, POINTER, WEIGHTS_POINTER, Manifest, check_name, generation_order,
                               parse_generation_name, parse_pins, parse_pointer, pins_to_bytes)
from . import incremental
from .retention import Plan, Retention, best_generation, plan
from ..format.signing import SigningKey
from ..storage.base import Store
from ..storage.verify import verify_generation

log = logging.getLogger("trainstate")


def policy_from_record(record: Mapping) -> Retention:
    """A :class:`Retention` from the record a manifest keeps of it."""
    fields = dict(record)
    if fields.get("best") is not None:
        fields["best"] = tuple(fields["best"])
    return Retention(**fields)


def new_timeline() -> str:
    """A fresh timeline id: a run's first save, or a resume from an older generation, starts one."""
    return secrets.token_hex(8)


class Lifecycle:
    """Reads and changes what a run directory keeps."""

    def __init__(self, store: Store, key: SigningKey | None = None):
        self.store = store
        self.key = key
        self.hold: Callable[[], set[str]] | None = None  # generations pruning must keep (a mirror not yet there)
        self._checked: dict[str, tuple[tuple, Manifest]] = {}  # name -> (its file listing, its verified manifest)
        # how a generation's structure is checked (default: every file present at its size); a node of a tiered
        # run holds only its part of each generation, and checks that part
        self.structure_check: Callable[[str], Manifest] | None = None
        self.allow_unsigned = False  # signing_key=False: keyless saves into a signed run, chosen (see keyless.py)

    # pins --------------------------------------------------------------------
    def pins(self) -> dict[str, str]:
        """Pin name -> generation. A damaged pins file raises: pruning then stops rather than guess."""
        data = self.store.read_pointer(PINS)
        return {} if data is None else parse_pins(data, PINS, self.key)

    def pin(self, name: str, generation: str) -> None:
        """Pin ``generation`` (which must exist and verify) under ``name``; replaces a pin of that name."""
        check_name("pin", name)
        if parse_generation_name(generation) is None:
            raise InvalidArgument(f"{generation!r} is not a generation name (gen-<12 digits>[-weights|-rNNN])")
        with self.store.exclusive("pins"):
            if generation not in self.store.generations():
                raise GenerationNotFound(f"no generation {generation} in {self.store.location}")
            self._structure(generation)
            pins = self.pins()
            pins[name] = generation
            self.store.write_pointer(PINS, pins_to_bytes(pins, self.key))

    def unpin(self, name: str) -> str:
        """Remove a pin; returns the generation it named. The generation stays until a prune."""
        check_name("pin", name)
        with self.store.exclusive("pins"):
            pins = self.pins()
            if name not in pins:
                raise PinNotFound(f"no pin named {name!r} in {self.store.location} (pins: {sorted(pins)})")
            generation = pins.pop(name)
            self.store.write_pointer(PINS, pins_to_bytes(pins, self.key))
            return generation

    # what the plan needs -----------------------------------------------------
    def anchors(self, kinds: Iterable[str] = ("full", "weights")) -> dict[str, str | None]:
        """For each kind, the generation its pointer names, if that generation verifies (structure)."""
        return {kind: None if found is None else found.generation
                for kind, found in ((k, self._anchored(k)) for k in kinds)}

    def _anchored(self, kind: str) -> Manifest | None:
        """The manifest of the generation the pointer of ``kind`` names, if it verifies (structure)."""
        try:
            data = self.store.read_pointer(POINTER if kind == "full" else WEIGHTS_POINTER)
            if data is None:
                return None
            pointer = parse_pointer(data, POINTER if kind == "full" else WEIGHTS_POINTER, self.key)
            verified = verify_generation(self.store, pointer.generation, pointer, content=False, key=self.key)
        except CorruptGeneration:
            return None
        return verified.manifest if pointer.kind == kind else None

    def newest_full(self) -> Manifest | None:
        """The manifest of the generation a restore starts from, structurally verified (no tensor data read).

        The one ``latest`` names when it verifies, else the newest full
        generation that does: what restore would pick, short of re-hashing
        every byte.
        """
        anchored = self._anchored("full")  # verified once: the pointer's generation is not read again below
        if anchored is not None:
            return anchored
        names = [n for n in self.store.generations() if parse_generation_name(n)[1] == "full"]
        for name in names:
            try:
                return verify_generation(self.store, name, content=False, key=self.key).manifest
            except CorruptGeneration:
                continue
        return None

    def recorded_policy(self) -> tuple[Retention | None, str | None]:
        """The retention policy the run recorded in its newest full generation, and that generation's name."""
        manifest = self.newest_full()
        if manifest is None or not manifest.retention:
            return None, None if manifest is None else manifest.generation
        return policy_from_record(manifest.retention), manifest.generation

    def manifests(self, names: list[str]) -> dict[str, Manifest]:
        """The manifest of every generation among ``names`` whose structure verifies (no tensor data read).

        Damaged ones are left out: never the best, never counted as an ancestor
        (so kept, as evidence, and never filling a ``keep_last`` slot).
        """
        out = {}
        for name in names:
            try:
                out[name] = self._structure(name)
            except (CorruptGeneration, FileNotFoundError):
                continue
        present = set(names)
        self._checked = {n: v for n, v in self._checked.items() if n in present}
        return out

    def _structure(self, name: str) -> Manifest:
        """``name``'s manifest, structurally verified; re-read only when its file listing (names, sizes) changed.

        A published generation never changes, so a save's prune (which looks
        at every generation) reads only new manifests: at 1,000 generations a
        directory listing each instead of reading, parsing and checking 1,000
        manifests. A file truncated, added or removed since changes the listing
        and is caught as before; a generation replaced under its own name (a
        weights-only one saved again at its update) changes the store's
        ``identity`` where it has one (a local directory's inode); restore and
        ``verify`` always read afresh.
        """
        identity = getattr(self.store, "identity", None)
        files = self.store.files(name)
        listing = (tuple(sorted(files.items(), key=lambda kv: kv[0])), identity(name) if identity is not None else None)
        cached = self._checked.get(name)
        if cached is not None and cached[0] == listing:
            return cached[1]
        manifest = self.structure_check(name) if self.structure_check is not None else \
            verify_generation(self.store, name, content=False, key=self.key, listed=files).manifest
        self._checked[name] = (listing, manifest)
        return manifest

    @staticmethod
    def lineage(newest: str | None, manifests: Mapping[str, Manifest]) -> set[str]:
        """``newest`` and every full generation that is one of its ancestors.

        Each manifest records its timelines (``[[id, end], ...]``, a new one
        at each fork); a generation is an ancestor when its own timeline
        appears in the newest's record and its update is within that
        timeline's inherited range. This survives pruning, unlike a walk of
        ``parent`` links. Generations written before lineage records existed
        fall back to that walk.
        """
        top = manifests.get(newest) if newest else None
        if top is None:
            return set()
        if not top.lineage:
            lineage, name = set(), newest
            while name in manifests and name not in lineage:
                lineage.add(name)
                name = manifests[name].parent
            return lineage
        ranges = [(timeline, end) for timeline, end in top.lineage]
        out = {newest}
        for name, manifest in manifests.items():
            if manifest.kind != "full" or generation_order(name) > generation_order(newest):
                continue  # newer, or a later revision at its update: never an ancestor
            own = manifest.lineage[-1][0] if manifest.lineage else "legacy"
            if any(own == t and (end is None or manifest.next_update <= end) for t, end in ranges):
                out.add(name)
        return out

    def plan(self, policy: Retention, anchors: Mapping[str, str | None] | None = None,
             pins: Mapping[str, str] | None = None) -> Plan:
        """The retention plan for the directory as it is now (no changes); ``pins``: these instead of the
        directory's own (node-local tiers pass every node's).

        When ``policy`` differs from the one the run recorded, the plan's
        ``note`` says so and names what the recorded policy would keep that
        this one prunes.
        """
        names = self.store.generations()
        anchors = dict(self.anchors() if anchors is None else anchors)
        manifests = self.manifests(names)
        lineage = self.lineage(anchors.get("full"), manifests)
        pins = self.pins() if pins is None else pins
        full = anchors.get("full")
        forks = {end for _, end in manifests[full].lineage[:-1]} if full in manifests else set()
        fallback = incremental.fallback(full, manifests, lineage)
        decided = plan(names, policy=policy, newest=anchors, lineage=lineage, pins=pins,
                       best=self._best(policy, manifests), forks=forks, fallback=fallback)
        record = manifests[full].retention if full in manifests else None
        recorded = policy_from_record(record) if record else None
        if recorded is None or recorded == policy:
            return decided
        under_recorded = plan(names, policy=recorded, newest=anchors, lineage=lineage, pins=pins,
                              best=self._best(recorded, manifests), forks=forks, fallback=fallback)
        lost = sorted(set(decided.prune) - set(under_recorded.prune))
        note = (f"the policy in force ({policy}) differs from the one {full} recorded ({recorded})"
                + (f"; it prunes {', '.join(lost)}, which the recorded policy keeps" if lost else ""))
        return dataclasses.replace(decided, note=note)

    def best(self, policy: Retention) -> str | None:
        """The generation with the best value of the policy's metric, among those whose structure verifies."""
        return self._best(policy, self.manifests(self.store.generations()))

    @staticmethod
    def _best(policy: Retention, manifests: Mapping[str, Manifest]) -> str | None:
        return best_generation({n: m.metrics for n, m in manifests.items()}, policy.best)

    def prune(self, policy: Retention, anchors: Mapping[str, str | None] | None = None, *,
              dry_run: bool = False) -> Plan:
        """Remove what the plan prunes (nothing with ``dry_run``); returns the plan."""
        with self.store.exclusive("pins"):
            decided = self.plan(policy, anchors)
            if not dry_run:
                if decided.note:
                    log.warning("%s: %s", self.store.location, decided.note)
                for decision in decided.decisions:
                    if decision.left_for_a_human:
                        log.warning("kept %s: %s", decision.generation, "; ".join(decision.reasons))
                held = self.hold() if self.hold is not None else set()
                for name in decided.prune:
                    if name in held:
                        log.info("kept %s: its mirror upload is not complete yet", name)
                        continue
                    self.store.remove(name)
        return decided
