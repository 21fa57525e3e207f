"""Starting drill workers: fresh interpreters (:class:`Spawner`) or forks of a
process that imported torch once (:class:`Zygote`). Both are real processes.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any
import torch
from .options import run_worker
from .worker import DrillConfig, DrillError, build


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


def processes_holding(paths: set[str]) -> dict[str, list[int]]:
    """The processes with one of ``paths`` open, by path (also once the file was deleted); empty without /proc.

    A drill worker with a loader opens its run's consumed-ids log before its
    DataLoader forks, and keeps it open; the DataLoader workers inherit it
    (torch renames them, but closes no descriptor), even ones whose parent
    was killed before they ran a line. An exited process holds nothing.
    """
    wanted = {os.path.realpath(p) for p in paths}
    found: dict[str, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue  # gone meanwhile, or not ours to see
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
            except OSError:
                continue
            target = target.removesuffix(" (deleted)")
            if target in wanted:
                found.setdefault(target, []).append(int(entry))
                break
    return found


def wait_for_exit(paths: set[str], timeout_s: float) -> dict[str, list[int]]:
    """Wait until no process holds one of ``paths``; those still holding one after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (alive := processes_holding(paths)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


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
        code = run_worker(args)
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

