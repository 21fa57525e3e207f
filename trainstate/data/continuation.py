"""Continuing a saved data position under another plan: another world size, another batch size.

All ranks of a run consume the same number of batches of the same epoch, so
what they consumed is a prefix of the epoch's global order. A loader at
another world size (resharding) or with another batch size (an allowed
regrouping) continues that prefix: same samples, same order, grouped into
its own batches. Exact when the global batch (world size times batch size)
is unchanged. Pure functions of the saved states and the plan that reads on;
:class:`trainstate.data.loader.ResumableLoader` applies what they return.
"""

from __future__ import annotations

from typing import Any

from ..errors import DataMismatch
from .order import SORT_V1, Plan, ids_digest

# what a position means beyond the world size and the batch size: a change of any makes it name other samples
MEANING = ("dataset_len", "seed", "shuffle", "drop_last", "uneven", "algorithm", "order_params", "mixture")


def with_algorithm(plan: dict[str, Any]) -> dict[str, Any]:
    """A saved plan; one without an algorithm name was written before there was a choice: the sort."""
    return plan if "algorithm" in plan else {**plan, "algorithm": SORT_V1}


def common_position(saved: list[dict[str, Any]], live: dict[str, Any], reweighted: bool
                    ) -> tuple[tuple[int, int, int], int, int]:
    """The one position every saved rank stopped at (epoch, cursor, start), and their samples and tokens summed;
    :class:`DataMismatch` when a saved plan means other samples than ``live`` (a plan as dict)."""
    for state in saved:
        old = with_algorithm(state["plan"]) if type(state.get("plan")) is dict else None
        if reweighted and type(old) is dict and type(old.get("mixture")) is dict:
            old = {**old, "mixture": {**old["mixture"], "weights": live["mixture"]["weights"]}}
        changed = [k for k in MEANING if type(old) is not dict or old.get(k) != live.get(k)]
        if changed:
            raise DataMismatch("the data plan differs from the checkpoint's beyond the world size and batch "
                               f"size ({', '.join(changed)}): its position would name other samples")
    try:
        positions = {(s["epoch"], s["cursor"], s.get("start", 0)) for s in saved}
        samples, tokens = sum(s["samples_seen"] for s in saved), sum(s["tokens_seen"] for s in saved)
    except (KeyError, TypeError):
        raise DataMismatch("not ResumableLoader states") from None
    if len(positions) != 1:
        raise DataMismatch(f"the saved ranks stopped at different positions {sorted(positions)}")
    (position,) = positions
    return position, samples, tokens


def continued(plan: Plan, old: dict[str, Any], position: tuple[int, int, int], samples: int, tokens: int,
              global_draws: bool) -> tuple[dict[str, Any], list[str]]:
    """The state that reads on, with ``plan``, after the ranks of ``old`` (a saved plan) stopped at ``position``
    (epoch, cursor, start), and the warning when the global batch changes."""
    epoch, cursor, start = position
    old_world, old_batch = old["world_size"], old["batch_size"]
    consumed = start + cursor * old_batch * old_world  # the global count of this epoch's positions read
    if consumed < plan.dataset_len and plan.batches_per_epoch(consumed):
        start = consumed
    else:  # the epoch is used up (padding wrapped, or what is left fills no batch of this plan)
        epoch, start = epoch + 1, 0
    ids = plan.batches(epoch, start)[0]
    state = {"epoch": epoch, "cursor": 0, "samples_seen": samples, "tokens_seen": tokens, "plan": plan.as_dict(),
             "next_batch": {"epoch": epoch, "cursor": 0, "size": len(ids), "ids_digest": ids_digest(epoch, 0, ids)},
             "worker_global_draws": global_draws}
    if start:
        state["start"] = start
    if plan.source is not None and len(plan.source.segments) > 1:
        state["mixture_segments"] = plan.source.saved_segments()
    before, after = old_batch * old_world, plan.batch_size * plan.world_size
    if before == after:
        return state, []
    return state, [f"the global batch size changed from {before} ({old_world} x {old_batch}) to {after} "
                   f"({plan.world_size} x {plan.batch_size}): the samples continue in the same order, grouped "
                   "into updates of another size, so the updates are not the uninterrupted run's"]
