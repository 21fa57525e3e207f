"""What ResumableLoader adds inside DataLoader worker processes: an exit with the parent, and a watch on global RNG draws."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


def _global_rng_marks() -> tuple:
    return random.getstate(), np.random.get_state()[1:], torch.get_rng_state()


def _same_marks(a: tuple, b: tuple) -> bool:
    return (a[0] == b[0] and a[1][1:] == b[1][1:] and np.array_equal(a[1][0], b[1][0])
            and torch.equal(a[2], b[2]))


class EndWithParent:
    """A ``worker_init_fn`` that also ends the worker soon after its parent dies (then calls the user's).

    torch's workers notice a dead parent only every few seconds, and later
    under load; a worker that outlives a SIGKILLed trainer holds the
    dataset's files and memory, and races the restarted run. A daemon thread
    polls the parent id and exits the worker once it is reparented.
    """

    def __init__(self, user_init: Callable[[int], None] | None):
        self.user_init, self.parent = user_init, os.getpid()

    def __call__(self, worker_id: int) -> None:
        threading.Thread(target=self._watch, name="trainstate-parent-watch", daemon=True).start()
        if self.user_init is not None:
            self.user_init(worker_id)

    def _watch(self) -> None:
        while os.getppid() == self.parent:
            time.sleep(0.2)
        os._exit(1)


class WatchGlobalDraws(Dataset):
    """Wraps the dataset in worker processes to notice draws from the worker's global RNG.

    Such draws continue only statistically after a mid-epoch resume. The flag
    is shared memory; once raised, the check stops costing anything.
    """

    def __init__(self, dataset: Any, flag: Any):
        self.dataset, self.flag = dataset, flag

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        if self.flag.value:
            return self.dataset[index]
        before = _global_rng_marks()
        item = self.dataset[index]
        if not _same_marks(before, _global_rng_marks()):
            self.flag.value = 1
        return item

    def __getitems__(self, indices: list[int]) -> list[Any]:
        batched = getattr(self.dataset, "__getitems__", None)
        if batched is None:
            return [self[i] for i in indices]
        if self.flag.value:
            return batched(indices)
        before = _global_rng_marks()
        items = batched(indices)
        if not _same_marks(before, _global_rng_marks()):
            self.flag.value = 1
        return items
