"""The process side of ``trainstate supervise``: start the command, forward signals, wait, log, restart.

Per start: (1) a stop already requested (a signal, the stop file) ends the
loop; (2) the disk preflight and the resume check run
(:func:`~trainstate.lifecycle.supervise.start_problem`): a failure is
permanent, and nothing is started; (3) the command starts in its own process
group, so a terminal's Ctrl-C reaches it once, through the supervisor, and (on
Linux) it receives SIGTERM if the supervisor dies; (4) SIGTERM and SIGINT
received by the supervisor are forwarded to it, and the stop file appearing
sends it SIGTERM; a child still running ``stop_grace_s`` after that is
killed; (5) its end is classified and decided by
:mod:`trainstate.lifecycle.supervise`, and appended to the attempt log.

The supervisor reads the run directory and appends to its log; it never
deletes, moves or writes a generation, ``latest`` or ``DONE``.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ..errors import EXIT_PERMANENT, CorruptGeneration
from ..format import signing
from ..format.manifest import parse_generation_name
from .candidates import recovery_point
from ..storage.locate import open_store
from ..storage.objectclient import is_url
from ..storage.verify import verify_generation
from . import done as done_mod
from . import supervise as policy_mod
from .supervise import Counts, Policy

LOG_NAME = "supervise.jsonl"
LOCK_NAME = ".trainstate.supervise.lock"
ENV_ATTEMPT = "TRAINSTATE_SUPERVISE_ATTEMPT"
ENV_RESUME_FROM = "TRAINSTATE_SUPERVISE_RESUME_FROM"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def default_log(run_dir: str) -> str:
    return str(Path(run_dir) / LOG_NAME)


def _child_setup(parent: int) -> Any:
    """Runs in the child between fork and exec: its own process group, and SIGTERM when the parent dies."""
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            prctl = None

    def setup() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the supervisor died before the line above: act as if it had fired
                os.kill(os.getpid(), signal.SIGTERM)
    return setup


class Supervisor:
    """Runs ``command`` under ``policy`` for the run in ``run_dir``; :meth:`run` returns the exit status."""

    def __init__(self, command: list[str], run_dir: str, *, policy: Policy = Policy(), stop_file: str | None = None,
                 log_path: str | None = None, config: Any = None, min_free: int = 0, headroom: float = 0.05,
                 stop_grace_s: float | None = 300.0, poll_s: float = 0.1, out: TextIO | None = None):
        self.command = list(command)
        self.run_dir = run_dir
        self.policy = policy
        self.stop_file = stop_file
        self.log_path = log_path or default_log(run_dir)
        self.config = config
        self.min_free = min_free
        self.headroom = headroom
        self.stop_grace_s = stop_grace_s
        self.poll_s = poll_s
        self.out = out if out is not None else sys.stderr
        self.session = secrets.token_hex(8)
        self.key = signing.resolve(None, None if is_url(run_dir) else run_dir)
        self.store = open_store(run_dir, create=False)
        self.counts = Counts()
        self.stopped_by: int | None = None  # the first stop signal (the stop file counts as SIGTERM)
        self._stop_deadline: float | None = None
        self._pid: int | None = None  # the running child's, while it runs
        self._lock_fd: int | None = None

    # logging -----------------------------------------------------------------
    def say(self, message: str) -> None:
        print(f"trainstate supervise: {message}", file=self.out, flush=True)

    def log(self, event: str, **fields: Any) -> None:
        record = {"event": event, "session": self.session, "time": _now(), **fields}
        with open(self.log_path, "a", encoding="utf-8") as stream:
            stream.write(json.dumps(record, sort_keys=True) + "\n")
            stream.flush()
            os.fsync(stream.fileno())

    def _lock(self) -> bool:
        """Hold the run's supervisor lock for this process's life (the kernel drops it when the process dies)."""
        path = Path(self.log_path).parent / LOCK_NAME
        self._lock_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            return False
        return True

    # signals -----------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        first = self.stopped_by is None
        if first:
            self.stopped_by = signum
        if self._pid is not None:
            try:
                os.kill(self._pid, signum)  # every signal, so a second Ctrl-C reaches the child as a second one
            except ProcessLookupError:
                pass
            if first and self.stop_grace_s is not None:
                self._stop_deadline = time.monotonic() + self.stop_grace_s

    def _check_stop_file(self) -> None:
        if self.stopped_by is None and self.stop_file and os.path.lexists(self.stop_file):
            self.say(f"stop file {self.stop_file} appeared: stopping" + (" the child (SIGTERM)" if self._pid else ""))
            self._on_signal(signal.SIGTERM, None)

    # one start ---------------------------------------------------------------
    def _resume_point(self) -> tuple[str | None, int | None, int]:
        """The validated full generation a start resumes from, its size, and how many full generations exist."""
        full = [n for n in self.store.generations() if parse_generation_name(n)[1] == "full"]
        name = recovery_point(self.store, self.key) if full else None
        size = None
        if name is not None:
            try:
                v = verify_generation(self.store, name, content=False, key=self.key)
                size = v.manifest_size + sum(f.size for f in v.manifest.files)
            except CorruptGeneration:
                name = None
        return name, size, len(full)

    def _preflight(self, first: bool, seen: bool) -> tuple[str | None, str]:
        """The generation the next start resumes from, and why it must not start (``""``: it may)."""
        resume, size, full = self._resume_point()
        problem = policy_mod.start_problem(first=first, recovery_point=resume, full_generations=full,
                                           seen_generation=seen)
        if not problem:
            needed = policy_mod.space_needed(size, self.headroom, self.min_free)
            problem = policy_mod.space_problem(self.store.free_bytes(), needed, self.store.location)
        if not problem and not is_url(self.run_dir) and not os.access(self.run_dir, os.W_OK | os.X_OK):
            problem = f"disk preflight: {self.run_dir} is not writable by this user; nothing was started"
        return resume, problem

    def _start(self, attempt: int, resume: str | None) -> subprocess.Popen:
        env = dict(os.environ, **{ENV_ATTEMPT: str(attempt), ENV_RESUME_FROM: resume or ""})
        proc = subprocess.Popen(self.command, env=env, preexec_fn=_child_setup(os.getpid()))
        self._pid = proc.pid
        if self.stopped_by is not None:  # a signal arrived while it was being started
            os.kill(proc.pid, self.stopped_by)
        return proc

    def _wait(self, proc: subprocess.Popen) -> int:
        killed = False
        while True:
            code = proc.poll()
            if code is not None:
                self._pid = None
                return code
            self._check_stop_file()
            if not killed and self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                self.say(f"the child is still running {self.stop_grace_s:g} s after the stop: SIGKILL")
                proc.kill()
                killed = True
            time.sleep(self.poll_s)

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.stopped_by is None and time.monotonic() < deadline:
            self._check_stop_file()
            time.sleep(min(self.poll_s, max(deadline - time.monotonic(), 0)))

    # the loop ----------------------------------------------------------------
    def run(self) -> int:
        """Start, wait, classify, decide, until the policy stops; return the supervisor's exit status."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            if not is_url(self.run_dir):
                Path(self.run_dir).mkdir(parents=True, exist_ok=True)
            if not self._lock():
                reason = (f"another supervisor is running for {self.run_dir} (it holds {LOCK_NAME}); one run, one "
                          "supervisor. Stop it (or its stop file) first, or wait for it")
                self.say(reason)
                return EXIT_PERMANENT
            self.log("begin", command=self.command, run_dir=self.run_dir, pid=os.getpid(),
                     policy={"max_starts": self.policy.max_starts, "backoff": list(self.policy.backoff),
                             "max_preemptions": self.policy.max_preemptions},
                     stop_file=self.stop_file)
            code, reason = self._loop()
            self.say(f"exit {code}: {reason}")
            self.log("exit", exit_code=code, reason=reason, starts=self.counts.starts,
                     failures=self.counts.failures, preemptions=self.counts.preemptions)
        except OSError as exc:  # the run directory or the log cannot be written: no restart can help
            code = EXIT_PERMANENT
            self.say(f"cannot use {self.run_dir} or the log {self.log_path}: {exc}")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the lock, after the last record
        return code

    def _loop(self) -> tuple[int, str]:
        seen = False  # a validated full generation existed at some start
        attempt = 0
        while True:
            attempt += 1
            self._check_stop_file()
            if self.stopped_by is not None:
                reason = f"stopped by the operator ({signal.Signals(self.stopped_by).name}) before start {attempt}"
                self.log("refused", attempt=attempt, classification="stopped", detail=reason)
                return 128 + self.stopped_by, reason
            resume, problem = self._preflight(first=attempt == 1, seen=seen)
            if problem:
                self.log("refused", attempt=attempt, classification="permanent", detail=problem, resumed_from=resume)
                return EXIT_PERMANENT, problem
            seen = seen or resume is not None
            self.say(f"start {attempt}, resuming from {resume or 'nothing (a fresh start)'}: "
                     f"{shlex.join(self.command)}")
            try:
                proc = self._start(attempt, resume)
            except OSError as exc:
                reason = f"cannot start {self.command[0]!r}: {exc.strerror or exc}"
                self.log("refused", attempt=attempt, classification="permanent", detail=reason, resumed_from=resume)
                return EXIT_PERMANENT, reason
            self.counts.starts += 1
            self.log("start", attempt=attempt, pid=proc.pid, command=self.command, resumed_from=resume)
            returncode = self._wait(proc)
            verdict = None
            if returncode == 0:
                verdict = done_mod.check(self.store, self.key, config=self.config)
            outcome = policy_mod.classify(returncode, stopped_by=self.stopped_by, done=verdict)
            decision = policy_mod.decide(outcome, self.counts, self.policy, self.stopped_by)
            exit_code, sig, _ = policy_mod.describe_status(returncode)
            self.say(f"start {attempt} ended: {outcome.detail}; {decision.reason}")
            self.log("end", attempt=attempt, exit_code=exit_code, signal=sig, classification=outcome.kind,
                     detail=outcome.detail, decision="restart" if decision.restart else "stop",
                     wait_s=decision.wait_s)
            if not decision.restart:
                return decision.exit_code, decision.reason
            self._sleep(decision.wait_s or 0.0)
