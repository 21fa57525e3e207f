"""trainstate's torchtitan checkpointer against torchtitan's own (DCP), inside the real trainer.

    python benchmarks/bench_torchtitan.py --reps 3 [--steps 16] [--ranks 2] [--out results.json]

Each repetition runs, interleaved, for each mode (``sync``: blocking saves;
``async``: ``--checkpoint.async_mode async``) and each checkpointer
(``stock``: ``--module llama3``; ``trainstate``: ``--module
trainstate.integrations.torchtitan``): a launch of ``--steps`` steps saving
every 2 (the llama3 debug model, FSDP2 on gloo, CPU, via
``tests/titan_launch.py``), then a launch of 2 more steps that loads the
last checkpoint. ``TITAN_TIMINGS`` records how long training waits inside
the checkpointer on rank 0: every save but the last (torchtitan's last-step
save is always blocking), the waits before the optimizer step, the close (an
asynchronous save still in flight), and the load. Reported: per
repetition, the ratio stock / trainstate of the summed save wait (saves +
staging waits + close) and of the load; medians over repetitions; the load
average; and the ratio of the median single save (the steady state, without
the first save's set-up). Above 1.0 trainstate is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from titan_harness import build_assets, checkpoint_flags, launch_titan, titan_args  # noqa: E402

MODULES = {"stock": "llama3", "trainstate": "trainstate.integrations.torchtitan"}


def _timings(out: Path) -> list[dict]:
    path = out / "timings" / "timings-rank0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def one(root: Path, assets, mode: str, who: str, steps: int, ranks: int) -> dict:
    out = root / f"{who}-{mode}"
    run = out / "ckpt"
    extra = [*checkpoint_flags(run, interval=2, keep_latest_k=0)]
    if mode == "async":
        extra += ["--checkpoint.async_mode", "async"]
    env = {"TITAN_TIMINGS": str(out / "timings"), "TITAN_DROPOUT": "0.1"}
    train = launch_titan(out, titan_args(out, assets, steps=steps, module=MODULES[who], extra=extra), ranks=ranks,
                         env=env)
    train.ok()
    rows = _timings(out)
    saves = [r["s"] for r in rows if r["op"] == "save" and r["args"] and r["args"][0] != steps]
    waits = [r["s"] for r in rows if r["op"] in ("staging", "close")]
    (out / "timings").rename(out / "timings-train")
    resume = launch_titan(out, titan_args(out, assets, steps=steps + 2, module=MODULES[who], extra=extra),
                          ranks=ranks, env=env)
    resume.ok()
    load = [r["s"] for r in _timings(out) if r["op"] == "load"]
    return {"save_s": sum(saves) + sum(waits), "saves": len(saves), "per_save_s": statistics.median(saves),
            "load_s": load[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-titan-"))
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # gigabytes of checkpoints


def run(args: argparse.Namespace, root: Path) -> None:
    assets = build_assets(root / "assets")
    results: dict[str, list] = {}
    loads = []
    for rep in range(args.reps):
        for mode in ("sync", "async"):
            order = ("stock", "trainstate") if rep % 2 == 0 else ("trainstate", "stock")
            got = {who: one(root / f"rep{rep}", assets, mode, who, args.steps, args.ranks) for who in order}
            results.setdefault(mode, []).append(got)
            loads.append(os.getloadavg()[0])
            print(f"rep {rep} {mode}: " + "  ".join(
                f"{who} save {g['save_s']:.3f} s ({g['saves']} saves, median {g['per_save_s']:.3f}) load "
                f"{g['load_s']:.3f} s" for who, g in got.items()), flush=True)
    summary = {}
    for mode, reps in results.items():
        save = statistics.median(r["stock"]["save_s"] / r["trainstate"]["save_s"] for r in reps)
        load = statistics.median(r["stock"]["load_s"] / r["trainstate"]["load_s"] for r in reps)
        per = statistics.median(r["stock"]["per_save_s"] / r["trainstate"]["per_save_s"] for r in reps)
        summary[mode] = {"save_ratio": save, "per_save_ratio": per, "load_ratio": load,
                         "stock_save_s": statistics.median(r["stock"]["save_s"] for r in reps),
                         "trainstate_save_s": statistics.median(r["trainstate"]["save_s"] for r in reps),
                         "stock_load_s": statistics.median(r["stock"]["load_s"] for r in reps),
                         "trainstate_load_s": statistics.median(r["trainstate"]["load_s"] for r in reps)}
        print(f"{mode}: save {save:.2f}x (all saves, the first included, and the close), median save {per:.2f}x, "
              f"load {load:.2f}x (stock / trainstate, medians of per-repetition ratios)")
    print(f"load average {min(loads):.1f}-{max(loads):.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "reps": results, "load": loads,
                                              "when": time.strftime("%Y-%m-%d %H:%M")}, indent=1))


if __name__ == "__main__":
    main()
