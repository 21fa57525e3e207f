"""Acceptance: the kill drill on several nodes (``trainstate demo --ranks N --nodes M``) loses a node, resumes bitwise.

The trial is :func:`trainstate.drill.nodes.run_nodes_drill` at CI size: two
``torchrun`` agents of this host (a c10d rendezvous on 127.0.0.1), each a
node of one rank with its own directory (node-local tiers, ``replicas=2``),
FSDP2 over gloo; two SIGKILLs of every agent and rank, the second of which
also deletes one node's directory, as a lost machine would. The first kill
is any of the seeded schedule's modes; the second is a ``time`` kill aimed
at 40-90 % of the updates left, which always comes after at least two saves
of its launch (or after a restore), so some generation is replicated when
the node is lost: the next launch must restore the generation the surviving
directory serves, with the lost node's files received from its replica,
refill the replacement, and end bitwise equal (full model, optimizer,
schedule, clock, every rank's streams) to the uninterrupted launch. While
the drill runs, every listening socket of its processes is sampled: all on
127.0.0.1. The negative control reuses the reference: a resume after a lost
node that forgets the per-rank RNG streams ends different.

The kill schedule is seeded: set TRAINSTATE_KILL_SEED to replay one.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from trainstate.cli.demo import RANKS_CONFIG
from trainstate.cli.main import main as cli_main
from trainstate.drill import KillPlan
from trainstate.drill.nodes import NodesLaunch, plan_node_losses, run_nodes_drill
from trainstate.drill.ranks import marked_processes, plan_rank_kills
from trainstate.drill.ranks_worker import FINAL_FILE
from trainstate.format.manifest import generation_name
from test_kill_ranks import _reap_strays as reap_strays

SEED = int(os.environ.get("TRAINSTATE_KILL_SEED") or random.SystemRandom().randrange(2**31))
TOKEN_ENV = "TRAINSTATE_TEST_KILL_NODES"  # inherited by every agent and rank the drill starts


def _reap_strays(token: str) -> list[int]:
    return reap_strays(token, TOKEN_ENV)


def _address(hexed: str) -> str:
    """An address of /proc/net/tcp{,6} (each 32-bit word in host order, little-endian here)."""
    raw = b"".join(bytes.fromhex(hexed[i:i + 8])[::-1] for i in range(0, len(hexed), 8))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def listening(token: str) -> set[str]:
    """The local addresses (``addr:port``) of the TCP sockets that processes carrying ``token`` listen on."""
    inodes: set[str] = set()
    for pid in marked_processes(token, TOKEN_ENV):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue  # gone meanwhile
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                host, port = fields[1].split(":")
                found.add(f"{_address(host)}:{int(port, 16)}")
    return found


class Listeners(threading.Thread):
    """Samples :func:`listening` every 0.2 s until stopped."""

    def __init__(self, token: str):
        super().__init__(daemon=True)
        self.token, self.seen, self._done = token, set(), threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.2):
            self.seen |= listening(self.token)

    def stop(self) -> None:
        self._done.set()
        self.join(10)


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory):
    """The drill with 2 kills, the second losing a node; (root, result, addresses listened on, strays, seconds)."""
    root = tmp_path_factory.mktemp("nodes") / "drill"
    rng = random.Random(SEED)
    plans = [plan_rank_kills(rng, 3)[0], KillPlan("time", rng.uniform(0.4, 0.9), rng.uniform(0.0, 1.0))]
    token = f"nodes-{os.getpid()}-{SEED}"
    sampler = Listeners(token)
    began = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TOKEN_ENV, token)
        sampler.start()
        try:
            result = run_nodes_drill(RANKS_CONFIG, root, kills=2, seed=SEED, nodes=2, per_node=1, plans=plans,
                                     lose=[False, True], log=print)
        finally:
            sampler.stop()
            strays = _reap_strays(token)
    return root, result, sampler.seen, strays, time.monotonic() - began


@pytest.mark.slow
def test_two_nodes_killed_twice_one_lost_resume_bitwise(drill):
    root, result, addresses, strays, elapsed = drill
    report = result.as_json()
    context = f"seed {SEED} (TRAINSTATE_KILL_SEED), {elapsed:.0f} s: {report}"
    assert not strays, f"processes {strays} outlived the drill"
    assert result.ok and report["problems"] == [] and report["differences"] == [], context
    assert report["kills"] == 2 and report["launches"] == 4, context
    assert set(report["compared"]) == {"model", "optimizer", "scheduler", "rank-0", "rank-1"}, context
    starts = report["starts"]
    assert [s["exit_code"] for s in starts] == [-signal.SIGKILL, -signal.SIGKILL, 0], context

    # one node lost at the second kill, with a generation the other node's replicas still served
    [loss] = result.lost
    assert loss.kill == 2 and loss.node in (0, 1) and loss.after is not None, context
    assert starts[2]["restored"] == loss.after and starts[2]["peer_bytes"] > 0, context
    assert starts[1]["lost_node"] == loss.node and starts[0]["lost_node"] is None, context

    # the replacement was refilled: at the end both nodes hold the final generation, each in its own and its
    # replicated tier; the final files are beside the node directories, every launch's log beside the run
    final = generation_name(RANKS_CONFIG.total)
    for node in ("node-0", "node-1"):
        assert (root / "interrupted" / node / final).is_dir(), node
        assert (root / "interrupted" / node / "replicas" / final).is_dir(), node
    assert (root / "interrupted" / FINAL_FILE).is_file()
    logs = sorted((root).glob("interrupted-launch-*.log"))
    assert len(logs) == 3, logs
    lines = logs[-1].read_text().splitlines()
    assert f"done {RANKS_CONFIG.total}" in {line.split("] ", 1)[1] for line in lines if line.startswith("[node ")}

    # loopback only: the rendezvous, the workers' store and gloo listened on 127.0.0.1 and nowhere else
    assert addresses, "the sampler saw no listening socket: it cannot have checked anything"
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses


@pytest.mark.slow
def test_negative_control_a_resume_after_a_lost_node_that_forgets_ends_different(drill, tmp_path):
    """The same comparison fails when the resume from the surviving node forgets the ranks' RNG streams."""
    root, result, _, _, _ = drill
    plan = [KillPlan("time", 0.5, 0.5)]  # about update 21 of 40: several generations saved and replicated
    negative = run_nodes_drill(RANKS_CONFIG, tmp_path, kills=1, seed=SEED, plans=plan, lose=[True], forget="rng",
                               reference=(root / "reference", result.drill.timing))
    r = negative.drill.report
    assert r.finished and not r.problems and r.kills == 1 and r.resumes == 1 and len(negative.lost) == 1, r
    differing = {d.split(":")[0] + ":" + d.split(":")[1].split()[0] for d in negative.drill.comparison.differences}
    assert {"rank-0.safetensors:noise.next", "rank-1.safetensors:noise.next"} <= differing, differing


