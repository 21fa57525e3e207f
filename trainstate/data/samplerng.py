"""Index-addressed randomness for per-sample work (augmentation, masking, cropping).

A generator drawn from the worker's global RNG depends on which worker ran
the sample and how many samples that worker fetched before it, so after a
resume (or with another worker count) the same sample is augmented
differently. A generator derived from ``(seed, epoch, sample index)`` depends
on nothing else: the same sample in the same epoch always draws the same
numbers, whatever the worker count, prefetch depth or resume point.

:class:`~trainstate.ResumableLoader` hands ``__getitem__`` a
:class:`SampleIndex`, an ``int`` that also carries its epoch and the loader's
seed, so a dataset needs one line::

    def __getitem__(self, index):
        g = ts.sample_generator(index)            # a torch.Generator
        image = augment(self.images[index], generator=g)
"""

from __future__ import annotations

import random

import numpy as np
import torch

from .order import derive
from ..errors import InvalidArgument, InvalidType


class SampleIndex(int):
    """A dataset index that knows the epoch and loader seed it was drawn for.

    It is an ``int`` everywhere an index is used (lists, arrays, tensors);
    :func:`sample_generator` reads its ``epoch`` and ``seed``.
    """

    epoch: int
    seed: int

    def __new__(cls, index: int, epoch: int, seed: int) -> SampleIndex:
        obj = super().__new__(cls, index)
        obj.epoch = epoch
        obj.seed = seed
        return obj

    def __reduce__(self):  # sent to DataLoader workers
        return SampleIndex, (int(self), self.epoch, self.seed)

    def __repr__(self) -> str:
        return f"SampleIndex({int(self)}, epoch={self.epoch}, seed={self.seed})"


def sample_seed(index: int, *, epoch: int | None = None, seed: int | None = None, stream: str = "") -> int:
    """The 63-bit seed for ``(seed, epoch, index)``, and an optional stream label."""
    if epoch is None or seed is None:
        if not isinstance(index, SampleIndex):
            raise InvalidType(
                f"index {index!r} is a plain int: pass epoch= and seed=, or read the dataset through "
                "ts.ResumableLoader, which hands __getitem__ a SampleIndex that carries both")
        epoch = index.epoch if epoch is None else epoch
        seed = index.seed if seed is None else seed
    if min(int(index), epoch, seed) < 0:
        raise InvalidArgument(f"index, epoch and seed must be non-negative, got {int(index)}, {epoch}, {seed}")
    return derive("sample", seed, epoch, int(index), stream) >> 1


def sample_generator(index: int, *, epoch: int | None = None, seed: int | None = None, stream: str = "",
                     kind: str = "torch") -> torch.Generator | np.random.Generator | random.Random:
    """A fresh generator for one sample, the same every time it is asked for.

    ``kind`` is ``"torch"`` (a CPU ``torch.Generator``), ``"numpy"`` (a
    ``numpy.random.Generator``) or ``"python"`` (a ``random.Random``).
    ``stream`` separates independent uses within one sample (``"crop"``,
    ``"noise"``). With a plain ``int`` index, pass ``epoch`` and ``seed``.
    """
    value = sample_seed(index, epoch=epoch, seed=seed, stream=stream)
    if kind == "torch":
        return torch.Generator().manual_seed(value)
    if kind == "numpy":
        return np.random.Generator(np.random.PCG64(value))
    if kind == "python":
        return random.Random(value)
    raise InvalidArgument(f"kind must be 'torch', 'numpy' or 'python', got {kind!r}")
