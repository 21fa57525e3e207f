"""Object store: upload and download of a real generation against local S3 servers, trainstate vs raw obstore vs s3fs.

Usage::

    python benchmarks/bench_objects.py --size 1G --reps 3 --out weed.json                 # SeaweedFS, 5-7 min
    python benchmarks/bench_objects.py --size 1G --reps 3 --servers moto --out moto.json  # moto, 6-7 min
    python benchmarks/bench_objects.py --size 1G --reps 1 --servers moto,seaweedfs --profile
    python benchmarks/bench_objects.py --size 64M --reps 1                                # smoke, under a minute
    python benchmarks/bench_objects.py --report weed.json                                 # print the tables again

Servers (``--servers``, default ``seaweedfs``; ``moto,seaweedfs`` runs both, one after the
other): each is started here on 127.0.0.1 (free ports, by ``tests/objectservers.py``) and
stopped by its PID when its part is done. moto is a Python server that keeps
every object in memory; SeaweedFS (``weed server -s3``, Go) stores on disk under a temp dir.
The clients sign every request (SigV4) with its payload's SHA-256, as the tests' options say.

State: stacked square ``nn.Linear`` layers + AdamW stepped once (as ``bench_suite.py``), tensor
bytes = ``--size``. It is saved once to a local directory (for the mirror upload and as the
source of the raw baselines' bytes) and once to ``<bucket>/down`` (what every download reads).

Every repetition ``r`` runs each upload method once, in an order rotated by ``r``, then each
download method, rotated the same way. Each upload goes to a fresh prefix, deleted (untimed)
after it. Tables give medians (min-max); ratios are ``other_s / trainstate_s`` (above 1:
trainstate is faster), both as a ratio of medians and as the median of per-repetition ratios.

Upload methods:

``trainstate``         ``CheckpointManager(url, storage_options=...).save(state)`` from the live
                       tensors: ``state.json`` + ``tensors.safetensors`` digested (blake3) beside
                       the upload, multipart with ``objects.PART_SIZE`` parts, then the manifest,
                       the commit record, the ``latest`` pointer (compare-and-swap) and the run
                       identity. Opening the manager (its lease) and closing it are timed apart.
``trainstate-mirror``  ``mirror.copy_generation(LocalStore, ObjectStore, name, None)`` of the local
                       generation (its files warm in the page cache): what a ``mirror=`` upload does
                       (read, digest, upload, compare with the manifest, commit, verify sizes).
``obstore``            raw ``obstore.put`` of the same three files' bytes (held in memory, read
                       untimed from the local generation) as three objects; the tensor file
                       multipart with the same part size and concurrency as trainstate (``16 MiB``,
                       8), fed the same way (an iterator of memoryviews), no digest: the floor.
``obstore-digested``   the same, each view digested in the iterator with the run's chunk digest
                       (``xxh3-chunked``), as ``ObjectStaging.write`` does: the least a verified
                       upload adds to the raw put.
``s3fs``               ``S3FileSystem.pipe_file`` of the same bytes, same part size and concurrency.

Download methods (all read the one generation under ``down/``):

``trainstate``         ``CheckpointManager(url).restore(fresh state)``: the default ``in_place``
                       restore above 256 MiB (a verifying pass, then a loading pass: two GETs
                       of every file), into a second model + AdamW zeroed (untimed) before, and
                       compared bitwise with the saved state (untimed) after every restore. The
                       two passes (``restore.load``, ``restore.load_in_place``) are timed by
                       wrapping those functions at run time (the library is not edited).
``trainstate-copy``    the same with ``restore(in_place=False)``: one pass into fresh tensors,
                       then copied into the live ones (one extra copy of the state, briefly).
``trainstate-verify``  ``verify_generation(ObjectStore(url), name, content=True)``: every file read
                       once through ``ObjectStore.open`` (one GET, If-Match) with its digest checked.
``obstore``            raw ``obstore.get(store, key).bytes()`` of the same three objects, no digest.
``obstore-stream``     raw ``obstore.get(store, key).stream(min_chunk_size=8 MiB)`` (as
                       ``Client.reader``), each chunk dropped: the floor.
``s3fs``               ``S3FileSystem.cat_file`` of the same three objects.

``--profile`` adds, interleaved with the above: ``obstore+blake3`` (upload: the raw put, hashing
each view in the iterator as ``ObjectStaging.write`` does) and ``reader+blake3`` (download:
``Client.reader`` + ``digest_stream``, one thread). For every method the client's CPU seconds
(this process, obstore's threads included) and the server's (its PID) are recorded, and the
1-minute load average at its start.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import blake3  # noqa: E402
import obstore  # noqa: E402
import s3fs  # noqa: E402
import torch  # noqa: E402

import trainstate as ts  # noqa: E402
from bench_suite import build, parse_size, rotated, size_label, tidy  # noqa: E402
from objectservers import Server, start_moto, start_seaweedfs  # noqa: E402
from trainstate import restore as restore_mod  # noqa: E402
from trainstate.format.digest import digest_bytes, digest_stream  # noqa: E402
from trainstate.format.manifest import MANIFEST  # noqa: E402
from trainstate.lifecycle.mirror import copy_generation  # noqa: E402
from trainstate.storage import objects as objects_mod  # noqa: E402
from trainstate.storage.local import LocalStore  # noqa: E402
from trainstate.storage.objects import ObjectStore  # noqa: E402
from trainstate.format.digest import FAST_CHUNKED, new_hasher  # noqa: E402
from trainstate.storage.verify import verify_generation  # noqa: E402

GB = 1e9
CONCURRENCY = 8  # as Client.put_stream
READ_CHUNK = 8 << 20  # as Client.reader's min_chunk_size
UPLOADS = ("trainstate", "trainstate-mirror", "obstore", "obstore-digested", "s3fs")
DOWNLOADS = ("trainstate", "trainstate-copy", "trainstate-verify", "obstore", "obstore-stream", "s3fs")
UPLOADS_PROFILE = ("obstore+blake3",)
DOWNLOADS_PROFILE = ("reader+blake3",)

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def load1() -> float:
    return os.getloadavg()[0]


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_pid(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def tree_digest() -> str:
    h = hashlib.sha256()
    for path in sorted((ROOT / "trainstate").rglob("*.py")):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


class Phases:
    """Wall time of the restore's two passes, by wrapping ``restore.load`` / ``restore.load_in_place``."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        for name in ("load", "load_in_place"):
            original = getattr(restore_mod, name)
            setattr(restore_mod, name, self._wrap(name, original))

    def _wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.last[name] = self.last.get(name, 0.0) + time.perf_counter() - start
        return timed

    def take(self) -> dict[str, float]:
        out, self.last = self.last, {}
        return out


