"""The parent side: one uninterrupted reference run, one run SIGKILLed again and again,
and the checks made after every kill.
"""
from __future__ import annotations

import math
import os
import random
import shutil
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from ..errors import CorruptGeneration, TrainStateError
from ..storage.base import Store
from ..storage.local import LocalStore
from ..storage.locate import open_store
from ..format.manifest import POINTER, generation_name, generation_order, parse_generation_name, parse_pointer
from ..storage.verify import verify_generation
from .worker import IDS_LOG, LOADER_LOG, DrillConfig, DrillError, mirror_options
from .launch import Spawner, _Child, _Pool, _TIMEOUT, processes_holding, wait_for_exit, worker_args


# parent: the drill -------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """The reference run's pace, used to place kills inside the interrupted run."""

    startup_s: float  # spawn to ready: interpreter, imports, building the state
    per_update_s: float  # training and saving, per update
    save_s: float  # median duration of one save
    wall_s: float
    upload_s: float = 0.0  # with a mirror: median time from "saved <n>" to "uploaded <n>"


@dataclass(frozen=True)
class KillPlan:
    """When to SIGKILL one worker start.

    ``save``: after a ``saving`` line (which one: ``fraction`` of the saves
    still ahead, never the last), wait ``delay`` times the reference's median
    save duration, so kills reach every phase of a save on a slow disk or a
    fast one; with one save left, as ``time``. ``time``:
    after a ``step`` line (which one: ``fraction`` of the updates still ahead),
    wait ``delay`` times the reference's time per update, which lands anywhere
    in training or saving but never after the end, however fast the worker
    runs. ``restore``: ``fraction`` of RESTORE_WINDOW_S after go. ``upload``
    (with a mirror): after a ``saved`` line, chosen as for ``save``, wait
    ``delay`` times the reference's median upload, while the upload of that
    generation runs in the background.
    """

    mode: str
    fraction: float
    delay: float = 0.0


RESTORE_WINDOW_S = 0.15


def plan_kills(rng: random.Random, kills: int, *, upload: bool = False) -> list[KillPlan]:
    """A reproducible schedule: mostly kills aimed at saves and at random times, at least one per save.

    With ``upload`` (a mirrored run) most kills aim at background uploads instead, at least one.
    """
    modes, weights = (["save", "time", "restore", "upload"], [2, 2, 1, 5]) if upload else (
        ["save", "time", "restore"], [5, 4, 1])
    plans = []
    for _ in range(kills):
        mode = rng.choices(modes, weights=weights)[0]
        plans.append(KillPlan(mode, rng.uniform(0.0, 0.9), rng.random()))
    must = "upload" if upload else "save"
    if kills and not any(p.mode == must for p in plans):
        plans[rng.randrange(kills)] = KillPlan(must, rng.uniform(0.0, 0.9), rng.random())
    return plans


@dataclass
class Start:
    """One worker start of the interrupted run."""

    index: int
    plan: KillPlan | None
    restored: str | None = None  # the generation it restored; None if fresh or killed first
    killed_after_s: float | None = None  # seconds after go
    landed: str = ""  # where the kill landed
    during_save: bool = False
    during_upload: bool = False  # with a mirror: an upload was queued or running (or the remote being pruned)
    lost_local: str | None = None  # with lose_local_after: the newest local generation deleted after this kill
    exit_code: int | None = None
    loader_orphans: int = 0  # with a loader: its DataLoader workers still alive right after the kill


@dataclass
class DrillReport:
    seed: int
    starts: list[Start] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    finished: bool = False
    verified_after_kills: int = 0  # generation verifications done after kills
    remote_verified_after_kills: int = 0  # with a mirror: remote generations verified in full after kills
    wall_s: float = 0.0
    ids_log: str | None = None  # with a loader: its consumed-ids log, held open by its processes
    loader_workers: int = 0  # with a loader: DataLoader worker processes started (recorded in LOADER_LOG)

    @property
    def kills(self) -> int:
        return sum(s.killed_after_s is not None for s in self.starts)

    @property
    def kills_during_save(self) -> int:
        return sum(s.during_save for s in self.starts)

    @property
    def kills_during_upload(self) -> int:
        return sum(s.during_upload for s in self.starts)

    @property
    def resumes(self) -> int:
        return sum(s.restored is not None for s in self.starts)

    @property
    def loader_orphans(self) -> int:
        return sum(s.loader_orphans for s in self.starts)


