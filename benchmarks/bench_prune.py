"""Retention at scale: plan and prune a run directory of 1,000 generations, without tensor I/O.

The directory is built cheaply but for real. One generation of a tiny state
(``Linear(3, 2)`` + SGD with momentum) is saved through ``CheckpointManager``;
it is then cloned N-2 times: ``tensors.safetensors`` is hard-linked (a published
generation is immutable), ``state.json`` is rewritten with the clone's update,
and the manifest is rebuilt with the library's own ``Manifest`` (name, update,
parent, the same timeline, a ``val`` metric) and the library's digest, so every
clone verifies, structure and content, and restores. The newest generation is
a second real save, which moves ``latest``. Nothing is pruned while building
(``keep_last`` is larger than N).

Then, in interleaved rounds (round ``r`` runs every method once, in an order
rotated by ``r``), under ``Retention(keep_last=10, milestone_every=2,
best=("val", "min"))``, which keeps about half:

- ``Lifecycle.plan``: the plan for the directory (changes nothing);
- ``manager.prune(dry_run=True)``: the same through ``CheckpointManager`` (takes the lock);
- ``manager.prune()``: a real prune of a fresh copy (hard links, made outside the
  timing), which removes about half the generations.

Every open of a file during the timed calls is counted, by wrapping
``LocalStore.open``, ``os.open``, ``io.open`` and ``builtins.open``; the run fails
unless ``tensors.safetensors`` was opened zero times ("no tensor I/O").

Usage::

    python benchmarks/bench_prune.py [--generations 1000] [--rounds 7] [--dir PATH] [--json out.json]
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import dataclasses
import datetime
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import trainstate as ts
from trainstate.format.digest import new_hasher
from trainstate.lifecycle.generations import Lifecycle
from trainstate.storage.local import LocalStore
from trainstate.format import signing  # noqa: E402
from trainstate.format.manifest import (
    MANIFEST,
    STATE,
    FileRecord,
    generation_name,
    parse_generation_name,
)
from trainstate.lifecycle.retention import Retention
from trainstate.storage.verify import read_manifest

TENSORS = "tensors.safetensors"
HALF = Retention(keep_last=10, milestone_every=2, best=("val", "min"))
METHODS = ("Lifecycle.plan", "prune(dry_run=True)", "prune()")


def tiny_state(seed: int = 0) -> ts.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return ts.TrainState(model=model, optimizer=opt, contract={"config": {"bench": "prune"}})


def val(update: int) -> float:
    """A deterministic, scattered metric; its minimum is at a single update."""
    return round(((update * 7919) % 1009) / 1009, 6)


def build_run(root: Path, generations: int) -> dict:
    """``generations`` full generations, updates 1..N, one timeline, every one verifiable; see the module doc."""
    if generations < 3:
        raise ValueError("need at least 3 generations")
    started = time.perf_counter()
    root.mkdir(parents=True)
    state = tiny_state()
    with ts.CheckpointManager(root, retention=Retention(keep_last=generations + 1)) as mgr:
        state.next_update = 1
        mgr.save(state, metrics={"val": val(1)})
        first = generation_name(1)
        template = read_manifest(mgr.store, first, key=mgr.key)[0]
        skeleton = json.loads((root / first / STATE).read_bytes())
        created = datetime.datetime.now(datetime.timezone.utc)
        for update in range(2, generations):
            skeleton["clocks"]["next_update"] = update
            data = json.dumps(skeleton, separators=(",", ":")).encode()
            hasher = new_hasher(template.digest_algorithm)
            hasher.update(data)
            files = tuple(FileRecord(STATE, len(data), hasher.hexdigest(), tuple(getattr(hasher, "chunks", ())))
                          if f.name == STATE else f for f in template.files)
            name = generation_name(update)
            manifest = dataclasses.replace(
                template, generation=name, next_update=update, files=files, parent=generation_name(update - 1),
                metrics={"val": val(update)},
                created=(created + datetime.timedelta(microseconds=update)).isoformat(timespec="microseconds"))
            (root / name).mkdir()
            (root / name / STATE).write_bytes(data)
            os.link(root / first / TENSORS, root / name / TENSORS)
            (root / name / MANIFEST).write_bytes(manifest.to_bytes(mgr.key))
        state.next_update = generations
        state.parent = generation_name(generations - 1)  # the same timeline continues: every clone is an ancestor
        mgr.save(state, metrics={"val": val(generations)})
        names = mgr.generations()
    assert len(names) == generations, f"built {len(names)} generations, wanted {generations}"
    return {"generations": generations, "build_s": time.perf_counter() - started}


def copy_run(src: Path, dst: Path) -> None:
    """A prunable copy: tensor files hard-linked, metadata copied, lock files left behind."""
    def link_or_copy(a: str, b: str) -> None:
        if Path(a).name == TENSORS:
            os.link(a, b)
        else:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link_or_copy, ignore=shutil.ignore_patterns(".trainstate*.lock"))


@contextlib.contextmanager
def count_opens() -> Iterator[Counter]:
    """Count every open by file name (store reads, raw ``os.open`` and Python ``open``) while active."""
    counts: Counter = Counter()
    real_store_open, real_os_open, real_io_open, real_builtin_open = LocalStore.open, os.open, io.open, builtins.open

    def store_open(self, generation, file):
        counts[file] += 1
        return real_store_open(self, generation, file)

    def os_open(path, *args, **kwargs):
        counts[f"os:{_kind(path)}"] += 1
        return real_os_open(path, *args, **kwargs)

    def py_open(file, *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)):
            counts[f"py:{_kind(file)}"] += 1
        return real_io_open(file, *args, **kwargs)

    LocalStore.open, os.open, io.open, builtins.open = store_open, os_open, py_open, py_open
    try:
        yield counts
    finally:
        LocalStore.open, os.open, io.open, builtins.open = real_store_open, real_os_open, real_io_open, real_builtin_open


def _kind(path: str | bytes | os.PathLike) -> str:
    """A file's name, with directories opened to fsync or remove them grouped."""
    p = Path(os.fsdecode(path))
    if p.name.startswith(".trainstate-trash-"):
        return "<trash dir (rmtree)>"
    if parse_generation_name(p.name) or p.is_dir():
        return "<directory>"
    return p.name


