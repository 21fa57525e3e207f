"""Which generations a restore tries, and in what order: the pointer, rolling forward, timelines.

``latest`` names where the run stands. A restore tries that generation
first; before it, newer complete generations that descend from it (a save
interrupted between its commit and the pointer move rolls forward; a signed
run's pointer replayed further back raises :class:`PointerRollback`); after
it, the older ones, newest first; last, newer generations the pointer does
not lead to (a timeline the run left when it resumed from an older
generation). Without a usable pointer, newest first. Everything here is
judged by structure (manifests and sizes); :mod:`trainstate.restore` reads
and verifies every byte of the one it loads.
"""

from __future__ import annotations

import datetime
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import CorruptGeneration, PointerRollback, Rejection
from ..format.manifest import (POINTER, RUN, Manifest, Pointer, generation_order, parse_generation_name, parse_pointer,
                               parse_run)
from ..format.signing import SigningKey
from ..storage.base import Store
from ..storage.verify import verify_generation
from .generations import Lifecycle

log = logging.getLogger("trainstate")


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
    ahead, abandoned, last = _descendants_ahead(store, key, pointer, rest, run)
    first = [name for name, _ in ahead]
    if ahead:
        rejected.append(Rejection(POINTER, _left_behind(store, key, pointer, ahead, abandoned)))
    # newer generations the pointer's does not lead to (a timeline the run left) only after its own ancestors
    order = first + [pointer.generation] + [n for n in rest if n not in first and n not in last] + last
    return Candidates(tuple(order), pointer, tuple(rejected), frozenset(full), run=run)


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
                       run: str | None) -> tuple[list[tuple[str, Manifest]], list[str], list[str]]:
    """Structurally valid full generations newer than the pointer's that descend from it on the timeline the run
    saved to last, newest first; those on a timeline it abandoned (:func:`current_branch`); and every newer one
    that is not among the first (newest first): should the pointer's generation fail, the fallback tries its
    ancestors before them. The last two are empty when the pointer's manifest tells no timeline."""
    newer = [n for n in others if generation_order(n) > generation_order(pointer.generation)]
    if not newer:
        return [], [], []
    try:
        base = verify_generation(store, pointer.generation, pointer, content=False, key=key).manifest
    except CorruptGeneration:
        return [], [], []  # the pointer's own generation is damaged: the ordinary fallback handles it
    if not base.lineage:
        return [], [], []  # written before timelines were recorded: no way to tell a descendant
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
    ahead, abandoned = current_branch(out)
    return ahead, abandoned, [n for n in newer if n not in dict(ahead)]


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
