"""Launch a multi-node ``torch.distributed`` job on this one host: one ``torchrun`` agent per simulated node.

Like ``tests/distlaunch.py`` (gloo on CPU, loopback only), but with
``--nnodes=N`` agents that meet at a c10d rendezvous on ``127.0.0.1``; each
agent (a "node") gets its own ``TRAINSTATE_NODE_DIR`` (node-local disk) and
``TRAINSTATE_TEST_NODE=<agent index>``.

The rendezvous, not the agent index, decides each agent's ``GROUP_RANK``
(torch sorts the agents by their rendezvous descriptor, host then pid), so a
worker must read the node from ``TRAINSTATE_TEST_NODE`` or its node dir, never
infer it from ``GROUP_RANK`` or ``RANK``.

Loopback only: ``--local-addr=127.0.0.1`` makes the agent that becomes rank 0
advertise ``MASTER_ADDR=127.0.0.1`` (not this host's FQDN) for the workers'
store, and exactly one agent is told ``is_host=1`` (the others ``is_host=0``)
so which agent serves the rendezvous store is decided here, not by a bind race.
``TCPStore`` servers listen on every interface (``*:port``) whatever host they
are given, and torch has no setting for that, so each agent runs torchrun's
own ``main()`` after a shim (``AGENT``) that hands every store server a socket
already bound to ``127.0.0.1`` (``master_listen_fd``); ``loopback_stores=False``
runs plain ``python -m torch.distributed.run`` instead. Gloo binds to ``lo``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from distlaunch import free_port, kill_launch
from trainstate.drill.nodes import AGENT  # torchrun with its store servers on 127.0.0.1 only

WORKER = Path(__file__).resolve().parent / "multinode_smoke_worker.py"


@dataclass
class NodesLaunch:
    out: Path
    returncodes: list[int]
    logs: list[str]
    nproc: int = 2

    @property
    def world_size(self) -> int:
        return len(self.returncodes) * self.nproc

    def tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- agent {i} (exit {code}) ---\n{log[-chars:]}"
                         for i, (code, log) in enumerate(zip(self.returncodes, self.logs)))

    def result(self, scenario: str, rank: int = 0) -> dict:
        """``out/<scenario>/rank<rank>.json``: ``rank`` is the global rank."""
        path = self.out / scenario / f"rank{rank}.json"
        assert path.exists(), f"{scenario} wrote no result for rank {rank} (exits {self.returncodes}):\n{self.tail()}"
        return json.loads(path.read_text())

    def ok(self, scenario: str, ranks: int | None = None) -> list[dict]:
        """Every rank's result (all ``world_size`` unless told); fails with the rank's traceback if it raised."""
        results = [self.result(scenario, r) for r in range(self.world_size if ranks is None else ranks)]
        for rank, result in enumerate(results):
            assert result.get("ok"), f"{scenario} on rank {rank}: {result.get('error')}\n{result.get('trace', '')}"
        return results


def launch_nodes(out: Path, node_dirs: list[Path], scenarios: list[str], *, worker: Path = WORKER, nproc: int = 2,
                 env: dict | None = None, node_env: list[dict] | None = None, timeout: float = 240,
                 start_delays: list[float] | None = None, monitor: float = 0.5,
                 loopback_stores: bool = True) -> NodesLaunch:
    """``len(node_dirs)`` ``torchrun`` agents of ``nproc`` ranks each, running ``worker OUT *scenarios``.

    ``env`` goes to every agent, ``node_env[i]`` to agent ``i`` only.
    ``start_delays[i]``: seconds after the launch begins that agent ``i``
    starts (a late node; the earliest agent hosts the rendezvous store).
    ``timeout`` counts from the launch's start; past it every process of the
    launch is killed and the test fails with each agent's log tail. Whatever
    happens, no agent or rank outlives the call. Agent ``i``'s output is kept
    in ``out/agent<i>.log``. ``loopback_stores=False``: plain torchrun, whose
    store servers listen on every interface.
    """
    nodes = len(node_dirs)
    node_env = node_env or [{} for _ in range(nodes)]
    start_delays = start_delays or [0.0] * nodes
    assert len(node_env) == nodes and len(start_delays) == nodes, "node_env / start_delays: one per node dir"
    out.mkdir(parents=True, exist_ok=True)
    port, run_id = free_port(), f"trainstate-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    host = min(range(nodes), key=lambda i: start_delays[i])  # the first agent up serves the rendezvous store
    marker = f"TRAINSTATE_TEST_LAUNCH={run_id}"  # inherited by every agent and rank: how cleanup finds them
    base = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1", **(env or {}), **dict([marker.split("=", 1)])}  # a crash shows every thread
    began = time.monotonic()
    deadline = began + timeout
    procs: dict[int, subprocess.Popen] = {}
    log_paths = [out / f"agent{i}.log" for i in range(nodes)]
    try:
        for i in sorted(range(nodes), key=lambda i: start_delays[i]):
            time.sleep(max(0.0, began + start_delays[i] - time.monotonic()))
            node_dirs[i].mkdir(parents=True, exist_ok=True)
            agent = ["-c", AGENT] if loopback_stores else ["-m", "torch.distributed.run"]
            command = [sys.executable, *agent, f"--nnodes={nodes}",
                       f"--nproc_per_node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                       f"--rdzv-id={run_id}", f"--rdzv-conf=is_host={int(i == host)}", "--local-addr=127.0.0.1",
                       f"--monitor-interval={monitor}", str(worker), str(out), *scenarios]
            environment = {**base, "TRAINSTATE_NODE_DIR": str(node_dirs[i]), "TRAINSTATE_TEST_NODE": str(i),
                           **node_env[i]}
            with open(log_paths[i], "w") as log:
                procs[i] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True,
                                            env=environment, start_new_session=True)
        while any(proc.poll() is None for proc in procs.values()):
            if time.monotonic() > deadline:
                kill_launch(list(procs.values()), marker)
                for proc in procs.values():
                    proc.wait()
                raise AssertionError(f"{nodes} torchrun agents {scenarios} did not finish in {timeout:.0f} s:\n"
                                     + _tails(log_paths, procs))
            time.sleep(0.1)
    finally:
        kill_launch(list(procs.values()), marker)  # nothing outlives the launch: no agent, no rank it left behind
        for proc in procs.values():
            proc.wait()
    return NodesLaunch(out, [procs[i].returncode for i in range(nodes)],
                       [path.read_text(errors="replace") for path in log_paths], nproc)


def _tails(paths: list[Path], procs: dict[int, subprocess.Popen], chars: int = 6000) -> str:
    return "\n".join(f"--- agent {i} (exit {procs[i].returncode if i in procs else 'not started'}) ---\n"
                     + (path.read_text(errors="replace")[-chars:] if path.exists() else "")
                     for i, path in enumerate(paths))
