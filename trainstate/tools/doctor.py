"""``ts.doctor(run, factory, step)``: why a resume drifts, found by measuring one update in fresh processes.

A faithful resume makes update k depend only on what the generation holds.
The doctor tests exactly that. It runs update k in three fresh processes
(:mod:`trainstate.tools.doctorrun`), each built by your factory and driven by
your step:

- ``resumed``: restores the newest full generation (update k) and runs update k;
- ``repeat``: the same again, in another process: if the two differ, the update
  is not reproducible from its inputs (a nondeterministic kernel, a draw from
  an unseeded source), and every other comparison inherits that;
- ``reference``: reaches update k *without a restart* and runs it: by default
  a replay from the factory's fresh state (update 0), or from an earlier
  generation (``replay_from``: that replay itself starts with a restart, so it
  is exact only where the run restarted there too); with ``against``, it
  restores the uninterrupted run's generation of the same update instead.

Each process records, in causal order, what update k saw and did; the first
stage where ``resumed`` and ``reference`` differ is the verdict:

1. ``contract``: the experiment contract and history (``ts.diff``'s first category);
2. ``state``: the state before the update (parameters, optimizer, scheduler, clocks, RNG, data position);
3. ``batch``: each batch the loaders handed out (sample ids and bytes), each registered module's first input;
4. ``rng``: the first draws of every RNG stream (global and named), drawn from copies;
5. ``lr``: the LR each param group used at ``optimizer.step()``, and the LR it holds after the update;
6. ``loss``; 7. ``grads`` (at ``optimizer.step()``); 8. ``updated``: the state after the update.

Each process also notes which RNG streams its update drew from (each stream's state just before and
just after the step). A stream that neither compared process drew from cannot explain a drift, whatever it
holds (a factory that seeds torch but not ``random`` leaves Python's stream to OS entropy in a replay): its
differences, in the state and the first draws alike, are set apart in ``DoctorReport.unused`` and decide
nothing. A stream that one of them drew from is compared as everything else is.

The roles are run, and their records read, by :mod:`trainstate.tools.doctorroles`: fresh processes, or,
for a multi-rank job (``launch=``), its own command once per role, recorded on every rank by the job's
checkpointer (:mod:`trainstate.tools.doctorjob`). This module compares them (pure) and gives the verdict.

Tensors are compared by their bits (``-0.0`` differs from ``0.0``), and each
difference is reported as measured: how many elements, the first index, the
largest absolute and relative difference. The diagnosis names what the first
differing stage points to; it never infers a cause from the size of a difference.

    report = ts.doctor("runs/exp1", "train:build_state", "train:one_update")
    if not report.identical:
        print(report.first, report.diagnosis)
"""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidArgument
from . import doctorroles as roles
from .diff import Category, DiffReport, Entry, _finite, diff
from .diffread import TensorDiff, _Accumulator
from .doctorroles import Record

STAGES = ("contract", "state", "batch", "rng", "lr", "loss", "grads", "updated")
_TITLES = {"contract": "contract and history", "state": "state before the update",
           "batch": "next batch (sample ids and bytes) and model inputs", "rng": "first draws of every RNG stream",
           "lr": "LR of each param group (used, and after the update)", "loss": "loss",
           "grads": "gradients at optimizer.step()", "updated": "state after the update"}


