"""The multi-rank kill drill: ``torchrun`` launches SIGKILLed as a lost node would be, resumed, compared bitwise.

:func:`run_ranks_drill` runs :mod:`trainstate.drill.ranks_worker` once
uninterrupted (the reference) and once more under repeated SIGKILLs, each
launch restarted from the run directory until one exits 0, then compares the
two runs' final files tensor by tensor (:func:`compare_ranks`).

A kill takes down the whole launch at once (:func:`kill_launch`): torchrun
runs in its own session and starts every rank in a session of its own, so
the driver stops, then SIGKILLs, torchrun's process group and each rank's
(every process of a launch carries a marker in its environment, which is
how they are found, even after torchrun is gone). Where each kill aims is a
seeded plan (:func:`plan_rank_kills`): ``save`` waits for a ``saving`` line
and then a fraction of the reference's median save; ``time`` waits for a
``step`` line and then a fraction of an update; ``startup`` kills at a
fraction of the reference's start-up (imports, rendezvous, building the
model, restoring). After every kill every visible generation must verify in
full, ``latest`` must name one, no process of the launch may be left, and
the next launch must restore exactly the generation ``latest`` names.
"""
from __future__ import annotations

import math
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file

from ..storage.local import LocalStore
from .compare import Comparison, compare_values
from .driver import DrillReport, KillPlan, Start, Timing, _landed, check_visible, expected_restore
from .launch import _TIMEOUT, _Child, worker_env
from .ranks_worker import AGENT_ENV, FINAL_FILE, LAUNCH_ENV, RanksConfig, rank_file
from .worker import DrillError

KILL_MODES = ("save", "time", "startup")


def plan_rank_kills(rng: random.Random, kills: int) -> list[KillPlan]:
    """A reproducible schedule: at least one kill aimed at a save, and with three or more one of each mode."""
    modes = ["save"] + (["time", "startup"] if kills >= 3 else [])
    modes += rng.choices(KILL_MODES, weights=[5, 4, 2], k=max(0, kills - len(modes)))
    modes = modes[:kills]
    rng.shuffle(modes)
    # a save kill waits under 0.8 of the median save, so it lands inside one on a machine as busy as the reference's
    return [KillPlan(m, rng.uniform(0.0, 0.9), rng.uniform(0.0, 0.8 if m == "save" else 1.0)) for m in modes]


