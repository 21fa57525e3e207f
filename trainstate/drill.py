"""Kill drill: train in a child process, SIGKILL it at random moments, resume, compare bitwise.

Two halves share this module so that the demo, the tests and a person at a
shell all run the same thing:

* the worker, ``python -m trainstate.drill worker --dir D --total N --every K``,
  trains a small deterministic model (every kind of state a real run has:
  parameters, BatchNorm buffers, AdamW moments, an LR schedule, a GradScaler,
  and five random streams, each drawn from in every update), resumes from
  ``D``, saves every ``K`` updates and a final generation at ``N``, then writes
  the *next draws* of every random stream and a probe update to
  ``D/next_draws.json``. It reports progress on stdout, one line each::

      ready                 built; waiting for "go" on stdin (--wait-for-go)
      fresh | restored <generation> next_update=<n> rejected=<names or -> identical=<0|1>
      training <n>
      step <n>              after each update
      saving <n>            right before ckpt.save
      saved <n>             right after it returns
      done <n>

* the parent (:func:`run_reference`, :func:`run_interrupted`,
  :func:`compare_runs`) runs one uninterrupted reference and one run that is
  SIGKILLed repeatedly, some kills at random moments and some just after a
  ``saving`` line so that they land inside the save. After every kill it
  checks that every visible generation verifies in full and predicts which
  generation the next start must restore; the next start must report it.

Workers start either as fresh interpreters (:class:`Spawner`) or forked from
a process that imported torch once (:class:`Zygote`); both are real
processes that build everything and restore from disk after they start.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import queue
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from . import snapshot
from .errors import TrainStateError
from .localfs import LocalStore
from .manager import CheckpointManager
from .manifest import POINTER, generation_name, parse_generation_name, parse_pointer
from .state import TrainState
from .verify import load_payload, verify_generation

DRAWS_FILE = "next_draws.json"
IN_FEATURES, OUT_FEATURES = 64, 32
FORGET_CHOICES = ("python", "numpy_global", "torch_cpu", "data", "noise", "optimizer", "scheduler", "scaler",
                  "weights-only")


class DrillError(TrainStateError):
    """The drill itself could not run (a worker crashed or hung, a directory was not empty)."""


@dataclass(frozen=True)
class DrillConfig:
    """What the worker trains; the reference and the interrupted run must share it."""

    total: int
    every: int
    seed: int = 0
    width: int = 384
    batch: int = 128

    def __post_init__(self) -> None:
        for name in ("total", "every", "width", "batch"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"DrillConfig.{name} must be a positive int, got {getattr(self, name)!r}")

    def argv(self) -> list[str]:
        return ["--total", str(self.total), "--every", str(self.every), "--seed", str(self.seed),
                "--width", str(self.width), "--batch", str(self.batch)]


# worker ------------------------------------------------------------------------
def build_model(cfg: DrillConfig) -> nn.Module:
    w = cfg.width
    return nn.Sequential(nn.Linear(IN_FEATURES, w), nn.BatchNorm1d(w), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(w, w), nn.LayerNorm(w), nn.ReLU(), nn.Linear(w, OUT_FEATURES))


def build(cfg: DrillConfig) -> TrainState:
    """A freshly seeded TrainState; identical in every process given ``cfg``."""
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.total, eta_min=1e-4)
    # A short growth interval and injected overflows (see train_step) keep the
    # scaler's scale and growth tracker moving, so a lost scaler state shows.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
    rngs = {"data": torch.Generator().manual_seed(cfg.seed + 1), "noise": np.random.default_rng(cfg.seed + 2)}
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, rngs=rngs,
                      contract={"config": asdict(cfg)})


def train_step(state: TrainState, cfg: DrillConfig) -> float:
    """One update that draws from every random source, so any stream restored wrong changes the weights."""
    model, optimizer, scaler = state["model"], state["optimizer"], state["scaler"]
    x = torch.randn(cfg.batch, IN_FEATURES, generator=state.rngs["data"])
    noise = state.rngs["noise"].normal(0.0, 0.1, (cfg.batch, OUT_FEATURES)).astype(np.float32)
    y = torch.tanh(2 * x[:, :OUT_FEATURES]) + torch.from_numpy(noise)
    weights = torch.from_numpy(np.random.uniform(0.5, 1.5, cfg.batch).astype(np.float32))
    overflow = random.random() < 0.05 and state.next_update > 0  # the first step must be a real one
    model.train()  # dropout draws from torch's global CPU generator
    loss = (((model(x) - y) ** 2).mean(dim=1) * weights).mean()
    scaler.scale(loss * math.inf if overflow else loss).backward()
    scaler.step(optimizer)  # skipped on overflow; the scaler then backs off
    scaler.update()
    state["scheduler"].step()
    optimizer.zero_grad(set_to_none=True)
    state.tokens_seen += cfg.batch
    state.counters["overflows"] = state.counters.get("overflows", 0) + int(overflow)
    value = loss.item()
    if value < state.facts.get("best_loss", math.inf):
        state.facts["best_loss"] = value
    return value


def next_draws(state: TrainState) -> dict[str, list[int]]:
    """The next values of every random stream: equal only if every stream was restored exactly."""
    return {
        "python": [random.getrandbits(64) for _ in range(4)],
        "numpy_global": np.random.randint(0, 2**62, 4, dtype=np.int64).tolist(),
        "numpy_generator:noise": state.rngs["noise"].integers(0, 2**62, 4).tolist(),
        "torch_cpu": torch.randint(0, 2**62, (4,)).tolist(),
        "torch_generator:data": torch.randint(0, 2**62, (4,), generator=state.rngs["data"]).tolist(),
    }


def probe(state: TrainState, cfg: DrillConfig) -> dict[str, str]:
    """One more update in memory, then a digest of the whole state.

    The final generation may have been written by an earlier process; this
    checks what the last process actually holds in its live objects.
    """
    loss = train_step(state, cfg)
    skeleton, tensors = snapshot.capture(state)
    digest = hashlib.sha256(snapshot.state_json(skeleton))
    for name in sorted(tensors):
        digest.update(tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"loss": float.hex(loss), "state_sha256": digest.hexdigest()}


def _fresh_states(state: TrainState) -> dict[str, Any]:
    """Copies of everything as built, for the negative control (``--forget``)."""
    return {"components": {n: copy.deepcopy(c.state_dict()) for n, c in state.components.items()},
            "python": random.getstate(), "numpy_global": np.random.get_state(),
            "torch_cpu": torch.get_rng_state(), "data": state.rngs["data"].get_state(),
            "noise": copy.deepcopy(state.rngs["noise"].bit_generator.state)}


def _forget(state: TrainState, what: str, fresh: dict[str, Any]) -> None:
    """Undo part of a restore, as a buggy resume would, so the comparison must fail."""
    names = FORGET_CHOICES[:-1] if what == "weights-only" else (what,)
    for name in names:
        if name in fresh["components"]:
            state[name].load_state_dict(copy.deepcopy(fresh["components"][name]))
        elif name == "python":
            random.setstate(fresh["python"])
        elif name == "numpy_global":
            np.random.set_state(fresh["numpy_global"])
        elif name == "torch_cpu":
            torch.set_rng_state(fresh["torch_cpu"])
        elif name == "data":
            state.rngs["data"].set_state(fresh["data"])
        else:
            state.rngs["noise"].bit_generator.state = copy.deepcopy(fresh["noise"])


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()  # the parent times its kills by these lines


def _save(ckpt: CheckpointManager, state: TrainState) -> None:
    _say(f"saving {state.next_update}")
    ckpt.save(state)
    _say(f"saved {state.next_update}")


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(tmp, path)  # a kill mid-write must not leave a truncated file behind


def worker_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    cfg = DrillConfig(args.total, args.every, args.seed, args.width, args.batch)
    state = build(cfg)
    fresh = _fresh_states(state) if args.forget else None
    if args.wait_for_go:
        # Imports and build (AdamW's first param group imports torch._dynamo) take
        # seconds; the parent starts the next worker early and lets it go only
        # after the previous one is dead and the directory has been checked.
        _say("ready")
        if sys.stdin.readline().strip() != "go":
            return 3
    with CheckpointManager(args.dir, keep_last=args.keep_last) as ckpt:
        info = ckpt.restore(state)
        if info is None:
            _say("fresh")
        else:
            rejected = ",".join(r.generation for r in info.rejected) or "-"
            _say(f"restored {info.generation.name} next_update={state.next_update} rejected={rejected} "
                 f"identical={int(info.identical_continuation)}")
            if fresh is not None:
                _forget(state, args.forget, fresh)
        _say(f"training {state.next_update}")
        while state.next_update < cfg.total:
            train_step(state, cfg)
            state.next_update += 1
            _say(f"step {state.next_update}")
            if state.next_update % cfg.every == 0:
                _save(ckpt, state)
        if state.parent != generation_name(state.next_update):
            _save(ckpt, state)
    draws = next_draws(state)
    _write_json(Path(args.dir) / DRAWS_FILE, {"next_update": state.next_update, "draws": draws,
                                              "probe": probe(state, cfg)})
    _say(f"done {state.next_update}")
    return 0


# parent: launching worker processes --------------------------------------------
_TIMEOUT = object()


def worker_env() -> dict[str, str]:
    """One thread per worker: deterministic kernels, two workers fit two cores, and forking is safe."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0")
    root = str(Path(__file__).resolve().parents[1])  # runs from a checkout without installing, too
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def worker_args(cfg: DrillConfig, directory: Path, forget: str | None = None) -> list[str]:
    """Arguments after ``python -m trainstate.drill``."""
    return ["worker", "--dir", str(directory), *cfg.argv(), "--wait-for-go"] + (["--forget", forget] if forget else [])


