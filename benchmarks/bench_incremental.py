"""Incremental generations (issue 32): what a steady save of a LoRA-shaped run writes and costs.

A frozen base of ``--base`` bytes (float32 ``Linear`` layers of 4096 x 4096),
LoRA adapters of rank ``--rank`` on each and their Adam state (about 1% of
the base at the defaults). Each repetition, interleaved:

- ``full``: a blocking save of the same state into a fresh directory
  (``full_every=None``: format 3, every byte written, fsynced, published);
- ``incremental``: one training step of the adapters, then a blocking save
  into the incremental run (``full_every=1000``), whose earlier saves laid the
  base out in part files: the base's files are linked, the adapters written;
- ``restore-full`` / ``restore-incremental``: an in-place restore of the
  newest generation of each directory into the live state (warm page cache).

Reported: medians and minima of each, the ratio of the steady save's time
to the full save's, the bytes the steady save wrote (the files it did not
link) against the bytes that changed (adapters, their moments, step
counters), and the restore ratio. ``--embedding`` adds the other shape the
issue asks about: a table of which 1% of rows change each update (the part
granularity is a tensor, so the table is rewritten whole).

    python benchmarks/bench_incremental.py --base 1G --reps 5
    python benchmarks/bench_incremental.py --base 256M --reps 2 --embedding 256M   # smoke, about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import trainstate as ts

DIM = 4096


def size_arg(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


class Lora(torch.nn.Module):
    def __init__(self, layers: int, rank: int):
        super().__init__()
        self.base = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM, bias=False) for _ in range(layers))
        self.base.requires_grad_(False)
        self.a = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(rank, DIM) * 0.01) for _ in range(layers))
        self.b = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(DIM, rank)) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w, a, b in zip(self.base, self.a, self.b):
            x = w(x) + (x @ a.T) @ b.T
        return x


def build(base_bytes: int, rank: int, embedding_bytes: int) -> ts.TrainState:
    torch.manual_seed(0)
    model = Lora(max(1, base_bytes // (DIM * DIM * 4)), rank)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    state = ts.TrainState(model=model, optimizer=opt, rngs={"data": torch.Generator().manual_seed(0)})
    if embedding_bytes:
        state.components["table"] = Table(embedding_bytes)
    return state


class Table:
    """An embedding table of 256-float rows, 1% of them changed per update (Check-N-Run's shape)."""

    def __init__(self, nbytes: int):
        self.rows = torch.randn(max(100, nbytes // (256 * 4)), 256)
        self.gen = torch.Generator().manual_seed(1)

    def touch(self) -> None:
        picked = torch.randint(0, self.rows.shape[0], (self.rows.shape[0] // 100,), generator=self.gen)
        self.rows[picked] += 0.01

    def state_dict(self) -> dict:
        return {"rows": self.rows}

    def load_state_dict(self, value: dict) -> None:
        self.rows.copy_(value["rows"])


def step(state: ts.TrainState) -> None:
    model, opt = state["model"], state["optimizer"]
    x = torch.randn(2, DIM, generator=state.rngs["data"])
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    if "table" in state.components:
        state["table"].touch()
    state.next_update += 1


def changed_bytes(state: ts.TrainState) -> int:
    model = state["model"]
    adapters = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    moments = sum(t.nbytes for s in state["optimizer"].state.values() for t in s.values() if torch.is_tensor(t))
    table = state["table"].rows.nbytes if "table" in state.components else 0
    return adapters + moments + table


def written_bytes(run: Path, name: str) -> int:
    manifest = json.loads((run / name / "manifest.json").read_bytes())
    shared = set(manifest.get("shares", {}))
    own = sum(f["size"] for f in manifest["files"] if f["name"] not in shared)
    return own + (run / name / "manifest.json").stat().st_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="1G", help="frozen base bytes (binary units)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--embedding", default="0", help="also a table of this many bytes, 1%% of rows per update")
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir on this disk)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-incremental-", dir=args.dir))
    state = build(size_arg(args.base), args.rank, size_arg(args.embedding))
    inc = work / "incremental"
    times: dict[str, list[float]] = {k: [] for k in ("full", "incremental", "restore-full", "restore-incremental")}
    written: list[int] = []
    loads: list[float] = []
    try:
        with ts.CheckpointManager(inc, keep_last=2, full_every=1000) as ckpt:
            for _ in range(2):  # gen 1 writes everything; gen 2 lays the unchanged base out in part files
                step(state)
                ckpt.save(state)
            for rep in range(args.reps):
                loads.append(os.getloadavg()[0])
                full_dir = work / f"full-{rep}"
                t = time.perf_counter()
                with ts.CheckpointManager(full_dir, keep_last=1, full_every=None) as full:
                    full.save(state)
                times["full"].append(time.perf_counter() - t)
                step(state)
                t = time.perf_counter()
                info = ckpt.save(state)
                times["incremental"].append(time.perf_counter() - t)
                written.append(written_bytes(inc, info.name))
                t = time.perf_counter()
                with ts.CheckpointManager(full_dir) as reader:
                    reader.restore(state)
                times["restore-full"].append(time.perf_counter() - t)
                t = time.perf_counter()
                ckpt.restore(state)  # (the run's own manager: it holds the directory)
                times["restore-incremental"].append(time.perf_counter() - t)
                shutil.rmtree(full_dir)
                print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items())
                      + f", wrote {written[-1] / 1e6:.1f} MB", flush=True)
        changed = changed_bytes(state)
        med = {k: statistics.median(v) for k, v in times.items()}
        low = {k: min(v) for k, v in times.items()}
        total = sum(t.nbytes for t in state["model"].state_dict().values()) + changed
        print(f"\nstate {total / 2**30:.2f} GiB; changed per update {changed / 1e6:.1f} MB "
              f"({100 * changed / total:.2f}%); load average (1 min) {min(loads):.1f}-{max(loads):.1f}")
        print("| | median s | min s |\n|---|---:|---:|")
        for k in times:
            print(f"| {k} | {med[k]:.3f} | {low[k]:.3f} |")
        print(f"steady save / full save: {med['incremental'] / med['full']:.3f} (medians), "
              f"{low['incremental'] / low['full']:.3f} (minima)")
        print(f"bytes written by a steady save / bytes changed: {statistics.median(written) / changed:.3f} "
              f"({statistics.median(written) / 1e6:.1f} MB / {changed / 1e6:.1f} MB)")
        print(f"restore incremental / self-contained: {med['restore-incremental'] / med['restore-full']:.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