@dataclass(frozen=True)
class DoctorReport:
    """Update ``update`` as the ``resumed`` process ran it, compared stage by stage with the ``reference``.

    ``first`` is the earliest differing stage (``None``: no difference). When
    ``reproducible`` is False, two fresh restores of the same generation
    already differ, and ``first`` is the first stage of *that* comparison
    (``repeat``); ``stages`` still holds the comparison with the reference.
    ``reproducible`` is ``None`` when that check was not run (``repeat=False``).
    ``notes`` holds the warnings each process raised, by role (a restore's
    ``ContinuationWarning`` among them). ``unused``: per RNG stream that differs
    but that no compared process's update drew from, its differences (paths
    ``stage/...``; ``repeat:stage/...`` between the two fresh restores); no
    stage holds them and they decide nothing. ``drawn``: per role, the
    streams its update drew from.
    """

    run: str
    generation: str
    update: int
    reference: str
    identical: bool
    first: str | None
    reproducible: bool | None
    diagnosis: str
    stages: list[Category]
    repeat: list[Category]
    notes: dict[str, list[str]] = field(default_factory=dict)
    unused: dict[str, list[Entry]] = field(default_factory=dict)
    drawn: dict[str, list[str]] = field(default_factory=dict)

    def stage(self, name: str) -> Category:
        """The stage called ``name`` (``"batch"``, ``"lr"``, ``"loss"``, ...); ``StopIteration`` if none."""
        return next(c for c in self.stages if c.name == name)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (a NaN difference becomes the string ``"nan"``)."""
        return _finite(asdict(self))


# comparison (pure) ----------------------------------------------------------------------------------------
def tensor_diff(a: torch.Tensor, b: torch.Tensor) -> TensorDiff:
    """Bitwise comparison of two in-memory tensors, with the same measures as ``ts.diff``."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return TensorDiff(a.numel(), 0, mismatch=f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
    ca, cb = (t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in (a, b))
    acc = _Accumulator(a.dtype, a.element_size())
    if ca != cb:
        acc.add(ca, cb, 0)
    return TensorDiff(a.numel(), acc.differing, acc.first, acc.max_abs, acc.max_rel)


def _message(a: torch.Tensor, b: torch.Tensor, got: TensorDiff) -> str:
    if got.mismatch:
        return f"dtype/shape differ: {got.mismatch}"
    text = f"{got.differing} of {got.elements} elements differ (first at flat index {got.first_index})"
    if got.max_abs is not None:
        text += f", max abs diff {got.max_abs:.6g}, max rel {got.max_rel:.6g}"
    if got.elements <= 8:
        text += f": {a.reshape(-1).tolist()} vs {b.reshape(-1).tolist()}"
    return text


def compare_records(a: Record, b: Record, stage: str) -> Category:
    """One observation stage (``batch``, ``rng``, ``lr``, ``loss`` or ``grads``) of two processes."""
    prefix = stage + "/"
    names = [n for n in a.tensors if n.startswith(prefix)] + [n for n in b.tensors if n.startswith(prefix)
                                                              and n not in a.tensors]
    entries, count = [], 0
    for name in names:
        path = name[len(prefix):]
        if name not in a.tensors or name not in b.tensors:
            entries.append(Entry(path, f"recorded by the {a.role if name in a.tensors else b.role} process only"))
            continue
        count += 1
        got = tensor_diff(a.tensors[name], b.tensors[name])
        if got.mismatch or got.differing:
            entries.append(Entry(path, _message(a.tensors[name], b.tensors[name], got), got))
    for name in [n for n in a.values if n.startswith(prefix)] + [n for n in b.values if n.startswith(prefix)
                                                                 and n not in a.values]:
        left, right = a.values.get(name, "(absent)"), b.values.get(name, "(absent)")
        if left != right:
            entries.append(Entry(name[len(prefix):], f"{left[:80]} vs {right[:80]}"))
    return Category(stage, _summary(stage, entries, count), entries, count)


def from_diff(stage: str, categories: list[Category]) -> Category:
    """``ts.diff`` categories folded into one doctor stage (their causal order kept)."""
    entries = [e for c in categories for e in c.entries]
    count = sum(c.tensors for c in categories)
    summary = _summary(stage, entries, count)
    where = next((c.name for c in categories if c.entries), None)
    if where is not None and stage != "contract":
        summary = summary.replace("DIFFERENT: ", f"DIFFERENT, first in {where}: ", 1)
    return Category(stage, summary, entries, count)


def _summary(stage: str, entries: list[Entry], tensors: int) -> str:
    title = _TITLES[stage]
    if not entries:
        return f"{title}: identical ({tensors} tensors bitwise equal)" if tensors else f"{title}: identical"
    head = entries[0]
    more = f" (and {len(entries) - 1} more)" if len(entries) > 1 else ""
    return f"{title}: DIFFERENT: {head.path}: {head.message}{more}"


def first_stage(stages: list[Category]) -> str | None:
    return next((c.name for c in stages if c.entries), None)


