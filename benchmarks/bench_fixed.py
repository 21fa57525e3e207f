"""The fixed cost of a restore: what a restore costs beyond its bytes, and how often it opens each metadata file.

    python benchmarks/bench_fixed.py                     # 40 restores per size, sizes 16K,4M,16M,64M
    python benchmarks/bench_fixed.py --sizes 16K,64M --reps 20 --out fixed.json

One process. For each size a model of square ``nn.Linear`` layers with AdamW
(stepped once, so the moments exist) is saved once; then the restores run,
sizes interleaved per repetition, each timing ``CheckpointManager(dir)``
(separately) and ``restore(fresh)`` into a freshly built state, warm page
cache. The fixed cost is the intercept of a least-squares line through
(bytes, median restore seconds): what a restore costs at zero bytes. A
restore of the smallest state is reported beside it. One extra restore per
size counts, by wrapping the library's functions, how many times the
manifest, ``state.json`` and the pointer are opened and how many times
``state.json`` is decoded: each should be once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dist import parse_size  # noqa: E402

import trainstate as ts  # noqa: E402
from trainstate.storage import local, verify  # noqa: E402


def build(nbytes: int, seed: int) -> ts.TrainState:
    """Layers of width ``w`` until the parameters and two moments reach ``nbytes`` (at least one 8x8 layer)."""
    torch.manual_seed(seed)
    width = 8
    while 3 * 4 * (2 * width) ** 2 <= nbytes and width < 2048:
        width *= 2
    layers = max(1, nbytes // (3 * 4 * width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    state = ts.TrainState(model=model, optimizer=optimizer)
    state.next_update = 1
    return state


def count_opens(directory: Path, state: ts.TrainState) -> dict[str, int]:
    """Files opened, pointer reads and ``state.json`` decodes during one manager's construction and restore."""
    counts: Counter[str] = Counter()
    original_open, original_pointer = local.LocalStore.open, local.LocalStore.read_pointer
    original_decode = verify.decode_verified

    def opened(self, generation, file):
        counts[f"open {file}"] += 1
        return original_open(self, generation, file)

    def pointer(self, name):
        counts[f"read pointer {name}"] += 1
        return original_pointer(self, name)

    def decoded(*args, **kwargs):
        counts["decode state.json"] += 1
        return original_decode(*args, **kwargs)

    local.LocalStore.open, local.LocalStore.read_pointer = opened, pointer
    verify.decode_verified = decoded
    import trainstate.restore as restore_mod
    restore_decode = restore_mod.decode_verified
    restore_mod.decode_verified = decoded
    try:
        with ts.CheckpointManager(directory) as ckpt:
            ckpt.restore(state)
    finally:
        local.LocalStore.open, local.LocalStore.read_pointer = original_open, original_pointer
        verify.decode_verified = original_decode
        restore_mod.decode_verified = restore_decode
    return dict(sorted(counts.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16K,4M,16M,64M")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-fixed-"))
    real: dict[int, int] = {}
    for size in sizes:
        state = build(size, 0)
        with ts.CheckpointManager(root / str(size)) as ckpt:
            real[size] = ckpt.save(state).size
    times: dict[int, list[float]] = {s: [] for s in sizes}
    setup: dict[int, list[float]] = {s: [] for s in sizes}
    for _ in range(args.reps):
        for size in sizes:
            fresh = build(size, 1)
            start = time.perf_counter()
            ckpt = ts.CheckpointManager(root / str(size))
            built = time.perf_counter()
            ckpt.restore(fresh)
            times[size].append(time.perf_counter() - built)
            setup[size].append(built - start)
            ckpt.close()
    medians = {s: statistics.median(v) for s, v in times.items()}
    xs, ys = [real[s] for s in sizes], [medians[s] for s in sizes]
    if len(sizes) > 1:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        intercept = my - slope * mx
    else:
        slope, intercept = 0.0, ys[0]
    opens = {real[s]: count_opens(root / str(s), build(s, 2)) for s in sizes}
    load = os.getloadavg()[0]
    print(f"restores, warm, median of {args.reps} (load {load:.1f}):")
    for s in sizes:
        print(f"  {real[s]:>12,} B  restore {1000 * medians[s]:7.2f} ms  (manager {1000 * statistics.median(setup[s]):.2f} ms)")
    print(f"fixed cost (intercept): {1000 * intercept:.2f} ms; slope {1 / slope / 1e9 if slope > 0 else float('inf'):.2f} GB/s")
    for nbytes, counted in opens.items():
        print(f"  {nbytes:,} B, one manager + restore: " + ", ".join(f"{k} x{v}" for k, v in counted.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"sizes": real, "median_s": {real[s]: medians[s] for s in sizes},
                                              "manager_s": {real[s]: statistics.median(setup[s]) for s in sizes},
                                              "fixed_s": intercept, "opens": opens, "load": load}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