# launching and killing ------------------------------------------------------------------------------------
def torchrun_args(cfg: RanksConfig, directory: Path, ranks: int, forget: str | None = None) -> list[str]:
    """``--standalone`` rendezvous on a free port: launches (and other runs on the machine) never collide."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            "--monitor-interval", "1", "-m", "trainstate.drill.ranks_worker", "--dir", str(directory),
            *cfg.argv()] + (["--forget", forget] if forget else [])


# Runs first in the launched process, then becomes the command (same pid): the kernel SIGKILLs it when the
# driver dies, however abruptly (PR_SET_PDEATHSIG survives the exec), and the ranks learn its pid, so they die
# with it too (ranks_worker.die_with_parent). Without it a killed driver would leave a launch running.
_SHIM = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9); os.getppid() == int(sys.argv[1]) or os._exit(1); "
         f"os.environ['{AGENT_ENV}'] = str(os.getpid()); os.execv(sys.argv[2], sys.argv[2:])")


def dying_with_this_process(args: list[str]) -> list[str]:
    """``args`` (an absolute executable first) run so that they are SIGKILLed when this process dies."""
    return [sys.executable, "-S", "-c", _SHIM, str(os.getpid()), *args]


def marked_processes(marker: str, name: str = LAUNCH_ENV) -> list[int]:
    """Live processes whose environment carries ``name=marker`` (zombies excluded; not this process)."""
    needle = f"{name}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rpartition(b")")[2].split()[0] in (b"Z", b"X"):
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return found


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def kill_launch(proc: subprocess.Popen, marker: str, timeout_s: float = 120.0) -> int:
    """SIGKILL every process of one launch, as a node loss would; returns how many groups were killed.

    torchrun's group is stopped first, so it starts no rank meanwhile; then
    every group found is stopped (no rank runs on past the others) and
    killed, until no marked process is left. A process SIGKILLed inside
    fsync dies only when the disk answers: hence the generous timeout.
    """
    groups = {proc.pid} if proc.returncode is None else set()  # once reaped, its pid may be another's
    for pgid in groups:
        _signal_group(pgid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        for pid in marked_processes(marker):
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                continue
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pgid in groups:
                _signal_group(pgid, sig)
        time.sleep(0.01)
        if not marked_processes(marker):
            return len(groups)
        if time.monotonic() > deadline:
            raise DrillError(f"processes {marked_processes(marker)} of a killed launch are still alive "
                             f"after {timeout_s:.0f} s")


class _Torchrun:
    """Starts torchrun in a session of its own, every process of it marked in its environment."""

    def __init__(self, marker: str):
        self.marker = marker

    def start(self, args: list[str]) -> subprocess.Popen:
        env = dict(worker_env(), **{LAUNCH_ENV: self.marker})
        return subprocess.Popen(dying_with_this_process(args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, env=env, start_new_session=True)


class Launch(_Child):
    """One torchrun launch; its lines come from rank 0 (and any warning or traceback from the others)."""

    def __init__(self, args: list[str]):
        self.marker = secrets.token_hex(8)
        self.groups_killed = 0
        super().__init__(_Torchrun(self.marker), args)

    def kill(self) -> None:
        """The whole launch at once, whatever state it is in (also after it exited: stray ranks go too)."""
        self.groups_killed = max(self.groups_killed, kill_launch(self.proc, self.marker))


# the drill ------------------------------------------------------------------------------------------------
def run_ranks_reference(cfg: RanksConfig, directory: Path, *, ranks: int = 2, timeout_s: float = 600.0,
                        start: Callable[[], Launch] | None = None) -> Timing:
    """Train ``cfg`` in one uninterrupted launch into ``directory`` (which must be empty); its pace.

    ``start`` makes the launch (default: one torchrun of ``ranks`` ranks; :mod:`.nodes` passes several agents).
    """
    _require_empty(directory)
    launch = start() if start is not None else Launch(torchrun_args(cfg, directory, ranks))
    deadline = launch.spawned + timeout_s
    started = done = None
    saves: list[float] = []
    saving: dict[str, float] = {}
    try:
        while (line := launch.next_line(deadline)) not in (None, _TIMEOUT):
            word, _, rest = line.partition(" ")
            now = time.monotonic()
            if word == "training":
                started = now
            elif word == "saving":
                saving[rest] = now
            elif word == "saved" and rest in saving:
                saves.append(now - saving[rest])
            elif word == "done":
                done = now
    finally:
        launch.kill()
        code = launch.reap()
    if line is _TIMEOUT:
        raise DrillError(f"the reference launch did not finish in {timeout_s:.0f} s: {launch.tail()}")
    if code != 0 or started is None or done is None or not saves:
        raise DrillError(f"the reference launch failed (exit {code}): {failure(launch)}")
    return Timing(started - launch.spawned, (done - started) / cfg.total, sorted(saves)[len(saves) // 2],
                  done - launch.spawned)


def _require_empty(directory: Path) -> None:
    if directory.exists() and any(directory.iterdir()):
        raise DrillError(f"{directory} is not empty; the drill needs a fresh directory for each run")


class Layout(Protocol):
    """Where the launches of :func:`run_ranks_interrupted` run, and what is checked after each kill.

    Call order, per launch: 1. :meth:`start` (the launch, before it is
    driven); 2. :meth:`keep_log` once it was reaped; 3. after a kill only,
    :meth:`after_kill`, which records where it landed, adds the problems it
    finds and returns the generation the next launch must restore; 4.
    :meth:`describe`, the line logged for it.
    """

    def start(self, index: int) -> Launch: ...

    def keep_log(self, index: int, launch: Launch) -> None: ...

    def after_kill(self, start: Start, launch: Launch, report: DrillReport) -> str | None: ...

    def describe(self, start: Start, launch: Launch) -> str: ...


class OneNode:
    """The plain layout: one torchrun of ``ranks`` ranks on this host, ``directory`` its checkpoint directory."""

    def __init__(self, cfg: RanksConfig, directory: Path, ranks: int, forget: str | None):
        self.cfg, self.directory, self.ranks, self.forget = cfg, directory, ranks, forget
        self.store = LocalStore(directory)
        self.leftovers: set[str] = set()

    def start(self, index: int) -> Launch:
        self.leftovers = set(self.store.leftovers())
        return Launch(torchrun_args(self.cfg, self.directory, self.ranks, self.forget))

    def keep_log(self, index: int, launch: Launch) -> None:
        _keep_log(self.directory, index, launch)

    def after_kill(self, start: Start, launch: Launch, report: DrillReport) -> str | None:
        start.landed, start.during_save = _landed(launch.lines, self.store, self.leftovers)
        report.problems += check_visible(self.store)
        report.verified_after_kills += len(self.store.generations())
        return expected_restore(self.store)

    def describe(self, start: Start, launch: Launch) -> str:
        return describe_launch(start, launch)


def run_ranks_interrupted(cfg: RanksConfig, directory: Path, *, kills: int, seed: int, timing: Timing,
                          ranks: int = 2, plans: list[KillPlan] | None = None, forget: str | None = None,
                          log: Callable[[str], None] | None = None, launch_timeout_s: float = 600.0,
                          layout: Callable[[], Layout] | None = None) -> DrillReport:
    """Launch until a launch exits 0, SIGKILLing the first ``kills`` (``plans`` overrides the seeded schedule).

    ``layout`` makes the :class:`Layout` once ``directory`` is found empty (default: :class:`OneNode`).
    """
    _require_empty(directory)
    seeded = plans is None  # a seeded schedule resumes at least once (below); given plans are followed as given
    plans = plans if plans is not None else plan_rank_kills(random.Random(seed), kills)
    report = DrillReport(seed)
    where = layout() if layout is not None else OneNode(cfg, directory, ranks, forget)
    began = time.monotonic()
    expected: str | None = None  # what the next launch must restore
    for index in range(1, len(plans) + 4):
        start = Start(index, plans[index - 1] if index <= len(plans) else None)
        # The last kill, with nothing published yet (earlier kills all landed before the first save completed,
        # as on a loaded machine), aims after the first save so that the drill resumes at least once.
        after_save = seeded and index == len(plans) and expected is None
        if after_save and start.plan.mode == "startup":
            start.plan = replace(start.plan, mode="time")
        report.starts.append(start)
        launch = where.start(index)
        share = 1 / max(1, len(plans) - index + 1)  # each kill aims within its share of what is left
        try:
            start.killed_after_s = _drive(launch, start.plan, share, cfg, timing, launch_timeout_s, after_save)
        finally:
            launch.kill()
            start.exit_code = launch.reap()
        if start.exit_code == 0:
            start.killed_after_s = None  # it finished just before the kill was due
        report.problems += _check_restore(start, launch, expected)
        where.keep_log(index, launch)
        if start.killed_after_s is None:
            if start.exit_code != 0:
                report.problems.append(f"launch {index} failed with exit {start.exit_code}: {failure(launch)}")
            report.finished = start.exit_code == 0
            if log:
                log(where.describe(start, launch))
            break
        expected = where.after_kill(start, launch, report)
        if log:
            log(where.describe(start, launch))
    else:
        report.problems.append(f"the run did not finish after {len(report.starts)} launches")
    report.wall_s = time.monotonic() - began
    return report


def failure(launch: Launch) -> str:
    """A failed launch in a few lines: the ranks' own tracebacks (torchrun prefixes them ``[rank<r>]:``)."""
    traced = [line for line in launch.lines if line.startswith("[rank")]
    return " | ".join(traced[-12:]) if traced else launch.tail(12)


