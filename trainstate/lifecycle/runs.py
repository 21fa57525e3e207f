"""Which run a directory holds, and what it promised: the recorded policy and the run a state belongs to.

A run directory records its retention policy in every full manifest and its
timelines in every full manifest's lineage. A manager opened on it keeps the
recorded policy unless told otherwise, and refuses to save a state that has
nothing to do with the run already there.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection

from ..errors import ExistingRun, InvalidArgument, InvalidType
from . import keyless
from .generations import Lifecycle
from .retention import Retention

log = logging.getLogger("trainstate")


def check_policy(keep_last: object, retention: object) -> None:
    """The manager's ``keep_last`` and ``retention`` arguments, before anything is opened."""
    if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
        raise InvalidArgument(f"keep_last must be a positive int, got {keep_last!r}")
    if retention is not None and keep_last is not None:
        raise InvalidArgument("pass keep_last inside retention=Retention(keep_last=...), not both")
    if retention is not None and not isinstance(retention, Retention):
        raise InvalidType(f"retention must be a trainstate.Retention, got {type(retention).__name__}")


def effective_policy(lifecycle: Lifecycle, keep_last: int | None, explicit: Retention | None) -> Retention:
    """The retention policy in force: never silently weaker than the one the run recorded.

    Without an explicit policy, the run's recorded one stays in force (best
    metric, milestones, weights-only count), with ``keep_last`` raised to the
    one given if that is larger. An explicit policy that differs from the
    recorded one is used, and the difference is logged here and shown by
    ``plan()`` before anything is pruned under it.
    """
    location = lifecycle.store.location
    recorded, source = lifecycle.recorded_policy()
    if explicit is not None:
        if recorded is not None and recorded != explicit:
            log.warning("%s: the retention policy given (%s) differs from the one %s recorded (%s); "
                        "generations are pruned under the new one from the next save (see plan())",
                        location, explicit, source, recorded)
        return explicit
    if recorded is None:
        return Retention(keep_last=keep_last or 3)
    if keep_last is not None and keep_last < recorded.keep_last:
        log.warning("%s: keeping the last %d generations as %s recorded, not %d; pass "
                    "retention=Retention(keep_last=%d, ...) to lower it deliberately",
                    location, recorded.keep_last, source, keep_last, keep_last)
    if keep_last is not None and keep_last > recorded.keep_last:
        return dataclasses.replace(recorded, keep_last=keep_last)
    return recorded


def check_same_run(lifecycle: Lifecycle, lineage: list | None, known: Collection[str] = ()) -> str | None:
    """Refuse to save a state that was never restored from the run in this directory into it.

    A script that forgets ``restore`` would otherwise move ``latest`` back to
    its own first update and bury the run that was there. A state belongs
    when it shares a timeline with the newest full generation (it was
    restored from, or saved into, this run), or when its current timeline is
    in ``known`` (already checked, or declared by ``start_new_timeline``).
    Returns the state's current timeline once it is known to belong. A
    manager without the key refuses to save into a signed run (:mod:`.keyless`).
    """
    ours = [t for t, _ in lineage or []]
    if ours and ours[-1] in known:
        return ours[-1]
    keyless.refuse(lifecycle)  # a keyless save into a signed run (the manager's open checked it too)
    newest = lifecycle.newest_full()
    theirs = {t for t, _ in newest.lineage} if newest is not None else set()
    if newest is None or not theirs or theirs & set(ours):
        return ours[-1] if ours else None
    raise ExistingRun(
        f"{lifecycle.store.location} holds another run (newest full generation {newest.generation}, update "
        f"{newest.next_update}) and this state was not restored from it; saving would move latest back and "
        "set that run's generations aside. Call ckpt.restore(state) first to continue it, use a new "
        "directory for a new run, or call ckpt.start_new_timeline(state) to start over here deliberately "
        "(the existing generations stay, set aside as evidence where updates collide).")