_POINTS_TO = {
    "contract": "the two processes built different experiments (config, classes, architecture, data plan): the "
                "factory does not build what wrote the generation, or the two runs were not the same experiment",
    "state": "the replay did not reach the state the generation holds at this update: the run that wrote the "
             "generation had already drifted before it (an earlier resume lost state: replay from where it "
             "resumed, with --from), or the factory and step do not reproduce the run (unseeded construction, "
             "other data)",
    "state-against": "the two runs already differ before this update: the drift started earlier; diagnose an "
                     "earlier generation of the resumed run (RUN@UPDATE), the first after its restart",
    "rng": "the state before the update is identical, yet a stream's next draws differ: that stream is not in the "
           "checkpoint (the run has capture_global_rngs=False, or a generator is not passed in rngs=)",
    "lr": "a learning-rate schedule keeps state outside the TrainState: an LR scheduler (or code that sets "
          "param_groups' lr) that is not registered restarts on resume. Register it: TrainState(scheduler=...)",
    "loss": "batch, RNG streams and LR are identical, yet the loss differs: the forward pass depends on something "
            "not restored (a generator not in rngs=, module state kept in a plain attribute rather than a buffer, "
            "a cache) or on a nondeterministic kernel",
    "grads": "the loss is identical, the gradients are not: backward depends on state that is not restored (hooks "
             "with state) or on a nondeterministic kernel (torch.use_deterministic_algorithms(True) names it)",
    "updated": "batch, LR and gradients are identical, the state after the update is not: the optimizer or another "
               "component steps with state its state_dict does not hold, or a component that changes the update "
               "(EMA, gradient clipping with memory) is not registered",
}


def _batch_points_to(category: Category) -> str:
    ids = [e for e in category.entries if e.path.endswith("/ids")]
    if ids:
        return ("the next batch holds other samples (its sample ids differ): the data position or order is not "
                "restored (a loader or sampler outside the TrainState, or a changed pipeline)")
    loaders = [e for e in category.entries if not e.path.startswith("input.")]
    if loaders:
        return ("the same samples arrive with other bytes: per-sample randomness depends on the process's history, "
                "as a draw from a DataLoader worker's global RNG (random, numpy.random, torch.rand in __getitem__) "
                "does: workers start fresh at a restore, mid-stream, and no checkpoint holds their RNG. Draw it "
                "from ts.sample_generator(index)")
    return ("the model's input differs (no ResumableLoader shows where the batch came from): the data pipeline "
            "outside the TrainState does not resume (position, order, or augmentation randomness)")


def diagnose(stages: list[Category], repeat: list[Category] | None, against: bool = False,
             unused: Iterable[str] = ()) -> tuple[str | None, bool | None, str]:
    """``(first, reproducible, diagnosis)`` from the two comparisons (see :class:`DoctorReport`); ``repeat``
    is ``None`` when no second fresh restore ran; ``against``: the reference is another run's generation;
    ``unused``: streams that differ but no update drew from (named, never the verdict)."""
    first, reproducible, text = _verdict(stages, repeat, against)
    unused = sorted(unused)
    if not unused:
        return first, reproducible, text
    names = ", ".join(unused)
    if first is None and reproducible is not False:
        return first, reproducible, (
            "no difference in anything the update used: it saw and did exactly what the uninterrupted one did, "
            f"bit for bit. RNG streams it never drew from differ ({names}), which cannot explain a drift: set apart")
    return first, reproducible, f"{text}. Set apart, as no update drew from them: {names}"


def _verdict(stages: list[Category], repeat: list[Category] | None, against: bool
             ) -> tuple[str | None, bool | None, str]:
    """The verdict from the stages alone (what :func:`diagnose` returns when no stream was set apart)."""
    checked = repeat is not None
    again = first_stage(repeat) if checked else None
    if again is not None:
        head = next(c for c in repeat if c.name == again).entries[0]
        return again, False, (
            f"not reproducible: the same generation restored into two fresh processes already differs at {again} "
            f"({head.path}: {head.message}). The update does not follow from its inputs: a nondeterministic kernel, "
            "a draw from an unseeded source (OS entropy, time), or a dependence on thread count or timing. Fix "
            "that first; every comparison with the reference inherits it")
    first, reproducible = first_stage(stages), True if checked else None
    if first is None:
        return None, reproducible, ("no difference: the resumed update saw and did exactly what the uninterrupted "
                                    "one did, bit for bit, at every stage")
    category = next(c for c in stages if c.name == first)
    head = category.entries[0]
    hint = _batch_points_to(category) if first == "batch" else _POINTS_TO[
        "state-against" if against and first == "state" else first]
    if first == "lr":
        when = sorted({e.path.rsplit("/", 1)[-1] for e in category.entries})
        hint = f"the LR differs ({' and '.join(when)} the update): {hint}"
    return first, reproducible, f"first difference: {first} ({head.path}: {head.message}). Points to: {hint}"