class Spawner:
    """Starts every worker as a fresh interpreter, ``sys.executable -m trainstate.drill worker``.

    The most isolated start there is, and the slowest: importing torch and
    the torch._dynamo import that AdamW triggers cost several CPU seconds each.
    """

    def start(self, args: list[str]) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "trainstate.drill", *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env=worker_env())

    def __enter__(self) -> Spawner:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class Zygote(Spawner):
    """Starts workers by forking ``python -m trainstate.drill zygote``, which imported torch once.

    Each worker is still its own process, killed by SIGKILL and sharing no
    training state with any other: it builds its objects and restores from
    disk after the fork, exactly as a fresh interpreter does. Only the
    imports are shared, which makes a start take milliseconds instead of
    seconds. The zygote reaps a child only when asked, after the parent
    killed it or saw its output end, so a pid the parent signals is never
    reused.
    """

    def __init__(self) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen([sys.executable, "-m", "trainstate.drill", "zygote", str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=worker_env())
        self._lock = threading.Lock()  # one request and its reply at a time, from any thread

    def _ask(self, request: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        with self._lock:
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds or [])
            reply = self._sock.recv(1 << 16)
        if not reply:
            raise DrillError(f"the zygote process died (exit {self.proc.poll()})")
        return json.loads(reply)

    def start(self, args: list[str]) -> _Forked:
        child_in, to_child = os.pipe()
        from_child, child_out = os.pipe()
        try:
            pid = self._ask({"op": "start", "args": args}, [child_in, child_out])["pid"]
        except BaseException:
            os.close(to_child)
            os.close(from_child)
            raise
        finally:
            os.close(child_in)
            os.close(child_out)
        return _Forked(self, pid, open(to_child, "w", buffering=1), open(from_child))

    def wait(self, pid: int) -> int:
        return self._ask({"op": "wait", "pid": pid})["code"]

    def __exit__(self, *exc: object) -> None:
        self._sock.close()  # the zygote exits at end of input
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


class _Forked:
    """The part of ``subprocess.Popen`` that _Child uses, for a process forked by the zygote."""

    def __init__(self, zygote: Zygote, pid: int, stdin: Any, stdout: Any):
        self.pid, self.stdin, self.stdout, self.returncode = pid, stdin, stdout, None
        self._zygote = zygote

    def poll(self) -> int | None:
        return self.returncode  # unknown until reaped; kill() below is safe either way

    def kill(self) -> None:
        if self.returncode is None:  # not reaped, so the pid is still ours, alive or a zombie
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.wait(self.pid)
        return self.returncode


def zygote_main(fd: int) -> int:
    """Serve start and wait requests from the parent on socket ``fd`` until it closes."""
    torch.set_num_threads(1)
    build(DrillConfig(total=1, every=1))  # AdamW's first use imports torch._dynamo: once, here
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads != 1:
        raise DrillError(f"the zygote runs {threads} threads; forking it would be unsafe")
    sock = socket.socket(fileno=fd)
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 2)
        if not message:
            return 0
        request = json.loads(message)
        if request["op"] == "start":
            pid = os.fork()
            if pid == 0:
                sock.close()
                _run_forked(request["args"], fds)
            for f in fds:
                os.close(f)
            sock.send(json.dumps({"pid": pid}).encode())
        else:
            _, status = os.waitpid(request["pid"], 0)
            sock.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())


