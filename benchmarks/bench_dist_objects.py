"""Multi-rank restore from an object store: trainstate against a raw obstore get of the same bytes, FSDP2, gloo.

Usage (the script starts SeaweedFS and ``torchrun`` itself)::

    python benchmarks/bench_dist_objects.py --size 256M --reps 5
    python benchmarks/bench_dist_objects.py --size 1G --reps 5 --profile 2 --out dobj.json
    python benchmarks/bench_dist_objects.py --size 64M --reps 1 --profile 1          # smoke, about a minute

The launcher (this script without ``WORLD_SIZE``) starts a SeaweedFS ``weed server -s3`` on 127.0.0.1 on
free ports (``tests/objectservers.start_seaweedfs``, as ``bench_objects.py``), creates a bucket, runs
``python -m torch.distributed.run --standalone --nproc_per_node N`` on this file, and stops the server by
its PID at the end. The ranks use gloo on CPU and one torch thread each.

State: as ``bench_dist.py`` (stacked square ``nn.Linear`` layers, each ``fully_shard``-ed, then the root;
AdamW stepped once); ``--size`` is the tensor bytes over all ranks. It is saved once, untimed, by
``ts.CheckpointManager("s3://<bucket>/run", storage_options=...)`` under the same ``torchrun`` (and, for
``dcp``, once by ``dcp.save`` through ``FsspecWriter`` to ``s3://<bucket>/dcp``).

Every repetition ``r`` runs each method once, in an order rotated by ``r``. Each timed region starts and
ends with a barrier on every rank; the figure is the largest over the ranks of the barrier-to-barrier wall
time (so: until the slowest rank is done).

``trainstate``     ``ckpt.restore(fresh)`` into a second, differently seeded FSDP2 model + AdamW whose local
                   tensors are zeroed (untimed) before; the manager is built and closed untimed (its set-up
                   is reported apart). Every 4 MiB chunk is checked against the manifest's digests. The local
                   tensors are compared bitwise (``torch.equal``) with the saved ones after every restore.
``obstore``        each rank ``obstore.get(store, key).bytes()`` of the objects it needs, one after another,
                   no digest: its own files (``shard-<rank>*``, ``rank-<rank>*``) and the global ones
                   (``manifest.json``, ``state.json``, ``dcp-metadata.json``, ...), listed with
                   ``ObjectStore.files(generation)``.
``obstore-checked`` as ``obstore``, then each 4 MiB chunk digested (XXH3-128) and copied into memory allocated
                   before (standing for the live tensors), object by object: the least any verified load adds
                   to the download, done by the raw client.
``obstore-ranges`` each rank ``obstore.get_ranges`` of exactly the spans its trainstate restore downloaded
                   (recorded in an untimed restore), per file, no digest: the same requests without the
                   verification, the hand-over to the other rank and the load.
``dcp``            stock ``dcp.load`` through ``FsspecReader`` (s3fs) + ``set_model_state_dict`` /
                   ``set_optimizer_state_dict``, checked bitwise too (``--no-dcp`` skips it).

Ratios are ``other_s / trainstate_s`` (above 1: trainstate is faster): the ratio of the medians, the
median of the per-repetition ratios, the ratio of the minima. ``--profile N`` then runs N more trainstate
restores with timers wrapped around library functions (the library is not edited) and prints, per rank,
where the time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
import traceback
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
ENV = "BENCH_DIST_OBJECTS_SERVER"  # the launcher hands the ranks the server as JSON
METHODS = ("trainstate", "obstore", "obstore-checked", "obstore-ranges", "dcp")
GB = 1e9
MiB = 1 << 20
warnings.filterwarnings("ignore", category=FutureWarning)


# launcher ------------------------------------------------------------------------------------------------
def launch(argv: list[str]) -> int:
    """Start SeaweedFS, run the ranks under torchrun, stop the server by its PID."""
    from bench_objects import start_seaweedfs  # the server code bench_objects.py uses (tests/objectservers.py)

    nproc, rest, skip = "2", [], False
    for i, arg in enumerate(argv):  # --nproc is torchrun's, not the ranks'
        if skip:
            skip = False
        elif arg == "--nproc" and i + 1 < len(argv):
            nproc, skip = argv[i + 1], True
        elif arg.startswith("--nproc="):
            nproc = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    workdir = Path(tempfile.mkdtemp(prefix="bench-dist-objects-"))
    server = start_seaweedfs(workdir / "seaweedfs")
    try:
        bucket = server.make_bucket()
        print(f"seaweedfs pid {server.pid} on {server.endpoint} (started in {server.startup_s:.1f} s), bucket "
              f"{bucket}; load {tuple(round(x, 2) for x in os.getloadavg())}", flush=True)
        env = {**os.environ, ENV: json.dumps({"bucket": bucket, "pid": server.pid, "options": server.storage_options(),
                                              "access_key": server.access_key, "secret_key": server.secret_key,
                                              "endpoint": server.endpoint, "region": server.region})}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   os.path.abspath(__file__), *rest]
        return subprocess.run(command, env=env, check=False).returncode
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"seaweedfs stopped (pid {server.pid})", flush=True)


if "WORLD_SIZE" not in os.environ and __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))

import obstore  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from obstore.store import S3Store  # noqa: E402
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,  # noqa: E402
                                                     set_model_state_dict, set_optimizer_state_dict)

import trainstate as ts  # noqa: E402

TRACE = os.environ.get("TS_TRACE_CALLS") == "1"
from bench_dist import (Profiler, broadcast_json, build, differs, gather_json, git, local_tensors, med,  # noqa: E402
                        parse_size, pick_hidden, rank, rotated, say, timed, tree_digest)
from bench_objects import cpu_pid  # noqa: E402
from bench_suite import tidy  # noqa: E402
from trainstate.storage.fetched import Fetched  # noqa: E402
from trainstate.storage.objectclient import Client  # noqa: E402
from trainstate.storage.objects import ObjectStore  # noqa: E402

try:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
except ImportError:  # no fsspec: the dcp method is skipped
    FsspecReader = FsspecWriter = None


def owner(name: str) -> int | None:
    """The rank a per-rank file belongs to (``shard-00001.safetensors``, ``rank-00001.json``); None: global."""
    if name.startswith(("shard-", "rank-")):
        return int(name.split("-")[1][:5])
    return None


class Traffic:
    """What one trainstate restore asked of the store on this rank: the spans ``Fetched`` downloaded per file,
    and the other client calls (commit records, pointers, manifests), counted by wrapping them."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.calls: dict[str, int] = defaultdict(int)
        self.undo: list[Callable[[], None]] = []
        original = Fetched._download

        def download(fetched, generation, name, spans):
            self.spans[name] += [tuple(s) for s in spans]
            return original(fetched, generation, name, spans)
        Fetched._download = download
        self.undo.append(lambda: setattr(Fetched, "_download", original))
        for method in ("read_ranges", "get_small", "get_versioned", "reader", "listing", "names", "head"):
            self._count(method)

    def _count(self, method: str) -> None:
        original = getattr(Client, method)

        def counted(*args, **kwargs):
            self.calls[method] += 1
            if TRACE:  # $TS_TRACE_CALLS=1: each call's key and the trainstate frames that made it
                where = [f"{f.filename.split('trainstate/')[-1]}:{f.lineno}:{f.name}" for f in traceback.extract_stack()
                         if "/trainstate/" in f.filename and "objectclient" not in f.filename]
                print(f"[rank {os.environ.get('RANK')}] {method} {args[1] if len(args) > 1 else ''} <- "
                      + " < ".join(reversed(where[-5:])), file=sys.stderr)
            return original(*args, **kwargs)
        setattr(Client, method, counted)
        self.undo.append(lambda: setattr(Client, method, original))

    def remove(self) -> dict:
        for undo in reversed(self.undo):
            undo()
        return {"spans": {k: v for k, v in self.spans.items()}, "calls": dict(self.calls)}


