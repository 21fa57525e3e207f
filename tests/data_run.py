"""A small training loop on a ResumableLoader, shared by tests/test_data_resume.py.

``run()`` trains a linear model on a dataset whose ``__getitem__`` augments
with ``ts.sample_generator(index)``; the step also draws dropout from torch's
global RNG, so the checkpoint's RNG capture matters too. It restores from its
run directory (if it holds a generation), trains until ``total`` updates or
``stop_at`` (where it saves and stops), and writes what it consumed:
``OUT.npz`` (sample ids, batch sizes, augmented tensors, final weights; read
back with ``allow_pickle=False``) and ``OUT.json`` (clocks, data position,
warnings).

As a script, ``python data_run.py JOBS.json RESULTS.json`` resumes each job
in its own process: the interpreter imports torch once, then forks one child
per job, which builds every object afresh, scrambles the global RNGs and
restores from disk. Nothing but the imports is shared with the process that
saved (a fresh interpreter costs seconds of CPU here, a fork milliseconds).
A job ``{"cli": [...], "stdout": PATH}`` runs ``python -m trainstate ...``
the same way (``runpy``, as ``-m`` does), its output in PATH.
"""

from __future__ import annotations

import gc
import json
import os
import random
import runpy
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

import trainstate as ts
from forkjobs import fork_call, warm_imports

DIM = 3
N = 22  # 22 samples, batches of 4: 6 batches per epoch, the last one of 2
BATCH = 4
SEED = 1234
TOTAL = 20  # 3 epochs and 2 batches into the 4th


class NoisyDataset(Dataset):
    """(id, base row + noise, token length); the noise comes from the per-sample generator."""

    def __init__(self, n: int = N):
        self.base = torch.arange(n * DIM, dtype=torch.float32).reshape(n, DIM) / 10

    def __len__(self) -> int:
        return len(self.base)

    def noise(self, index: int) -> torch.Tensor:
        return torch.randn(DIM, generator=ts.sample_generator(index))

    def __getitem__(self, index: int) -> dict:
        return {"id": int(index), "x": self.base[index] + self.noise(index), "length": 1 + int(index) % 5}


class GlobalRandDataset(NoisyDataset):
    """The same, with noise from torch's global RNG: in a DataLoader worker, the worker's RNG."""

    def noise(self, index: int) -> torch.Tensor:
        return torch.rand(DIM)


DATASETS = {"sample": NoisyDataset, "global": GlobalRandDataset}


def count_tokens(batch: dict) -> int:
    return int(batch["length"].sum())


@dataclass(frozen=True)
class Config:
    workers: int = 0
    persistent: bool = False
    prefetch: int | None = None
    dataset: str = "sample"

    def loader_kwargs(self) -> dict:
        kwargs: dict = {"num_workers": self.workers}
        if self.workers:
            kwargs["persistent_workers"] = self.persistent
            if self.prefetch is not None:
                kwargs["prefetch_factor"] = self.prefetch
        return kwargs


