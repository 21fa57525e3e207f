"""Launch ``tests/dist_worker.py`` scenarios under a real ``torchrun`` (gloo on CPU, loopback only)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
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


def launch(out: Path, scenarios: list[str], *, ranks: int = 2, env: dict | None = None, timeout: float = 240,
           monitor: float = 0.5, worker: Path = WORKER) -> Launch:
    """One ``torchrun`` for ``scenarios`` (in order, sharing the launch's start-up cost) of ``worker``."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--nnodes=1",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", f"--monitor-interval={monitor}",
               str(worker), str(out), *scenarios]
    environment = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                   **(env or {})}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank: nothing outlives the test
        log, _ = proc.communicate()
        raise AssertionError(f"torchrun {scenarios} did not finish in {timeout:.0f} s:\n{log[-4000:]}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # a rank torchrun left behind
        except ProcessLookupError:
            pass
    return Launch(out, proc.returncode, log)