class Run:
    """One server: its bucket, clients, the download source, and every method."""

    def __init__(self, server: Server, bench, fresh, local_dir: Path, local_name: str,
                 payload: dict[str, bytes]):
        self.server, self.bench, self.fresh = server, bench, fresh
        self.local_dir, self.local_name, self.payload = local_dir, local_name, payload
        self.bucket = server.make_bucket()
        self.opts = server.storage_options()
        self.store = server.store(self.bucket)  # raw S3Store at the bucket's root
        self.fs = s3fs.S3FileSystem(key=server.access_key, secret=server.secret_key, endpoint_url=server.endpoint,
                                    client_kwargs={"region_name": server.region}, skip_instance_cache=True)
        self.down_url = server.url(self.bucket, "down")
        self.down_name = ""
        self.down_keys: dict[str, str] = {}
        self.down_sizes: dict[str, int] = {}
        self.restore_ok: list[bool] = []
        self.extra: dict[str, list] = defaultdict(list)

    # setup -----------------------------------------------------------------------
    def seed_download(self) -> float:
        start = time.perf_counter()
        with ts.CheckpointManager(self.down_url, storage_options=self.opts) as ckpt:
            ckpt.save(self.bench.state)
        took = time.perf_counter() - start
        store = ObjectStore(self.down_url, storage_options=self.opts)
        self.down_name = store.generations()[0]
        attempt = store._attempt(self.down_name)
        files = store.files(self.down_name)
        self.down_keys = {f: f"down/attempts/{attempt}/{f}" for f in files}
        self.down_sizes = dict(files)
        return took

    def clear(self, prefix: str) -> None:
        paths = [m["path"] for batch in obstore.list(self.store, prefix=prefix) for m in batch]
        for start in range(0, len(paths), 1000):
            obstore.delete(self.store, paths[start:start + 1000])

    # uploads: each into ``prefix`` ---------------------------------------------------
    def up_trainstate(self, prefix: str) -> float:
        start = time.perf_counter()
        ckpt = ts.CheckpointManager(self.server.url(self.bucket, prefix), storage_options=self.opts)
        ckpt.__enter__()
        opened = time.perf_counter()
        try:
            ckpt.save(self.bench.state)
            saved = time.perf_counter()
        finally:
            ckpt.close()
        self.extra["trainstate-open-close"].append(opened - start + time.perf_counter() - saved)
        return saved - opened

    def up_trainstate_mirror(self, prefix: str) -> None:
        local = LocalStore(self.local_dir, create=False)
        dst = ObjectStore(self.server.url(self.bucket, prefix), storage_options=self.opts)
        copy_generation(local, dst, self.local_name, None)

    def _raw_put(self, prefix: str, hasher: bool | str = False) -> None:
        for name, data in self.payload.items():
            key = f"{prefix}/{name}"
            h = (new_hasher(hasher) if isinstance(hasher, str) else blake3.blake3()) if hasher else None
            if len(data) < objects_mod.PART_SIZE:
                if h:
                    h.update(data)
                obstore.put(self.store, key, data, use_multipart=False)
                continue

            def views(mv: memoryview = memoryview(data), h=h):
                for i in range(0, len(mv), objects_mod.PART_SIZE):
                    v = mv[i:i + objects_mod.PART_SIZE]
                    if h:
                        h.update(v)
                    yield v

            obstore.put(self.store, key, views(), chunk_size=objects_mod.PART_SIZE, max_concurrency=CONCURRENCY)

    def up_obstore(self, prefix: str) -> None:
        self._raw_put(prefix)

    def up_obstore_digested(self, prefix: str) -> None:
        self._raw_put(prefix, hasher=FAST_CHUNKED)

    def up_obstore_blake3(self, prefix: str) -> None:
        self._raw_put(prefix, hasher=True)

    def up_s3fs(self, prefix: str) -> None:
        for name, data in self.payload.items():
            self.fs.pipe_file(f"{self.bucket}/{prefix}/{name}", data, chunksize=objects_mod.PART_SIZE,
                              max_concurrency=CONCURRENCY)

    # downloads of the ``down/`` generation ---------------------------------------------
    def _zero_fresh(self) -> None:
        with torch.no_grad():
            for t in self.fresh.tensors().values():
                t.zero_()

    def _check_fresh(self) -> None:
        want, got = self.bench.tensors(), self.fresh.tensors()
        self.restore_ok.append(want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want))

    def _restore(self, in_place: bool | None) -> float:
        self._zero_fresh()
        with ts.CheckpointManager(self.down_url, storage_options=self.opts) as ckpt:
            start = time.perf_counter()
            info = ckpt.restore(self.fresh.state, in_place=in_place)
            took = time.perf_counter() - start
        if info is None:
            raise RuntimeError(f"{self.down_url} holds no generation")
        self._check_fresh()
        return took

    def down_trainstate(self) -> float:
        return self._restore(None)

    def down_trainstate_copy(self) -> float:
        return self._restore(False)

    def down_trainstate_verify(self) -> None:
        verify_generation(ObjectStore(self.down_url, storage_options=self.opts), self.down_name, content=True)

    def down_obstore(self) -> None:
        for name, key in self.down_keys.items():
            got = obstore.get(self.store, key).bytes()
            if len(got) != self.down_sizes[name]:
                raise RuntimeError(f"{key}: {len(got)} bytes, expected {self.down_sizes[name]}")
            del got

    def down_obstore_stream(self) -> None:
        for name, key in self.down_keys.items():
            n = sum(len(c) for c in obstore.get(self.store, key).stream(min_chunk_size=READ_CHUNK))
            if n != self.down_sizes[name]:
                raise RuntimeError(f"{key}: {n} bytes, expected {self.down_sizes[name]}")

    def down_reader_blake3(self) -> None:
        store = ObjectStore(self.down_url, storage_options=self.opts)
        for name in self.down_keys:
            with store.open(self.down_name, name) as stream:
                size, _ = digest_stream(stream, "blake3", self.down_sizes[name])
            if size != self.down_sizes[name]:
                raise RuntimeError(f"{name}: {size} bytes")

    def down_s3fs(self) -> None:
        for name, key in self.down_keys.items():
            got = self.fs.cat_file(f"{self.bucket}/{key}")
            if len(got) != self.down_sizes[name]:
                raise RuntimeError(f"{key}: {len(got)} bytes")
            del got

    def method(self, phase: str, name: str) -> Callable:
        return getattr(self, f"{phase}_{name.replace('-', '_').replace('+', '_')}")