def seed_globals(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build(cfg: Config, *, init_seed: int = 0, **loader_args) -> tuple[ts.TrainState, ts.ResumableLoader]:
    torch.manual_seed(init_seed)
    model = torch.nn.Linear(DIM, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    args = {"batch_size": BATCH, "seed": SEED, "shuffle": True, "count_tokens": count_tokens,
            **cfg.loader_kwargs(), **loader_args}
    dataset = DATASETS[cfg.dataset](args.pop("n", N))
    loader = ts.ResumableLoader(dataset, args.pop("batch_size"), **args)
    return ts.TrainState(model=model, optimizer=opt, data=loader), loader


def train_step(state: ts.TrainState, batch: dict) -> None:
    model, opt = state["model"], state["optimizer"]
    x = torch.nn.functional.dropout(batch["x"], p=0.25, training=True)  # torch's global RNG
    y = (batch["id"] % 3).to(torch.float32).unsqueeze(1)
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


class Recorder:
    """What the loop consumed, batch by batch."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.xs: list[np.ndarray] = []

    def add(self, batch: dict) -> None:
        self.ids.append(batch["id"].numpy().astype(np.int64))
        self.xs.append(batch["x"].numpy().astype(np.float32))

    def arrays(self) -> dict[str, np.ndarray]:
        return {"ids": np.concatenate(self.ids) if self.ids else np.zeros(0, np.int64),
                "sizes": np.array([len(i) for i in self.ids], dtype=np.int64),
                "x": np.concatenate(self.xs) if self.xs else np.zeros((0, DIM), np.float32)}


def train(state: ts.TrainState, loader: ts.ResumableLoader, ckpt: ts.CheckpointManager | None, *,
          total: int, stop_at: int | None = None, recorder: Recorder | None = None) -> dict | None:
    """The training loop: the rest of each epoch, until total updates; at stop_at save and return the position."""
    while state.next_update < total:
        for batch in loader:
            if recorder is not None:
                recorder.add(batch)
            train_step(state, batch)
            state.next_update += 1
            if state.next_update in (stop_at, total):
                break
        if state.next_update == stop_at:
            position = loader.data_position()
            if ckpt is not None:
                ckpt.save(state)
            return position
    return None


def run(directory: str | Path, out: str | Path, cfg: Config, *, total: int = TOTAL, stop_at: int | None = None,
        fresh_seed: int = 0) -> dict:
    """Restore (if there is a checkpoint), train to total or stop_at, and record it all under ``out``."""
    torch.set_num_threads(1)
    seed_globals(7 if fresh_seed == 0 else fresh_seed)  # a resumed run scrambles them: the checkpoint must win
    state, loader = build(cfg, init_seed=fresh_seed)
    recorder = Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts.CheckpointManager(directory) as ckpt:
            info = ckpt.restore(state)
            start = {"next_update": state.next_update, "epoch": loader.epoch, "cursor": loader.cursor}
            saved = train(state, loader, ckpt, total=total, stop_at=stop_at, recorder=recorder)
    meta = {
        "restored": info is not None,
        "identical_continuation": None if info is None else info.identical_continuation,
        "restore_warnings": [] if info is None else list(info.warnings),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, ts.ContinuationWarning)],
        "start": start,
        "saved_position": saved,
        "next_update": state.next_update,
        "samples_seen": loader.samples_seen,
        "tokens_seen": loader.tokens_seen,
        "epoch": loader.epoch,
        "cursor": loader.cursor,
    }
    weights = {f"w.{k}": v.detach().numpy() for k, v in state["model"].state_dict().items()}
    np.savez(f"{out}.npz", **recorder.arrays(), **weights)
    Path(f"{out}.json").write_text(json.dumps(meta))
    return meta


def load(out: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    with np.load(f"{out}.npz", allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    return arrays, json.loads(Path(f"{out}.json").read_text())


def _job(job: dict) -> None:
    if "cli" in job:  # `python -m trainstate ARGS > STDOUT`, in this forked process
        with open(job["stdout"], "w") as out:
            os.dup2(out.fileno(), 1)
        sys.argv = ["trainstate", *job["cli"]]
        runpy.run_module("trainstate", run_name="__main__", alter_sys=True)
        return
    run(job["dir"], job["out"], Config(**job["config"]), total=job["total"], stop_at=job.get("stop_at"),
        fresh_seed=job["fresh_seed"])
    gc.collect()  # shut the DataLoader workers down before the job exits


def main(jobs_file: str, results_file: str) -> int:
    torch.set_num_threads(1)
    warm_imports()
    jobs = json.loads(Path(jobs_file).read_text())
    results = []
    for job in jobs:
        pid, status = fork_call(lambda job=job: _job(job))  # the job's own process
        results.append({"out": job.get("out", job.get("stdout")), "pid": pid,
                        "exit": os.waitstatus_to_exitcode(status)})
    Path(results_file).write_text(json.dumps(results))  # each job's exit status; the caller judges them
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

