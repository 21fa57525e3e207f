"""What each tier of a tiered run can promise, computed from its measurements: pure arithmetic, no I/O.

``trainstate cadence --run NODE_DIR`` (:mod:`trainstate.cli.sla`) reads a
node's ``tier-timings.json`` (:mod:`trainstate.distributed.tiertimes`) and
its generations' manifests, and hands them here with the failure rates the
user knows from the fleet's history (a run directory cannot measure them).
Every figure out of here names the medians and sample counts it came from;
a figure with no measurement behind it is ``None`` with the reason, never a
default.

Three failure classes, each served by one tier:

=================================  ==========  ==================  ===========================
failure                            tier        restore source      protected after the local
                                                                   commit by (the *lag*)
=================================  ==========  ==================  ===========================
a process crash (disks intact)     local       ``restore_local``   0
the loss of one failure domain     replicated  ``restore_peer``    ``replicate``
the loss of every node             remote      ``restore_remote``  ``replicate`` + ``upload``
=================================  ==========  ==================  ===========================

(replication and the upload run one after the other on the writer thread.)

The model, with a save every ``u`` updates of ``tau`` seconds of compute and
a blocking save of ``C`` seconds (``save_local``): saves are ``P = u tau + C``
apart; the local and replicated tiers gain a generation every save, the
remote every ``K``-th (``mirror_every``), so a tier's protection points are
``P_c`` = ``P`` or ``K P`` apart. A failure at a random moment loses the
work since the newest generation its tier protects: on average
``P_c / 2 + lag``, at worst ``P_c + lag`` seconds, and that over ``tau`` in
updates. Both bound the compute to redo from above (by at most the save
time: they count the save itself as work), for a lag shorter than ``P``.
``save_local`` is the whole blocking time of ``save()`` as the manager's
clock measures it (capturing the state, any wait for the previous save's
replication and upload, the local commit); :func:`report` notes when the
manifests' gap between saves says that saves blocked longer still.

Getting back to where it was takes the measured restore from that
source, plus a restart the user measured (``restart_s``: relaunch,
rendezvous, a replacement node; not in the restore timing), plus the lost
work again.
To first order (Young), checkpointing adds to the run
``C / (u tau) + sum over classes (lost + restore + restart) / MTBF``.

The intervals are Young's ``sqrt(2 C M)`` and Daly's higher-order optimum
(:mod:`.cadence`): for the local tier ``C`` against the process-crash MTBF,
for the replicated tier ``C`` against the failure-domain MTBF, for the save
interval itself ``C`` against both together (every save serves both), and
for the remote tier the upload time against the every-node MTBF, rounded to
a whole number of saves (``mirror_every``). Failures are modelled as
independent and exponentially distributed: real ones cluster.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import InvalidArgument
from .cadence import daly_interval, young_interval

COST_KINDS = ("save_local", "replicate", "upload")
RESTORE_KINDS = ("restore_local", "restore_peer", "restore_remote")

# failure class -> (what fails, the tier that serves it, its restore source, the MTBF's flag)
CLASSES = {
    "process": ("a process crash (every rank killed, disks intact)", "local", "restore_local", "--process-mtbf"),
    "domain": ("the loss of one failure domain (a node, a rack)", "replicated", "restore_peer", "--node-mtbf"),
    "every_node": ("the loss of every node", "remote", "restore_remote", "--all-mtbf"),
}

# what to run to measure each kind (named in the "not measured" reasons)
HOW = {
    "save_local": "save at least once with node-local tiers (CheckpointManager(dir, replicas=2) under torchrun)",
    "replicate": "save with replicas=2 or more (the replicas are copied after each save, timed on each node)",
    "upload": "save with mirror=URL (uploads are timed on rank 0's node: point --run at that node's directory)",
    "restore_local": "restart the job once with every node's directory intact",
    "restore_peer": "restart once after deleting one node's directory (a rehearsal of losing that node)",
    "restore_remote": "restart once with every node's generations gone (a rehearsal: the object store alone)",
}


@dataclass(frozen=True)
class Figure:
    """The median of one kind's measured samples, and how many samples it is the median of."""

    kind: str
    seconds: float
    bytes: int
    samples: int


def figures(samples: Mapping[str, Sequence[Sequence[float]]]) -> dict[str, Figure | None]:
    """Each kind's median seconds and bytes over its ``[seconds, bytes, unix time]`` samples (``None``: none).

    >>> figures({"save_local": [[1.0, 10, 0], [3.0, 30, 1], [2.0, 20, 2]]})["save_local"]
    Figure(kind='save_local', seconds=2.0, bytes=20, samples=3)
    """
    out: dict[str, Figure | None] = {}
    for kind in COST_KINDS + RESTORE_KINDS:
        rows = list(samples.get(kind) or [])
        out[kind] = Figure(kind, statistics.median(r[0] for r in rows), round(statistics.median(r[1] for r in rows)),
                           len(rows)) if rows else None
    return out