def tensor_opens(counts: Counter) -> int:
    return sum(n for key, n in counts.items() if key.split(":")[-1] == TENSORS)


def measure(master: Path, work: Path, rounds: int, policy: Retention = HALF) -> dict:
    """Time the three methods in interleaved rounds; count opens; check what the real prune removed."""
    key = signing.resolve(None, master)
    expected = Lifecycle(LocalStore(master, create=False), key).plan(policy)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    opens: Counter = Counter()
    removed: list[int] = []

    def plan_once() -> None:
        with count_opens() as counts:
            t = time.perf_counter()
            got = Lifecycle(LocalStore(master, create=False), key).plan(policy)
            times["Lifecycle.plan"].append(time.perf_counter() - t)
        opens.update(counts)
        assert got == expected, "the plan changed between rounds"

    def dry_run_once() -> None:
        before = sorted(os.listdir(master))
        with ts.CheckpointManager(master, retention=policy) as mgr, count_opens() as counts:
            t = time.perf_counter()
            got = mgr.prune(dry_run=True)
            times["prune(dry_run=True)"].append(time.perf_counter() - t)
        opens.update(counts)
        assert got == expected and sorted(os.listdir(master)) == before, "a dry run changed the directory"

    def prune_once() -> None:
        target = work / f"copy-{len(removed)}"
        copy_run(master, target)
        with ts.CheckpointManager(target, retention=policy) as mgr:
            with count_opens() as counts:
                t = time.perf_counter()
                got = mgr.prune()
                times["prune()"].append(time.perf_counter() - t)
            left = mgr.generations()
        opens.update(counts)
        assert got.prune == expected.prune and sorted(left) == sorted(expected.keep), "the prune removed other than planned"
        removed.append(len(got.prune))
        shutil.rmtree(target)

    steps: list[Callable[[], None]] = [plan_once, dry_run_once, prune_once]
    for r in range(rounds):
        for i in range(len(steps)):
            steps[(i + r) % len(steps)]()
    return {
        "generations": len(expected.decisions), "kept": len(expected.keep), "pruned": removed[0] if removed else 0,
        "rounds": rounds,
        "median_s": {m: statistics.median(v) for m, v in times.items()},
        "min_s": {m: min(v) for m, v in times.items()},
        "max_s": {m: max(v) for m, v in times.items()},
        "opens": dict(sorted(opens.items())), "tensor_opens": tensor_opens(opens),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed after)")
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench-prune-", dir=args.dir))
    try:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        built = build_run(work / "master", args.generations)
        result = measure(work / "master", work, args.rounds)
        result.update(build_s=built["build_s"], load_avg_1m=load,
                      command=" ".join([Path(sys.executable).name, *sys.argv]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"command: {result['command']}")
    print(f"{result['generations']} generations (built in {result['build_s']:.1f} s); policy {HALF}; "
          f"a prune keeps {result['kept']}, removes {result['pruned']}; {args.rounds} interleaved rounds; "
          f"1-min load average at start {load if load is None else round(load, 2)}")
    print(f"{'method':<22}{'median s':>10}{'min s':>10}{'max s':>10}{'per generation':>18}")
    for m in METHODS:
        med = result["median_s"][m]
        print(f"{m:<22}{med:>10.4f}{result['min_s'][m]:>10.4f}{result['max_s'][m]:>10.4f}"
              f"{med / result['generations'] * 1e6:>15.0f} us")
    print("opens during the timed calls: " + ", ".join(f"{k} x{v}" for k, v in result["opens"].items()))
    print(f"tensors.safetensors opened {result['tensor_opens']} times")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if result["tensor_opens"]:
        print("FAILED: the plan or prune read tensor files", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
