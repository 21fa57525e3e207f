"""The multi-node kill drill: several ``torchrun`` agents on this host, node-local tiers, and lost nodes.

:func:`run_nodes_drill` is :func:`.ranks.run_ranks_drill` with each launch
split over ``nodes`` torchrun agents of this host (:class:`NodesLaunch`), each
agent a node with its own directory, ``<run>/node-<i>``, that no other node
reads: the ranks of :mod:`.ranks_worker` save with
``CheckpointManager(node_dir, keep_last=2, replicas=2)`` (node-local tiers:
every node's files are copied to another node in the background). The run
directory itself receives only the final files the comparison reads.

A kill takes down every agent and every rank at once: the agents' process
groups are stopped first, then :func:`.ranks.kill_launch` stops and kills
every process carrying the launch's marker, whatever session torchrun put
it in. At the kills the seeded schedule picks (:func:`plan_node_losses`),
one node is then *lost*: its directory is deleted, as a machine that does
not come back takes its disk with it, and the next launch starts that node
with an empty directory (the replacement). The next launch must restore the
newest generation the surviving directories serve whole (its lost files from
the replicas) and refill the replacement. A node whose loss no surviving
holding could cover (a generation committed, its first replicas not yet)
is not deleted there, nor one while the nodes hold nothing yet (unless it is the
last kill): the loss moves to the next kill, and the report says so.

After every kill, before any loss, every node's directory is read together
(:func:`trainstate.tools.nodes.check_nodes`): every held byte digested,
every ``latest`` servable by the nodes, every ``replicas/latest`` servable
after the loss of any one node. Between a loss and the first launch since
that reached training (its restore refilled the replacement and moved every
pointer) the pointers are not judged: a loss may take what they claim (the
other copy of what ``replicas/latest`` names), which is what the next
restore repairs. At the end the finished run's nodes must be sound and its
final generation on two nodes (:func:`check_finished`).

Loopback only. The agents meet at a c10d rendezvous on ``127.0.0.1`` (agent
0 serves its store: ``is_host=1``, the others ``is_host=0``) and pass
``--local-addr=127.0.0.1``, so the ranks are told ``MASTER_ADDR=127.0.0.1``;
gloo is bound to ``lo``. ``TCPStore`` servers listen on every interface
whatever host they are given, so each agent runs torchrun's own ``main()``
after a shim (:data:`AGENT`) that hands every store server it creates a
socket already bound to ``127.0.0.1`` (``master_listen_fd``): the drill
listens on no other address of the machine.
"""

from __future__ import annotations

import queue
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..storage.local import LocalStore
from ..tools.nodes import check_nodes, read_node
from .driver import DrillReport, KillPlan, Start, Timing, _landed
from .launch import _TIMEOUT, worker_env
from .ranks import (RanksDrill, _signal_group, compare_ranks, describe_launch, dying_with_this_process, kill_launch,
                    plan_rank_kills, run_ranks_interrupted, run_ranks_reference)
from .ranks_worker import LAUNCH_ENV, NODE_DIR_ENV, RanksConfig
from .worker import DrillError

REPLICAS = 2  # every node's files on two nodes: the run survives the loss of any one

# ``python -c AGENT <torchrun args>``: torchrun, with every TCPStore server it starts listening on 127.0.0.1 only.
AGENT = """
import socket, sys
import torch.distributed as dist


class LoopbackTCPStore(dist.TCPStore):
    def __init__(self, host_name, port, world_size=None, is_master=False, *args, **kwargs):
        if is_master and kwargs.get("master_listen_fd") is None and len(args) < 4:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError as exc:  # what torch's own bind raises, so its fallbacks still apply
                sock.close()
                raise RuntimeError(f"loopback TCPStore bind 127.0.0.1:{port}: {exc}") from exc
            sock.listen(4096)
            port = sock.getsockname()[1]
            kwargs["master_listen_fd"] = sock.detach()  # the store owns the socket now
        super().__init__(host_name, port, world_size, is_master, *args, **kwargs)


dist.TCPStore = LoopbackTCPStore  # before torchrun imports the rendezvous modules
from torch.distributed.run import main

sys.argv[0] = "torchrun"
sys.exit(main())
"""


def node_dirs(directory: Path, nodes: int) -> list[Path]:
    """Each node's own directory inside the run directory: ``node-0``, ``node-1``..."""
    return [directory / f"node-{i}" for i in range(nodes)]