def mirror_every(save_times: Sequence[float], upload_times: Sequence[float]) -> tuple[int, int] | None:
    """``mirror_every`` as the run did it: the saves finished between consecutive uploads, and how many gaps.

    An upload of a generation ends after its save and before the next save
    ends (the next save waits for the writer thread), so the saves in
    ``(upload i, upload i+1]`` are the saves per upload. The most common
    gap is taken (ties: the larger): a restart uploads its first save early
    (a shorter gap). Only gaps inside the window the save samples cover
    count. ``None`` with fewer than two uploads in that window.

    >>> mirror_every([1, 2, 3, 4, 5], [1.5, 3.5, 5.5])
    (2, 2)
    """
    saves = sorted(save_times)
    uploads = [t for t in sorted(upload_times) if saves and t >= saves[0]]
    gaps = [sum(1 for s in saves if a < s <= b) for a, b in zip(uploads, uploads[1:])]
    gaps = [g for g in gaps if g > 0]
    if not gaps:
        return None
    return max(set(gaps), key=lambda g: (gaps.count(g), g)), len(gaps)


@dataclass(frozen=True)
class Rates:
    """The failure rates (mean seconds between failures of each class; ``None``: not given) and a restart time,
    all given by the user: a run directory measures none of them."""

    process_mtbf_s: float | None = None
    domain_mtbf_s: float | None = None
    every_node_mtbf_s: float | None = None
    restart_s: float = 0.0

    def __post_init__(self) -> None:
        for failure in CLASSES:
            value = self.mtbf(failure)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise InvalidArgument(f"{CLASSES[failure][3]} must be a positive number of seconds, got {value!r}")
        if not (math.isfinite(self.restart_s) and self.restart_s >= 0):
            raise InvalidArgument(f"--restart must be zero or more seconds, got {self.restart_s!r}")

    def mtbf(self, failure: str) -> float | None:
        return getattr(self, f"{failure}_mtbf_s")


@dataclass(frozen=True)
class Cadence:
    """How the run saves: updates between saves, compute seconds per update, saves per upload (``None``: no
    remote tier measured), each with where it came from."""

    updates_per_save: int
    step_s: float
    mirror_every: int | None
    sources: tuple[str, ...] = ()  # where each of the three figures came from
    gap_s: float | None = None  # the median seconds between saves the manifests show, ``gap_updates`` apart
    gap_updates: int | None = None

    def __post_init__(self) -> None:
        if type(self.updates_per_save) is not int or self.updates_per_save < 1:
            raise InvalidArgument(f"updates between saves must be a positive int, got {self.updates_per_save!r}")
        if not (math.isfinite(self.step_s) and self.step_s > 0):
            raise InvalidArgument(f"seconds per update must be a positive number, got {self.step_s!r}")
        if self.mirror_every is not None and (type(self.mirror_every) is not int or self.mirror_every < 1):
            raise InvalidArgument(f"mirror_every must be a positive int, got {self.mirror_every!r}")


def step_time(interval_s: float, updates_per_save: int, save_s: float) -> float:
    """Compute seconds per update from the measured time between saves (which includes the blocking save)."""
    compute = interval_s - save_s
    return (compute if compute > 0 else interval_s) / updates_per_save


@dataclass(frozen=True)
class Interval:
    """One Young/Daly interval: a cost against a failure rate; ``daly_every`` in updates (``unit="updates"``) or
    in saves (the remote tier, ``unit="saves"``). ``missing`` says why it is not computed (then the rest is None)."""

    tier: str
    cost: str  # the kind of the cost: save_local or upload
    against: tuple[str, ...]  # the failure classes (keys of CLASSES) whose MTBFs it is weighed against
    cost_s: float | None
    cost_samples: int
    mtbf_s: float | None
    young_s: float | None
    daly_s: float | None
    daly_every: int | None
    unit: str
    missing: str = ""


