"""Launch ``tests/dist_worker.py`` scenarios under a real ``torchrun`` (gloo on CPU, loopback only)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "dist_worker.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Launch:
    out: Path
    returncode: int
    log: str

    def result(self, scenario: str, rank: int = 0) -> dict:
        path = self.out / scenario / f"rank{rank}.json"
        assert path.exists(), f"{scenario} wrote no result for rank {rank} (exit {self.returncode}):\n{self.log[-4000:]}"
        return json.loads(path.read_text())

    def ok(self, scenario: str, ranks: int = 2) -> list[dict]:
        """Every rank's result; fails the test with the rank's traceback if it raised."""
        results = [self.result(scenario, r) for r in range(ranks)]
        for rank, result in enumerate(results):
            assert result.get("ok"), f"{scenario} on rank {rank}: {result.get('error')}\n{result.get('trace', '')}"
        return results


_MARKER = "TRAINSTATE_TEST_LAUNCH"  # in every launch's environment, inherited by torchrun and each rank it starts


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_launch(procs: list[subprocess.Popen], marker: str) -> None:
    """SIGKILL each torchrun's process group, then every process carrying ``marker`` (``NAME=value``) in its environ.

    torchrun may start each rank in a session of its own, so killing its group
    can leave ranks running (reparented away from it); each rank inherits
    ``marker``, and its group (the rank, its loader workers) goes too. Also
    for several agents at once (``tests/multinode.py``).
    """
    for proc in procs:
        _killpg(proc.pid)
    needle, ours = marker.encode(), os.getpgrp()
    for _ in range(50):
        found = False
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if needle not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                pgid = os.getpgid(int(entry.name))
            except OSError:  # gone, or not ours to read
                continue
            found = True
            if pgid != ours:
                _killpg(pgid)
            else:
                os.kill(int(entry.name), signal.SIGKILL)
        if not found:
            return
        time.sleep(0.1)


def launch(out: Path, scenarios: list[str], *, ranks: int = 2, env: dict | None = None, timeout: float = 240,
           monitor: float = 0.5, worker: Path = WORKER) -> Launch:
    """One ``torchrun`` for ``scenarios`` (in order, sharing the launch's start-up cost) of ``worker``."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--nnodes=1",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", f"--monitor-interval={monitor}",
               str(worker), str(out), *scenarios]
    marker = f"{_MARKER}=trainstate-{os.getpid()}-{uuid.uuid4().hex[:12]}"  # how cleanup finds every rank
    environment = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                   "PYTHONFAULTHANDLER": "1", **(env or {}), **dict([marker.split("=", 1)])}  # a crash shows threads
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_launch([proc], marker)  # torchrun and every rank, in whatever session: nothing outlives the test
        log, _ = proc.communicate()
        raise AssertionError(f"torchrun {scenarios} did not finish in {timeout:.0f} s:\n{log[-4000:]}") from None
    finally:
        kill_launch([proc], marker)  # a rank torchrun left behind
        if proc.poll() is None:  # interrupted (Ctrl-C) before communicate() returned: torchrun is killed, reap it
            proc.wait()
    return Launch(out, proc.returncode, log)
