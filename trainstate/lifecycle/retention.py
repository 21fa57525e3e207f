"""Which generations to keep, and why: pure planning, no I/O.

Only names the library writes (``gen-<12 digits>[-weights|-rNNN]``) are ever
considered; anything else in the directory is not even listed. Ordering is
by parsed update number, never lexical. Every generation gets a decision with
its reasons, so a dry run can show exactly what a prune would do.

A generation is kept when any rule keeps it:

- it is the newest verified generation of its kind (the recovery point, for full ones);
- it is newer than that (an interrupted or abandoned run: left for a human);
- it is one of the last ``keep_last`` ancestors of the newest (by the manifests'
  ``parent`` links; a full generation that is not an ancestor was skipped by
  restore or belongs to an abandoned timeline, and is never pruned automatically),
  a generation superseded by a later revision at its update (``gen-U-r001``:
  a later save at the same update with a different state) takes no slot of
  its own: it is kept while that revision is kept as the newest or one of the
  last ``keep_last``, and pruned with it;
- its update is a multiple of ``milestone_every``;
- it is pinned by name;
- it is the best by the policy's metric;
- it is the *fallback* of an incremental run: with ``keep_last >= 2``, the
  newest ancestor that shares no file with the newest (see
  :func:`trainstate.lifecycle.incremental.fallback`), so one damaged shared
  file always leaves a whole generation to restore, whatever ``full_every``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from ..format.manifest import generation_order, parse_generation_name
from ..errors import InvalidArgument


@dataclass(frozen=True)
class Retention:
    """What a run directory keeps.

    ``keep_last`` full generations along the newest one's lineage and
    ``keep_last_weights`` weights-only ones (default: the same number);
    full generations every ``milestone_every`` updates; pinned generations;
    and, with ``best=("val_loss", "min")``, the generation whose
    ``save(..., metrics=...)`` value is best. The best generation is an
    evaluation artifact: restore still resumes from the latest.
    """

    keep_last: int = 3
    keep_last_weights: int | None = None
    milestone_every: int | None = None
    best: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_last_weights", "milestone_every"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
        if self.keep_last is None:
            raise InvalidArgument("keep_last must be a positive int")
        if self.best is not None:
            if (not isinstance(self.best, tuple) or len(self.best) != 2 or type(self.best[0]) is not str
                    or self.best[1] not in ("min", "max")):
                raise InvalidArgument(f"best must be (metric_name, 'min' | 'max'), got {self.best!r}")

    def record(self) -> dict:
        """The policy as every full manifest records it (``retention``), so that a reopened run keeps it."""
        record = dataclasses.asdict(self)
        record["best"] = list(self.best) if self.best else None
        return record

    def keep_for(self, kind: str) -> int:
        """How many of the newest generations of ``kind`` (``"full"`` or ``"weights"``) are kept."""
        return self.keep_last if kind == "full" or self.keep_last_weights is None else self.keep_last_weights


@dataclass(frozen=True)
class Decision:
    generation: str
    keep: bool
    reasons: tuple[str, ...]
    left_for_a_human: bool = False  # kept only as another timeline's or an interrupted run's leftover


@dataclass(frozen=True)
class Plan:
    decisions: tuple[Decision, ...]  # newest first
    note: str = ""  # e.g. that the policy in force differs from the one the run recorded

    @property
    def keep(self) -> tuple[str, ...]:
        return tuple(d.generation for d in self.decisions if d.keep)

    @property
    def prune(self) -> tuple[str, ...]:
        return tuple(d.generation for d in self.decisions if not d.keep)

    def reasons(self, generation: str) -> tuple[str, ...]:
        return next(d.reasons for d in self.decisions if d.generation == generation)

    def describe(self) -> str:
        lines = [f"note: {self.note}"] if self.note else []
        return "\n".join(lines + [f"{'keep ' if d.keep else 'prune'}  {d.generation}  {'; '.join(d.reasons)}"
                                  for d in self.decisions])


def best_generation(metrics: Mapping[str, Mapping[str, float]], best: tuple[str, str] | None) -> str | None:
    """The generation with the best value of ``best[0]``; ties go to the newest."""
    if best is None:
        return None
    name, mode = best
    scored = [(v[name], generation_order(g), g) for g, v in metrics.items()
              if name in v and parse_generation_name(g) is not None]
    if not scored:
        return None
    sign = 1 if mode == "min" else -1
    return min(scored, key=lambda s: (sign * s[0], -s[1][0], -s[1][1]))[2]


def plan(names: Collection[str], *, policy: Retention, newest: Mapping[str, str | None],
         lineage: Collection[str] | None = None, pins: Mapping[str, str] | None = None,
         best: str | None = None, forks: Collection[int] = (), fallback: str | None = None) -> Plan:
    """Decide every library generation in ``names``.

    ``newest`` maps a kind (``"full"``, ``"weights"``) to the newest generation
    of that kind that has verified (``None``: nothing of that kind is pruned).
    ``lineage`` is the newest full generation and its ancestors; ``pins`` maps
    pin names to generations; ``best`` is the best generation by the metric;
    ``forks`` the updates where the newest's lineage left an older timeline; ``fallback`` the newest
    ancestor that shares no file with the newest (an incremental run; kept with ``keep_last >= 2``).
    """
    pinned: dict[str, list[str]] = {}
    for pin, generation in (pins or {}).items():
        pinned.setdefault(generation, []).append(pin)
    parsed = sorted(((p[0], p[1], generation_order(n)[1], n) for n in names if (p := parse_generation_name(n))),
                    reverse=True)
    superseded = superseded_by(names, newest.get("full"), lineage, forks)
    counted = {"full": 0, "weights": 0}
    recent: set[str] = set()  # kept as the newest or among the last keep_last: what superseded ones ride along with
    decisions = []
    for update, kind, revision, name in parsed:
        reasons = []
        leftover = False
        anchor = newest.get(kind)
        top = generation_order(anchor) if anchor else None
        if top is None:
            reasons.append(f"no verified newest {kind} generation to anchor a prune")
        elif name == anchor:
            reasons.append("newest: the recovery point" if kind == "full" else "newest weights-only")
        elif (update, revision) > top:
            reasons.append(f"newer than the newest verified {kind} generation (interrupted or abandoned run)")
            leftover = True
        elif kind == "full" and lineage is not None and name not in lineage:
            reasons.append("not an ancestor of the newest (skipped by restore, or an abandoned timeline)")
            leftover = True
        elif name in superseded:
            if superseded[name] in recent:  # no slot of its own: it goes when its update goes
                reasons.append(f"superseded by {superseded[name]}, kept while that is")
        elif counted[kind] < policy.keep_for(kind) - 1:
            reasons.append(f"last {policy.keep_for(kind)}")
        if name == anchor or (reasons and reasons[0].startswith("last ")):
            recent.add(name)
        if top is not None and name != anchor and (update, revision) < top and name not in superseded and (
                kind == "weights" or lineage is None or name in lineage):
            counted[kind] += 1
        if kind == "full" and policy.milestone_every and update % policy.milestone_every == 0 \
                and name not in superseded:
            reasons.append(f"milestone (every {policy.milestone_every} updates)")
        if name in pinned:
            reasons.append("pinned: " + ", ".join(sorted(pinned[name])))
        if name == best and policy.best:
            reasons.append(f"best {policy.best[0]} ({policy.best[1]})")
        if name == fallback and policy.keep_last >= 2 and name != anchor:
            reasons.append("fallback: shares no file with the newest (one damaged shared file leaves it whole)")
        why = (f"superseded by {superseded[name]} (a later save at the same update)",) if name in superseded \
            else (f"older than the last {policy.keep_for(kind)} {kind} generations",)
        decisions.append(Decision(name, bool(reasons), tuple(reasons) or why, leftover and len(reasons) == 1))
    return Plan(tuple(decisions))


def superseded_by(names: Collection[str], anchor: str | None, lineage: Collection[str] | None,
                  forks: Collection[int] = ()) -> dict[str, str]:
    """Full generations that a later revision at the same update supersedes, each with the newest such revision.

    Only a revision at or below ``anchor`` (the recovery point) that lies on its
    lineage supersedes: one above it is an interrupted save, never published.
    At an update where the lineage forked (``forks``: a resume from an older
    generation) the record cannot tell which revision the fork left from, so
    none is superseded there.
    """
    if anchor is None or parse_generation_name(anchor) is None:
        return {}
    top = generation_order(anchor)
    heads: dict[int, tuple[int, str]] = {}
    for name in names:
        parsed = parse_generation_name(name)
        if parsed is None or parsed[1] != "full":
            continue
        order = generation_order(name)
        if order <= top and order[0] not in forks and (name == anchor or lineage is None or name in lineage):
            heads[order[0]] = max(heads.get(order[0], (-1, "")), (order[1], name))
    out = {}
    for name in names:
        parsed = parse_generation_name(name)
        if parsed is not None and parsed[1] == "full" and parsed[0] in heads:
            head = heads[parsed[0]][1]
            if generation_order(name)[1] < heads[parsed[0]][0]:
                out[name] = head
    return out
