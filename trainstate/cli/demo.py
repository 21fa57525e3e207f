"""``trainstate demo``: SIGKILL a training run at random moments, resume it, and compare bitwise.

The machinery lives in :mod:`trainstate.drill`; this module picks the sizes,
a work directory, and prints the report. It runs the worker uninterrupted
once (the reference) and once more under repeated SIGKILLs, some of them
aimed inside saves, then compares the two final states value by value.
With ``--ranks N`` (:func:`run_ranks_demo`) each run is a ``torchrun`` launch
of N ranks training FSDP2 over gloo, and each SIGKILL takes down the whole
launch, as a lost node would. With ``--nodes M`` as well (:func:`run_nodes_demo`)
the N ranks are split over M torchrun agents of this host, each a node with
its own directory (node-local tiers, ``replicas=2``); each kill takes down
every agent, and some kills also delete one node's directory, as a lost
machine would.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..drill import (Comparison, DrillConfig, DrillError, DrillReport, Timing, Zygote, compare_runs,
                    run_interrupted, run_reference)
from ..drill.nodes import REPLICAS, run_nodes_drill
from ..drill.ranks import run_ranks_drill
from ..drill.ranks_worker import RanksConfig

# Start-up dominates a torchrun launch here (importing torch and DTensor in every rank): few updates and few
# kills keep the multi-rank demo near half a minute. 10 saves, each a sizeable share of the training time.
RANKS_CONFIG = RanksConfig(total=40, every=4)
RANKS_KILLS = 2
NODES_KILLS = 3  # with --nodes: about a minute here; half of the kills (rounded up) also lose a node

# About 5 s of training and 20 saves (about a third of that time): kills aimed
# at saves land inside them. Workers are forked from a zygote that imported
# torch once; a fresh interpreter costs 5-8 s of CPU here, too much for a demo.
CONFIG = DrillConfig(total=200, every=10)


def run_demo(directory: str | None = None, seed: int | None = None, kills: int = 6, json_output: bool = False) -> int:
    """Run the drill; 0 if the interrupted run ends bitwise equal to the reference, else 1.

    ``directory`` keeps the runs (it must be empty or absent); without it a
    temporary directory is used and removed. ``seed`` fixes the kill schedule.
    """
    if kills < 0:
        raise DrillError(f"--kills must be 0 or more, got {kills}")
    seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
    say = (lambda line: None) if json_output else (lambda line: print(line, flush=True))
    began = time.monotonic()
    root = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="trainstate-demo-"))
    try:
        say(f"trainstate demo: {CONFIG.total} updates, a save every {CONFIG.every}, "
            f"{kills} SIGKILL{'' if kills == 1 else 's'} (kill schedule seed {seed}; rerun with --seed {seed})")
        timing: list[Timing] = []

        with Zygote() as launcher:
            def reference() -> Timing:
                timing.append(run_reference(CONFIG, root / "reference", launcher=launcher))
                say(f"reference: ran uninterrupted in {timing[0].wall_s:.1f} s, a save taking "
                    f"{timing[0].save_s * 1000:.0f} ms (median)")
                say("interrupted run (each start a new process, forked before it builds anything):")
                return timing[0]

            report = run_interrupted(CONFIG, root / "interrupted", kills=kills, seed=seed, timing=reference,
                                     launcher=launcher, log=say)
        comparison = compare_runs(CONFIG, root / "reference", root / "interrupted") if report.finished else None
    finally:
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)
    ok = report.finished and not report.problems and comparison is not None and comparison.equal
    if json_output:
        print(json.dumps(_as_json(report, comparison, ok, time.monotonic() - began, directory), indent=1))
    else:
        _print_report(report, comparison, ok, time.monotonic() - began)
    return 0 if ok else 1


def run_ranks_demo(ranks: int = 2, directory: str | None = None, seed: int | None = None, kills: int = RANKS_KILLS,
                   json_output: bool = False) -> int:
    """The drill under ``torchrun`` with ``ranks`` ranks; 0 if the interrupted run ends bitwise equal, else 1."""
    if kills < 0:
        raise DrillError(f"--kills must be 0 or more, got {kills}")
    if ranks < 1:
        raise DrillError(f"--ranks must be 1 or more, got {ranks}")
    seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
    say = (lambda line: None) if json_output else (lambda line: print(line, flush=True))
    began = time.monotonic()
    root = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="trainstate-demo-"))
    cfg = RANKS_CONFIG
    try:
        mode = "FSDP2" if cfg.mode == "fsdp" else "DDP"
        say(f"trainstate demo: {ranks} ranks under torchrun ({mode}, gloo), {cfg.total} updates, a "
            f"save every {cfg.every} by all ranks together, {kills} SIGKILL{'' if kills == 1 else 's'} of the whole "
            f"launch (kill schedule seed {seed}; rerun with --seed {seed})")
        drill = run_ranks_drill(cfg, root, kills=kills, seed=seed, ranks=ranks, log=say)
    finally:
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)
    elapsed = time.monotonic() - began
    if json_output:
        print(json.dumps({**drill.as_json(), "seconds": round(elapsed, 2), "directory": directory}, indent=1))
    else:
        launches = f"{len(drill.report.starts) + 1} torchrun launches (the reference and {len(drill.report.starts)} " \
                   "interrupted)"
        _print_report(drill.report, drill.comparison, drill.ok, elapsed, launches)
    return 0 if drill.ok else 1


def run_nodes_demo(ranks: int, nodes: int, directory: str | None = None, seed: int | None = None,
                   kills: int = NODES_KILLS, json_output: bool = False) -> int:
    """The drill on ``nodes`` torchrun agents of this host, ``ranks`` ranks in all (``ranks / nodes`` per node), each
    node its own directory; half the kills (rounded up) also lose a node. 0 if bitwise equal, else 1."""
    if kills < 0:
        raise DrillError(f"--kills must be 0 or more, got {kills}")
    if nodes < 2 or ranks < nodes or ranks % nodes:
        raise DrillError(f"--nodes {nodes} with --ranks {ranks}: --ranks is the total number of ranks, split evenly "
                         "over 2 or more nodes; give a multiple of --nodes (e.g. --ranks 2 --nodes 2: 2 nodes of 1 "
                         "rank)")
    seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
    say = (lambda line: None) if json_output else (lambda line: print(line, flush=True))
    began = time.monotonic()
    root = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="trainstate-demo-"))
    cfg, per_node, losses = RANKS_CONFIG, ranks // nodes, (kills + 1) // 2
    try:
        mode = "FSDP2" if cfg.mode == "fsdp" else "DDP"
        say(f"trainstate demo: {nodes} nodes x {per_node} rank{'' if per_node == 1 else 's'}, one torchrun agent per "
            f"node on this host (c10d rendezvous on 127.0.0.1; {mode}, gloo), each node its own directory "
            f"(node-local tiers, replicas={REPLICAS}); {cfg.total} updates, a save every {cfg.every}; {kills} "
            f"SIGKILL{'' if kills == 1 else 's'} of every agent and rank, {losses} of them also losing one node's "
            f"directory (kill schedule seed {seed}; rerun with --seed {seed})")
        result = run_nodes_drill(cfg, root, kills=kills, seed=seed, nodes=nodes, per_node=per_node, losses=losses,
                                 log=say)
    finally:
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)
    elapsed = time.monotonic() - began
    if json_output:
        print(json.dumps({**result.as_json(), "seconds": round(elapsed, 2), "directory": directory}, indent=1))
        return 0 if result.ok else 1
    drill = result.drill
    lost = ", ".join(f"node {x.node} at kill {x.kill}" for x in result.lost)
    print(f"nodes lost: {lost} (each time the directory deleted, the next launch resumed from what the other nodes "
          f"held; at the end every node's directory verified, the final generation on {REPLICAS} nodes)" if lost
          else "nodes lost: none (see above why)")
    launches = f"{len(drill.report.starts) + 1} launches of {nodes} torchrun agents (the reference and " \
               f"{len(drill.report.starts)} interrupted)"
    _print_report(drill.report, drill.comparison, drill.ok, elapsed, launches)
    return 0 if result.ok else 1


def _print_report(report: DrillReport, comparison: Comparison | None, ok: bool, elapsed: float,
                  starts: str | None = None) -> None:
    starts = starts or f"{len(report.starts)} process starts"
    print(f"{report.kills} kills ({report.kills_during_save} inside a save), {report.resumes} resumes, "
          f"{starts}; after every kill all visible generations verified in full "
          f"({report.verified_after_kills} verifications)")
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    if comparison is not None:
        print(f"compared bitwise, reference vs interrupted ({comparison.values} values, "
              f"{comparison.elements:,} tensor elements):")
        for part, what in comparison.compared.items():
            print(f"  {part + ':':<12}{what}")
        for difference in comparison.differences[:20]:
            print(f"DIFFERS: {difference}")
        if len(comparison.differences) > 20:
            print(f"... and {len(comparison.differences) - 20} more differences")
    verdict = "bitwise identical" if ok else "FAILED"
    print(f"result: {verdict} ({elapsed:.1f} s)", file=sys.stdout if ok else sys.stderr)


def _as_json(report: DrillReport, comparison: Comparison | None, ok: bool, elapsed: float,
             directory: str | None) -> dict[str, Any]:
    return {
        "ok": ok, "seed": report.seed, "seconds": round(elapsed, 2), "directory": directory,
        "kills": report.kills, "kills_during_save": report.kills_during_save, "resumes": report.resumes,
        "starts": [{"restored": s.restored, "mode": s.plan.mode if s.plan else None,
                    "killed_after_s": s.killed_after_s, "landed": s.landed or None, "exit_code": s.exit_code}
                   for s in report.starts],
        "problems": report.problems,
        "compared": comparison.compared if comparison else None,
        "differences": comparison.differences if comparison else None,
    }