def _run_forked(args: list[str], fds: list[int]) -> None:
    """In the forked child: stdin and stdout/stderr become the parent's pipes, then run the worker."""
    os.dup2(fds[0], 0)
    os.dup2(fds[1], 1)
    os.dup2(fds[1], 2)
    for f in fds:
        os.close(f)
    code = 1
    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code if type(exc.code) is int else 2
    except BaseException:  # the child must never return into the zygote's loop
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class _Child:
    """A worker process; a reader thread turns its output into lines we can wait on with a timeout."""

    def __init__(self, launcher: Spawner, args: list[str]):
        self.spawned = time.monotonic()
        self.proc = launcher.start(args)
        self.lines: list[str] = []
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def next_line(self, deadline: float) -> Any:
        """The next output line, ``None`` at end of output, or ``_TIMEOUT``."""
        try:
            line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return _TIMEOUT
        if line is not None:
            self.lines.append(line)
        return line

    def wait_ready(self, deadline: float) -> None:
        while "ready" not in self.lines:
            line = self.next_line(deadline)
            if line is None or line is _TIMEOUT:
                raise DrillError(f"worker did not become ready: {self.tail()}")

    def go(self) -> float:
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died while waiting; the end of its output reports that
        return time.monotonic()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def reap(self, timeout: float = 300.0) -> int:
        """Wait for exit and collect the rest of the output (what it printed before dying).

        The timeout is generous: a process SIGKILLed inside fsync dies only
        when the disk answers, which can take long on a busy machine.
        """
        self.proc.wait(timeout)
        self._reader.join(timeout)
        while not self._queue.empty():
            line = self._queue.get()
            if line is not None:
                self.lines.append(line)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(BrokenPipeError):  # a "go" it died before reading
                stream.close()
        return self.proc.returncode

    def tail(self, n: int = 8) -> str:
        return " | ".join(self.lines[-n:]) or "(no output)"


