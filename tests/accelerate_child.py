"""Jobs for tests/test_accelerate.py: a CPU Accelerate loop, killed at chosen moments, resumed two ways.

``python accelerate_child.py jobs.json results.json`` runs each job in its
own forked process (see forkjobs.py). ``mode`` picks the checkpointing:

- ``"trainstate"``: ``train_state(accelerator, data=ResumableLoader)`` saved by
  a ``CheckpointManager``;
- ``"accelerate"``: ``accelerator.save_state()``/``load_state()`` with a
  prepared DataLoader and the update counter given to ``register_for_checkpointing``.

``kill``: ``["step", k]`` SIGKILLs the job as update k+1 begins;
``["save", k]`` inside the save at update k, just before the generation's
commit (the rename of its staging directory). Each job appends the sample ids
of every update to ``ids`` and, when it finishes, writes the model and
optimizer tensors to ``final``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from safetensors.torch import save_file

import trainstate as ts
from forkjobs import run_jobs
from trainstate.integrations.accelerate import train_state
from trainstate.storage.posix import PosixOps

TOTAL, EVERY, N, BATCH = 12, 3, 40, 8  # 5 batches an epoch: 12 updates cross two epoch boundaries


class Points(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(N, 8, generator=g), torch.randn(N, 1, generator=g)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i], self.y[i], int(i)


class Updates:
    """The update counter, registered with ``register_for_checkpointing`` in the Accelerate-only loop."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def build(accelerator: Accelerator):
    set_seed(0)  # random, numpy and torch, as a training script does (a forked job's `random` is reseeded)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    return model, opt, sched


def update(accelerator, model, opt, sched, x, y) -> None:
    opt.zero_grad()
    accelerator.backward(torch.nn.functional.mse_loss(model(x.to(accelerator.device)), y.to(accelerator.device)))
    opt.step()
    sched.step()


def kill_in_save(step: int, clock) -> None:
    rename = PosixOps.rename

    def rename_or_die(self, src, dst):
        if dst.name.startswith("gen-") and src.name.startswith(".trainstate-staging-") and clock() == step:
            die()
        rename(self, src, dst)

    PosixOps.rename = rename_or_die


def run_trainstate(spec: dict, record) -> torch.nn.Module:
    accelerator = Accelerator(cpu=True)
    model, opt, sched = accelerator.prepare(*build(accelerator))
    loader = ts.ResumableLoader(Points(), batch_size=BATCH, seed=3, shuffle=True)
    state = train_state(accelerator, data=loader)
    kill = spec.get("kill")
    if kill and kill[0] == "save":
        kill_in_save(kill[1], lambda: state.next_update)
    with ts.CheckpointManager(spec["dir"], keep_last=2) as ckpt:
        ckpt.restore(state)
        while state.next_update < TOTAL:
            for x, y, ids in loader:
                if kill and kill[0] == "step" and state.next_update == kill[1]:
                    die()
                update(accelerator, model, opt, sched, x, y)
                state.next_update += 1
                record(state.next_update, ids)
                if state.next_update % EVERY == 0:
                    ckpt.save(state)
                if state.next_update == TOTAL:
                    break
    return accelerator.unwrap_model(model), opt.optimizer


def run_accelerate(spec: dict, record) -> torch.nn.Module:
    config = ProjectConfiguration(project_dir=spec["dir"], automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(cpu=True, project_config=config)
    model, opt, sched = build(accelerator)
    data = torch.utils.data.DataLoader(Points(), batch_size=BATCH, shuffle=True,
                                       generator=torch.Generator().manual_seed(3))
    model, opt, sched, data = accelerator.prepare(model, opt, sched, data)
    updates = Updates()
    accelerator.register_for_checkpointing(updates)
    saved = sorted(Path(spec["dir"], "checkpoints").glob("checkpoint_*"), key=lambda p: int(p.name.split("_")[1]))
    if saved:
        accelerator.load_state(str(saved[-1]))
        config.iteration = int(saved[-1].name.split("_")[1]) + 1
    kill = spec.get("kill")
    while updates.n < TOTAL:
        for x, y, ids in data:
            if kill and updates.n == kill[1]:
                die()
            update(accelerator, model, opt, sched, x, y)
            updates.n += 1
            record(updates.n, ids)
            if updates.n % EVERY == 0:
                accelerator.save_state()
            if updates.n == TOTAL:
                break
    return accelerator.unwrap_model(model), opt.optimizer


def job(spec: dict) -> None:
    torch.set_num_threads(1)

    def record(update_no: int, ids: torch.Tensor) -> None:
        with open(spec["ids"], "a") as out:
            out.write(f"{update_no} {' '.join(str(int(i)) for i in ids)}\n")

    model, optimizer = {"trainstate": run_trainstate, "accelerate": run_accelerate}[spec["mode"]](spec, record)
    tensors = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, moments in enumerate(optimizer.state.values()):
        tensors.update({f"opt.{i}.{k}": v.clone() for k, v in moments.items() if isinstance(v, torch.Tensor)})
    save_file(tensors, spec["final"])


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(run_jobs(sys.argv[1], sys.argv[2], job))