def _keep_log(directory: Path, index: int, launch: Launch) -> None:
    """Everything a launch printed, beside (not inside) the run directory, for a reader of a failure."""
    path = directory.parent / f"{directory.name}-launch-{index}.log"
    path.write_text("".join(line + "\n" for line in launch.lines))


def _drive(launch: Launch, plan: KillPlan | None, share: float, cfg: RanksConfig, timing: Timing,
           limit_s: float, after_save: bool = False) -> float | None:
    """Follow the launch and SIGKILL it when ``plan`` says; seconds after its start, or None if it exited.
    ``after_save``: the aim counts only lines after the launch's first ``saved`` line."""
    deadline = launch.spawned + limit_s
    kill_at = launch.spawned + plan.fraction * timing.startup_s if plan and plan.mode == "startup" else None
    target: tuple[str, int, float] | None = None  # (line, how many, unit of the delay)
    seen = 0
    while True:
        line = launch.next_line(min(deadline, kill_at) if kill_at is not None else deadline)
        now = time.monotonic()
        if line is _TIMEOUT:
            if kill_at is None or now < kill_at - 1e-4:
                raise DrillError(f"a launch did not finish within {limit_s:.0f} s: {launch.tail()}")
            if plan.mode == "save" and _missed_save(launch, cfg):
                kill_at, target = None, ("saving", 1, 0.0)  # re-aimed: at the very start of the next save
                seen = 0
                continue
            launch.kill()
            return now - launch.spawned
        if line is None:
            return None
        word, _, rest = line.partition(" ")
        if plan is None or kill_at is not None:
            continue
        if after_save:
            if word != "saved":
                continue
            after_save, word = False, "training"  # aims within what is left after the first save ("saved N")
        if word == "training":
            begin = int(rest)
            saves, updates = cfg.total // cfg.every - begin // cfg.every, cfg.total - begin
            if plan.mode == "save" and saves > 0:
                target = ("saving", 1 + int(plan.fraction * math.ceil(share * saves)), timing.save_s)
            elif updates > 0:  # "time", or a save kill with no save left to aim at
                target = ("step", 1 + int(plan.fraction * math.ceil(share * updates)), timing.per_update_s)
        elif target is not None and word == target[0]:
            seen += 1
        if target is not None and seen == target[1]:
            kill_at = now + plan.delay * target[2]