# without torchrun --------------------------------------------------------------------------------------------
def test_node_losses_are_seeded_and_avoid_startup_kills():
    for seed in range(30):
        plans = plan_rank_kills(random.Random(seed), 4)
        lose = plan_node_losses(random.Random(seed), plans, 2)
        assert lose == plan_node_losses(random.Random(seed), plans, 2) and sum(lose) == 2
        assert all(plan.mode != "startup" for plan, lost in zip(plans, lose) if lost)
    only_startup = [KillPlan("startup", 0.1)]
    assert plan_node_losses(random.Random(0), only_startup, 1) == [True]  # nothing else to choose
    assert plan_node_losses(random.Random(0), [], 1) == []


_AGENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print("agent", sys.argv[1], child.pid, flush=True)
time.sleep(600)
"""


def test_a_launch_of_several_agents_is_read_and_killed_as_one():
    """Two stand-in agents, each starting a child in a session of its own (as torchrun starts its ranks): their
    lines arrive on one stream, and one kill takes down both agents and both children."""
    launch = NodesLaunch([[sys.executable, "-c", _AGENT, str(i)] for i in range(2)], [{}, {}])
    try:
        lines = [launch.next_line(time.monotonic() + 60) for _ in range(2)]
        assert sorted(line.split()[1] for line in lines) == ["0", "1"], lines
        children = [int(line.split()[2]) for line in lines]
        deadline = time.monotonic() + 30  # a child just forked may be between fork and exec: not yet readable
        while len(marked_processes(launch.marker)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(marked_processes(launch.marker)) == sorted(children + [p.pid for p in launch.procs])
        assert all(os.getpgid(c) != os.getpgid(p.pid) for c, p in zip(children, launch.procs))
        launch.kill()
        assert launch.reap(30) == -signal.SIGKILL and launch.groups_killed == 4
        assert marked_processes(launch.marker) == [] and launch.next_line(time.monotonic() + 1) is None
    finally:
        for pid in marked_processes(launch.marker):
            os.kill(pid, signal.SIGKILL)


def test_demo_nodes_flag_needs_ranks_that_split_evenly(capsys):
    assert cli_main(["demo", "--nodes", "2"]) == 1
    assert "--nodes needs --ranks" in capsys.readouterr().err
    assert cli_main(["demo", "--ranks", "3", "--nodes", "2"]) == 1
    assert "multiple of --nodes" in capsys.readouterr().err
    assert cli_main(["demo", "--ranks", "1", "--nodes", "1"]) == 1
    assert "2 or more nodes" in capsys.readouterr().err