class _Pool:
    """Workers started ahead of time, each built and waiting for 'go'.

    Start-up (for a fresh interpreter, imports and building the state) costs
    seconds of CPU; starting the next workers while the current one trains
    hides some of it. ``take(more)``
    says how many more starts are planned, so no worker is started in vain.
    """

    def __init__(self, launcher: Spawner, args: list[str], spares: int, starts: int):
        self._launcher, self._args, self._spares = launcher, args, max(1, spares)
        self._waiting: list[_Child] = []
        self._top_up(starts)

    def _top_up(self, starts: int) -> None:
        while len(self._waiting) < min(self._spares, starts):
            self._waiting.append(_Child(self._launcher, self._args))

    def take(self, timeout: float, more: int) -> _Child:
        """The next worker, ready; ``more``: starts planned after this one."""
        self._top_up(1)
        child = self._waiting.pop(0)
        self._top_up(more)
        try:
            child.wait_ready(time.monotonic() + timeout)
        except DrillError:
            child.kill()
            child.reap()
            raise
        return child

    def close(self) -> None:
        for child in self._waiting:
            child.kill()
            child.reap()
        self._waiting.clear()


# parent: the drill -------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """The reference run's pace, used to place kills inside the interrupted run."""

    startup_s: float  # spawn to ready: interpreter, imports, building the state
    per_update_s: float  # training and saving, per update
    save_s: float  # median duration of one save
    wall_s: float


@dataclass(frozen=True)
class KillPlan:
    """When to SIGKILL one worker start.

    ``save``: after a ``saving`` line (which one: ``fraction`` of the saves
    still ahead), wait ``delay`` times the reference's median save duration, so
    kills reach every phase of a save on a slow disk or a fast one. ``time``:
    after a ``step`` line (which one: ``fraction`` of the updates still ahead),
    wait ``delay`` times the reference's time per update, which lands anywhere
    in training or saving but never after the end, however fast the worker
    runs. ``restore``: ``fraction`` of RESTORE_WINDOW_S after go.
    """

    mode: str
    fraction: float
    delay: float = 0.0


