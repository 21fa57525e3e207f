"""Multi-rank incremental generations (issue 32): a steady save of a LoRA-shaped FSDP2 run against a full one.

The state of ``bench_incremental.py`` (a frozen base of float32 ``Linear(4096, 4096)`` layers, LoRA adapters
of rank 8 on each and their Adam state), each base layer and the root ``fully_shard``-ed over ``--nproc``
gloo ranks, one torch thread per rank. ``--base`` is the whole base over all ranks. Each repetition,
interleaved, every timed region between barriers on every rank (rank 0's wall time, so until the slowest
rank is done):

- ``full``: a blocking save of the same state into a fresh directory (``full_every`` unset), by a manager
  built beforehand (untimed: building one creates two gloo groups);
- ``dcp``: stock ``dcp.save`` of the model's and optimizer's state dicts with
  ``FileSystemWriter(sync_files=True)`` into a fresh directory, for reference;
- ``incremental``: one training step of the adapters, then a blocking save into the incremental run
  (``full_every=1000``; its second save laid each rank's base out in a part file, so it is linked);
- ``restore-full`` / ``restore-incremental``: an in-place restore of each newest generation (warm).

    python benchmarks/bench_dist_incremental.py --base 1G --reps 5
    python benchmarks/bench_dist_incremental.py --base 256M --reps 2      # smoke, under a minute
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainstate as ts  # noqa: E402
from bench_incremental import DIM, Lora, size_arg  # noqa: E402


def build(base_bytes: int, rank: int) -> ts.TrainState:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Lora(max(1, base_bytes // (DIM * DIM * 4)), rank)
    for layer in model.base:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return ts.TrainState(model=model, optimizer=opt, rngs={"data": torch.Generator().manual_seed(0)})


def step(state: ts.TrainState) -> None:
    x = torch.randn(2, DIM, generator=state.rngs["data"])
    state["model"](x).square().mean().backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()
    state.next_update += 1


def timed(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def dcp_save(state: ts.TrainState, where: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, opt = state["model"], state["optimizer"]
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             storage_writer=dcp.FileSystemWriter(str(where), sync_files=True))


def owned_bytes(run: Path, name: str) -> int:
    manifest = json.loads((run / name / "manifest.json").read_bytes())
    shared = set(manifest.get("shares", {}))
    return sum(f["size"] for f in manifest["files"] if f["name"] not in shared)


def run(args: argparse.Namespace) -> int:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank0 = dist.get_rank() == 0
    work = Path(args.work)
    state = build(size_arg(args.base), args.rank)
    inc = work / "incremental"
    times: dict[str, list[float]] = {k: [] for k in ("full", "dcp", "incremental", "restore-full",
                                                     "restore-incremental")}
    written, loads = [], []
    with ts.CheckpointManager(inc, keep_last=2, full_every=1000) as ckpt:
        for _ in range(2):  # gen 1 writes everything; gen 2 lays each rank's unchanged base out in a part
            step(state)
            ckpt.save(state)
        for rep in range(args.reps):
            loads.append(os.getloadavg()[0])
            full_dir, dcp_dir = work / f"full-{rep}", work / f"dcp-{rep}"
            full = ts.CheckpointManager(full_dir, keep_last=1, full_every=None)
            order = [("full", lambda: full.save(state)), ("dcp", lambda: dcp_save(state, dcp_dir))]
            for name, fn in order[rep % 2:] + order[:rep % 2]:
                times[name].append(timed(fn))
            step(state)
            info = None

            def save() -> None:
                nonlocal info
                info = ckpt.save(state)

            times["incremental"].append(timed(save))
            written.append(owned_bytes(inc, info.name))
            times["restore-full"].append(timed(lambda: full.restore(state)))
            times["restore-incremental"].append(timed(lambda: ckpt.restore(state)))
            full.close()
            dist.barrier()
            if rank0:
                shutil.rmtree(full_dir)
                shutil.rmtree(dcp_dir)
                print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items())
                      + f", wrote {written[-1] / 1e6:.1f} MB", flush=True)
    if rank0:
        model = state["model"]
        changed = 3 * sum(p.to_local().nbytes for p in model.parameters() if p.requires_grad) * dist.get_world_size()
        total = sum(f["size"] for f in json.loads((inc / info.name / "manifest.json").read_bytes())["files"])
        med = {k: statistics.median(v) for k, v in times.items()}
        low = {k: min(v) for k, v in times.items()}
        print(f"\n{dist.get_world_size()} ranks; generation {total / 2**30:.2f} GiB; adapters and moments "
              f"{changed / 1e6:.1f} MB; load average (1 min) {min(loads):.1f}-{max(loads):.1f}")
        print("| | median s | min s |\n|---|---:|---:|")
        for k in times:
            print(f"| {k} | {med[k]:.3f} | {low[k]:.3f} |")
        print(f"steady save / full save: {med['incremental'] / med['full']:.3f} (medians), "
              f"{low['incremental'] / low['full']:.3f} (minima); steady save / dcp.save: "
              f"{med['incremental'] / med['dcp']:.3f}")
        print(f"bytes a steady save owns / adapters and moments: {statistics.median(written) / changed:.3f} "
              f"({statistics.median(written) / 1e6:.1f} MB)")
        print(f"restore incremental / self-contained: {med['restore-incremental'] / med['restore-full']:.3f}")
    dist.destroy_process_group()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="1G", help="frozen base bytes over all ranks (binary units)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir on this disk)")
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:
        return run(args)
    work = tempfile.mkdtemp(prefix="bench-dist-incremental-", dir=args.dir)
    try:
        return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc_per_node={args.nproc}", __file__, *sys.argv[1:], "--work", work],
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