class Bench:
    def __init__(self, server: dict, live: ts.TrainState, fresh: ts.TrainState, timeout_s: float):
        self.server, self.live, self.fresh, self.timeout_s = server, live, fresh, timeout_s
        self.opts = server["options"]
        self.url = f"s3://{server['bucket']}/run"
        self.dcp_url = f"s3://{server['bucket']}/dcp"
        self.store = S3Store(server["bucket"], **self.opts)
        self.fs_options = {"key": server["access_key"], "secret": server["secret_key"],
                           "endpoint_url": server["endpoint"], "client_kwargs": {"region_name": server["region"]}}
        self.prefix = ""  # the generation's attempt, as an object key prefix
        self.keys: dict[str, str] = {}  # file -> object key, this rank's share
        self.sizes: dict[str, int] = {}
        self.traffic: dict = {}
        self.setup_s: list[float] = []
        self.failed: list[str] = []

    def manager(self) -> ts.CheckpointManager:
        return ts.CheckpointManager(self.url, storage_options=self.opts, collective_timeout_s=self.timeout_s)

    def save(self) -> float:
        start = time.perf_counter()
        with self.manager() as ckpt:
            ckpt.save(self.live)
        return time.perf_counter() - start

    def locate(self) -> str:
        """Rank 0 lists the generation's objects; every rank keeps its own files and the global ones."""
        listing = None
        if rank() == 0:
            store = ObjectStore(self.url, storage_options=self.opts)
            generation = store.generations()[0]
            attempt = store._attempt(generation)
            listing = {"generation": generation, "prefix": f"run/attempts/{attempt}/", "files": store.files(generation)}
        listing = broadcast_json(listing)
        self.prefix = listing["prefix"]
        for name, size in sorted(listing["files"].items()):
            if owner(name) in (None, rank()):
                self.keys[name], self.sizes[name] = listing["prefix"] + name, size
        return listing["generation"]

    def dcp_save(self) -> None:
        model, opt = self.live["model"], self.live["optimizer"]
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(sd, storage_writer=FsspecWriter(self.dcp_url, **self.fs_options))

    # the methods: each returns a timing dict (bench_dist.timed) ------------------------------------------
    def scramble(self) -> None:
        with torch.no_grad():
            for tensor in local_tensors(self.fresh).values():
                tensor.zero_()

    def check(self, what: str) -> None:
        bad = gather_json(differs(local_tensors(self.live), local_tensors(self.fresh)))
        if any(bad):
            self.failed.append(f"{what}: {bad}")

    def run(self, method: str) -> dict:
        cpu = time.process_time()  # this rank's CPU seconds, obstore's threads included
        t = getattr(self, method.replace("-", "_"))()
        return {**t, "cpu": time.process_time() - cpu}

    def trainstate(self) -> dict:
        self.scramble()
        start = time.perf_counter()
        ckpt = self.manager()
        ckpt.__enter__()
        self.setup_s.append(time.perf_counter() - start)
        try:
            got = {}
            t = timed(lambda: got.setdefault("info", ckpt.restore(self.fresh)))
        finally:
            ckpt.close()
        if got.get("info") is None:
            raise RuntimeError(f"{self.url} holds no generation")
        return t

    def obstore(self) -> dict:
        def get_all() -> None:
            for name, key in self.keys.items():
                data = obstore.get(self.store, key).bytes()
                if len(data) != self.sizes[name]:
                    raise RuntimeError(f"{key}: {len(data)} bytes, expected {self.sizes[name]}")
                del data
        return timed(get_all)

    def obstore_checked(self) -> dict:
        """As ``obstore``, then what any verified load adds: each 4 MiB chunk digested (XXH3-128, the run's
        chunk digest) and copied into memory allocated before (standing for the live tensors), each object
        right after its GET."""
        import numpy as np
        import xxhash

        into = {name: np.empty(size, np.uint8) for name, size in self.sizes.items()}  # untimed: the live state

        def get_check_place() -> None:
            for name, key in self.keys.items():
                data = np.frombuffer(obstore.get(self.store, key).bytes(), np.uint8)
                if len(data) != self.sizes[name]:
                    raise RuntimeError(f"{key}: {len(data)} bytes, expected {self.sizes[name]}")
                for at in range(0, len(data), 4 << 20):
                    xxhash.xxh3_128(data[at:at + (4 << 20)]).digest()
                    into[name][at:at + (4 << 20)] = data[at:at + (4 << 20)]
                del data
        return timed(get_check_place)

    def obstore_ranges(self) -> dict:
        def get_ranges() -> None:
            for name, spans in self.traffic["spans"].items():
                got = obstore.get_ranges(self.store, self.prefix + name, starts=[b for b, _ in spans],
                                         ends=[e for _, e in spans], coalesce=0)
                if [len(g) for g in got] != [e - b for b, e in spans]:
                    raise RuntimeError(f"{name}: short ranges")
                del got
        return timed(get_ranges)

    def dcp(self) -> dict:
        self.scramble()
        model, opt = self.fresh["model"], self.fresh["optimizer"]

        def load() -> None:
            sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(sd, storage_reader=FsspecReader(self.dcp_url, **self.fs_options))
            set_model_state_dict(model, sd["model"])
            set_optimizer_state_dict(model, opt, sd["optim"])
        return timed(load)