RESTORE_WINDOW_S = 0.15


def plan_kills(rng: random.Random, kills: int) -> list[KillPlan]:
    """A reproducible schedule: mostly kills aimed at saves and at random times, at least one per save."""
    plans = []
    for _ in range(kills):
        mode = rng.choices(["save", "time", "restore"], weights=[5, 4, 1])[0]
        plans.append(KillPlan(mode, rng.uniform(0.0, 0.9), rng.random()))
    if kills and not any(p.mode == "save" for p in plans):
        plans[rng.randrange(kills)] = KillPlan("save", rng.uniform(0.0, 0.9), rng.random())
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
    exit_code: int | None = None


@dataclass
class DrillReport:
    seed: int
    starts: list[Start] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    finished: bool = False
    verified_after_kills: int = 0  # generation verifications done after kills
    wall_s: float = 0.0

    @property
    def kills(self) -> int:
        return sum(s.killed_after_s is not None for s in self.starts)

    @property
    def kills_during_save(self) -> int:
        return sum(s.during_save for s in self.starts)

    @property
    def resumes(self) -> int:
        return sum(s.restored is not None for s in self.starts)


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
        while (line := child.next_line(deadline)) not in (None, _TIMEOUT):
            word, now = line.partition(" ")[0], time.monotonic()
            if word == "training":
                started = now
            elif word == "saving":
                saving = now
            elif word == "saved":
                saves.append(now - saving)
            elif word == "done":
                done = now
        if line is _TIMEOUT:
            raise DrillError(f"reference run did not finish in {timeout_s:.0f} s: {child.tail()}")
    finally:
        child.kill()
        code = child.reap()
    if code != 0 or started is None or done is None or not saves:
        raise DrillError(f"reference run failed (exit {code}): {child.tail()}")
    return Timing(ready - child.spawned, (done - started) / cfg.total, sorted(saves)[len(saves) // 2],
                  done - child.spawned)


def _require_empty(directory: Path) -> None:
    if directory.exists() and any(directory.iterdir()):
        raise DrillError(f"{directory} is not empty; the drill needs a fresh directory for each run")


def run_interrupted(cfg: DrillConfig, directory: Path, *, kills: int, seed: int,
                    timing: Timing | Callable[[], Timing], plans: list[KillPlan] | None = None,
                    forget: str | None = None, launcher: Spawner | None = None, spares: int = 1,
                    log: Callable[[str], None] | None = None, start_timeout_s: float = 300.0) -> DrillReport:
    """Start the worker until it finishes on its own, SIGKILLing the first ``kills`` starts.

    ``timing`` may be a callable (say, one that runs the reference): it is
    called after the first workers have been spawned, so their start-up
    overlaps it.
    """
    _require_empty(directory)
    plans = plans if plans is not None else plan_kills(random.Random(seed), kills)
    report = DrillReport(seed)
    store = LocalStore(directory)
    pool = _Pool(launcher or Spawner(), worker_args(cfg, directory, forget), spares, starts=len(plans) + 1)
    try:
        timing = timing() if callable(timing) else timing
        began = time.monotonic()
        expected: str | None = None  # what the next start must restore
        for index in range(1, len(plans) + 4):
            start = Start(index, plans[index - 1] if index <= len(plans) else None)
            report.starts.append(start)
            child = pool.take(start_timeout_s, more=max(0, len(plans) + 1 - index))
            leftovers, pointer = set(store.leftovers()), _pointer_name(store)
            share = 1 / max(1, len(plans) - index + 1)  # each kill aims within its share of what is left
            _run_start(child, start, share, cfg, timing, start_timeout_s)
            report.problems += _check_restore(start, child, expected, pointer)
            if start.killed_after_s is None:
                if start.exit_code != 0:
                    report.problems.append(f"start {index} failed with exit {start.exit_code}: {child.tail()}")
                report.finished = start.exit_code == 0
                break
            expected = _after_kill(start, child, store, leftovers, report)
            if log:
                log(_describe_start(start))
        else:
            report.problems.append(f"the worker did not finish after {len(report.starts)} starts")
    finally:
        pool.close()
    report.wall_s = time.monotonic() - began
    if log and report.starts and report.finished:
        log(_describe_start(report.starts[-1]))
    return report


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
            if plan.mode == "time" and updates:
                target = ("step", int(plan.fraction * math.ceil(share * updates)), timing.per_update_s)
            elif plan.mode == "save" and saves:
                target = ("saving", 1 + int(plan.fraction * math.ceil(share * saves)), timing.save_s)
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
    first commit and the first pointer write), and over no generation at all.
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
            if fields.get("rejected") != ("-" if pointer else POINTER if expected else "-"):
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
    if not saving or saving[-1] in saved:
        return "during training", False
    gen = generation_name(saving[-1])
    new = set(store.leftovers()) - leftovers_before
    latest = _pointer_name(store)
    if latest == gen:
        phase = "pruning" if any("-trash-" in n for n in new) else "published, not yet returned"
    elif gen in store.generations():
        phase = "committed, verifying; pointer not yet moved"
    elif any(n.startswith(f".trainstate-staging-{gen}-") for n in new):
        phase = "writing staged files"
    else:
        phase = "capturing, before staging"
    return f"in the save of update {saving[-1]} ({phase})", True


