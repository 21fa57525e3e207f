"""Peak memory of ``trainstate export``: a 2-rank FSDP2 generation and a single-process one, streamed.

    python benchmarks/bench_export.py --size 1G --max-shard-size 128MB [--out export.json]
    python benchmarks/bench_export.py --size 64M                        # smoke, well under a minute

Steps (each in its own process, so every figure is one process's own peak):

1. ``make-sharded``: under ``torch.distributed.run --standalone --nproc_per_node 2``
   (gloo, CPU), a stack of square bias-free ``nn.Linear`` layers of 64 MiB each
   (fewer, smaller ones below 1 GiB) built on the meta device, each
   ``fully_shard``-ed, then the root, materialised shard by shard (no rank ever
   holds the full model) and saved by a multi-rank ``CheckpointManager``
   (weights only: the model is the whole generation).
2. ``make-single``: the same layers in one process, saved by a single-process
   ``CheckpointManager``.
3. ``export`` (twice, one per generation): a fresh interpreter imports
   trainstate, records ``ru_maxrss`` (the baseline: interpreter, torch, the
   library), runs ``ts.export(generation, out, max_shard_size=...)`` with no
   process group, and records ``ru_maxrss`` again (the peak) and the wall time.

The goal (issue 20): the exporting process's peak RSS under a third of the
model size. Both the peak and the export's own share of it (peak minus
baseline) are reported beside the model size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYER = 4096  # 4096 x 4096 fp32: 64 MiB per layer


def _size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def _layers(size: int) -> tuple[int, int]:
    """(how many layers, their width): 64 MiB layers, or smaller ones for a small ``size``."""
    width = LAYER
    while width > 64 and size // (width * width * 4) < 4:
        width //= 2
    return max(1, size // (width * width * 4)), width


def _model(size: int, device: str):
    import torch

    count, width = _layers(size)
    with torch.device(device):
        return torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(count)))


def make_sharded(directory: str, size: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import trainstate as ts

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = _model(size, "meta")
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()
            local.copy_(torch.randn(local.shape, generator=g))
    with ts.CheckpointManager(directory) as ckpt:
        ckpt.save(ts.TrainState(model=model))
    dist.destroy_process_group()


def make_single(directory: str, size: int) -> None:
    import torch

    import trainstate as ts

    torch.manual_seed(0)
    model = _model(size, "cpu")
    with ts.CheckpointManager(directory) as ckpt:
        ckpt.save(ts.TrainState(model=model))


def export(source: str, out: str, max_shard_size: str) -> None:
    import torch  # noqa: F401  (in the baseline)

    import trainstate as ts
    from trainstate.tools import export as _export  # noqa: F401  (in the baseline)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.monotonic()
    info = ts.export(source, out, max_shard_size=max_shard_size)
    seconds = time.monotonic() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"baseline_bytes": before, "peak_bytes": peak, "seconds": round(seconds, 2),
                      "model_bytes": info.total_bytes, "files": len(info.files), "world_size": info.world_size}))


def _run(*args: str, ranks: int = 0) -> str:
    command = [sys.executable, __file__, *args]
    if ranks:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                   __file__, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(args[:1])} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step", nargs="?", default="all", choices=["all", "make-sharded", "make-single", "export"])
    parser.add_argument("paths", nargs="*")
    parser.add_argument("--size", default="1G", help="model bytes (total over the ranks), e.g. 1G, 64M")
    parser.add_argument("--max-shard-size", default="128MB")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--dir", default=None, help="where to put the generations (default: a temp dir)")
    args = parser.parse_args()
    size = _size(args.size)
    if args.step == "make-sharded":
        return make_sharded(args.paths[0], size)
    if args.step == "make-single":
        return make_single(args.paths[0], size)
    if args.step == "export":
        return export(args.paths[0], args.paths[1], args.max_shard_size)
    root = Path(tempfile.mkdtemp(prefix="bench-export-", dir=args.dir))
    results = {}
    try:
        _run("make-sharded", str(root / "sharded"), "--size", args.size, ranks=2)
        _run("make-single", str(root / "single"), "--size", args.size)
        for case in ("sharded", "single"):
            line = _run("export", str(root / case), str(root / f"{case}-out"), "--max-shard-size",
                        args.max_shard_size).strip().splitlines()[-1]
            results[case] = json.loads(line)
            shutil.rmtree(root / f"{case}-out")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    count, width = _layers(size)
    print(f"model: {count} x Linear({width}, {width}) fp32; --max-shard-size {args.max_shard_size}")
    for case, r in results.items():
        mib = 2**20
        own = (r["peak_bytes"] - r["baseline_bytes"]) / mib
        print(f"{case:8s} world {r['world_size']}: model {r['model_bytes'] / mib:7.1f} MiB, peak RSS "
              f"{r['peak_bytes'] / mib:6.1f} MiB ({r['peak_bytes'] / r['model_bytes']:.2f} of the model; baseline "
              f"{r['baseline_bytes'] / mib:.1f} MiB, the export's own {own:.1f} MiB), {r['files']} files, "
              f"{r['seconds']:.1f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"size": size, "max_shard_size": args.max_shard_size, **results},
                                             indent=1))


if __name__ == "__main__":
    main()