def measure(fn: Callable[[], object], server_pid: int) -> dict[str, float]:
    tidy()
    load = load1()
    c0, s0 = cpu_self(), cpu_pid(server_pid)
    start = time.perf_counter()
    inner = fn()
    wall = time.perf_counter() - start
    c1, s1 = cpu_self(), cpu_pid(server_pid)
    return {"s": inner if isinstance(inner, float) else wall, "wall_s": wall, "client_cpu_s": c1 - c0,
            "server_cpu_s": s1 - s0, "load1": load}


def run_server(kind: str, args: argparse.Namespace, bench, fresh, local_dir: Path, local_name: str,
               payload: dict[str, bytes], workdir: Path, phases: Phases) -> dict:
    say(f"{kind}: starting")
    server = start_moto(workdir / "moto") if kind == "moto" else start_seaweedfs(workdir / "seaweedfs")
    result: dict = {"server": kind, "startup_s": round(server.startup_s, 2), "up": defaultdict(list),
                    "down": defaultdict(list)}
    try:
        run = Run(server, bench, fresh, local_dir, local_name, payload)
        seeded = run.seed_download()
        say(f"{kind}: pid {server.pid}, {server.endpoint}; download source {run.down_name} saved in {seeded:.1f} s")
        ups = UPLOADS + (UPLOADS_PROFILE if args.profile else ())
        downs = DOWNLOADS + (DOWNLOADS_PROFILE if args.profile else ())
        for rep in range(args.reps):
            for name in rotated(ups, rep):
                prefix = f"up/{rep}-{name.replace('+', '-')}"
                m = measure(lambda: run.method("up", name)(prefix), server.pid)
                run.clear(prefix + "/")
                result["up"][name].append(m)
                say(f"{kind} rep {rep} upload   {name:18s} {m['s']:6.2f} s  client cpu {m['client_cpu_s']:5.2f}  "
                    f"server cpu {m['server_cpu_s']:5.2f}  load {m['load1']:.1f}")
            for name in rotated(downs, rep):
                phases.take()
                m = measure(run.method("down", name), server.pid)
                if name.startswith("trainstate") and name != "trainstate-verify":
                    m.update({f"phase_{k}_s": v for k, v in phases.take().items()})
                result["down"][name].append(m)
                say(f"{kind} rep {rep} download {name:18s} {m['s']:6.2f} s  client cpu {m['client_cpu_s']:5.2f}  "
                    f"server cpu {m['server_cpu_s']:5.2f}  load {m['load1']:.1f}")
        result["restores_bitwise_equal"] = run.restore_ok
        result["trainstate_open_close_s"] = run.extra["trainstate-open-close"]
        result["seed_save_s"] = seeded
    finally:
        server.stop()
        say(f"{kind}: stopped (pid {server.pid})")
    result["up"], result["down"] = dict(result["up"]), dict(result["down"])
    return result