def _pointer_name(store: LocalStore) -> str | None:
    data = store.read_pointer(POINTER)
    try:
        return None if data is None else parse_pointer(data, POINTER).generation
    except TrainStateError:
        return None


def check_visible(store: LocalStore) -> list[str]:
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


def expected_restore(store: LocalStore) -> str | None:
    """The pointer's generation; without a pointer (killed between the first commit and pointer), the newest."""
    full = [n for n in store.generations() if parse_generation_name(n)[1] == "full"]
    return _pointer_name(store) or (full[0] if full else None)


def _describe_start(start: Start) -> str:
    restored = start.restored or ("nothing (fresh start)" if start.index == 1 else "nothing")
    if start.killed_after_s is None:
        return f"  start {start.index}: restored {restored}, ran to the end (exit {start.exit_code})"
    return (f"  start {start.index}: restored {restored}, SIGKILL {start.killed_after_s:.3f} s after go "
            f"[{start.plan.mode}] {start.landed}")


# parent: comparison ------------------------------------------------------------
@dataclass
class Comparison:
    """The outcome of comparing two finished runs; equal only if every compared value is bitwise equal."""

    differences: list[str]
    compared: dict[str, str]  # part -> what was compared in it, for reports
    values: int  # leaves compared (tensors, numbers, strings)
    elements: int  # tensor elements compared

    @property
    def equal(self) -> bool:
        return not self.differences


@dataclass
class _Final:
    files: dict[str, tuple[int, str]]
    payload: dict[str, Any]
    draws: dict[str, Any]


def _final(directory: Path) -> _Final:
    store = LocalStore(directory, create=False)
    data = store.read_pointer(POINTER)
    if data is None:
        raise DrillError(f"{directory} has no {POINTER} pointer: the run did not finish")
    pointer = parse_pointer(data, POINTER)
    manifest = verify_generation(store, pointer.generation, pointer).manifest
    draws = json.loads((directory / DRAWS_FILE).read_text())
    return _Final({f.name: (f.size, f.digest) for f in manifest.files}, load_payload(store, manifest), draws)


def compare_runs(cfg: DrillConfig, reference: Path, candidate: Path) -> Comparison:
    """Compare the final generations and next draws of two finished runs, bitwise."""
    ref, got = _final(reference), _final(candidate)
    differences: list[str] = []
    counts = [0, 0]
    compare_values(ref.payload, got.payload, "state", differences, counts)
    compare_values(ref.draws, got.draws, DRAWS_FILE, differences, counts)
    if ref.files != got.files:
        differences.append(f"generation files differ: {ref.files} vs {got.files}")
    return Comparison(differences, describe_compared(cfg, ref.payload, ref.draws, ref.files), counts[0], counts[1])