def run_reference(cfg: DrillConfig, directory: Path, *, launcher: Spawner | None = None,
                  timeout_s: float = 300.0) -> Timing:
    """Train ``cfg`` uninterrupted in ``directory`` (which must be empty)."""
    _require_empty(directory)
    child = _Child(launcher or Spawner(), worker_args(cfg, directory))
    try:
        deadline = time.monotonic() + timeout_s
        child.wait_ready(deadline)
        ready = child.go()
        started = done = None
        saves: list[float] = []
        uploads: list[float] = []
        saving: dict[str, float] = {}  # by update: with --async-save, "saved" may follow a later "saving"
        saved: dict[str, float] = {}
        while (line := child.next_line(deadline)) not in (None, _TIMEOUT):
            word, _, rest = line.partition(" ")
            now = time.monotonic()
            if word == "training":
                started = now
            elif word == "saving":
                saving[rest] = now
            elif word == "saved":
                saves.append(now - saving[rest])
                saved[rest] = now
            elif word == "uploaded" and rest in saved:  # (the uploader skips to the newest when behind)
                uploads.append(now - saved[rest])
            elif word == "done":
                done = now
        if line is _TIMEOUT:
            raise DrillError(f"reference run did not finish in {timeout_s:.0f} s: {child.tail()}")
    finally:
        child.kill()
        code = child.reap()
    if code != 0 or started is None or done is None or not saves or (cfg.mirror and not uploads):
        raise DrillError(f"reference run failed (exit {code}): {child.tail()}")
    return Timing(ready - child.spawned, (done - started) / cfg.total, sorted(saves)[len(saves) // 2],
                  done - child.spawned, sorted(uploads)[len(uploads) // 2] if uploads else 0.0)


def _require_empty(directory: Path) -> None:
    if directory.exists() and any(directory.iterdir()):
        raise DrillError(f"{directory} is not empty; the drill needs a fresh directory for each run")


def run_interrupted(cfg: DrillConfig, directory: Path, *, kills: int, seed: int,
                    timing: Timing | Callable[[], Timing], plans: list[KillPlan] | None = None,
                    forget: str | None = None, launcher: Spawner | None = None, spares: int = 1,
                    log: Callable[[str], None] | None = None, start_timeout_s: float = 300.0,
                    stray_timeout_s: float | None = None, lose_local_after: Collection[int] = ()) -> DrillReport:
    """Start the worker until it finishes on its own, SIGKILLing the first ``kills`` starts.

    ``timing`` may be a callable (say, one that runs the reference): it is
    called after the first workers have been spawned, so their start-up
    overlaps it. With a loader, ``stray_timeout_s`` waits that long at the
    end for every DataLoader worker of the run to be gone (torch's workers
    notice a dead parent within about 5 s) and reports any left as a problem;
    without it, ``report.ids_log`` lets the caller check later
    (:func:`~trainstate.drill.launch.wait_for_exit`).

    With ``cfg.mirror`` every kill is also followed by the remote's check
    (every remote generation and the one its ``latest`` names verify in
    full), and the finished run's final generation must be the remote
    ``latest``. ``lose_local_after`` (kill numbers, from 1): after those
    kills the local directory is deleted, as with a lost instance; the next
    start must restore the newest remote generation.
    """
    _require_empty(directory)
    if lose_local_after and (cfg.mirror is None or cfg.loader_workers is not None):
        raise DrillError("lose_local_after needs a mirror (cfg.mirror), and no loader (its log is local)")
    plans = plans if plans is not None else plan_kills(random.Random(seed), kills, upload=cfg.mirror is not None)
    report = DrillReport(seed)
    store = LocalStore(directory)
    remote = None if cfg.mirror is None else open_store(cfg.mirror, storage_options=mirror_options())
    report.ids_log = None if cfg.loader_workers is None else os.path.realpath(directory / IDS_LOG)
    pool = _Pool(launcher or Spawner(), worker_args(cfg, directory, forget), spares, starts=len(plans) + 1)
    try:
        timing = timing() if callable(timing) else timing
        began = time.monotonic()
        expected: str | None = None  # what the next start must restore
        pulls = False  # the next restore copies `expected` from the remote first (the local directory is behind)
        for index in range(1, len(plans) + 4):
            start = Start(index, plans[index - 1] if index <= len(plans) else None)
            report.starts.append(start)
            child = pool.take(start_timeout_s, more=max(0, len(plans) + 1 - index))
            leftovers, pointer = set(store.leftovers()), expected if pulls else _pointer_name(store)
            remote_leftovers = set(remote.leftovers()) if remote is not None else set()
            share = 1 / max(1, len(plans) - index + 1)  # each kill aims within its share of what is left
            _run_start(child, start, share, cfg, timing, start_timeout_s)
            report.problems += _check_restore(start, child, expected, pointer)
            if start.killed_after_s is None:
                if start.exit_code != 0:
                    report.problems.append(f"start {index} failed with exit {start.exit_code}: {child.tail()}")
                report.finished = start.exit_code == 0
                if remote is not None and report.finished:
                    report.problems += check_remote(remote, generation_name(cfg.total))
                break
            expected = _after_kill(start, child, store, leftovers, report)
            if remote is not None:
                _after_kill_remote(start, child, remote, remote_leftovers, report)
                if index in lose_local_after:  # the instance is lost: a fresh, empty local directory
                    start.lost_local = next(iter(_full(store)), "nothing")
                    shutil.rmtree(directory)
                    store, expected = LocalStore(directory), None
                expected, pulls = _expected_pull(store, remote, expected)
            if log:
                log(_describe_start(start))
        else:
            report.problems.append(f"the worker did not finish after {len(report.starts)} starts")
    finally:
        pool.close()
    report.wall_s = time.monotonic() - began
    if report.ids_log is not None:
        report.loader_workers = _count_loader_workers(directory / LOADER_LOG)
        if stray_timeout_s is not None:
            for pid in wait_for_exit({report.ids_log}, stray_timeout_s).get(report.ids_log, []):
                report.problems.append(f"DataLoader worker {pid} is still alive {stray_timeout_s:.0f} s after "
                                       "the run ended: it outlived its SIGKILLed parent")
    if log and report.starts and report.finished:
        log(_describe_start(report.starts[-1]))
    return report


def _after_kill_remote(start: Start, child: _Child, remote: Store, leftovers: set[str], report: DrillReport) -> None:
    """Record where the kill caught the uploader, and check everything the remote shows."""
    upload = _upload_landed(child.lines, remote, leftovers)
    if upload:
        start.landed, start.during_upload = f"{start.landed}; {upload}", True
    report.problems += check_remote(remote)
    report.remote_verified_after_kills += len(remote.generations())


def _expected_pull(store: LocalStore, remote: Store, expected: str | None) -> tuple[str | None, bool]:
    """What the next start restores: the newest remote full generation when it is newer than every local one
    (restore copies it first; every remote generation verified just now), else ``expected``."""
    local = max((parse_generation_name(n)[0] for n in _full(store)), default=-1)
    newer = [n for n in _full(remote) if parse_generation_name(n)[0] > local]
    return (newer[0], True) if newer else (expected, False)


def _full(store: Store) -> list[str]:
    return [n for n in store.generations() if parse_generation_name(n)[1] == "full"]


def _upload_landed(lines: list[str], remote: Store, leftovers_before: set[str]) -> str:
    """Where the kill caught the uploader ("" if idle): what this start saved or restored, against the remote."""
    wanted = [int(line.split()[1]) for line in lines if line.startswith("saved ")]
    wanted += [int(line.split("next_update=")[1].split()[0]) for line in lines if line.startswith("restored ")]
    if not wanted:
        return ""
    remote_latest = _pointer_update(remote)
    new = sorted(set(remote.leftovers()) - leftovers_before)
    if remote_latest is not None and remote_latest[1] >= max(wanted):
        return f"while pruning the remote (left {', '.join(new)})" if new else ""
    behind = f"in the upload of update {max(wanted)} (remote latest {remote_latest and remote_latest[0]}"
    committed = [n for n in remote.generations()
                 if remote_latest is None or parse_generation_name(n)[0] > remote_latest[1]]
    if new:
        return f"{behind}, writing {', '.join(new)})"
    if committed:
        return f"{behind}, {', '.join(committed)} committed, latest not yet moved)"
    return f"{behind}, nothing of it written yet: queued, starting, or pruning after the previous)"


def _count_loader_workers(path: Path) -> int:
    try:
        return sum(line.startswith("worker ") for line in path.read_text(errors="replace").splitlines())
    except FileNotFoundError:
        return 0


def _run_start(child: _Child, start: Start, share: float, cfg: DrillConfig, timing: Timing, limit_s: float) -> None:
    try:
        start.killed_after_s = _drive(child, start.plan, share, cfg, timing, limit_s)
    finally:
        child.kill()
        start.exit_code = child.reap()
    if start.exit_code == 0:
        start.killed_after_s = None  # it finished just before the kill was due


def _after_kill(start: Start, child: _Child, store: LocalStore, leftovers: set[str], report: DrillReport) -> str | None:
    """Record where the kill landed, check what is visible, and predict what the next start restores."""
    start.landed, start.during_save = _landed(child.lines, store, leftovers)
    if report.ids_log is not None:  # orphans of this kill (and of earlier ones not yet gone)
        start.loader_orphans = len(processes_holding({report.ids_log}).get(report.ids_log, []))
    report.problems += check_visible(store)
    report.verified_after_kills += len(store.generations())
    return expected_restore(store)


def _drive(child: _Child, plan: KillPlan | None, share: float, cfg: DrillConfig, timing: Timing,
           limit_s: float) -> float | None:
    """Let the worker go and SIGKILL it when ``plan`` says; the kill time after go, or None if it exited."""
    went = child.go()
    deadline = went + limit_s
    kill_at = went + plan.fraction * RESTORE_WINDOW_S if plan and plan.mode == "restore" else None
    target: tuple[str, int, float] | None = None  # (line, how many, unit of delay)
    seen = 0
    while True:
        line = child.next_line(min(deadline, kill_at) if kill_at is not None else deadline)
        now = time.monotonic()
        if line is _TIMEOUT:
            if kill_at is None or now < kill_at - 1e-4:
                raise DrillError(f"worker start did not finish within {limit_s:.0f} s: {child.tail()}")
            child.kill()
            return now - went
        if line is None:
            return None
        word, _, rest = line.partition(" ")
        if plan is None or kill_at is not None:
            continue
        if word == "training":
            saves, updates = _saves_left(cfg, int(rest)), cfg.total - int(rest)
            if plan.mode == "save" and saves > 1:  # not the last save: one faster than the reference's would end
                # the run before its kill (the worker exits), and the trial would have one kill fewer than planned
                target = ("saving", min(saves - 1, 1 + int(plan.fraction * math.ceil(share * saves))), timing.save_s)
            elif plan.mode in ("time", "save") and updates:  # a time never past the end: the last save's kill too
                target = ("step", int(plan.fraction * math.ceil(share * updates)), timing.per_update_s)
            elif plan.mode == "upload" and saves:  # the upload starts as the save returns
                target = ("saved", 1 + int(plan.fraction * math.ceil(share * saves)), timing.upload_s)
        elif target is not None and word == target[0]:
            seen += 1
        if target is not None and seen == target[1]:
            kill_at = now + plan.delay * target[2]


def _saves_left(cfg: DrillConfig, next_update: int) -> int:
    periodic = cfg.total // cfg.every - next_update // cfg.every
    return periodic + (cfg.total % cfg.every != 0 and next_update < cfg.total)


def _check_restore(start: Start, child: _Child, expected: str | None, pointer: str | None) -> list[str]:
    """The start must have restored exactly the generation predicted after the previous kill.

    It may pass over the pointer only when there was none (a kill between the
    first commit and the first pointer write) or when it rolled forward to the
    one save a kill caught between its commit and its pointer move, and over no
    generation at all.
    """
    for line in child.lines:
        word, _, rest = line.partition(" ")
        if word == "fresh":
            return [] if expected is None else [f"start {start.index} started fresh; expected {expected}"]
        if word == "restored":
            name, *fields = rest.split()
            start.restored = name
            fields = dict(f.split("=", 1) for f in fields)
            problems = [] if name == expected else [f"start {start.index} restored {name}; expected {expected}"]
            rolled = pointer is not None and expected is not None and expected != pointer
            if fields.get("rejected") != (POINTER if rolled or (not pointer and expected) else "-"):
                problems.append(f"start {start.index} rejected {fields.get('rejected')} (pointer was {pointer})")
            if fields.get("identical") != "1":
                problems.append(f"start {start.index}: restore reports no identical continuation")
            return problems
    if start.killed_after_s is None:
        return [f"start {start.index} never reported its restore: {child.tail()}"]
    return []  # killed before restore finished


def _landed(lines: list[str], store: LocalStore, leftovers_before: set[str]) -> tuple[str, bool]:
    """Where the kill landed, from the worker's last lines and what the save left on disk."""
    if not any(line.startswith("training ") for line in lines):
        return "during start-up or restore", False
    saving = [int(line.split()[1]) for line in lines if line.startswith("saving ")]
    saved = {int(line.split()[1]) for line in lines if line.startswith("saved ")}
    staged = {int(line.split()[1]) for line in lines if line.startswith("staged ")}  # only with --async-save
    if not saving or saving[-1] in saved:
        return "during training", False
    update, waiting = saving[-1], ""
    behind = sorted(staged - saved)
    if update not in staged and behind:  # its save waited for a slot (backpressure) behind one still writing
        update, waiting = behind[-1], f"; the save of update {saving[-1]} waiting for it"
    gen = generation_name(update)
    new = set(store.leftovers()) - leftovers_before
    latest = _pointer_name(store)
    if latest == gen:
        phase = "pruning" if any("-trash-" in n for n in new) else "published, not yet returned"
    elif gen in store.generations():
        phase = "committed, verifying; pointer not yet moved"
    elif any(n.startswith(f".trainstate-staging-{gen}-") for n in new):
        phase = "writing staged files"
    elif update in staged:
        phase = "staged in memory, not yet writing"
    else:
        phase = "capturing, before staging"
    if update in staged:  # save(blocking=False) had returned: training went on while it was written
        phase += f", in the background{waiting}"
    return f"in the save of update {update} ({phase})", True


def _pointer_name(store: Store) -> str | None:
    latest = _pointer_update(store)
    return None if latest is None else latest[0]


def _pointer_update(store: Store) -> tuple[str, int] | None:
    data = store.read_pointer(POINTER)
    try:
        pointer = None if data is None else parse_pointer(data, POINTER)
    except TrainStateError:
        return None
    return None if pointer is None else (pointer.generation, pointer.next_update)


def check_visible(store: Store) -> list[str]:
    """Every visible generation verifies in full and the pointer names one of them: nothing partial shows."""
    problems = []
    for name in store.generations():
        try:
            verify_generation(store, name)
        except (TrainStateError, OSError) as exc:
            problems.append(f"partial or corrupt generation visible: {exc}")
    data = store.read_pointer(POINTER)
    if data is not None:
        try:
            pointer = parse_pointer(data, POINTER)
            verify_generation(store, pointer.generation, pointer, content=False)
        except (TrainStateError, OSError) as exc:
            problems.append(f"the {POINTER} pointer does not name a valid generation: {exc}")
    return problems


def check_remote(remote: Store, final: str | None = None) -> list[str]:
    """The mirror's copy: :func:`check_visible` there (every generation, the one ``latest`` names included,
    verifies in full); with ``final`` (a finished run), its ``latest`` must name that generation."""
    problems = [f"remote: {p}" for p in check_visible(remote)]
    if final is not None and _pointer_name(remote) != final:
        problems.append(f"remote: the run finished, but the remote {POINTER} names {_pointer_name(remote)}, "
                        f"not its final generation {final}")
    return problems


def expected_restore(store: LocalStore) -> str | None:
    """The pointer's generation, or the one save a kill caught between its commit and its pointer move (a
    single newer full generation whose parent is the pointer's: complete, so restore rolls forward to it);
    without a pointer (killed between the first commit and pointer), the newest."""
    full = _full(store)
    pointed = _pointer_name(store)
    if pointed is None:
        return full[0] if full else None
    newer = [n for n in full if generation_order(n) > generation_order(pointed)]
    try:
        if len(newer) == 1 and verify_generation(store, newer[0], content=False).manifest.parent == pointed:
            return newer[0]
    except CorruptGeneration:  # damaged: passed over, the pointer's is restored
        pass
    return pointed


_AIMED = {"save": "aimed inside a save", "time": "at a random moment of training", "restore": "aimed at its restore",
          "upload": "aimed at a background upload"}


def _describe_start(start: Start) -> str:
    """One line a newcomer can read: where this process resumed from, and how it ended."""
    if start.restored:
        began = f"resumed from {start.restored}"
    elif start.index == 1:
        began = "started fresh (nothing saved yet)"
    elif start.killed_after_s is not None and start.landed == "during start-up or restore":
        began = "was still starting up or restoring"
    else:
        began = "found nothing to resume and started fresh"
    if start.killed_after_s is None:
        return f"  start {start.index}: {began}; ran to the end (exit {start.exit_code})"
    aimed = _AIMED.get(start.plan.mode, start.plan.mode) if start.plan else "at random"
    lost = f"; then its local directory (newest: {start.lost_local}) was deleted" if start.lost_local else ""
    return (f"  start {start.index}: {began}; killed with SIGKILL {start.killed_after_s:.3f} s after it was let go "
            f"({aimed}), which landed {start.landed}{lost}")
