"""What reading a run from an object store downloads: requests, bytes and seconds, through a counting proxy.

Usage::

    python benchmarks/bench_restore_traffic.py                    # 2 ranks FSDP2 and DDP, and one process
    python benchmarks/bench_restore_traffic.py --width 4096       # a larger model (width 4096: about 200 MB)
    PYTHONPATH=/path/to/older/checkout python benchmarks/bench_restore_traffic.py   # the same, older library

moto's server runs on 127.0.0.1 (started and stopped here by ``tests/objectservers.py``); a
``FaultProxy`` between the real ``obstore`` client and the server relays every request and counts
the body bytes it relays (a GET a reader abandons counts with every byte already sent). Each case
saves once without the proxy, then restores (or verifies, exports, pulls) through it:

- ``restore-1``: one process, ``CheckpointManager(url).restore``;
- ``verify``, ``export``, ``mirror-pull``: ``verify_generation(content=True)``, ``ts.export``, a
  ``mirror=`` restore into an empty local directory;
- ``restore-fsdp``, ``restore-ddp``: 2 ranks under ``torchrun`` (gloo), the ``object_restore``
  scenario of ``tests/dist_worker.py`` (a 3-layer MLP of ``--width`` and AdamW).

Printed per case: the generation's bytes, GET bytes and their ratio to it, GETs, HEADs, LISTs, and
seconds (the restore as the processes timed it; for one process, the call). The library is the
one ``import trainstate`` finds, so an older checkout on ``PYTHONPATH`` measures the code before.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import trainstate as ts  # noqa: E402
from objectservers import FaultProxy, free_port, start_moto, start_seaweedfs  # noqa: E402


def counts(traffic: list) -> dict:
    gets = [t for t in traffic if t.method == "GET" and "list-type" not in t.path and "?uploads" not in t.path]
    return {"get_bytes": sum(t.bytes for t in gets), "gets": len(gets),
            "heads": sum(t.method == "HEAD" for t in traffic),
            "lists": sum(t.method == "GET" and "list-type" in t.path for t in traffic)}


def state(width: int, seed: int = 0) -> ts.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    out = ts.TrainState(model=model, optimizer=opt)
    out.next_update = 1
    return out


def single(server, width: int) -> list[dict]:
    url = server.url(server.make_bucket(), f"run-{uuid.uuid4().hex[:8]}")
    with ts.CheckpointManager(url, storage_options=server.storage_options()) as ckpt:
        size = ckpt.save(state(width)).size
    rows = []
    for case in ("restore-1", "verify", "export", "mirror-pull"):
        with FaultProxy(server.endpoint) as proxy, tempfile.TemporaryDirectory() as tmp:
            options = server.storage_options(endpoint=proxy.endpoint)
            started = time.perf_counter()
            if case == "restore-1":
                with ts.CheckpointManager(url, storage_options=options) as ckpt:
                    ckpt.restore(state(width, seed=1))
            elif case == "verify":
                from trainstate.storage.locate import open_store
                from trainstate.storage.verify import verify_generation

                store = open_store(url, storage_options=options)
                verify_generation(store, store.generations()[0], content=True)
            elif case == "export":
                ts.export(url, Path(tmp) / "release", storage_options=options)
            else:
                with ts.CheckpointManager(Path(tmp) / "local", mirror=url, mirror_options=options) as ckpt:
                    ckpt.restore(state(width, seed=1))
            seconds = time.perf_counter() - started
            rows.append({"case": case, "size": size, "seconds": round(seconds, 3), **counts(proxy.traffic)})
    return rows


def ranks(server, width: int, mode: str) -> dict:
    url = server.url(server.make_bucket(), f"run-{uuid.uuid4().hex[:8]}")
    with tempfile.TemporaryDirectory() as tmp:
        common = {"url": url, "mode": mode, "reference": str(Path(tmp) / "ref.safetensors")}

        def launch(phase: str, options: dict) -> list[dict]:
            out = Path(tmp) / phase
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TRAINSTATE_TEST_WIDTH": str(width),
                   "TRAINSTATE_TEST_S3": json.dumps({**common, "phase": phase, "storage_options": options})}
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
                            "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                            str(ROOT / "tests" / "dist_worker.py"), str(out), "object_restore"],
                           env=env, check=True, capture_output=True, timeout=900)
            return [json.loads((out / "object_restore" / f"rank{r}.json").read_text()) for r in range(2)]

        size = launch("save", server.storage_options())[0]["size"]
        with FaultProxy(server.endpoint) as proxy:
            restored = launch("restore", server.storage_options(endpoint=proxy.endpoint))
            traffic = list(proxy.traffic)
    assert all(r["differs"] == [] for r in restored), restored
    return {"case": f"restore-{mode}", "size": size, "seconds": max(r["seconds"] for r in restored),
            **counts(traffic)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=2048, help="the MLP's hidden width (2048: about 52 MB)")
    parser.add_argument("--server", choices=("moto", "seaweedfs"), default="moto",
                        help="moto serves a ranged GET by copying the whole object (a range costs what the object "
                        "does); SeaweedFS serves ranges in proportion to their bytes, as S3 does")
    parser.add_argument("--cases", default="restore-1,verify,export,mirror-pull,restore-fsdp,restore-ddp")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    server = start_moto() if args.server == "moto" else start_seaweedfs(Path(tempfile.mkdtemp()))
    try:
        cases = args.cases.split(",")
        rows = [r for r in single(server, args.width) if r["case"] in cases] if set(cases) - {
            "restore-fsdp", "restore-ddp"} else []
        rows += [ranks(server, args.width, m) for m in ("fsdp", "ddp") if f"restore-{m}" in cases]
    finally:
        server.stop()
    if args.json:
        print(json.dumps({"library": ts.__file__, "load": os.getloadavg(), "rows": rows}, indent=1))
        return 0
    print(f"library {ts.__file__}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'case':<14}{'generation':>14}{'GET bytes':>14}{'ratio':>7}{'GETs':>6}{'HEADs':>6}{'LISTs':>6}{'s':>8}")
    for r in rows:
        print(f"{r['case']:<14}{r['size']:>14,}{r['get_bytes']:>14,}{r['get_bytes'] / r['size']:>7.2f}"
              f"{r['gets']:>6}{r['heads']:>6}{r['lists']:>6}{r['seconds']:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
