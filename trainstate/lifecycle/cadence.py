"""How often to checkpoint: the Young and Daly models, pure arithmetic.

A run that fails on average every ``M`` seconds and spends ``C`` seconds
blocked per checkpoint loses, per failure, the work since the last
checkpoint plus the restart, and pays ``C`` per checkpoint in between. Young
(1974) gave the first-order optimum interval ``T* = sqrt(2 C M)``; Daly (2006)
the higher-order form used here (with restart time ``R`` in the expected
wall time). These are models of exponentially distributed failures, not a
service-level promise: real failures cluster, and a preemption notice (see
:mod:`trainstate.preemption`) beats any interval.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument


def _check(save_cost: float, mtbf: float) -> None:
    if not (math.isfinite(save_cost) and save_cost > 0):
        raise InvalidArgument(f"save cost must be a positive number of seconds, got {save_cost!r}")
    if not (math.isfinite(mtbf) and mtbf > 0):
        raise InvalidArgument(f"MTBF must be a positive number of seconds, got {mtbf!r}")


def young_interval(save_cost: float, mtbf: float) -> float:
    """Young's optimum compute time between checkpoints: ``sqrt(2 C M)`` seconds."""
    _check(save_cost, mtbf)
    return math.sqrt(2 * save_cost * mtbf)


def daly_interval(save_cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints, in seconds.

    ``sqrt(2CM) * (1 + sqrt(C/2M)/3 + (C/2M)/9) - C`` while ``C < 2M``,
    else ``M``.
    """
    _check(save_cost, mtbf)
    if save_cost >= 2 * mtbf:
        return mtbf
    ratio = save_cost / (2 * mtbf)
    return math.sqrt(2 * save_cost * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_cost


def expected_overhead(interval: float, save_cost: float, mtbf: float, restart: float = 0.0) -> float:
    """Expected wall time over failure-free compute time, minus one, under Daly's model.

    With exponentially distributed failures, a segment of ``interval``
    seconds of work plus ``save_cost`` completes in expected time
    ``M e^(R/M) (e^((T+C)/M) - 1)``; the fraction returned is what
    checkpointing, lost work and restarts add to the run.
    """
    _check(save_cost, mtbf)
    if not (math.isfinite(interval) and interval > 0) or restart < 0:
        raise InvalidArgument("interval must be positive and restart non-negative")
    segment = mtbf * math.exp(restart / mtbf) * math.expm1((interval + save_cost) / mtbf)
    return segment / interval - 1


@dataclass(frozen=True)
class Advice:
    """A recommended checkpoint interval, in seconds and in updates."""

    save_cost_s: float
    mtbf_s: float
    step_time_s: float
    young_s: float
    daly_s: float
    young_updates: int
    daly_updates: int
    overhead_young: float  # expected fraction added to the run at Young's interval
    overhead_daly: float

    def describe(self) -> str:
        return (f"save cost {self.save_cost_s:.3g} s, MTBF {self.mtbf_s:.6g} s, update {self.step_time_s:.3g} s\n"
                f"Young: every {self.young_s:.1f} s = {self.young_updates} updates "
                f"(expected overhead {self.overhead_young:.2%})\n"
                f"Daly:  every {self.daly_s:.1f} s = {self.daly_updates} updates "
                f"(expected overhead {self.overhead_daly:.2%})\n"
                "A model of exponentially distributed failures, not a guarantee.")


def advise(save_cost: float, mtbf: float, step_time: float, restart: float = 0.0) -> Advice:
    """Young's and Daly's intervals for a measured save cost and update time (all in seconds)."""
    if not (math.isfinite(step_time) and step_time > 0):
        raise InvalidArgument(f"step time must be a positive number of seconds, got {step_time!r}")
    young, daly = young_interval(save_cost, mtbf), daly_interval(save_cost, mtbf)
    y_updates, d_updates = max(1, round(young / step_time)), max(1, round(daly / step_time))
    return Advice(save_cost, mtbf, step_time, young, daly, y_updates, d_updates,
                  expected_overhead(y_updates * step_time, save_cost, mtbf, restart),
                  expected_overhead(d_updates * step_time, save_cost, mtbf, restart))


@dataclass(frozen=True)
class Cadence:
    """Pick the full-save interval from measurements (see :mod:`trainstate.cadence`).

    ``mtbf_s`` is the mean time between failures; ``restart_s`` the time a
    restart costs. The first save is due after ``first_after`` updates (to
    measure a save); afterwards the interval is Daly's optimum (``model="young"``
    for Young's), in updates, clamped to ``[min_updates, max_updates]``.
    """

    mtbf_s: float
    restart_s: float = 0.0
    first_after: int = 10
    min_updates: int = 1
    max_updates: int | None = None
    model: str = "daly"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mtbf_s) and self.mtbf_s > 0):
            raise InvalidArgument(f"mtbf_s must be positive, got {self.mtbf_s!r}")
        if self.model not in ("daly", "young"):
            raise InvalidArgument(f"model must be 'daly' or 'young', got {self.model!r}")
        if self.first_after < 1 or self.min_updates < 1 or (self.max_updates is not None
                                                               and self.max_updates < self.min_updates):
            raise InvalidArgument("first_after and min_updates must be >= 1, and max_updates >= min_updates")


class Clock:
    """Measured save cost and update time (monotonic clock)."""

    def __init__(self) -> None:
        self.saves: list[float] = []
        self.updates: list[float] = []
        self.last_boundary: float | None = None
        self.saving_since_boundary = 0.0
        self.on_saved: Any = None  # told each save's blocking seconds (node-local tiers record them on disk)

    def boundary(self) -> None:
        now = time.monotonic()
        if self.last_boundary is not None:
            self.updates.append(max(now - self.last_boundary - self.saving_since_boundary, 1e-9))
            del self.updates[:-1000]
        self.last_boundary, self.saving_since_boundary = now, 0.0

    def saved(self, seconds: float) -> None:
        self.saves.append(seconds)
        del self.saves[:-20]
        self.saving_since_boundary += seconds
        if self.on_saved is not None:
            self.on_saved(seconds)

    @staticmethod
    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None


def measured_advice(clock: Clock, cadence: Cadence | None, mtbf_s: float | None = None) -> Advice | None:
    """Young's and Daly's intervals from ``clock``'s measurements (``None`` until a save and an update are measured)."""
    mtbf = mtbf_s if mtbf_s is not None else (cadence.mtbf_s if cadence else None)
    save, step = clock.mean(clock.saves), clock.mean(clock.updates)
    if mtbf is None or save is None or step is None:
        return None
    return advise(save, mtbf, step, cadence.restart_s if cadence else 0.0)


def interval(clock: Clock, cadence: Cadence | None) -> int | None:
    """The save interval in updates the cadence puts in force now, within its bounds (``None`` until measured)."""
    advice = measured_advice(clock, cadence)
    if advice is None:
        return None
    updates = advice.daly_updates if cadence.model == "daly" else advice.young_updates
    updates = max(updates, cadence.min_updates)
    return updates if cadence.max_updates is None else min(updates, cadence.max_updates)