def unused_streams(a: Record, b: Record) -> set[str]:
    """The RNG streams neither process's update drew from (one a process did not judge counts as drawn)."""
    return {n for n in set(a.streams) | set(b.streams) if a.streams.get(n) is False and b.streams.get(n) is False}


def stream_of(stage: str, path: str, streams: Iterable[str]) -> str | None:
    """Which of ``streams`` an RNG entry belongs to. ``state``/``updated`` paths are ``ts.diff``'s
    (``rng.python``, ``rng.numpy_global.state.key``), ``rng`` paths the draws' (``python``, ``torch_cuda.0``)."""
    if stage == "rng":
        path = "rng." + ("torch_cuda" if path.startswith("torch_cuda.") else path)
    for name in sorted(streams, key=len, reverse=True):  # longest first: rng.named.a.b is not rng.named.a
        if path == name or path.startswith((name + ".", name + "[", name + " ")):
            return name
    return None


def set_apart(stage: str, category: Category, unused: set[str], apart: dict[str, list[Entry]]) -> Category:
    """``category`` without the entries of ``unused`` streams, which go to ``apart`` (path ``stage/...``)."""
    keep, tensors = [], category.tensors
    for e in category.entries:
        name = stream_of(stage, e.path, unused)
        if name is None:
            keep.append(e)
        else:
            apart.setdefault(name, []).append(Entry(f"{stage}/{e.path}", e.message, e.tensor))
            tensors -= e.tensor is not None
    summary = _summary(stage, keep, tensors) if stage == category.name else category.summary
    return Category(category.name, summary, keep, tensors)  # counts only what it still compares


def compare(a: Record, b: Record) -> tuple[list[Category], dict[str, list[Entry]]]:
    """Every stage of two processes' records, in causal order; and apart, the differences of the RNG streams
    neither update drew from (only ``ts.diff``'s ``rng`` category and the draws can hold them)."""
    unused, apart = unused_streams(a, b), {}
    before, after = diff(a.before, b.before), diff(a.after, b.after)

    def folded(stage: str, report: DiffReport) -> Category:
        return from_diff(stage, [set_apart(stage, c, unused, apart) if c.name == "rng" else c
                                 for c in report.categories if c.name != "contract"])

    out = [from_diff("contract", [before.category("contract")]), folded("state", before),
           compare_records(a, b, "batch"), set_apart("rng", compare_records(a, b, "rng"), unused, apart)]
    out += [compare_records(a, b, s) for s in ("lr", "loss", "grads")]
    out.append(folded("updated", after))
    return [_marked(c, apart) for c in out], apart


def _marked(stage: Category, apart: dict[str, list[Entry]]) -> Category:
    """A stage whose summary says which unused streams were set apart from it (its "identical" is then
    about everything else)."""
    names = [n for n, entries in apart.items() if any(e.path.startswith(stage.name + "/") for e in entries)]
    if not names:
        return stage
    summary = f"{stage.summary} [set apart, never drawn from by the update: {', '.join(sorted(names))}]"
    return Category(stage.name, summary, stage.entries, stage.tensors)