@dataclass(frozen=True)
class ClassRow:
    """One failure class at one cadence: the lost work, the restore, the time back, its share of the overhead.

    A ``None`` is a figure without a measurement (or without a given MTBF) behind it; ``missing`` says which and
    what to run to measure it."""

    failure: str
    what: str
    tier: str
    source: str
    mtbf_s: float | None
    period_s: float  # between the tier's protection points
    lag_s: float | None
    lag_samples: int
    expected_lost_s: float | None
    worst_lost_s: float | None
    expected_lost_updates: float | None
    worst_lost_updates: float | None
    restore_s: float | None
    restore_samples: int
    back_s: float | None  # restart + restore + expected lost work
    worst_back_s: float | None
    overhead: float | None  # (expected lost + restore + restart) / MTBF
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class SLA:
    """Every failure class at one cadence, with the blocking saves' share and the total overhead (first order)."""

    label: str
    updates_per_save: int
    mirror_every: int | None
    period_s: float
    save_overhead: float  # C / (u tau)
    rows: tuple[ClassRow, ...]
    overhead: float | None  # save_overhead + every row's share (None when no row has one)
    overhead_covers: tuple[str, ...]  # the classes summed into ``overhead``
    overhead_leaves_out: tuple[str, ...]  # classes with an MTBF whose share could not be computed


@dataclass(frozen=True)
class Report:
    """The measured inputs, the intervals, the SLA at the run's cadence and at the recommended one."""

    figures: dict[str, Figure | None]
    cadence: Cadence
    rates: Rates
    intervals: tuple[Interval, ...]
    as_run: SLA
    recommended: SLA | None
    notes: tuple[str, ...]


def not_measured(kind: str) -> str:
    return f"{kind} not measured: {HOW[kind]}"


def _interval(tier: str, cost: Figure | None, against: tuple[str, ...], rates: Rates, unit: str,
              period_s: float) -> Interval:
    given = tuple(f for f in against if rates.mtbf(f) is not None)
    kind = cost.kind if cost else ("upload" if unit == "saves" else "save_local")
    if cost is None:
        return Interval(tier, kind, given or against, None, 0, None, None, None, None, unit, not_measured(kind))
    if not given:
        names = " + ".join(CLASSES[f][0] for f in against)
        flags = " / ".join(CLASSES[f][3] for f in against)
        return Interval(tier, kind, against, cost.seconds, cost.samples, None, None, None, None, unit,
                        f"no MTBF given for {names} ({flags})")
    mtbf = 1 / sum(1 / rates.mtbf(f) for f in given)  # independent classes: their rates add
    young, daly = young_interval(cost.seconds, mtbf), daly_interval(cost.seconds, mtbf)
    every = max(1, round(daly / period_s))
    return Interval(tier, kind, given, cost.seconds, cost.samples, mtbf, young, daly, every, unit)


def intervals(figs: Mapping[str, Figure | None], rates: Rates, cadence: Cadence) -> tuple[Interval, ...]:
    """Young's and Daly's intervals per tier (see the module docstring); the remote's in saves at the run's
    cadence. The ``saves`` row is the interval to save at (every save serves the local and replicated tiers)."""
    save = figs["save_local"]
    per_update = cadence.step_s
    saves_apart = cadence.updates_per_save * cadence.step_s + (save.seconds if save else 0.0)
    return (_interval("local", save, ("process",), rates, "updates", per_update),
            _interval("replicated", save, ("domain",), rates, "updates", per_update),
            _interval("saves", save, ("process", "domain"), rates, "updates", per_update),
            _interval("remote", figs["upload"], ("every_node",), rates, "saves", saves_apart))


def _lag(failure: str, figs: Mapping[str, Figure | None]) -> tuple[float | None, int, list[str]]:
    """A tier's lag behind the local commit, the samples behind it, and what is not measured."""
    if failure == "process":
        return 0.0, 0, []
    kinds = ("replicate",) if failure == "domain" else ("replicate", "upload")
    missing = [not_measured(k) for k in kinds if figs[k] is None]
    if missing:
        return None, 0, missing
    return sum(figs[k].seconds for k in kinds), min(figs[k].samples for k in kinds), []


def class_row(failure: str, figs: Mapping[str, Figure | None], rates: Rates, cadence: Cadence,
              period_s: float) -> ClassRow:
    """One failure class at ``cadence`` (saves ``period_s`` apart): see the module docstring."""
    what, tier, source, _ = CLASSES[failure]
    per_update = cadence.step_s
    missing: list[str] = []
    tier_period = period_s
    if failure == "every_node":
        if cadence.mirror_every is None:
            missing.append("mirror_every not known: fewer than two uploads measured (pass --mirror-every)")
        tier_period = period_s * (cadence.mirror_every or 1)
    lag, lag_samples, lag_missing = _lag(failure, figs)
    missing += lag_missing
    known = lag is not None and not (failure == "every_node" and cadence.mirror_every is None)
    expected = tier_period / 2 + lag if known else None
    worst = tier_period + lag if known else None
    restore = figs[source]
    if restore is None:
        missing.append(not_measured(source))
    back = expected + restore.seconds + rates.restart_s if expected is not None and restore else None
    worst_back = worst + restore.seconds + rates.restart_s if worst is not None and restore else None
    mtbf = rates.mtbf(failure)
    return ClassRow(failure, what, tier, source, mtbf, tier_period, lag, lag_samples, expected, worst,
                    None if expected is None else expected / per_update, None if worst is None else worst / per_update,
                    restore.seconds if restore else None, restore.samples if restore else 0, back, worst_back,
                    back / mtbf if back is not None and mtbf else None, tuple(missing))


