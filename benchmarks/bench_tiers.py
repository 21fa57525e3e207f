"""Node-local tiers against the object store: save stall, recovery after a lost node, training beside replication,
and a save at every update (Gemini's headline), on several ``torchrun`` agents of this host.

Usage::

    python benchmarks/bench_tiers.py                                  # quick: 64M, 2 nodes x 1 rank, a few minutes
    python benchmarks/bench_tiers.py --size 256M --reps 5 --nproc 2   # 2 nodes x 2 ranks
    python benchmarks/bench_tiers.py --server seaweedfs --parts save,restore
    python benchmarks/bench_tiers.py --parts headline --updates 200 --headline-reps 2 --out tiers.json

Each "node" is a ``torchrun`` agent started by ``tests/multinode.launch_nodes`` with its own
``TRAINSTATE_NODE_DIR`` (gloo on loopback, CPU); the ranks run ``benchmarks/tier_bench_worker.py``. The object
store is moto (or SeaweedFS, ``--server seaweedfs``) on 127.0.0.1, started and stopped by PID by
``tests/objectservers.py``. State: FSDP2 over a stack of square ``nn.Linear`` layers and AdamW, ``--size`` bytes of
parameters and moments over all ranks; one update is forward + backward + AdamW on a ``--batch`` x hidden input.

Parts (``--parts``, default all):

1. ``save``: one launch. Per repetition, in an order rotated by the repetition: a block of K updates without a
   save; a save into the node-local tier (``replicas=2``, replication on the writer thread) followed by K updates
   while it replicates, then ``wait()``; the same save straight to the object store
   (``CheckpointManager("s3://...")``); a tiered save with ``wait_replicas=True``. The stall is rank 0's wall
   time from a barrier before ``save`` to a barrier after it (the slowest rank). K covers the warm-up's
   replication (or ``--steps``).
3. (same launch) the updates that began while replication was in flight against the updates of the blocks
   without a save.
2. ``restore``: one launch saves the same generation to the tiers (replicas committed) and to the object store;
   then per repetition, rotated: ``tier-lost`` (node 1's directory deleted, then a launch restores: node 1's shards
   come from node 0's replicas and node 1 is refilled), ``remote`` (a launch restores from the object store), and
   ``tier-intact`` (nothing lost). The restore is timed between barriers inside the launch, a freshly and
   differently seeded state, and its local tensors are compared with the saved ones (a digest per rank). One
   more ``remote`` restore runs through ``FaultProxy`` to count the bytes GET returned (untimed).
4. ``headline``: one launch, node directories under ``--shm`` (a RAM disk); per repetition ``--updates`` updates
   without checkpointing and the same with ``save(blocking=False)`` after every update (the order alternates).
   Timers around ``Writer.reserve``, ``Session.prepare``/``stage`` (the stall's parts) and ``tiersave.publish``,
   ``replicate``, ``prune`` (the writer thread's work) say where the time goes; ``getrusage`` the CPU seconds.

Medians throughout; ratios are median of per-repetition ratios (and the ratio of medians). The load average is
recorded at each launch and inside the ranks. ``--nproc 2`` runs 2 ranks per node (4 processes on this host).
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
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from multinode import launch_nodes  # noqa: E402
from objectservers import FaultProxy, start_moto, start_seaweedfs  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_dist import parse_size, pick_hidden  # noqa: E402  (the same sizes and widths as the DCP benchmark)

WORKER = Path(__file__).resolve().parent / "tier_bench_worker.py"
T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s load {os.getloadavg()[0]:.2f}] {msg}", flush=True)




def med(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def mb(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:,.1f} MB"


def library() -> dict:
    import trainstate

    where = Path(trainstate.__file__).resolve().parent
    info = {"path": str(where)}
    try:
        info["commit"] = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True, check=True).stdout.strip()
        info["dirty"] = bool(subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--", str(where)],
                                            capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass  # a snapshot outside any checkout (PYTHONPATH=...)
    return info


class Bench:
    def __init__(self, args, server, workdir: Path):
        self.args, self.server, self.workdir = args, server, workdir
        self.bucket = server.make_bucket()
        self.config = {"size": args.size, "hidden": args.hidden or pick_hidden(args.size), "batch": args.batch,
                       "reps": args.reps, "steps": args.steps, "updates": args.updates,
                       "headline_reps": args.headline_reps, "headline_batch": args.headline_batch or args.batch,
                       "storage_options": server.storage_options(), "collective_timeout_s": args.timeout,
                       "profile_dir": os.path.abspath(args.profile_dir) if args.profile_dir else None}
        self.launches: list[dict] = []

    def launch(self, name: str, dirs: list[Path], phases: list[str], config: dict | None = None) -> list[dict]:
        out = self.workdir / f"{name}-{len(self.launches)}"
        env = {"TS_BENCH": json.dumps({**self.config, **(config or {})})}
        load0, t = os.getloadavg(), time.perf_counter()
        launched = launch_nodes(out, dirs, phases, worker=WORKER, nproc=self.args.nproc, env=env,
                                timeout=self.args.timeout)
        wall = time.perf_counter() - t
        self.launches.append({"name": name, "phases": phases, "wall_s": round(wall, 2),
                              "load_before": [round(x, 2) for x in load0],
                              "load_after": [round(x, 2) for x in os.getloadavg()]})
        results = {}
        for p in phases:
            rows = []
            for rank in range(launched.world_size):
                path = out / p / f"rank{rank}.json"
                if not path.exists():
                    raise SystemExit(f"{name}/{p}: rank {rank} wrote nothing (exits {launched.returncodes}):\n"
                                     + launched.tail())
                row = json.loads(path.read_text())
                if not row.get("ok"):
                    raise SystemExit(f"{name}/{p} on rank {rank}: {row.get('error')}\n{row.get('trace', '')}\n"
                                     + launched.tail())
                rows.append(row)
            missing = rows[0].get("timers_missing")
            if missing:
                say(f"{name}/{p}: this library has no {', '.join(missing)}: those timers are left out")
            results[p] = rows
        say(f"{name}: launch {wall:.1f} s")
        return results[phases[0]] if len(phases) == 1 else results

    def node_dirs(self, root: Path, name: str) -> list[Path]:
        base = root / f"ts-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}" / name
        return [base / f"node{i}" for i in range(2)]


# 1 and 3 ------------------------------------------------------------------------------------------------------
def events(rows, name: str, main: bool | None = None) -> list[float]:
    return [e - s for n, m, s, e in rows if n == name and (main is None or m == main)]


def breakdown(rows, parent: str, main: bool | None = None) -> dict[str, float]:
    """Seconds per sub-step (``tiersave._begin``...) summed over the calls inside ``parent``'s calls, per call."""
    parents = [(s, e) for n, m, s, e in rows if n == parent and (main is None or m == main)]
    out: dict[str, float] = {}
    for n, m, s, e in rows:
        if n.startswith("tiersave.") and (main is None or m == main) and any(a <= s and e <= b for a, b in parents):
            out[n[9:]] = out.get(n[9:], 0.0) + (e - s)
    return {k: v / max(1, len(parents)) for k, v in out.items()}