def install_profile(prof: Profiler) -> None:
    """Timers around the multi-rank remote restore's stages (inclusive seconds, per rank)."""
    from trainstate.distributed import load, session, share, storage
    from trainstate.distributed.group import Ranks
    from trainstate.storage import chunked, fetched, objectclient

    prof.wrap(session.Session, "restore", "restore (Session.restore)")
    prof.wrap(load, "restore", "restore/load.restore")
    prof.wrap(load, "_choose", "restore/1 choose")
    prof.wrap(load, "verify_generation", "restore/1 choose/verify_generation (manifest, sizes)")
    prof.wrap(load, "_templates", "restore/1 choose/templates (get_*_state_dict)")
    prof.wrap(load, "fetch_share", "restore/1 choose/_fetch_share")
    for step in ("_want_records", "_want_header_starts", "_want_headers", "_want_pieces"):
        prof.wrap(share, step, f"restore/1 choose/_fetch_share/{step} (plan)")
    prof.wrap(share, "fetch_together", lambda *a, **k: f"restore/1 choose/_fetch_share/fetch_together, {_round(a[3])}")
    prof.wrap(fetched.Fetched, "fetch_chunks", "restore/1 choose/_fetch_share/fetch_together/fetch_chunks")
    prof.wrap(fetched.Fetched, "_download", "restore/1 choose/_fetch_share/fetch_together/fetch_chunks/GETs")
    prof.wrap(chunked, "_check", "chunk digests (all: fetch rounds and loads)")
    prof.wrap(share, "_share", "restore/1 choose/_fetch_share/fetch_together/_share (broadcast + verify)")
    prof.wrap(load, "_read", "restore/1 choose/_read (decode small files)")
    prof.wrap(load, "_load", "restore/2+3 check and load")
    prof.wrap(load, "sharded_state", "restore/2+3/templates (get_*_state_dict)")
    prof.wrap(load, "_load_checked", "restore/2+3/dcp.load")
    prof.wrap(storage.Reader, "read_data", "restore/2+3/dcp.load/read_data")
    prof.wrap(load, "set_model_state_dict", "restore/2+3/set_model_state_dict")
    prof.wrap(load, "set_optimizer_state_dict", "restore/2+3/set_optimizer_state_dict")
    prof.wrap(objectclient.Client, "get_small", "client get_small (records, pointers)")
    prof.wrap(objectclient.Client, "reader", "client reader (HEAD)")
    prof.wrap(Ranks, "all_gather", lambda _, value, phase: f"collective/{phase}")
    prof.wrap(Ranks, "broadcast", lambda _, value, phase: f"collective/{phase}")
    prof.wrap(Ranks, "check", lambda _, phase, error: f"collective/{phase} (check)")