def sla(label: str, figs: Mapping[str, Figure | None], rates: Rates, cadence: Cadence) -> SLA:
    """Every failure class at ``cadence``, and the expected overhead (first order; module docstring)."""
    save = figs["save_local"]
    if save is None:
        raise InvalidArgument(f"no save_local measurement: nothing to compute an SLA from; {HOW['save_local']}")
    compute_s = cadence.updates_per_save * cadence.step_s
    period = compute_s + save.seconds
    rows = tuple(class_row(f, figs, rates, cadence, period) for f in CLASSES)
    covered = tuple(r.failure for r in rows if r.overhead is not None)
    left_out = tuple(r.failure for r in rows if r.mtbf_s is not None and r.overhead is None)
    share = save.seconds / compute_s
    total = share + sum(r.overhead for r in rows if r.overhead is not None) if covered else None
    return SLA(label, cadence.updates_per_save, cadence.mirror_every, period, share, rows, total, covered, left_out)


def recommended_cadence(found: Sequence[Interval], cadence: Cadence) -> Cadence | None:
    """The cadence the Daly intervals recommend (``None`` when no save interval could be computed); the remote's
    ``mirror_every`` recomputed against the recommended save period."""
    by_tier = {i.tier: i for i in found}
    saves, remote = by_tier["saves"], by_tier["remote"]
    if saves.daly_every is None:
        return None
    every = saves.daly_every
    mirror = cadence.mirror_every
    if remote.daly_s is not None:
        mirror = max(1, round(remote.daly_s / (every * cadence.step_s + saves.cost_s)))
    return Cadence(every, cadence.step_s, mirror, ("the Daly intervals above",))


def report(figs: Mapping[str, Figure | None], rates: Rates, cadence: Cadence) -> Report:
    """Intervals, the SLA at the run's cadence and at the recommended one, and notes on what bounds them."""
    if all(rates.mtbf(f) is None for f in CLASSES):
        raise InvalidArgument("no failure rate given: pass at least one of --process-mtbf, --node-mtbf, --all-mtbf "
                              "(mean seconds between failures of that class, from your fleet's history: a run "
                              "directory cannot measure them)")
    figs = dict(figs)
    found = intervals(figs, rates, cadence)
    as_run = sla("as run", figs, rates, cadence)
    better = recommended_cadence(found, cadence)
    notes = list(_gap_notes(figs["save_local"], cadence))
    compute = cadence.updates_per_save * cadence.step_s
    for kinds, which in ((("replicate",), "every save"), (("replicate", "upload"), "each save that uploads")):
        behind = sum(figs[k].seconds for k in kinds if figs[k] is not None)
        if behind > compute:
            notes.append(f"the writer thread's work after {which} ({' + '.join(kinds)}, {behind:.3g} s) exceeds the "
                         f"compute between saves ({compute:.3g} s): the next save waits for it, so saves block "
                         "longer than save_local says")
            break
    return Report(figs, cadence, rates, found, as_run, sla("recommended", figs, rates, better) if better else None,
                  tuple(notes))


def _gap_notes(save: Figure | None, cadence: Cadence) -> list[str]:
    """What the manifests' gap between saves says about the blocking save, at the given seconds per update."""
    if save is None or cadence.gap_s is None or cadence.gap_updates is None:
        return []
    implied = cadence.gap_s - cadence.gap_updates * cadence.step_s
    if implied < 0:
        return [f"{cadence.gap_updates} updates of {cadence.step_s:.3g} s take longer than the {cadence.gap_s:.3g} s "
                "the manifests put between saves: is the seconds per update right?"]
    if implied > 1.1 * save.seconds + 1e-3:
        return [f"the manifests put saves {cadence.gap_s:.3g} s apart every {cadence.gap_updates} updates: at "
                f"{cadence.step_s:.3g} s per update each save blocked about {implied:.3g} s, more than save_local's "
                f"{save.seconds:.3g} s; the figures above use save_local"]
    return []