def free_port() -> int:
    """A port free on 127.0.0.1 now (the rendezvous binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def agent_args(cfg: RanksConfig, directory: Path, *, nodes: int, per_node: int, host: bool, port: int,
               run_id: str, forget: str | None = None) -> list[str]:
    """One agent's command: torchrun (behind :data:`AGENT`) of ``per_node`` ranks, one of ``nodes``."""
    return [sys.executable, "-c", AGENT, f"--nnodes={nodes}", f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}", f"--rdzv-conf=is_host={int(host)}",
            "--local-addr=127.0.0.1", "--monitor-interval=1", "-m", "trainstate.drill.ranks_worker",
            "--dir", str(directory), *cfg.argv(), "--replicas", str(REPLICAS)] + (
                ["--forget", forget] if forget else [])


class NodesLaunch:
    """One launch of ``nodes`` torchrun agents, read and killed as one (what :mod:`.ranks` drives and checks).

    Every agent and rank carries the same marker in its environment; the
    progress lines come from rank 0, on whichever agent the rendezvous made
    group rank 0. ``lines`` holds every agent's output in arrival order;
    ``tagged`` the same lines with the agent that printed them.
    """

    def __init__(self, commands: list[list[str]], node_env: list[dict[str, str]]):
        self.marker = secrets.token_hex(8)
        self.groups_killed = 0
        self.lines: list[str] = []
        self.tagged: list[tuple[int, str]] = []
        self._queue: queue.SimpleQueue[tuple[int, str | None]] = queue.SimpleQueue()
        self._open = len(commands)
        self.spawned = time.monotonic()
        self.procs: list[subprocess.Popen] = []
        try:
            for extra, args in zip(node_env, commands):
                env = dict(worker_env(), GLOO_SOCKET_IFNAME="lo", **{LAUNCH_ENV: self.marker}, **extra)
                self.procs.append(subprocess.Popen(dying_with_this_process(args), stdin=subprocess.DEVNULL,
                                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                   bufsize=1, env=env, start_new_session=True))
        except BaseException:
            self.kill()
            raise
        self._readers = [threading.Thread(target=self._read, args=(i, proc), daemon=True)
                         for i, proc in enumerate(self.procs)]
        for reader in self._readers:
            reader.start()

    def _read(self, agent: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self._queue.put((agent, line.rstrip("\n")))
        self._queue.put((agent, None))

    def next_line(self, deadline: float) -> Any:
        """The next line of any agent, ``None`` once every agent's output ended, or ``_TIMEOUT``."""
        while self._open:
            try:
                agent, line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return _TIMEOUT
            if line is None:
                self._open -= 1
                continue
            self.lines.append(line)
            self.tagged.append((agent, line))
            return line
        return None

    def kill(self) -> None:
        """Every agent and rank at once, whatever state it is in (also after the agents exited: strays go too)."""
        live = [p for p in self.procs if p.returncode is None]
        for proc in live:  # no agent starts or restarts a rank meanwhile
            _signal_group(proc.pid, signal.SIGSTOP)
        if self.procs:  # it finds every agent and rank by the marker; the first agent's group is stopped first
            self.groups_killed = max(self.groups_killed, kill_launch((live or self.procs)[0], self.marker))

    def reap(self, timeout: float = 300.0) -> int:
        """Wait for every agent; 0 if all exited 0, else the first other exit status (agent order)."""
        codes = [proc.wait(timeout) for proc in self.procs]
        for reader in self._readers:
            reader.join(timeout)
        while not self._queue.empty():
            agent, line = self._queue.get()
            if line is None:
                self._open -= 1
            else:
                self.lines.append(line)
                self.tagged.append((agent, line))
        for proc in self.procs:
            proc.stdout.close()
        return next((code for code in codes if code != 0), 0)

    def tail(self, n: int = 8) -> str:
        return " | ".join(f"node {agent}: {line}" for agent, line in self.tagged[-n:]) or "(no output)"


def start_nodes(cfg: RanksConfig, directory: Path, nodes: int, per_node: int, forget: str | None = None) -> NodesLaunch:
    """A fresh launch: each node's directory made if missing (a replacement's is empty), agent 0 hosting."""
    port, run_id = free_port(), f"trainstate-drill-{secrets.token_hex(6)}"
    commands, envs = [], []
    for i, path in enumerate(node_dirs(directory, nodes)):
        path.mkdir(parents=True, exist_ok=True)
        commands.append(agent_args(cfg, directory, nodes=nodes, per_node=per_node, host=i == 0, port=port,
                                   run_id=run_id, forget=forget))
        envs.append({NODE_DIR_ENV: str(path)})
    return NodesLaunch(commands, envs)


# which kills lose a node -----------------------------------------------------------------------------------
def plan_node_losses(rng: random.Random, plans: list[KillPlan], losses: int) -> list[bool]:
    """Which kills also lose a node: ``losses`` of them, taken from kills that land after start-up (a start-up
    kill may come before anything was saved, where losing a node would test nothing)."""
    eligible = [i for i, plan in enumerate(plans) if plan.mode != "startup"] or list(range(len(plans)))
    chosen = set(rng.sample(eligible, min(losses, len(eligible))))
    return [i in chosen for i in range(len(plans))]


@dataclass
class Loss:
    """One node lost after a kill (``node`` None: a loss planned there could not happen; ``note`` says why)."""

    kill: int
    node: int | None
    before: str | None  # the newest generation all the nodes served together, right after the kill
    after: str | None  # the newest the surviving nodes serve: what the next launch must restore
    note: str = ""


class Nodes:
    """The :class:`.ranks.Layout` of the multi-node drill: launches of agents, checks over every node, losses."""

    def __init__(self, cfg: RanksConfig, directory: Path, nodes: int, per_node: int, lose: list[bool],
                 rng: random.Random, forget: str | None = None):
        self.cfg, self.directory, self.nodes, self.per_node = cfg, directory, nodes, per_node
        self.dirs = node_dirs(directory, nodes)
        self.lose, self.rng, self.forget = lose, rng, forget
        self.losses: list[Loss] = []
        self.peer_bytes: dict[int, int] = {}  # launch -> bytes its restore received from other nodes
        self.pending = False  # a planned loss that could not happen yet
        self.unrepaired = False  # a node was lost and no launch has refilled it yet (reached training since)
        self.leftovers: set[str] = set()

    def start(self, index: int) -> NodesLaunch:
        self.leftovers = set(LocalStore(self.dirs[0]).leftovers())  # made here if missing, as the launch would
        return start_nodes(self.cfg, self.directory, self.nodes, self.per_node, self.forget)

    def keep_log(self, index: int, launch: NodesLaunch) -> None:
        """Every agent's output, beside (not inside) the run directory, each line tagged with its node; and the
        bytes its restore received from other nodes."""
        path = self.directory.parent / f"{self.directory.name}-launch-{index}.log"
        path.write_text("".join(f"[node {agent}] {line}\n" for agent, line in launch.tagged))
        restored = next((x.split() for x in launch.lines if x.startswith("restored ")), [])
        self.peer_bytes[index] = next((int(f[5:]) for f in restored if f.startswith("peer=")), 0)

    def after_kill(self, start: Start, launch: NodesLaunch, report: DrillReport) -> str | None:
        start.landed, start.during_save = _landed(launch.lines, LocalStore(self.dirs[0]), self.leftovers)
        if any(line.startswith("training ") for line in launch.lines):
            self.unrepaired = False  # its restore refilled every node and moved every pointer before training
        found = check_nodes(self.dirs)
        # Until a launch refills a lost node, the pointers may claim what the loss took (a replicas/latest whose
        # other copy was on the lost node): only the bytes held are judged then.
        failures = [d for path in self.dirs for d in read_node(path)[0].damaged] if self.unrepaired else \
            found["failures"]
        report.problems += [f"after kill {start.index}: {failure}" for failure in failures]
        report.verified_after_kills += sum(v["servable"] for v in found["generations"].values())
        newest = found["recovery_point"]
        if self.unrepaired:
            start.landed += "; the lost node not yet refilled"
        elif newest is not None and not found["generations"][newest]["survives_one_node"]:
            start.landed += f"; {newest} not yet replicated"
        if not (self.pending or (start.index <= len(self.lose) and self.lose[start.index - 1])):
            return newest
        return self._lose_one(start.index, newest, bool(found["generations"]), start.index >= len(self.lose))

    def _lose_one(self, kill: int, newest: str | None, held: bool, last: bool) -> str | None:
        """Delete one node's directory whose loss the other nodes can cover; what the next launch must restore.

        While a later kill remains, a node is lost only once the nodes hold something to lose. A loss the
        surviving holdings could not cover (the first generation committed, its replicas not yet) never
        happens: the run could not resume (``NoValidGeneration``, as a real cluster would find).
        """
        after = {i: check_nodes([d for j, d in enumerate(self.dirs) if j != i], content=False)["recovery_point"]
                 for i in range(self.nodes)}
        survivable = [i for i in range(self.nodes) if after[i] is not None] if held else \
            list(range(self.nodes)) if last else []
        if not survivable:
            why = f"{newest or 'a generation'} is on every node, its replicas not yet" if held else \
                "the nodes held nothing yet"
            self.pending = not last
            self.losses.append(Loss(kill, None, newest, newest, why + (": no node lost" if last else
                                                                        "; the loss moves to the next kill")))
            return newest
        node = self.rng.choice(survivable)
        shutil.rmtree(self.dirs[node])
        self.pending, self.unrepaired = False, True
        self.losses.append(Loss(kill, node, newest, after[node]))
        return after[node]

    def describe(self, start: Start, launch: NodesLaunch) -> str:
        line = describe_launch(start, launch, f"all {self.nodes} torchrun agents and every rank")
        peer = self.peer_bytes.get(start.index, 0)
        if peer:
            line = line.replace(f"resumed from {start.restored}",
                                f"resumed from {start.restored} ({peer:,} bytes from other nodes' replicas)", 1)
        for loss in (x for x in self.losses if x.kill == start.index):
            if loss.node is None:
                line += f"\n    (node loss planned at this kill postponed: {loss.note})"
            else:
                line += (f"\n    node {loss.node} LOST at kill {loss.kill}: {self.dirs[loss.node]} deleted "
                         f"(the nodes held {loss.before or 'nothing'}); the next launch must restore "
                         f"{loss.after or 'nothing (fresh)'} from the surviving nodes")
        return line


# the drill ------------------------------------------------------------------------------------------------
@dataclass
class NodesDrill:
    """The outcome of :func:`run_nodes_drill`: the ranks drill's, plus the node layout and the losses."""

    drill: RanksDrill
    nodes: int
    per_node: int
    losses: list[Loss] = field(default_factory=list)
    peer_bytes: dict[int, int] = field(default_factory=dict)  # launch -> bytes its restore got from other nodes

    @property
    def lost(self) -> list[Loss]:
        return [loss for loss in self.losses if loss.node is not None]

    @property
    def ok(self) -> bool:
        return self.drill.ok

    def as_json(self) -> dict[str, Any]:
        out = self.drill.as_json()
        for index, start in enumerate(out["starts"], 1):
            start["lost_node"] = next((x.node for x in self.lost if x.kill == index), None)
            start["peer_bytes"] = self.peer_bytes.get(index, 0)
        return {**out, "nodes": self.nodes, "ranks_per_node": self.per_node, "replicas": REPLICAS,
                "nodes_lost": len(self.lost), "losses": [asdict(loss) for loss in self.losses]}


def run_nodes_drill(cfg: RanksConfig, root: Path, *, kills: int, seed: int, nodes: int = 2, per_node: int = 1,
                    losses: int | None = None, plans: list[KillPlan] | None = None, lose: list[bool] | None = None,
                    forget: str | None = None, reference: tuple[Path, Timing] | None = None,
                    log: Callable[[str], None] | None = None) -> NodesDrill:
    """Reference into ``root/reference`` (or reuse ``reference``), interrupted into ``root/interrupted``, compare.

    ``kills`` SIGKILLs (``plans`` overrides the seeded schedule), of which
    ``losses`` (default: half, rounded up) also lose a node (``lose``, one
    bool per kill, overrides which).
    """
    if nodes < 2 or per_node < 1:
        raise DrillError(f"the multi-node drill needs 2 or more nodes of 1 or more ranks, got {nodes} x {per_node}")
    rng = random.Random(seed)
    plans = plans if plans is not None else plan_rank_kills(rng, kills)
    lose = lose if lose is not None else plan_node_losses(rng, plans, (len(plans) + 1) // 2 if losses is None
                                                          else losses)
    if reference is None:
        ref_dir = root / "reference"
        timing = run_ranks_reference(cfg, ref_dir, start=lambda: start_nodes(cfg, ref_dir, nodes, per_node))
        if log:
            log(f"reference: one launch of {nodes} agents ran uninterrupted in {timing.wall_s:.1f} s (start-up "
                f"{timing.startup_s:.1f} s, a save taking {timing.save_s * 1000:.0f} ms, median)")
    else:
        ref_dir, timing = reference
    if log:
        log("interrupted run (each launch new torchrun agents with fresh processes, restoring from the nodes' disks):")
    directory = root / "interrupted"
    layout = Nodes(cfg, directory, nodes, per_node, lose, rng, forget)
    report = run_ranks_interrupted(cfg, directory, kills=len(plans), seed=seed, timing=timing, plans=plans, log=log,
                                   layout=lambda: layout)
    if report.finished:
        report.problems += check_finished(node_dirs(directory, nodes))
    comparison = compare_ranks(ref_dir, directory, nodes * per_node) if report.finished else None
    return NodesDrill(RanksDrill(timing, report, comparison), nodes, per_node, layout.losses, layout.peer_bytes)


def check_finished(dirs: list[Path]) -> list[str]:
    """A finished run's nodes, read together: sound, and the final generation survives the loss of any one node
    (so every replacement was refilled and its replicas written before the run closed)."""
    found = check_nodes(dirs)
    problems = [f"after the run: {failure}" for failure in found["failures"]]
    final = found["recovery_point"]
    if final is None or not found["generations"][final]["survives_one_node"]:
        problems.append(f"after the run: its final generation ({final or 'none'}) would not survive the loss of a node")
    return problems