def collectives(rows) -> dict:
    """Per background save: how many ``torch.distributed`` calls the writer made inside the local commit and the
    replication, and the seconds spent in them."""
    out = {}
    for parent in ("local_commit", "replicate"):
        spans = [(s, e) for n, m, s, e in rows if n == parent and not m]
        inside = [e - s for n, m, s, e in rows if n.startswith("dist.") and any(a <= s and e <= b for a, b in spans)]
        out[parent] = {"calls": len(inside) / max(1, len(spans)), "seconds": sum(inside) / max(1, len(spans))}
    return out


def show(parts: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))


def part_save(bench: Bench) -> dict:
    dirs = bench.node_dirs(bench.workdir, "save")
    url = bench.server.url(bench.bucket, f"save-{uuid.uuid4().hex[:8]}")
    say(f"part 1+3: save stall and steps beside replication ({bench.args.reps} reps)")
    ranks = bench.launch("save", dirs, ["save"], {"url": url})
    r0 = ranks[0]
    reps = r0["reps"]
    stall = {m: [rep[m]["stall_s"] for rep in reps] for m in ("tier", "remote", "tier-wait")}
    ratio = [rep["tier"]["stall_s"] / rep["remote"]["stall_s"] for rep in reps]
    ratio_wait = [rep["tier-wait"]["stall_s"] / rep["remote"]["stall_s"] for rep in reps]
    commit = [sum(events(rep["tier"]["events"], "local_commit", True)) for rep in reps]
    replicate = [sum(events(rep["tier"]["events"], "replicate", False)) for rep in reps]
    replicate_wait = [sum(events(rep["tier-wait"]["events"], "replicate", True)) for rep in reps]
    # part 3: updates that began while the writer thread replicated, against blocks without any save
    base_all = [s for r in ranks for rep in r["reps"] for s, _ in rep["steps"]]
    busy_all = [s for r in ranks for rep in r["reps"] for s, b in rep["tier_steps"] if b]
    base0 = [s for rep in reps for s, _ in rep["steps"]]
    busy0 = [s for rep in reps for s, b in rep["tier_steps"] if b]
    per_rep = []
    for rep in reps:
        b = med(s for s, _ in rep["steps"])
        busy = [s for s, f in rep["tier_steps"] if f]
        if busy:
            per_rep.append({"base": b, "busy": med(busy), "n": len(busy), "extra_s": sum(busy) - len(busy) * b,
                            "replicate_s": sum(events(rep["tier"]["events"], "replicate", False))})
    out = {
        "size": r0["size"], "world": r0["world"], "steps_per_block": r0["steps_per_block"], "warm": r0["warm"],
        "load": r0["load"], "stall_s": {m: med(v) for m, v in stall.items()}, "stall_samples": stall,
        "ratio_tier_remote": med(ratio), "ratio_of_medians": med(stall["tier"]) / med(stall["remote"]),
        "ratio_tier_wait_remote": med(ratio_wait), "local_commit_s": med(commit), "replicate_bg_s": med(replicate),
        "replicate_wait_s": med(replicate_wait),
        "wait_after_steps_s": med(rep["tier"]["wait_after_steps_s"] for rep in reps),
        "step_base_s": med(base0), "step_busy_s": med(busy0), "busy_steps": len(busy0),
        "step_ratio": (med(busy0) / med(base0)) if busy0 else None,
        "step_base_all_ranks_s": med(base_all), "step_busy_all_ranks_s": med(busy_all),
        "per_rep_steps": per_rep,
        "commit_steps": {k: med(breakdown(rep["tier"]["events"], "local_commit", True).get(k) for rep in reps)
                         for k in breakdown(reps[0]["tier"]["events"], "local_commit", True)},
        "replicate_steps": {k: med(breakdown(rep["tier"]["events"], "replicate", False).get(k) for rep in reps)
                            for k in breakdown(reps[0]["tier"]["events"], "replicate", False)},
    }
    print(f"\nPart 1: save stall, {mb(out['size'])} generation, {len(dirs)} nodes x {bench.args.nproc} "
          f"rank(s) (world {out['world']}), {bench.args.server}, load {out['load']}")
    print(f"{'method':<34}{'median s':>10}{'samples':>40}")
    for m, label in (("tier", "node-local tier (replicas in bg)"), ("tier-wait", "tier, wait_replicas=True"),
                     ("remote", "object store, blocking")):
        print(f"{label:<34}{fmt(out['stall_s'][m]):>10}   {', '.join(f'{x:.3f}' for x in stall[m])}")
    verdict = "met" if out["ratio_tier_remote"] <= 0.25 else "MISSED"
    print(f"stall tier / remote: {fmt(out['ratio_tier_remote'], 3)} (median of per-rep ratios; ratio of medians "
          f"{fmt(out['ratio_of_medians'], 3)}); goal <= 0.25: {verdict}")
    print(f"  tier-wait / remote {fmt(out['ratio_tier_wait_remote'])}; local commit (tiersave.publish) "
          f"{fmt(out['local_commit_s'])} s; replication on the writer thread {fmt(out['replicate_bg_s'])} s "
          f"(inline with wait_replicas: {fmt(out['replicate_wait_s'])} s)")
    print(f"  local commit, s: {show(out['commit_steps'])}")
    print(f"  replication, s: {show(out['replicate_steps'])}")
    print(f"\nPart 3: update time beside background replication ({out['steps_per_block']} updates per block)")
    print(f"  without saves {fmt(out['step_base_s'], 4)} s; while replicating {fmt(out['step_busy_s'], 4)} s "
          f"({out['busy_steps']} updates): x{fmt(out['step_ratio'], 2)} (all ranks: "
          f"{fmt(out['step_base_all_ranks_s'], 4)} / {fmt(out['step_busy_all_ranks_s'], 4)})")
    for i, p in enumerate(per_rep):
        print(f"  rep {i}: {p['n']} updates beside a {p['replicate_s']:.3f} s replication, "
              f"{p['extra_s']:+.3f} s in all against the block without saves")
    return out


