"""Incremental generations by default: what they cost a state whose every tensor changes at every update.

Full fine-tuning and pretraining have nothing to link, so the default
(``full_every=8``) can only cost them: the fingerprint pass over a tensor's
bytes before it is written. A large tensor that changed when last compared
is written without that pass, and each process probes (fingerprints
everything) at its first incremental save and every ``full_every``-th after
(:func:`trainstate.lifecycle.incremental.take`).

Two runs of the same state side by side: ``whole`` (``full_every=None``:
format 3, no fingerprints) and ``default`` (no argument). Before each pair of
saves every parameter and momentum buffer moves in place (``add_`` under
``no_grad``: an update of every byte, without the minutes a 1 GiB backward
takes on two cores). The two blocking saves run in alternating order, each
into its own directory with ``keep_last=2``. Reported: medians of the
per-save times, the ratio default / whole over all saves, and the ratio
split into the saves that probed or compared (a fingerprint pass) and the
ones that skipped it.

    python benchmarks/bench_default.py --size 1G --saves 17
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

import trainstate as ts
from trainstate.state import changes

DIM = 4096


def size_arg(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=size_arg, default=size_arg("1G"),
                        help="parameter and momentum bytes together (default 1G)")
    parser.add_argument("--saves", type=int, default=17, help="saves per run (default 17: two probes and more)")
    parser.add_argument("--dir", default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="write the raw figures here")
    args = parser.parse_args()

    layers = max(1, args.size // (2 * DIM * DIM * 4))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(DIM, DIM, bias=False) for _ in range(layers)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # the momentum buffers exist
    opt.zero_grad(set_to_none=True)
    states = {kind: ts.TrainState(model=model, optimizer=opt) for kind in ("whole", "default")}  # each its parent
    state_bytes = sum(p.nbytes for p in model.parameters()) * 2

    passes: list[bool] = []
    real = changes.fingerprints

    def counted(tensors, **kw):
        passes[-1] = passes[-1] or any(t.nbytes >= 1 << 20 for t in tensors.values())
        return real(tensors, **kw)

    changes.fingerprints = counted
    root = tempfile.mkdtemp(prefix="bench-default-", dir=args.dir)
    times: dict[str, list[float]] = {"whole": [], "default": []}
    probed: list[bool] = []
    try:
        runs = {"whole": ts.CheckpointManager(os.path.join(root, "whole"), keep_last=2, full_every=None),
                "default": ts.CheckpointManager(os.path.join(root, "default"), keep_last=2)}
        for save in range(args.saves):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
                    opt.state[p]["momentum_buffer"].mul_(0.9).add_(1e-3)
            for state in states.values():
                state.next_update += 1
            order = ["whole", "default"] if save % 2 == 0 else ["default", "whole"]
            for kind in order:
                passes.append(False)
                started = time.perf_counter()
                runs[kind].save(states[kind])
                times[kind].append(time.perf_counter() - started)
                if kind == "default":
                    probed.append(passes[-1])
        for ckpt in runs.values():
            ckpt.close()
    finally:
        changes.fingerprints = real
        shutil.rmtree(root, ignore_errors=True)

    steady = range(1, args.saves)  # the first save of each run writes into an empty directory
    ratio = statistics.median(times["default"][i] / times["whole"][i] for i in steady)
    with_pass = [times["default"][i] / times["whole"][i] for i in steady if probed[i]]
    without = [times["default"][i] / times["whole"][i] for i in steady if not probed[i]]
    report = {
        "state_bytes": state_bytes, "saves": args.saves, "load": os.getloadavg(),
        "whole_median_s": statistics.median(times["whole"][1:]),
        "default_median_s": statistics.median(times["default"][1:]),
        "ratio_median": ratio,
        "saves_with_a_pass": [i + 1 for i, p in enumerate(probed) if p],
        "ratio_with_a_pass": statistics.median(with_pass) if with_pass else None,
        "ratio_without": statistics.median(without) if without else None,
        "times": times,
    }
    print(f"state {state_bytes / 1e9:.2f} GB, {args.saves} saves per run, load {report['load'][0]:.1f}")
    print(f"whole (full_every=None): median {report['whole_median_s']:.3f} s")
    print(f"default (full_every=8):  median {report['default_median_s']:.3f} s")
    print(f"default / whole, per save pair: median {ratio:.3f}; saves with a fingerprint pass "
          f"{report['saves_with_a_pass']}: {report['ratio_with_a_pass']}; without: {report['ratio_without']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