def compare_values(a: Any, b: Any, path: str, out: list[str], counts: list[int]) -> None:
    """Append to ``out`` every place where ``b`` is not bitwise ``a`` (same types, dtypes, shapes, bits).

    Bits, not ``==``: -0.0 equals 0.0 and NaN never equals itself, but a
    faithful resume reproduces both exactly.
    """
    if type(a) is not type(b):
        out.append(f"{path}: {type(a).__name__} vs {type(b).__name__}")
    elif isinstance(a, (torch.Tensor, np.ndarray)):
        counts[0] += 1
        ta, tb = torch.as_tensor(a), torch.as_tensor(b)
        counts[1] += ta.numel()
        if ta.dtype != tb.dtype or ta.shape != tb.shape:
            out.append(f"{path}: {ta.dtype} {tuple(ta.shape)} vs {tb.dtype} {tuple(tb.shape)}")
        elif not torch.equal(_bits(ta), _bits(tb)):
            differ = (_bits(ta) != _bits(tb)).reshape(ta.numel(), -1).any(dim=1).sum().item()
            out.append(f"{path}: {differ} of {ta.numel()} elements differ")
    elif type(a) is dict:
        if list(a) != list(b):
            out.append(f"{path}: keys {list(a)!r:.200} vs {list(b)!r:.200}")
        for key in a.keys() & b.keys():
            compare_values(a[key], b[key], f"{path}.{key}", out, counts)
    elif type(a) in (list, tuple):
        if len(a) != len(b):
            out.append(f"{path}: length {len(a)} vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            compare_values(x, y, f"{path}[{i}]", out, counts)
    else:
        counts[0] += 1
        same = struct.pack("<d", a) == struct.pack("<d", b) if type(a) is float else (
            a.tobytes() == b.tobytes() and a.dtype == b.dtype if isinstance(a, np.generic) else a == b)
        if not same:
            out.append(f"{path}: {a!r:.80} vs {b!r:.80}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(t.numel(), 1).view(torch.uint8)


def describe_compared(cfg: DrillConfig, payload: dict[str, Any], draws: dict[str, Any],
                      files: dict[str, Any]) -> dict[str, str]:
    """What a comparison covered, part by part, in words."""
    comps = {name: c["state"] for name, c in payload["components"].items()}
    params = {name for name, _ in build_model(cfg).named_parameters()}
    buffers = [k for k in comps["model"] if k not in params]
    moments = sorted({k for s in comps["optimizer"]["state"].values() for k in s})
    rng = payload["rng"]
    streams = [k for k in ("python", "numpy_global", "torch_cpu") if k in rng]
    streams += [f"{n} ({r['type']})" for n, r in rng["named"].items()]
    return {
        "model": f"{len(comps['model']) - len(buffers)} parameters, {len(buffers)} buffers ({', '.join(buffers)})",
        "optimizer": f"{', '.join(moments)} for {len(comps['optimizer']['state'])} parameters; param_groups",
        "scheduler": ", ".join(comps["scheduler"]),
        "scaler": ", ".join(f"{k}={v}" for k, v in comps["scaler"].items()),
        "rng state": ", ".join(streams),
        "clocks": f"{payload['clocks']}, counters {payload['counters']}, facts {payload['facts']}",
        "next draws": f"{', '.join(draws['draws'])}; a probe update (loss, state digest)",
        "files": f"{', '.join(files)}: sizes and digests",
    }


# command line ------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainstate.drill", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("worker", help="train to --total, resuming from --dir (the child the drill kills)")
    p.add_argument("--dir", required=True)
    p.add_argument("--total", type=int, required=True)
    p.add_argument("--every", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=DrillConfig.width)
    p.add_argument("--batch", type=int, default=DrillConfig.batch)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--wait-for-go", action="store_true", help="after building, wait for 'go' on stdin")
    p.add_argument("--forget", choices=FORGET_CHOICES, default=None,
                   help="negative control: after restoring, reset this part to its fresh state")
    p = sub.add_parser("zygote", help="fork workers on request from the parent (see Zygote)")
    p.add_argument("fd", type=int, help="the parent's socket")
    args = parser.parse_args(argv)
    return zygote_main(args.fd) if args.command == "zygote" else worker_main(args)


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    # Everything the worker wrote is durable (the manager fsyncs, the draws file
    # was renamed into place). Interpreter teardown with torch._dynamo loaded
    # takes over a second, paid by every worker start, so skip it.
    os._exit(status)
