"""The multi-node launcher (``tests/multinode.py``): several ``torchrun`` agents on this host form one job.

Each agent is a simulated node with its own node dir; ``GROUP_RANK`` comes
from the rendezvous, so the checks map ranks to nodes by ``TRAINSTATE_TEST_NODE``.
"""

from __future__ import annotations

import pytest

from multinode import launch_nodes

pytestmark = pytest.mark.slow


def check_topology(launched, nodes: int, nproc: int, node_dirs) -> list[dict]:
    assert launched.returncodes == [0] * nodes, launched.tail()
    results = launched.ok("topology", nodes * nproc)
    world = nodes * nproc
    assert [r["rank"] for r in results] == list(range(world))
    envs = [r["env"] for r in results]
    assert {int(e["WORLD_SIZE"]) for e in envs} == {world}
    assert {int(e["LOCAL_WORLD_SIZE"]) for e in envs} == {nproc}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert sorted({int(e["GROUP_RANK"]) for e in envs}) == list(range(nodes))
    for node in range(nodes):
        mine = [e for e in envs if e["TRAINSTATE_TEST_NODE"] == str(node)]
        assert len(mine) == nproc, f"agent {node} ran {len(mine)} ranks"
        assert {e["TRAINSTATE_NODE_DIR"] for e in mine} == {str(node_dirs[node])}
        assert sorted(int(e["LOCAL_RANK"]) for e in mine) == list(range(nproc))
        assert len({e["GROUP_RANK"] for e in mine}) == 1, "one agent, one group rank"
        group = int(mine[0]["GROUP_RANK"])  # torchrun's global rank: group rank * nproc + local rank
        assert sorted(int(e["RANK"]) for e in mine) == [group * nproc + local for local in range(nproc)]
    # every rank saw the same gathered view: one node dir per agent, shared by exactly its ranks
    views = [r["node_dirs"] for r in results]
    assert all(view == views[0] for view in views)
    assert sorted(views[0]) == sorted(str(d) for d in node_dirs)
    assert all(len(ranks) == nproc for ranks in views[0].values())
    return results


@pytest.mark.parametrize("nodes,nproc", [(2, 2), (4, 1)])
def test_agents_form_one_job(tmp_path, nodes, nproc):
    node_dirs = [tmp_path / f"node{i}" for i in range(nodes)]
    launched = launch_nodes(tmp_path / "out", node_dirs, ["topology"], nproc=nproc, timeout=120)
    check_topology(launched, nodes, nproc, node_dirs)


def test_late_node_joins(tmp_path):
    """Agent 0 starts 3 s after agent 1 (which then hosts the rendezvous store); the job still forms."""
    node_dirs = [tmp_path / f"node{i}" for i in range(2)]
    launched = launch_nodes(tmp_path / "out", node_dirs, ["topology"], nproc=1, timeout=120, start_delays=[3.0, 0.0],
                            node_env=[{"TRAINSTATE_TEST_MARK": "late"}, {"TRAINSTATE_TEST_MARK": "early"}])
    envs = [r["env"] for r in check_topology(launched, 2, 1, node_dirs)]
    assert {e["TRAINSTATE_TEST_NODE"]: e["TRAINSTATE_TEST_MARK"] for e in envs} == {"0": "late", "1": "early"}
