"""Data order at pretraining scale: epoch start and resume at N/2, time to the first batch and peak RSS.

    python benchmarks/bench_order.py --sizes 1e6,1e8,1e9 --reps 3 --out order.json

Every (method, N, phase) runs in a fresh subprocess, so its peak RSS
(``ru_maxrss`` after minus before the measured work) is its own. The dataset is
virtual (``__getitem__`` returns its index). Phases: ``start`` (a new loader's
first batch of epoch 1) and ``resume`` (a new loader restored at global
position N/2 of epoch 1, then its first batch). Batch 32 per rank, 8 ranks,
measured on rank 0 (every rank pays the same). Methods:

- ``feistel``: ``ts.ResumableLoader`` (``order="feistel-v1"``, the default);
- ``sort``: ``ts.ResumableLoader(order="splitmix64-sort-v1")``, the order before it;
- ``randperm``: ``DistributedSampler`` (``torch.randperm`` + ``tolist``), resumed by
  skipping the consumed indices of its iterator, as users do;
- ``stateful``: torchdata ``StatefulDataLoader`` (shuffle, one rank: it has no
  DistributedSampler state), restored from a ``state_dict`` taken at N/2, then
  its first batch (it regenerates the permutation and fast-forwards through it).

A method is skipped where it cannot fit in memory (estimated before it runs) or
would take too long; the report then extrapolates from the largest N measured
(time linearly in N, or per position for the fast-forward), and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

BATCH, WORLD = 32, 8
GIB = 1 << 30
# bytes per sample at the peak, measured at 1e6/1e7 on this machine, to refuse what cannot fit
PEAK_BYTES_PER_SAMPLE = {"feistel": 0, "sort": 40, "randperm": 45, "stateful": 45}
MAX_SECONDS_ESTIMATE = 300
ALGORITHMS = {"feistel": "feistel-v1", "sort": "splitmix64-sort-v1"}


class Virtual:
    """A map-style dataset of ``n`` samples whose sample is its index."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return int(index)


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _resumable_state(n: int, algorithm: str) -> dict | None:
    """The state a run saved at global position N/2 of epoch 1 (built before the clock starts)."""
    import trainstate as ts
    from trainstate.data import order

    loader = ts.ResumableLoader(Virtual(n), batch_size=BATCH, seed=1234, rank=0, world_size=WORLD, order=algorithm)
    cursor = n // 2 // (BATCH * WORLD)
    ids = loader.plan.batches(1)[cursor]
    return {"epoch": 1, "cursor": cursor, "samples_seen": 0, "tokens_seen": 0, "plan": loader.plan.as_dict(),
            "worker_global_draws": False, "next_batch": {"epoch": 1, "cursor": cursor, "size": len(ids),
                                                         "ids_digest": order.ids_digest(1, cursor, ids)}}


def _resumable(n: int, algorithm: str, state: dict | None) -> list[int]:
    import trainstate as ts
    from trainstate.data import order, permute

    order._sorted.cache_clear()
    permute.feistel.cache_clear()
    loader = ts.ResumableLoader(Virtual(n), batch_size=BATCH, seed=1234, rank=0, world_size=WORLD, order=algorithm)
    if state is not None:
        loader.load_state_dict(state)
    else:
        loader.epoch = 1
    return next(iter(loader)).tolist()


def _randperm(n: int, phase: str) -> list[int]:
    import itertools

    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(Virtual(n), num_replicas=WORLD, rank=0, shuffle=True, seed=1234)
    sampler.set_epoch(1)
    it = iter(sampler)
    if phase == "resume":  # no state to restore: skip what this rank consumed
        next(itertools.islice(it, n // 2 // WORLD - 1, None))
    return list(itertools.islice(it, BATCH))


def _stateful(n: int, state: dict | None) -> list[int]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(Virtual(n), batch_size=BATCH, shuffle=True)
    if state is not None:
        loader.load_state_dict(state)
    return next(iter(loader)).tolist()


def _stateful_state(n: int) -> dict:
    """The state_dict a StatefulDataLoader saves after N/2 samples: a real one, its counts moved to N/2."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(Virtual(64), batch_size=BATCH, shuffle=True)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    batches = n // 2 // BATCH
    state["_sampler_iter_state"]["samples_yielded"] = batches * BATCH
    state["_sampler_iter_state"]["sampler_iter_state"]["yielded"] = batches * BATCH
    state["_sampler_iter_yielded"] = state["_num_yielded"] = batches
    return state


def measure(method: str, n: int, phase: str, reps: int) -> dict:
    """In this process: median seconds to the first batch, and peak RSS growth over the first repetition."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch  # noqa: F401 - imports are not part of the measurement

    state = None
    if phase == "resume" and method == "stateful":
        state = _stateful_state(n)
    elif phase == "resume" and method in ("feistel", "sort"):  # built in another process: its memory is not ours
        out = subprocess.run([sys.executable, __file__, "--state", method, str(n)], capture_output=True, text=True,
                             check=True)
        state = json.loads(out.stdout)
    if method in ("feistel", "sort"):
        import trainstate  # noqa: F401
    if method == "stateful":
        import torchdata.stateful_dataloader  # noqa: F401
    before = _maxrss()
    times, rss = [], 0
    for rep in range(reps):
        began = time.perf_counter()
        if method in ("feistel", "sort"):
            _resumable(n, ALGORITHMS[method], state)
        elif method == "randperm":
            _randperm(n, phase)
        else:
            _stateful(n, state)
        times.append(time.perf_counter() - began)
        if rep == 0:
            rss = _maxrss() - before
    return {"method": method, "n": n, "phase": phase, "seconds": statistics.median(times), "reps": reps,
            "peak_rss_mib": rss / 2 ** 20}


def _memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def run_all(sizes: list[int], reps: int) -> list[dict]:
    results = []
    for n in sizes:
        for method in ("feistel", "sort", "randperm", "stateful"):
            for phase in ("start", "resume"):
                need = PEAK_BYTES_PER_SAMPLE[method] * n
                slow = [r for r in results if r["method"] == method and r["phase"] == phase and "seconds" in r]
                estimate = slow[-1]["seconds"] * n / slow[-1]["n"] if slow else 0.0
                if need > 0.7 * _memory_bytes() or estimate > MAX_SECONDS_ESTIMATE:
                    why = f"needs about {need / GIB:.0f} GiB" if need > 0.7 * _memory_bytes() else \
                        f"about {estimate:.0f} s"
                    results.append({"method": method, "n": n, "phase": phase, "skipped": why})
                    print(json.dumps(results[-1]), flush=True)
                    continue
                r = reps if method == "feistel" or n <= 10 ** 6 else 1
                out = subprocess.run([sys.executable, __file__, "--one", method, str(n), phase, str(r)],
                                     capture_output=True, text=True, check=False)
                if out.returncode:
                    results.append({"method": method, "n": n, "phase": phase, "failed": out.stderr[-300:]})
                else:
                    results.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(json.dumps(results[-1]), flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1e6,1e8,1e9")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument("--one", nargs=4, metavar=("METHOD", "N", "PHASE", "REPS"), help=argparse.SUPPRESS)
    parser.add_argument("--state", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.state:
        print(json.dumps(_resumable_state(int(args.state[1]), ALGORITHMS[args.state[0]])))
        return 0
    if args.one:
        method, n, phase, reps = args.one
        print(json.dumps(measure(method, int(n), phase, int(reps))))
        return 0
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    results = run_all(sizes, args.reps)
    meta = {"load_average": os.getloadavg(), "cpus": os.cpu_count(), "batch": BATCH, "world": WORLD}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