# 2 ---------------------------------------------------------------------------------------------------------------
def part_restore(bench: Bench) -> dict:
    dirs = bench.node_dirs(bench.workdir, "restore")
    url = bench.server.url(bench.bucket, f"restore-{uuid.uuid4().hex[:8]}")
    config = {"restore_url": url}
    say("part 2: recovery after one lost node")
    setup = bench.launch("setup", dirs, ["setup_restore"], config)
    digests = [r["digest"] for r in setup]
    methods = [m for m in ("tier-lost", "remote", "tier-intact") if m in bench.args.restores.split(",")]
    samples: dict[str, list[dict]] = {m: [] for m in methods}
    for rep in range(bench.args.reps):
        order = methods[rep % len(methods):] + methods[:rep % len(methods)]
        for method in order:
            if method == "tier-lost":
                shutil.rmtree(dirs[1])
                dirs[1].mkdir()
            ranks = bench.launch(method, dirs, ["restore_remote" if method == "remote" else "restore_tier"], config)
            bad = [r["rank"] for r, d in zip(ranks, digests) if r["digest"] != d]
            if bad:
                raise SystemExit(f"{method}: ranks {bad} restored other bytes than were saved")
            r0 = ranks[0]
            steps = {}
            for r in ranks:
                for n, m, st, e in r["events"]:
                    if n.startswith("restore.") or n == "refill":
                        key = f"node{r['node']}.{n.removeprefix('restore.')}"
                        steps[key] = steps.get(key, 0.0) + e - st
            timeline = {f"rank{r['rank']}": [[n.removeprefix("restore."), round(st, 4), round(e, 4)]
                                              for n, m, st, e in r["events"] if m and n.startswith("restore.")]
                        for r in ranks}  # the main thread's steps, in order (--out)
            samples[method].append({"steps": steps, "timeline": timeline, "restore_s": r0["restore_s"],
                                    "manager_s": r0["manager_s"],
                                    "refill_s": max((sum(events(r["events"], "refill")) for r in ranks), default=0),
                                    "sources": r0["sources"], "load": r0["load"],
                                    "cpu_s": sum(r["cpu_s"] for r in ranks)})
    with FaultProxy(bench.server.endpoint) as proxy:  # bytes the object-store restore downloads (untimed)
        counted = bench.launch("remote-counted", dirs, ["restore_remote"],
                               {**config, "restore_options": bench.server.storage_options(endpoint=proxy.endpoint)})
        traffic = list(proxy.traffic)
    gets = [t for t in traffic if t.method == "GET" and "list-type" not in t.path]
    remote_bytes = sum(t.bytes for t in gets)
    out = {"size": setup[0]["size"], "samples": samples,
           "restore_s": {m: med(s["restore_s"] for s in v) for m, v in samples.items()},
           "manager_s": {m: med(s["manager_s"] for s in v) for m, v in samples.items()},
           "refill_s": {m: med(s["refill_s"] for s in v) for m, v in samples.items()},
           "remote_get_bytes": remote_bytes, "remote_gets": len(gets), "counted_restore_s": counted[0]["restore_s"]}
    if "tier-lost" in samples and "remote" in samples:
        pairs = list(zip(samples["tier-lost"], samples["remote"]))
        out["ratio_lost_remote"] = med(a["restore_s"] / b["restore_s"] for a, b in pairs)
        out["ratio_lost_remote_with_manager"] = med(
            (a["restore_s"] + a["manager_s"]) / (b["restore_s"] + b["manager_s"]) for a, b in pairs)
    print(f"\nPart 2: restore after losing node 1, {mb(out['size'])} generation, world {setup[0]['world']}")
    print(f"{'method':<14}{'restore s':>10}{'refill s':>14}{'manager s':>11}{'object-store GET bytes':>24}"
          f"  sources (bytes)")
    for m in methods:
        remote = f"{remote_bytes:,}" if m == "remote" else "0 (none set)"
        print(f"{m:<14}{fmt(out['restore_s'][m]):>10}{fmt(out['refill_s'][m]):>14}{fmt(out['manager_s'][m]):>11}"
              f"{remote:>24}  {samples[m][-1]['sources']}")
    for m in methods:
        keys = sorted({k for s in samples[m] for k in s["steps"]})
        medians = {k: med(s["steps"].get(k, 0.0) for s in samples[m]) for k in keys}
        print(f"  {m}, s summed over each node's ranks: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()))
    if "ratio_lost_remote" in out:
        print(f"restore tier-lost / remote: {fmt(out['ratio_lost_remote'])} (with the manager's set-up "
              f"{fmt(out['ratio_lost_remote_with_manager'])}; the refill runs after restore returns, on the writer "
              "thread, and is not in either); goal <= 0.5: "
              f"{'met' if out['ratio_lost_remote'] <= 0.5 else 'MISSED'}")
    print(f"object-store restore through the proxy: {len(gets)} GETs, {remote_bytes:,} bytes "
          f"({remote_bytes / out['size']:.2f}x the generation)")
    return out


# 4 ---------------------------------------------------------------------------------------------------------------
def part_headline(bench: Bench) -> dict:
    dirs = bench.node_dirs(Path(bench.args.shm), "headline")
    size = bench.args.headline_size or bench.args.size
    config = {"size": size, "hidden": bench.args.hidden or pick_hidden(size)}
    say(f"part 4: a background save after every update, {bench.args.updates} updates, tiers in {bench.args.shm}")
    try:
        ranks = bench.launch("headline", dirs, ["headline"], config)
    finally:
        shutil.rmtree(dirs[0].parent.parent, ignore_errors=True)
    runs_by_rank = [r["runs"] for r in ranks]
    rows = []
    for i, run in enumerate(runs_by_rank[0]):
        same = [rr[i] for rr in runs_by_rank]
        row = {"mode": run["mode"], "rep": run["rep"], "loop_s": run["loop_s"], "drained_s": run["drained_s"],
               "barrier_s": run["barrier_s"], "step_med": med(run["steps"]), "step_sum": sum(run["steps"]),
               "cpu_s": sum(r["cpu_s"] for r in same), "load": run["load_before"]}
        if run["mode"] == "ckpt":
            fractions = [sum(r["stalls"]) / sum(r["steps"]) for r in same]
            ev = run["events"]
            row.update(stall_sum=sum(run["stalls"]), stall_med=med(run["stalls"]), stall_max=max(run["stalls"]),
                       stall_fraction=fractions[0], stall_fraction_max_rank=max(fractions),
                       stall_med_fraction=med(run["stalls"]) / med(run["steps"]),
                       reserve=sum(events(ev, "reserve", True)), prepare=sum(events(ev, "prepare", True)),
                       stage=sum(events(ev, "stage", True)), join=sum(events(ev, "prepare.join", True)),
                       capture=sum(events(ev, "prepare.capture", True)), commit=events(ev, "local_commit", False),
                       replicate=events(ev, "replicate", False), prune=events(ev, "prune", False),
                       collectives=collectives(ev),
                       commit_steps=breakdown(ev, "local_commit", False),
                       replicate_steps=breakdown(ev, "replicate", False))
        rows.append(row)
    none = [r for r in rows if r["mode"] == "none"]
    ckpt = [r for r in rows if r["mode"] == "ckpt"]
    slowdowns = [c["drained_s"] / n["drained_s"] - 1 for n, c in zip(none, ckpt)]
    out = {"size": ranks[0]["size"], "world": ranks[0]["world"], "updates": bench.args.updates, "rows": rows,
           "step_none_s": med(r["step_med"] for r in none), "step_ckpt_s": med(r["step_med"] for r in ckpt),
           "stall_fraction": med(r["stall_fraction"] for r in ckpt),
           "stall_fraction_max_rank": med(r["stall_fraction_max_rank"] for r in ckpt),
           "slowdown": med(slowdowns), "node_dir": ranks[0]["node_dir"]}
    print(f"\nPart 4: save(blocking=False) after every update, tiers on {bench.args.shm}, {mb(out['size'])} generation,"
          f" world {out['world']}, {bench.args.updates} updates")
    print(f"{'run':<10}{'load':>6}{'run s':>8}{'+drain s':>9}{'update s':>10}{'stall s':>9}{'stall/update':>13}"
          f"{'CPU s':>8}  stall = reserve + prepare + stage (s); writer: commit / replicate / prune (median s)")
    for r in rows:
        line = (f"{r['mode'] + ' ' + str(r['rep']):<10}{r['load'][0]:>6.2f}{r['loop_s']:>8.2f}{r['drained_s']:>9.2f}"
                f"{r['step_med']:>10.4f}")
        if r["mode"] == "ckpt":
            line += (f"{r['stall_med']:>9.4f}{r['stall_fraction']:>12.1%} {r['cpu_s']:>8.1f}  "
                     f"{r['stall_sum']:.2f} = {r['reserve']:.2f} + {r['prepare']:.2f} + {r['stage']:.2f}; "
                     f"{fmt(med(r['commit']))} / {fmt(med(r['replicate']))} / {fmt(med(r['prune']))} "
                     f"({len(r['commit'])} saves)")
        else:
            line += f"{'-':>9}{'-':>13}{r['cpu_s']:>8.1f}"
        print(line)
        if r["mode"] == "ckpt":
            print(f"{'':<10}prepare: join {r['join']:.2f} s (waits for the slowest rank), capture {r['capture']:.2f} s")
            c = r["collectives"]
            print(f"{'':<10}torch.distributed calls per save on the writer thread: local commit "
                  f"{c['local_commit']['calls']:.0f} ({c['local_commit']['seconds']:.3f} s), replicate "
                  f"{c['replicate']['calls']:.0f} ({c['replicate']['seconds']:.3f} s)")
            print(f"{'':<10}writer, per save: commit {show(r['commit_steps'])}; replicate {show(r['replicate_steps'])}")
    print(f"save() blocks training {fmt(out['stall_fraction'] * 100, 1)}% of the update time (sum of stalls / sum of "
          f"updates, rank 0; slowest rank {fmt(out['stall_fraction_max_rank'] * 100, 1)}%); goal <= 5%: "
          f"{'met' if out['stall_fraction'] <= 0.05 else 'MISSED'}")
    print(f"whole run with checkpointing (drained) / without: +{fmt(out['slowdown'] * 100, 1)}%; update "
          f"{fmt(out['step_none_s'], 4)} s without, {fmt(out['step_ckpt_s'], 4)} s with")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("64M"),
                        help="parameters + AdamW moments over all ranks (default 64M)")
    parser.add_argument("--headline-size", type=parse_size, default=None, help="part 4's size (default --size)")
    parser.add_argument("--hidden", type=int, default=None, help="layer width (default: bench_dist.py's for the size)")
    parser.add_argument("--batch", type=int, default=96, help="rows per rank and update (sets the update's time)")
    parser.add_argument("--headline-batch", type=int, default=None, help="part 4's batch (default --batch)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per node (2 nodes)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="updates per block in part 3 (0: cover a replication)")
    parser.add_argument("--updates", type=int, default=200, help="part 4's updates per run")
    parser.add_argument("--headline-reps", type=int, default=1, help="part 4's pairs of runs (none, ckpt)")
    parser.add_argument("--parts", default="save,restore,headline")
    parser.add_argument("--restores", default="tier-lost,remote,tier-intact")
    parser.add_argument("--server", choices=("moto", "seaweedfs"), default="moto")
    parser.add_argument("--shm", default="/dev/shm", help="RAM disk for part 4's node directories")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    parser.add_argument("--out", default=None, help="write every figure and sample as JSON")
    parser.add_argument("--profile-dir", default=None, help="dump each rank's restore under cProfile here")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-tiers-"))
    say(f"library {library()}; {os.cpu_count()} CPUs; workdir {workdir}")
    server = start_moto(workdir / "moto") if args.server == "moto" else start_seaweedfs(workdir / "weed")
    results: dict = {"args": vars(args), "library": library(), "cpus": os.cpu_count(),
                     "load_start": [round(x, 2) for x in os.getloadavg()]}
    try:
        bench = Bench(args, server, workdir)
        parts = args.parts.split(",")
        if "save" in parts:
            results["save"] = part_save(bench)
        if "restore" in parts:
            results["restore"] = part_restore(bench)
        if "headline" in parts:
            results["headline"] = part_headline(bench)
        results["launches"] = bench.launches
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    results["load_end"] = [round(x, 2) for x in os.getloadavg()]
    say(f"done; load average at start {results['load_start']}, at end {results['load_end']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