def doctor(run: str | Path, factory: str | None = None, step: str | None = None, *, launch: str | list[str] | None = None,
           against: str | Path | None = None, replay_from: str | int = "start", repeat: bool = True,
           timeout_s: float | None = None) -> DoctorReport:
    """Run update k of ``run``'s newest full generation in fresh processes and find the first stage that differs.

    ``factory`` and ``step`` are ``"module:function"``: the factory returns a
    fresh :class:`~trainstate.TrainState`, the step runs one update on it
    (it takes the next batch itself; ``next_update`` is advanced for it when
    it does not). ``against``: another run directory whose generation of the
    same update is the reference, instead of a replay. ``replay_from``:
    ``"start"`` (the factory's fresh state, update 0) or an earlier full
    generation of ``run`` (its update or name). ``repeat=False`` skips the
    second fresh restore (one process fewer; ``reproducible`` is then
    ``None``). See the module docstring.

    ``launch``, instead of ``factory`` and ``step``: a multi-rank job's own
    command (``torchrun ...``, a string split as a shell would, or a list),
    run once per role with ``TRAINSTATE_DOCTOR`` set; the job's trainstate
    checkpointer does the recording on every rank
    (:mod:`trainstate.tools.doctorjob`; torchtitan's
    :class:`~trainstate.integrations.torchtitan.TrainStateCheckpointer`).
    Every observation is compared rank by rank.
    """
    if launch is not None:
        if factory is not None or step is not None:
            raise InvalidArgument("give either launch (a multi-rank job's command) or factory and step, not both")
        if not (shlex.split(launch) if isinstance(launch, str) else list(launch)):
            raise InvalidArgument("launch is empty: give the job's command, e.g. 'torchrun --nproc-per-node 2 ...'")
    for what, spec in () if launch is not None else (("factory", factory), ("step", step)):
        module, sep, attr = str(spec).partition(":")
        if not (module and sep and attr):
            raise InvalidArgument(f"{what} {spec!r} must look like 'module:function' (importable from the working "
                                  "directory)")
    with tempfile.TemporaryDirectory(prefix="trainstate-doctor-") as tmp:
        work = Path(tmp)
        jobs, generation, update, described = roles.jobs(str(run), factory, step, None if against is None else str(against),
                                                    replay_from, repeat, work)
        if launch is None:
            roles.run_children(jobs, work, timeout_s)
            records = [roles.read(j) for j in jobs]
        else:
            roles.launch_roles(jobs, work, launch, timeout_s)
            records = [roles.read_launched(j) for j in jobs]
        resumed, reference = records[0], records[-1]
        stages, unused = compare(resumed, reference)
        again, unused_again = compare(resumed, records[1]) if repeat else (None, {})
    for name, entries in unused_again.items():
        unused.setdefault(name, []).extend(Entry(f"repeat:{e.path}", e.message, e.tensor) for e in entries)
    first, reproducible, diagnosis = diagnose(stages, again, against is not None, unused)
    notes = {r.role: r.notes for r in records if r.notes}
    drawn = {r.role: sorted(n for n, moved in r.streams.items() if moved) for r in records}
    return DoctorReport(str(run), generation, update, described, first is None and reproducible is not False, first,
                        reproducible, diagnosis, stages, again or [], notes, unused=dict(sorted(unused.items())),
                        drawn=drawn)


def render(report: DoctorReport) -> str:
    """The human-readable form: the verdict, one line per stage, each difference, and the processes' warnings."""
    lines = [f"run: {report.run}", f"update {report.update}: resumed from {report.generation}, compared with "
             f"{report.reference}", report.diagnosis]
    for c in report.stages:
        lines.append(f"  {c.summary}")
        lines += [f"    {e.path}: {e.message}" for e in c.entries[:20]]
        if len(c.entries) > 20:
            lines.append(f"    ... and {len(c.entries) - 20} more")
    if report.unused:
        lines.append(f"unused streams differ (cannot explain drift): {', '.join(report.unused)}")
        lines += [f"    {e.path}: {e.message}" for entries in report.unused.values() for e in entries[:4]]
    if report.drawn:
        drawn = {", ".join(names) or "none" for names in report.drawn.values()}
        lines += [f"RNG streams the update drew from: {drawn.pop()}"] if len(drawn) == 1 else [
            f"RNG streams the {role}'s update drew from: {', '.join(names) or 'none'}"
            for role, names in report.drawn.items()]
    if report.reproducible is False:
        lines.append("two fresh restores of the same generation:")
        lines += [f"  {c.summary}" for c in report.repeat if c.entries]
    for role, notes in report.notes.items():
        lines += [f"warning in the {role} process: {n}" for n in notes]
    return "\n".join(lines)
