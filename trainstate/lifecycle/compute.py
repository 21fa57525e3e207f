"""The training compute a run measures itself: device kinds, and wall time summed over a lineage's updates.

Recorded in each manifest's optional ``compute`` field (absent in older
generations: "not recorded"), shown by ``trainstate inspect`` and in the model
card of an export.

Wall time (``wall_s``) is the seconds of training behind a generation: its
parent's recorded sum plus the training interval that led from the parent to
this save. An interval begins when ``restore`` returns (whether or not it found
a generation), or when the manager is built if ``restore`` was never called,
or when ``start_new_timeline`` is declared; it restarts when each ``save``
returns. The time spent inside ``save`` (for a background save, the stall until
it returns; the overlapped write is training time) is excluded, so a
generation's sum is exactly: (each earlier process's intervals up to the save
its lineage continued from) + (this process's intervals since it restored),
save stalls excluded. Time between a crash and the next restore, and work done
after the last save and lost to a crash, belong to no lineage and are in no sum.

What counts as "not recorded" (``wall_s`` absent) rather than a partial sum:

- the parent recorded no sum (a generation from before this field);
- the state descends from a generation this manager neither restored nor
  saved (e.g. restored by another manager, or a manager built mid-run);
  and every generation descending from such a one.

A run that starts without a parent counts from the manager's construction
(or ``restore`` returning ``None``): setup before that is not training time
as trainstate sees it. Pure bookkeeping over ``time.monotonic``; no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

KEEP = 16  # generations whose interval start is remembered (a failed save rolls back to an earlier one)


def device_kinds(tensors: Iterable[Any]) -> list[str]:
    """The distinct device kinds of ``tensors``: ``cpu``, ``cuda (NVIDIA H200)``, ``mps``..., sorted."""
    import torch

    kinds = set()
    seen: set[Any] = set()
    for tensor in tensors:
        device = tensor.device
        if device in seen:
            continue
        seen.add(device)
        if device.type == "cuda":
            kinds.add(f"cuda ({torch.cuda.get_device_name(device)})")
        else:
            kinds.add(device.type)
    return sorted(kinds)


def state_devices(state: Any) -> list[str]:
    """The device kinds of the parameters and buffers of ``state``'s modules (``[]``: it holds none)."""
    return device_kinds(t for m in state.modules().values() for t in (*m.parameters(), *m.buffers()))


class Compute:
    """A manager's running wall-time bookkeeping: for each generation the live state may descend from,
    its recorded sum (``None``: not recorded), when the training interval after it began, and the save
    stall accumulated by then."""

    def __init__(self) -> None:
        self._stalled = 0.0  # seconds spent inside save() calls so far
        self._from: dict[str | None, tuple[float | None, float, float]] = {}
        self.restart(None, 0.0)
        self._prepared: tuple[str, float | None] | None = None

    def restart(self, generation: str | None, wall_s: float | None) -> None:
        """The state now is ``generation`` (``None``: no parent) with sum ``wall_s``; training starts now."""
        self._from = {generation: (wall_s, time.monotonic(), self._stalled)}

    def sum_at(self, parent: str | None, renamed: Mapping[str, str], at: float) -> float | None:
        """The sum for a save called at ``at`` whose state descends from ``parent`` (``None`` if not known)."""
        entry = self._from.get(parent)
        if entry is None:
            entry = next((e for k, e in self._from.items() if k is not None and renamed.get(k) == parent), None)
        if entry is None or entry[0] is None:
            return None
        base, began, stalled = entry
        return base + max(at - began - (self._stalled - stalled), 0.0)

    def record(self, state: Any, pending: Any, renamed: Mapping[str, str], at: float) -> None:
        """Put the ``compute`` record into a generation prepared by a save called at ``at`` (before its
        tensors are staged)."""
        wall = self.sum_at(pending.parent, renamed, at)
        record: dict[str, Any] = {}
        devices = state_devices(state)
        if devices:
            record["devices"] = devices
        if wall is not None:
            record["wall_s"] = round(wall, 6)
        pending.extra["compute"] = record
        self._prepared = (pending.name, wall) if pending.kind == "full" else None

    def saved(self, started: float, also: str | None = None, published: bool = True) -> None:
        """A save call that began at ``started`` returns now (or failed: ``published=False``): its stall is
        excluded, and the interval after the generation it prepared (also known as ``also``, the name it
        was published under) begins."""
        now = time.monotonic()
        self._stalled += now - started
        if self._prepared is not None and published:
            name, wall = self._prepared
            self._prepared = None
            for key in {name, also}:
                if key is not None:
                    self._from[key] = (wall, now, self._stalled)
            while len(self._from) > KEEP:
                del self._from[next(iter(self._from))]
        self._prepared = None
