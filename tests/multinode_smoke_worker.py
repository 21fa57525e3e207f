"""Checks the multi-node launcher itself, run by ``tests/test_multinode_launch.py`` through ``tests/multinode.py``.

``launch_nodes`` starts one ``torchrun`` agent per simulated node, each with
its own ``TRAINSTATE_NODE_DIR``; this worker reports what each rank sees.
``GROUP_RANK`` is assigned by the c10d rendezvous (agents sorted by pid), so it
need not equal the agent index ``TRAINSTATE_TEST_NODE``: nothing here assumes
it does.

``... multinode_smoke_worker.py OUT SCENARIO [SCENARIO ...]`` writes
``OUT/<scenario>/rank<global rank>.json`` per scenario.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_worker as dw  # noqa: E402

SCENARIOS = {}
ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TRAINSTATE_NODE_DIR", "TRAINSTATE_TEST_NODE")


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


@scenario
def topology(where: Path) -> dict:
    """Each rank's launch environment, and every rank's node dir: one per agent, shared by its ranks."""
    env = {**{key: os.environ.get(key) for key in ENVIRONMENT},
           **{key: value for key, value in os.environ.items() if key.startswith("TRAINSTATE_")}}
    mine = {"rank": dist.get_rank(), "node_dir": env["TRAINSTATE_NODE_DIR"], "node": env["TRAINSTATE_TEST_NODE"],
            "group_rank": env["GROUP_RANK"], "local_rank": env["LOCAL_RANK"]}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    by_dir: dict[str, list[int]] = {}
    for seen in everyone:
        by_dir.setdefault(seen["node_dir"], []).append(seen["rank"])
    same_node = sorted(seen["rank"] for seen in everyone if seen["node"] == mine["node"])
    assert by_dir[mine["node_dir"]] == same_node, f"node dir {mine['node_dir']} held by {by_dir} vs agent {same_node}"
    assert int(env["RANK"]) == dist.get_rank() and int(env["WORLD_SIZE"]) == dist.get_world_size()
    return {"env": env, "rank": dist.get_rank(), "world_size": dist.get_world_size(), "everyone": everyone,
            "node_dirs": by_dir}


if __name__ == "__main__":
    sys.exit(dw.main(SCENARIOS))