# report ------------------------------------------------------------------------------
def med(values: list[float]) -> float:
    return statistics.median(values)


def fmt(values: list[float]) -> str:
    return f"{med(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def ratios(table: dict, ours: str, other: str) -> str:
    """``other_s / ours_s``: ratio of the medians / median of per-repetition ratios / ratio of the minima."""
    a, b = [m["s"] for m in table[ours]], [m["s"] for m in table[other]]
    return (f"{med(b) / med(a):.2f} / {med([y / x for x, y in zip(a, b)]):.2f} / {min(b) / min(a):.2f}")


def report(res: dict, nbytes: int) -> list[str]:
    lines = [f"### {res['server']}", "",
             "| | method | median s (min-max) | GB/s | client cpu s | server cpu s |", "|---|---|---:|---:|---:|---:|"]
    for phase, label in (("up", "upload"), ("down", "download")):
        for name, ms in res[phase].items():
            secs = [m["s"] for m in ms]
            lines.append(f"| {label} | {name} | {fmt(secs)} | {nbytes / med(secs) / GB:.2f} | "
                         f"{med([m['client_cpu_s'] for m in ms]):.2f} | {med([m['server_cpu_s'] for m in ms]):.2f} |")
    lines += ["", "Ratios other_s / trainstate_s (above 1: trainstate faster): medians / per rep / minima", "",
              "| | trainstate method | x obstore | x obstore-stream | x s3fs |", "|---|---|---:|---:|---:|"]
    for phase, label in (("up", "upload"), ("down", "download")):
        table = res[phase]
        for ours in (n for n in table if n.startswith("trainstate")):
            cells = [ratios(table, ours, other) if other in table else "-" for other in ("obstore", "obstore-stream",
                                                                                         "s3fs")]
            lines.append(f"| {label} | {ours} | " + " | ".join(cells) + " |")
    loads = [m["load1"] for phase in ("up", "down") for ms in res[phase].values() for m in ms]
    lines.append("")
    lines.append(f"load average (1 min) at the start of each method: {min(loads):.1f}-{max(loads):.1f}; "
                 f"restores bitwise equal: {all(res['restores_bitwise_equal'])} "
                 f"({len(res['restores_bitwise_equal'])}); trainstate open+close "
                 f"{fmt(res['trainstate_open_close_s'])} s")
    for name, ms in res["down"].items():
        keys = sorted(k for k in ms[0] if k.startswith("phase_"))
        if keys:
            lines.append(f"{name} passes: " + ", ".join(f"{k[6:-2]} {fmt([m.get(k, 0.0) for m in ms])} s"
                                                        for k in keys))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1G", help="tensor bytes of the state (binary units: 64M, 1G)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--servers", default="seaweedfs", help="comma-separated: moto, seaweedfs")
    parser.add_argument("--profile", action="store_true", help="add the profiling methods (see the docstring)")
    parser.add_argument("--dir", default=None, help="work directory (default: a fresh temp dir, removed at the end)")
    parser.add_argument("--out", default=None, help="write every figure as JSON here")
    parser.add_argument("--report", default=None, metavar="JSON", help="print the tables of an earlier --out; run nothing")
    args = parser.parse_args()
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        print("\n".join(line for res in saved["results"] for line in report(res, saved["generation_bytes"]) + [""]))
        return 0
    nbytes = parse_size(args.size)
    kinds = [k.strip() for k in args.servers.split(",") if k.strip()]
    if unknown := set(kinds) - {"moto", "seaweedfs"}:
        parser.error(f"unknown servers {sorted(unknown)}")
    torch.set_num_threads(1)
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-objects-"))
    workdir.mkdir(parents=True, exist_ok=True)
    say(f"size {size_label(nbytes)}, reps {args.reps}, servers {kinds}, profile {args.profile}; trainstate "
        f"{git('rev-parse', '--short', 'HEAD')} (tree {tree_digest()}), obstore {obstore.__version__}, s3fs "
        f"{s3fs.__version__}; PART_SIZE {objects_mod.PART_SIZE >> 20} MiB; load {os.getloadavg()}")
    results = []
    try:
        bench = build(nbytes)
        fresh = build(nbytes, hidden=bench.hidden, seed=1)
        local_dir = workdir / "local"
        with ts.CheckpointManager(local_dir) as ckpt:
            ckpt.save(bench.state)
        local_name = LocalStore(local_dir, create=False).generations()[0]
        gen_dir = local_dir / local_name
        payload = {p.name: p.read_bytes() for p in sorted(gen_dir.iterdir()) if p.name != MANIFEST}
        payload[MANIFEST] = (gen_dir / MANIFEST).read_bytes()  # last, as trainstate writes it
        total = sum(len(v) for v in payload.values())
        t = time.perf_counter()
        blake3.blake3(payload["tensors.safetensors"]).hexdigest()
        blake3_s = time.perf_counter() - t
        manifest = json.loads(payload[MANIFEST])
        digest = digest_bytes(manifest["digest_algorithm"], payload["tensors.safetensors"])  # format 3: chunked
        recorded = {f["name"]: f["digest"] for f in manifest["files"]}
        if recorded.get("tensors.safetensors") != digest:
            raise RuntimeError("the raw baselines' bytes are not the generation's tensor file")
        say(f"state {bench.nbytes():,} tensor bytes, hidden {bench.hidden}; generation files "
            f"{ {k: len(v) for k, v in payload.items()} } = {total:,} bytes; blake3 in memory {blake3_s:.2f} s "
            f"({len(payload['tensors.safetensors']) / blake3_s / GB:.2f} GB/s)")
        phases = Phases()
        for kind in kinds:
            results.append(run_server(kind, args, bench, fresh, local_dir, local_name, payload,
                                      workdir / kind, phases))
            tidy()
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    lines = []
    for res in results:
        lines += report(res, total) + [""]
    print("\n".join(lines), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "size": nbytes, "generation_bytes": total, "reps": args.reps, "profile": args.profile,
            "blake3_memory_s": blake3_s, "part_size": objects_mod.PART_SIZE, "concurrency": CONCURRENCY,
            "trainstate": {"commit": git("rev-parse", "HEAD"), "tree_digest": tree_digest(),
                           "dirty": git("status", "--short", "trainstate").splitlines()},
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "torch": torch.__version__, "obstore": obstore.__version__, "s3fs": s3fs.__version__},
            "results": results}, indent=1))
    say(f"done; load {tuple(round(x, 2) for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