def _round(wanted: dict[str, list[int]]) -> str:
    """Which of the four rounds of ``share.fetch_share`` a ``fetch_together`` call is, from what this rank wants."""
    shards = {n: c for n, c in wanted.items() if n.startswith("shard-")}
    if not shards:
        return "records round" if wanted else "a round this rank wants nothing from"
    return "header round (chunk 0)" if all(c == [0] for c in shards.values()) else "pieces round"


# report ----------------------------------------------------------------------------------------------------
def figure(per_rank: list[dict]) -> float:
    """The largest barrier-to-barrier wall time over the ranks."""
    return max(t["wall"] for t in per_rank)


def ratio_cells(times: dict[str, list[float]], other: str) -> str:
    a, b = times["trainstate"], times[other]
    return (f"{med(b) / med(a):.2f} / {med([y / x for x, y in zip(a, b)]):.2f} / {min(b) / min(a):.2f}")


def report(result: dict) -> list[str]:
    times = {m: [figure(p) for p in result["times"][m]] for m in result["methods"]}
    nbytes = result["state_bytes"]
    lines = [f"\n{result['world']} ranks, {result['size']} ({nbytes:,} tensor bytes), {result['reps']} reps, "
             f"SeaweedFS on loopback; command: {result['command']}",
             "| method | median s | min-max s | GB/s (state) | other_s / trainstate_s: medians / per rep / minima |",
             "|---|---:|---:|---:|---:|"]
    for m in result["methods"]:
        xs = times[m]
        lines.append(f"| {m} | {med(xs):.3f} | {min(xs):.3f}-{max(xs):.3f} | {nbytes / med(xs) / GB:.2f} | "
                     + ("-" if m == "trainstate" else ratio_cells(times, m)) + " |")
    lines.append("per-repetition ratios other_s / trainstate_s: " + "; ".join(
        f"{m} " + ", ".join(f"{y / x:.2f}" for x, y in zip(times["trainstate"], times[m]))
        for m in result["methods"] if m != "trainstate"))
    lines.append("load average (1 min) at each method's start, per rep: " + "; ".join(
        f"{m} " + ",".join(f"{x:.1f}" for x in result["loads"][m]) for m in result["methods"]))
    lines.append("cpu s per method, medians: server; rank 0, rank 1, ...: " + "; ".join(
        f"{m} {med(result['server_cpu'][m]):.2f}; " + ", ".join(
            f"{med([p[r]['cpu'] for p in result['times'][m]]):.2f}" for r in range(result["world"]))
        for m in result["methods"]))
    lines.append(f"restores bitwise equal (trainstate, dcp; torch.equal of every local tensor): "
                 f"{not result['failed']} (target differed before: {result['differed_before']})")
    lines += [f"  {f}" for f in result["failed"]]
    lines.append("trainstate manager set-up (untimed), median s per rank: "
                 + ", ".join(f"r{r} {med(s):.3f}" for r, s in enumerate(result["setup_s"])))
    lines.append(f"save once (untimed): trainstate {result['save_s']:.2f} s")
    for r, (share, traffic) in enumerate(zip(result["shares"], result["traffic"])):
        fetched = sum(e - b for spans in traffic["spans"].values() for b, e in spans)
        gets = sum(len(s) for s in traffic["spans"].values())
        lines.append(f"rank {r}: obstore gets {len(share)} objects, {sum(share.values()) / MiB:.1f} MiB; trainstate "
                     f"downloaded {fetched / MiB:.1f} MiB in {gets} ranged GETs from "
                     f"{sorted(traffic['spans'])}, other client calls {traffic['calls']}")
    return lines


