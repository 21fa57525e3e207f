"""A restart with every node's disk intact sends nothing to the remote, at 2, 4 and 8 emulated nodes (issue 50).

Usage::

    python benchmarks/bench_tier_restart.py                       # 2, 4 and 8 nodes, one rank each
    python benchmarks/bench_tier_restart.py --nodes 8 --out r.json

Each node is a ``torchrun --nnodes`` agent of this host with its own directory (``tests/multinode.py``), one
rank per node, gloo on loopback. The remote tier is moto on 127.0.0.1 behind ``tests/objectservers.FaultProxy``,
which counts every request. One launch trains the tests' FSDP2 model and saves every 2 updates
(``tests/tier_worker.py``: two replicas, every second generation uploaded); every process then exits, and a new
launch of every node restores (``tier_resume``: a freshly seeded state, compared bitwise with the state saved).
Reported per N: the requests that reached the object store during the restart (goal: 0), the bytes each
source served (own disk, peers, remote), the restore's wall time as rank 0 saw it, and whether every rank
resumed bitwise. The load average is recorded before each N.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from multinode import launch_nodes  # noqa: E402
from objectservers import FaultProxy, start_moto  # noqa: E402

WORKER = ROOT / "tests" / "tier_worker.py"


def restart(n: int, server, workdir: Path) -> dict:
    bucket = server.make_bucket()
    url = server.url(bucket, f"run-{uuid.uuid4().hex[:8]}")
    dirs = [workdir / f"n{n}" / f"node{i}" for i in range(n)]
    out = workdir / f"n{n}" / "out"
    with FaultProxy(server.endpoint) as proxy:
        env = {"TRAINSTATE_TEST_S3": json.dumps({"url": url, "storage_options": server.storage_options(
            endpoint=proxy.endpoint)}), "TS_MIRROR_EVERY": "2"}
        load = os.getloadavg()
        started = time.perf_counter()
        trained = launch_nodes(out, dirs, ["tier_train"], worker=WORKER, nproc=1, env=env)
        trained.ok("tier_train", n)
        train_s = time.perf_counter() - started
        uploads = proxy.count("PUT")
        proxy.clear()
        started = time.perf_counter()
        resumed = launch_nodes(out, dirs, ["tier_resume"], worker=WORKER, nproc=1, env=env)
        results = resumed.ok("tier_resume", n)
        return {"nodes": n, "load_before": [round(x, 2) for x in load], "train_launch_s": round(train_s, 1),
                "restart_launch_s": round(time.perf_counter() - started, 1), "uploads_while_training": uploads,
                "remote_requests_at_restart": proxy.count(), "generation": results[0]["generation"],
                "sources": results[0]["sources"], "restore_s": results[0].get("restore_s"),
                "bitwise": all(r["full_differs"] == [] and r["rank_differs"] == [] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="2,4,8", help="comma-separated node counts")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        server = start_moto(Path(tmp))
        try:
            for n in [int(x) for x in args.nodes.split(",")]:
                result = restart(n, server, Path(tmp))
                results.append(result)
                print(json.dumps(result), flush=True)
        finally:
            server.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print("| nodes | remote requests at restart | own disk B | peers B | remote B | bitwise | restart launch s | load |")
    print("|---:|---:|---:|---:|---:|---|---:|---|")
    for r in results:
        s = r["sources"]
        print(f"| {r['nodes']} | **{r['remote_requests_at_restart']}** | {s['local']:,} | {s['peer']:,} | "
              f"{s['remote']:,} | {r['bitwise']} | {r['restart_launch_s']} | {r['load_before'][0]} |")


if __name__ == "__main__":
    main()
