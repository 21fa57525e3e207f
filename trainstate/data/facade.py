"""What ResumableLoader offers scripts written for a DataLoader: ``sampler``, a non-consuming peek, and the
warning when a peek by ``next(iter(loader))`` consumed batches."""

from __future__ import annotations

import contextlib
import operator
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgument, InvalidType
from .samplerng import SampleIndex

def batch_indices(batches: Sequence[np.ndarray], i: int, epoch: int, seed: int) -> list[SampleIndex]:
    """What ``__getitem__`` receives for batch ``i`` of ``epoch``."""
    keyed = getattr(batches, "keyed", None)  # a mixture keys each sample by its source's epoch
    ids, epochs = keyed(i) if keyed is not None else (batches[i], None)
    if epochs is None:
        return [SampleIndex(j, epoch, seed) for j in ids.tolist()]
    return [SampleIndex(j, e, seed) for j, e in zip(ids.tolist(), epochs.tolist())]


@contextlib.contextmanager
def _global_rngs_kept() -> Iterator[None]:
    """Whatever a dataset draws from the global RNGs inside is undone: a peek changes no stream."""
    py, npy = random.getstate(), np.random.get_state()
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


class EpochSampler:
    """``loader.sampler``: what DataLoader scripts ask of a ``DistributedSampler``, answered by the loader.

    The loader's epoch is its own clock: it advances when an epoch's last
    batch is handed out and comes back with the position on resume, so
    ``set_epoch`` has nothing to do. With the loader's current epoch (what
    the DDP tutorial's ``for epoch in range(...)`` loop passes) it is a
    no-op; another value is refused, since ignoring it would hide a loop
    whose epoch counter and data disagree (typically one restarted at 0
    after a resume).
    """

    def __init__(self, loader: Any):  # a ResumableLoader (not imported: no cycle)
        self._loader = loader

    @property
    def epoch(self) -> int:
        return self._loader.epoch

    def set_epoch(self, epoch: int) -> None:
        try:
            asked = operator.index(epoch)
        except TypeError:
            raise InvalidType(f"set_epoch takes an int, got {type(epoch).__name__}") from None
        current = self._loader.epoch
        if asked != current:
            raise InvalidArgument(
                f"set_epoch({asked}) but the ResumableLoader is at epoch {current} (batch {self._loader.cursor} of "
                f"{len(self._loader)}): the loader advances its epoch itself when an epoch's last batch is handed "
                "out, and restores it on resume, so the call is not needed. Remove it, or loop "
                "`for epoch in range(loader.epoch, epochs)` so your counter follows the loader's.")

    def __len__(self) -> int:
        """Samples per epoch on this rank (``DistributedSampler.num_samples``)."""
        return self._loader.plan.shard_size()

    def __iter__(self) -> Iterator[int]:
        """The sample ids of the loader's current epoch on this rank, in order; the position does not move."""
        for ids in self._loader.epoch_batches(self._loader.epoch):
            yield from ids.tolist()


def build_batch(dataset: Any, indices: list[SampleIndex], collate_fn: Callable[[list], Any]) -> Any:
    """A batch built in this process, as DataLoader's fetcher builds it, changing no RNG stream.

    The same sample indices give the same ``sample_generator`` draws as in a
    worker; whatever the dataset draws from the global RNGs is undone.
    """
    with _global_rngs_kept():
        getitems = getattr(dataset, "__getitems__", None)
        samples = getitems(indices) if callable(getitems) else [dataset[i] for i in indices]
        return collate_fn(samples)


def abandoned_message(epoch: int, cursor: int, taken: int) -> str:
    many = taken > 1
    return (f"a new ResumableLoader iterator continues epoch {epoch} at batch {cursor}: the previous iterator "
            f"handed out {taken} batch{'es' if many else ''} of this epoch and was abandoned before the epoch "
            f"ended, so {'they count' if many else 'it counts'} as consumed and this epoch will not yield "
            f"{'them' if many else 'it'} again (the position is counted where batches leave the iterator, which is "
            "what makes a resume exact). To look at a batch without consuming it, use loader.peek() instead of "
            "next(iter(loader)). If the loop deliberately stopped after training on them, this is expected (a "
            "save in between also marks them as used).")
