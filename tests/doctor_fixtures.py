"""Factories and a step for tests/test_doctor.py: the same code writes the run and is handed to `trainstate doctor`.

Three runs differ in one thing each:
- ``good``: every input of the update is registered; the dataset draws its noise from
  ``ts.sample_generator(index)``;
- ``worker_rng``: the dataset draws its noise from the DataLoader worker's *global* torch RNG
  (``torch.rand`` in ``__getitem__``). ``ResumableLoader`` seeds each worker from ``(seed, epoch)``, so those
  draws depend on how many samples the worker has fetched since the epoch (or the worker) started; a
  restore mid-epoch starts fresh workers at the cursor, which the uninterrupted run's workers were not;
- ``unregistered_scheduler``: the LambdaLR that drives the optimizer lives in a script-level variable, not in
  the TrainState, so a restore leaves it at step 0.

All use two workers, so each run is a negative control for the others.
"""

from __future__ import annotations

import random
import weakref

import numpy as np
import torch

import trainstate as ts

SAMPLES, BATCH, WORKERS = 24, 4, 2

# Where a training script keeps what it does not register: here the scheduler (keyed by its optimizer)
# and each loader's live iterator.
_SCHEDULERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ITERATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Points(torch.utils.data.Dataset):
    def __init__(self, global_noise: bool):
        g = torch.Generator().manual_seed(3)
        self.xs = torch.randn(SAMPLES, 4, generator=g)
        self.ys = torch.randn(SAMPLES, 2, generator=g)
        self.global_noise = global_noise

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index):
        if self.global_noise:
            noise = torch.rand(4)  # the worker's global stream: depends on the worker's history
        else:
            noise = torch.rand(4, generator=ts.sample_generator(index))
        return self.xs[index] + 0.1 * noise, self.ys[index]


def _build(*, global_noise: bool = False, register_scheduler: bool = True) -> ts.TrainState:
    torch.set_num_threads(1)
    random.seed(0)  # every global stream seeded: a replay from update 0 starts where the run started
    np.random.seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 0.8 ** u)
    loader = ts.ResumableLoader(Points(global_noise), batch_size=BATCH, seed=11, shuffle=True,
                                num_workers=WORKERS)
    components = {"model": model, "optimizer": optimizer, "data": loader}
    if register_scheduler:
        components["scheduler"] = scheduler
    else:
        _SCHEDULERS[optimizer] = scheduler
    return ts.TrainState(**components)


def good() -> ts.TrainState:
    return _build()


def worker_rng() -> ts.TrainState:
    return _build(global_noise=True)


def unregistered_scheduler() -> ts.TrainState:
    return _build(register_scheduler=False)


def _next_batch(loader: ts.ResumableLoader):
    it = _ITERATORS.get(loader)
    batch = None if it is None else next(it, None)
    if batch is None:  # first call, or the epoch ended: the rest of the (next) epoch
        it = _ITERATORS[loader] = iter(loader)
        batch = next(it)
    return batch


def step(state: ts.TrainState) -> torch.Tensor:
    """One update; the caller advances ``state.next_update``."""
    x, y = _next_batch(state["data"])
    model, optimizer = state["model"], state["optimizer"]
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    scheduler = state.components.get("scheduler") or _SCHEDULERS[optimizer]
    scheduler.step()
    return loss.detach()


def write_run(directory, factory, updates: int, *, save_at: tuple[int, ...] = (), step_fn=None) -> None:
    """Train ``updates`` updates from ``factory()`` without a restart, saving at each of ``save_at`` and at the end
    (``step_fn``: the update, this module's ``step`` by default)."""
    state = factory()
    step_fn = step if step_fn is None else step_fn
    with ts.CheckpointManager(directory) as ckpt:
        while state.next_update < updates:
            step_fn(state)
            state.next_update += 1
            if state.next_update in save_at or state.next_update == updates:
                ckpt.save(state)