def _missed_save(launch: Launch, cfg: RanksConfig) -> bool:
    """A kill aimed inside a save is due, but that save has already ended and another is still to come.
    The driver aims from when it *reads* a ``saving`` line; on a loaded machine it reads it late, and a
    short save (an incremental one takes tens of milliseconds) can be over by then."""
    while (line := launch.next_line(time.monotonic())) is not None and line is not _TIMEOUT:
        pass  # everything the launch printed so far, so that a finished save is seen as finished
    saving = [int(line.split()[1]) for line in launch.lines if line.startswith("saving ")]
    saved = {int(line.split()[1]) for line in launch.lines if line.startswith("saved ")}
    return bool(saving) and saving[-1] in saved and saving[-1] + cfg.every <= cfg.total


def _check_restore(start: Start, launch: Launch, expected: str | None) -> list[str]:
    """The launch must restore exactly what ``latest`` named after the previous kill, as an identical continuation."""
    for line in launch.lines:
        word, _, rest = line.partition(" ")
        if word == "fresh":
            return [] if expected is None else [f"launch {start.index} started fresh; expected {expected}"]
        if word == "restored":
            name, *fields = rest.split()
            start.restored = name
            problems = [] if name == expected else [f"launch {start.index} restored {name}; expected {expected}"]
            if "identical=1" not in fields:
                problems.append(f"launch {start.index}: restore reports no identical continuation")
            return problems
    if start.killed_after_s is None:
        return [f"launch {start.index} never reported its restore: {launch.tail()}"]
    return []  # killed before its restore finished


_AIMED = {"save": "aimed inside a save", "time": "at a random moment of training",
          "startup": "at a random moment of start-up"}


def describe_launch(start: Start, launch: Launch, killed: str = "torchrun and every rank") -> str:
    """One line a newcomer can read: where this launch resumed from, and how it ended (``killed``: what a kill
    takes down)."""
    if start.restored:
        began = f"resumed from {start.restored}"
    elif any(line == "fresh" for line in launch.lines):
        began = "started fresh (nothing saved yet)"
    else:
        began = "was still starting up or restoring"
    if start.killed_after_s is None:
        return f"  launch {start.index}: {began}; ran to the end (exit {start.exit_code})"
    aimed = _AIMED.get(start.plan.mode, start.plan.mode) if start.plan else "at random"
    return (f"  launch {start.index}: {began}; SIGKILLed {start.killed_after_s:.2f} s after it started, {killed} "
            f"({launch.groups_killed} process groups; {aimed}), which landed {start.landed}")