def profile_lines(by_rank: list[dict]) -> list[str]:
    keys = sorted({k for p in by_rank for k in p}, key=lambda k: (k != "total", k))
    lines = ["  " + " " * 78 + "   ".join(f"rank {r}" for r in range(len(by_rank)))]
    for key in keys:
        vals = [p.get(key) for p in by_rank]
        if all(v is None or v < 0.0005 for v in vals):
            continue
        lines.append(f"    {key:76s} " + " ".join("      -" if v is None else f"{v:7.3f}" for v in vals))
    return lines


# main --------------------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256M", help="total tensor bytes over all ranks (binary units: 256M, 1G)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", type=int, default=0, help="profiled trainstate restores after the reps")
    parser.add_argument("--no-dcp", action="store_true", help="skip stock dcp.load through FsspecReader")
    parser.add_argument("--timeout", type=float, default=600.0, help="collective_timeout_s of the managers")
    parser.add_argument("--out", default=None, help="write every figure as JSON here")
    parser.add_argument("--nproc", default="2", help="ranks (read by the launcher)")
    args = parser.parse_args()
    server = json.loads(os.environ[ENV])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    nbytes = parse_size(args.size)
    hidden = pick_hidden(nbytes)
    methods = tuple(m for m in METHODS if m != "dcp" or (FsspecReader is not None and not args.no_dcp))
    say(f"{world} ranks, {args.size}, hidden {hidden}; trainstate from {Path(ts.__file__).parent} (this checkout: "
        f"{git('rev-parse', '--short', 'HEAD')} + tree {tree_digest()}); torch {torch.__version__}, "
        f"obstore {obstore.__version__}; methods {methods}")
    live = build(nbytes, hidden, seed=0)
    fresh = build(nbytes, hidden, seed=1)
    b = Bench(server, live, fresh, args.timeout)
    total = sum(gather_json(sum(t.nbytes for t in local_tensors(live).values())))
    differed_before = any(gather_json(differs(local_tensors(live), local_tensors(fresh))))
    save_s = b.save()
    generation = b.locate()
    if "dcp" in methods:
        b.dcp_save()
    say(f"saved {generation} in {save_s:.2f} s; {total:,} tensor bytes; this rank's objects {sorted(b.keys)}")

    # one untimed restore: which spans trainstate downloads on each rank (the obstore-ranges baseline)
    traffic = Traffic()
    b.trainstate()
    b.traffic = traffic.remove()
    b.check("untimed first restore")
    b.setup_s.clear()

    times: dict[str, list[list[dict]]] = {m: [] for m in methods}
    loads: dict[str, list[float]] = {m: [] for m in methods}
    server_cpu: dict[str, list[float]] = {m: [] for m in methods}
    for r in range(args.reps):
        for method in rotated(methods, r):
            tidy()
            dist.barrier()
            loads[method].append(os.getloadavg()[0])
            cpu0 = cpu_pid(server["pid"])
            t = b.run(method)
            server_cpu[method].append(cpu_pid(server["pid"]) - cpu0)
            if method in ("trainstate", "dcp"):
                b.check(f"rep {r} {method}")
            times[method].append(gather_json(t))
            say(f"rep {r} {method:15s} {figure(times[method][-1]):7.3f} s  load {loads[method][-1]:.1f}")

    prof_by_rank = None
    if args.profile:
        prof = Profiler()
        install_profile(prof)
        samples = []
        try:
            for i in range(args.profile):
                tidy()
                prof.take()
                t = b.trainstate()
                samples.append({"total": t["own"], "wall": t["wall"], **prof.take()})
                b.check(f"profile {i}")
        finally:
            prof.uninstall()
        keys = {k for s in samples for k in s}
        prof_by_rank = gather_json({k: med([s.get(k, 0.0) for s in samples]) for k in keys})

    result = {"world": world, "size": args.size, "state_bytes": total, "reps": args.reps, "methods": list(methods),
              "command": "python benchmarks/bench_dist_objects.py " + " ".join(sys.argv[1:]),
              "times": times, "loads": loads, "server_cpu": server_cpu, "failed": b.failed,
              "differed_before": differed_before, "setup_s": gather_json(b.setup_s), "save_s": save_s,
              "shares": gather_json(b.sizes), "traffic": gather_json(b.traffic), "profile_by_rank": prof_by_rank,
              "trainstate": {"commit": git("rev-parse", "HEAD"), "tree_digest": tree_digest(),
                             "imported_from": str(Path(ts.__file__).parent)}}
    if rank() == 0:
        lines = report(result)
        if prof_by_rank:
            lines.append(f"\nprofile ({args.profile} trainstate restores, medians, seconds, inclusive; per rank):")
            lines += profile_lines(prof_by_rank)
        print("\n".join(lines), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
            print(f"wrote {args.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if b.failed else 0


if __name__ == "__main__":
    sys.exit(main())
