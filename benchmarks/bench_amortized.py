"""A run pays for what changed, amortized (issue 51): 20 saves of a LoRA run, bytes added and time per save.

The issue's run: a frozen base of ``--base`` bytes (float32 ``Linear(2048,
2048)`` layers; 256 MiB is 16 of them), rank-16 adapters on each, AdamW
(12 MiB of change per update at 256 MiB), ``CheckpointManager(dir,
keep_last=3)``, ``--saves`` saves one update apart. Three runs side by side,
interleaved save by save, each on its own copy of the same state:

- ``default``: today's defaults (incremental, each part in two copies);
- ``full_every=8``: the old default (every 8th generation written whole);
- ``whole``: ``full_every=None`` (every generation written whole: the
  baseline a steady save's time is compared with).

For each save: the bytes it added to the run directory (the blocks of every
inode not there before, each counted once, as ``du`` counts hard links) and
its wall time. Reported: the bytes per save, the amortized ratio over saves
2..N (bytes added / bytes changed), the median steady save time against the
whole save's, and the load average. ``--s3 moto`` (or ``seaweedfs``) runs the
same on an object store started here on 127.0.0.1 (``tests/objectservers.py``):
the bytes each save adds to what the bucket holds (every object listed), and
``--mirror`` on a local run mirrored there (the remote's bytes). ``--ranks 2``
runs the same under ``torchrun`` with gloo ranks, each base layer and the
model ``fully_shard``-ed over them (FSDP2), every run in one directory the
ranks share; each save's time is rank 0's between barriers.

    python benchmarks/bench_amortized.py --base 256M
    python benchmarks/bench_amortized.py --base 1G --saves 20
    python benchmarks/bench_amortized.py --base 256M --s3 seaweedfs [--mirror]
    python benchmarks/bench_amortized.py --base 256M --ranks 2
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

import trainstate as ts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

DIM, RANK = 2048, 16


def size_arg(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


class Lora(torch.nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.base = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM, bias=False) for _ in range(layers))
        self.base.requires_grad_(False)
        self.a = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(RANK, DIM) * 0.01) for _ in range(layers))
        self.b = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(DIM, RANK) * 0.01) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w, a, b in zip(self.base, self.a, self.b):
            x = w(x) + (x @ a.T) @ b.T
        return x


def build(layers: int) -> ts.TrainState:
    torch.manual_seed(0)
    model = Lora(layers)
    if dist.is_initialized():  # FSDP2 over the ranks: each base layer, then the rest
        from torch.distributed.fsdp import fully_shard

        for layer in model.base:
            fully_shard(layer)
        fully_shard(model)
    return ts.TrainState(model=model, optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                                  lr=1e-3))


def step(state: ts.TrainState) -> None:
    model, opt = state["model"], state["optimizer"]
    model(torch.randn(2, DIM)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    state.next_update += 1


def changed_bytes(state: ts.TrainState) -> int:
    """The adapters and their two AdamW moments: what a steady save must write (step counters aside)."""
    moments = [v for entry in state["optimizer"].state.values() for v in entry.values() if v.dim()]
    return sum(nbytes(p) for p in state["model"].parameters() if p.requires_grad) + sum(nbytes(m) for m in moments)


def nbytes(tensor: torch.Tensor) -> int:
    """The bytes of ``tensor`` over every rank (a DTensor's global size)."""
    return tensor.numel() * tensor.element_size()


def blocks(run: Path) -> dict[tuple[int, int], int]:
    found = {}
    for path in run.glob("gen-*/*"):
        try:
            st = path.stat()
        except FileNotFoundError:  # pruned while listed
            continue
        found[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=size_arg, default=size_arg("256M"))
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--runs", default="default,full_every=8,whole")
    parser.add_argument("--dir", default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--s3", choices=["moto", "seaweedfs"], default=None, help="an object store instead")
    parser.add_argument("--mirror", action="store_true", help="with --s3: local runs mirrored there")
    parser.add_argument("--ranks", type=int, default=1, help="gloo ranks under torchrun (FSDP2), a shared directory")
    args = parser.parse_args()
    if args.ranks > 1 and "WORLD_SIZE" not in os.environ:
        if args.s3:
            parser.error("--ranks with --s3 is not measured here")
        raise SystemExit(subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                          f"--nproc_per_node={args.ranks}", __file__, *sys.argv[1:]],
                                         env={**os.environ, "OMP_NUM_THREADS": "1"}))
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
    lead = not dist.is_initialized() or dist.get_rank() == 0
    layers = max(1, args.base // (DIM * DIM * 4))
    options = {"default": {}, "full_every=8": {"full_every": 8}, "whole": {"full_every": None}}
    runs = args.runs.split(",")
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-amortized-"))
    if dist.is_initialized():  # every rank saves into rank 0's directory
        shared = [str(root)]
        dist.broadcast_object_list(shared, 0)
        root = Path(shared[0])
    states = {r: build(layers) for r in runs}
    dirs = {r: root / r.replace("=", "-") for r in runs}
    server = stores = None
    if args.s3:
        from objectservers import start_moto, start_seaweedfs

        from trainstate.storage.objects import ObjectStore

        server = start_moto(root / "moto") if args.s3 == "moto" else start_seaweedfs(root / "seaweedfs")
        bucket, remote = server.make_bucket(), {}
        for r in runs:
            url, where = server.url(bucket, r.replace("=", "-")), server.storage_options()
            remote[r] = (dict(mirror=url, mirror_options=where, mirror_retention=ts.Retention(keep_last=args.keep_last))
                         if args.mirror else dict(storage_options=where))
            dirs[r] = url if not args.mirror else dirs[r]
        stores = {r: ObjectStore(server.url(bucket, r.replace("=", "-")), storage_options=server.storage_options())
                  for r in runs}
        options = {r: {**options[r], **remote[r]} for r in runs}
    managers = {r: ts.CheckpointManager(dirs[r], keep_last=args.keep_last, **options[r]) for r in runs}
    added: dict[str, list[int]] = {r: [] for r in runs}
    seconds: dict[str, list[float]] = {r: [] for r in runs}
    seen: dict[str, dict] = {r: {} for r in runs}
    held: dict[str, int] = {}  # what the run holds after the last save
    loads = []
    try:
        for _ in range(args.saves):
            for r in runs:  # interleaved: each run's save i, then the next run's
                step(states[r])
                os.sync()
                barrier()
                start = time.perf_counter()
                managers[r].save(states[r])
                barrier()
                seconds[r].append(time.perf_counter() - start)
                if not lead:
                    continue
                if stores is None:
                    now = blocks(dirs[r])
                else:
                    deadline = time.monotonic() + 600  # a mirror: its upload of this save, counted as the save's
                    while args.mirror and managers[r].status().mirror.remote_update != states[r].next_update \
                            and time.monotonic() < deadline:
                        time.sleep(0.05)
                    now = stores[r].client.listing("")
                added[r].append(sum(size for inode, size in now.items() if inode not in seen[r]))
                seen[r], held[r] = now, sum(now.values())
            loads.append(os.getloadavg()[0])
    finally:
        for m in managers.values():
            m.close()
        if server is not None:
            server.stop()
    changed = changed_bytes(states[runs[0]])
    base = sum(nbytes(p) for p in states[runs[0]]["model"].base.parameters())
    if not lead:
        dist.destroy_process_group()
        return
    mib = 1 << 20
    where = f"{args.s3}{' (mirrored)' if args.mirror else ''}" if args.s3 else "local disk"
    where += f", {args.ranks} ranks (FSDP2, gloo)" if args.ranks > 1 else ""
    print(f"base {base / mib:.0f} MiB ({layers} x Linear({DIM}, {DIM})), change per save {changed / mib:.1f} MiB, "
          f"{args.saves} saves, keep_last={args.keep_last}, {where}; load {min(loads):.1f}-{max(loads):.1f}")
    report = {"base": base, "changed": changed, "saves": args.saves, "load": [min(loads), max(loads)], "runs": {}}
    whole = statistics.median(seconds["whole"][1:]) if "whole" in runs else None
    for r in runs:
        later = added[r][1:]
        amortized = sum(later) / (changed * len(later))
        steady = statistics.median(seconds[r][1:])
        ratio = f", {steady / whole:.3f}x the whole save's {whole:.3f} s" if whole and r != "whole" else ""
        print(f"{r:>13}: MiB added per save {[round(a / mib, 1) for a in added[r]]}")
        print(f"{'':>13}  amortized over saves 2-{args.saves}: {amortized:.3f}x the changed bytes; first save "
              f"{added[r][0] / mib:.0f} MiB; median save {steady:.3f} s{ratio}; holds {held[r] / mib:.0f} MiB "
              f"at the end ({held[r] / base:.2f}x the base)")
        report["runs"][r] = {"added": added[r], "seconds": seconds[r], "amortized": amortized, "held": held[r]}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