# comparison -----------------------------------------------------------------------------------------------
def compare_ranks(reference: Path, candidate: Path, ranks: int) -> Comparison:
    """The final full state (rank 0's file) and every rank's streams, bitwise, reference first."""
    differences: list[str] = []
    counts = [0, 0]
    files = [FINAL_FILE] + [rank_file(r) for r in range(ranks)]
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    for name in files:
        missing = [str(d / name) for d in (reference, candidate) if not (d / name).is_file()]
        if missing:
            differences.append(f"{', '.join(missing)} missing: the run did not finish")
            continue
        ref, got = load_file(str(reference / name)), load_file(str(candidate / name))
        loaded[name] = ref
        for key in sorted(set(ref) ^ set(got)):
            differences.append(f"{name}: {key} only in the {'reference' if key in ref else 'interrupted run'}")
        for key in sorted(set(ref) & set(got)):
            compare_values(ref[key], got[key], f"{name}: {key}", differences, counts)
    return Comparison(differences, describe_ranks(loaded), counts[0], counts[1])


def describe_ranks(loaded: dict[str, dict[str, torch.Tensor]]) -> dict[str, str]:
    """What a comparison covered, part by part, in words."""
    final = loaded.get(FINAL_FILE, {})
    params = [k for k in final if k.startswith("model.")]
    moments = sorted({k.rsplit(".", 1)[1] for k in final if k.startswith("optim.")})
    out = {"model": f"{len(params)} parameters as full tensors ({sum(final[k].numel() for k in params):,} values)",
           "optimizer": f"{', '.join(moments)} of every parameter, gathered full",
           "scheduler": "last_epoch and learning rate; the update clock"}
    for name, tensors in loaded.items():
        if name != FINAL_FILE:
            out[name.split(".")[0]] = "next draws of its generator, its global torch RNG state, loader position " \
                                      "and next sample ids"
    return out


@dataclass
class RanksDrill:
    """The outcome of :func:`run_ranks_drill`."""

    timing: Timing
    report: DrillReport
    comparison: Comparison | None

    @property
    def ok(self) -> bool:
        r = self.report
        return r.finished and not r.problems and self.comparison is not None and self.comparison.equal

    def as_json(self) -> dict[str, Any]:
        r, c = self.report, self.comparison
        return {"ok": self.ok, "seed": r.seed, "launches": len(r.starts) + 1, "kills": r.kills,
                "kills_during_save": r.kills_during_save, "resumes": r.resumes,
                "verified_after_kills": r.verified_after_kills, "timing": asdict(self.timing),
                "interrupted_s": round(r.wall_s, 2),
                "starts": [{"restored": s.restored, "mode": s.plan.mode if s.plan else None,
                            "killed_after_s": s.killed_after_s, "landed": s.landed or None,
                            "during_save": s.during_save, "exit_code": s.exit_code} for s in r.starts],
                "problems": r.problems, "compared": c.compared if c else None,
                "differences": c.differences if c else None}


def run_ranks_drill(cfg: RanksConfig, root: Path, *, kills: int, seed: int, ranks: int = 2,
                    plans: list[KillPlan] | None = None, forget: str | None = None,
                    reference: tuple[Path, Timing] | None = None,
                    log: Callable[[str], None] | None = None) -> RanksDrill:
    """Reference into ``root/reference`` (or reuse ``reference``), interrupted into ``root/interrupted``, compare."""
    if reference is None:
        ref_dir = root / "reference"
        timing = run_ranks_reference(cfg, ref_dir, ranks=ranks)
        if log:
            log(f"reference: one launch ran uninterrupted in {timing.wall_s:.1f} s (start-up {timing.startup_s:.1f} s"
                f", a save taking {timing.save_s * 1000:.0f} ms, median)")
    else:
        ref_dir, timing = reference
    if log:
        log("interrupted run (each launch a new torchrun with fresh processes, restoring from disk):")
    report = run_ranks_interrupted(cfg, root / "interrupted", kills=kills, seed=seed, timing=timing, ranks=ranks,
                                   plans=plans, forget=forget, log=log)
    comparison = compare_ranks(ref_dir, root / "interrupted", ranks) if report.finished else None
    return RanksDrill(timing, report, comparison)
