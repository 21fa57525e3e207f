"""Which samples each rank reads in each epoch, and in which batches: pure logic.

The order of an epoch is a function of ``(seed, epoch)`` alone, computed here,
not by ``torch.randperm`` or ``numpy.random.permutation``, whose streams may
change between library versions (NumPy's NEP 19 allows it for ``Generator``),
while a resumed run may run a newer version: the order must not change. Two
algorithms, named in every plan (and so in the contract):

- ``feistel-v1`` (the default for new runs): a keyed Feistel permutation
  (:mod:`trainstate.data.permute`) maps a position of the epoch to a sample
  index directly. Nothing is materialised: the batch at any position of any
  epoch costs O(batch size), whatever the dataset length.
- ``splitmix64-sort-v1`` (every run before it): sorts the sample indices by a
  keyed SplitMix64 hash, a bijection on 64-bit integers, so no two keys tie.
  It builds the whole epoch (O(N) time and memory at each epoch start and
  resume); runs saved with it keep it.

The order is defined over *global* positions. Sharding follows
``torch.utils.data.DistributedSampler``: rank ``r`` of ``W`` reads positions
``r, r + W, ...``; ``uneven="pad"`` repeats the first positions so every rank
gets the same count (DistributedSampler's default), ``uneven="drop"`` drops the
tail (its ``drop_last=True``). ``start`` (after a resume at another world size)
skips the first positions of the epoch: the remaining ones are sharded the same
way, so the run continues from the global count of samples consumed.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..errors import InvalidArgument
from .keys import derive
from .permute import NAME as FEISTEL_V1, PARAMS as FEISTEL_PARAMS, feistel

SORT_V1 = "splitmix64-sort-v1"
DEFAULT_ORDER = FEISTEL_V1
ORDERS = {SORT_V1: {}, FEISTEL_V1: FEISTEL_PARAMS}  # name -> parameters recorded in the plan
CHUNK_POSITIONS = 1 << 12  # positions computed together: amortises NumPy's per-call cost over batches

__all__ = ["DEFAULT_ORDER", "FEISTEL_V1", "ORDERS", "SORT_V1", "EpochBatches", "Plan", "derive", "epoch_order",
           "ids_digest", "order_at"]


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, vectorised; uint64 arithmetic wraps modulo 2**64."""
    x = x.copy()
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def epoch_order(length: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The whole order of one epoch under ``splitmix64-sort-v1`` (int64): O(length) time and memory."""
    indices = np.arange(length, dtype=np.int64)
    if not shuffle or length < 2:
        return indices
    with np.errstate(over="ignore"):
        keys = _mix(indices.astype(np.uint64) + np.uint64(derive("order", seed, epoch)))
    return np.argsort(keys, kind="stable").astype(np.int64)


@functools.lru_cache(maxsize=2)
def _sorted(length: int, seed: int, epoch: int) -> np.ndarray:
    order = epoch_order(length, seed, epoch, True)
    order.flags.writeable = False  # shared by every caller of the cache
    return order


def order_at(algorithm: str, length: int, seed: int, epoch: int, shuffle: bool, positions: np.ndarray) -> np.ndarray:
    """The sample index at each of ``positions`` of the epoch's global order (int64)."""
    positions = np.asarray(positions, dtype=np.int64)
    if not shuffle or length < 2:
        return positions.copy()
    if algorithm == FEISTEL_V1:
        return feistel(length, seed, epoch)(positions)
    if algorithm == SORT_V1:
        return _sorted(length, seed, epoch)[positions]
    raise InvalidArgument(f"unknown order algorithm {algorithm!r}; known: {', '.join(sorted(ORDERS))}")


class SampleOrder(Protocol):
    """An order that is not a permutation of one dataset (a :class:`~trainstate.Mixture`'s).

    ``ids_at(epoch, positions)`` returns the sample ids at global positions of
    the epoch and the epoch to key each sample's randomness with; ``plan()``
    is its part of the loader's plan.
    """

    def ids_at(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def plan(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Plan:
    """Everything that fixes the batches of an epoch; two equal plans give equal batches."""

    dataset_len: int
    batch_size: int
    seed: int
    shuffle: bool
    drop_last: bool
    rank: int
    world_size: int
    uneven: str
    algorithm: str = DEFAULT_ORDER
    source: SampleOrder | None = None  # a mixture's order over its sources, instead of a permutation

    def __post_init__(self) -> None:
        for name in ("dataset_len", "seed", "rank"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must be a non-negative int, got {getattr(self, name)!r}")
        for name in ("batch_size", "world_size"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.rank >= self.world_size:
            raise InvalidArgument(f"rank {self.rank} is not below world_size {self.world_size}")
        if self.uneven not in ("pad", "drop"):
            raise InvalidArgument(f"uneven must be 'pad' or 'drop', got {self.uneven!r}")
        if self.seed >= 1 << 64:
            raise InvalidArgument("seed must fit in 64 bits")
        if self.algorithm not in ORDERS:
            raise InvalidArgument(f"order algorithm must be one of {', '.join(sorted(ORDERS))}, got "
                                  f"{self.algorithm!r}")
        if self.algorithm == SORT_V1 and self.source is not None:
            raise InvalidArgument(f"a mixture orders its sources with {FEISTEL_V1}, not {SORT_V1}")

    def as_dict(self) -> dict:
        """The plan as recorded in the contract and the loader state.

        A ``splitmix64-sort-v1`` plan is exactly the dict every earlier version
        recorded, so old runs compare equal; newer algorithms add their parameters.
        """
        out = {"dataset_len": self.dataset_len, "batch_size": self.batch_size, "seed": self.seed,
               "shuffle": self.shuffle, "drop_last": self.drop_last, "rank": self.rank,
               "world_size": self.world_size, "uneven": self.uneven, "algorithm": self.algorithm}
        if ORDERS[self.algorithm]:
            out["order_params"] = dict(ORDERS[self.algorithm])
        if self.source is not None:
            out["mixture"] = self.source.plan()
        return out

    def shard_size(self, start: int = 0) -> int:
        n, w = self.dataset_len - start, self.world_size
        return -(-n // w) if self.uneven == "pad" else n // w

    def batches_per_epoch(self, start: int = 0) -> int:
        per_rank = self.shard_size(start)
        return per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)

    def positions(self, start: int, slots: np.ndarray) -> np.ndarray:
        """Global positions of this rank's ``slots`` (its 0-based reading order) in an epoch that starts at ``start``.

        Rank ``r`` reads ``start + r``, ``start + r + W``, ...; with ``pad``,
        positions past the end wrap around to ``start``, as DistributedSampler
        repeats the first indices.
        """
        offsets = self.rank + self.world_size * np.asarray(slots, dtype=np.int64)
        remaining = self.dataset_len - start
        if self.uneven == "pad" and remaining:
            offsets %= remaining
        return start + offsets

    def ids_at(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Sample ids at global ``positions`` of ``epoch``, and the epochs their randomness is keyed by (None: ``epoch``)."""
        if self.source is not None:
            return self.source.ids_at(epoch, positions)
        return order_at(self.algorithm, self.dataset_len, self.seed, epoch, self.shuffle, positions), None

    def shard(self, epoch: int, start: int = 0) -> np.ndarray:
        """This rank's sample indices for ``epoch``, in reading order: O(shard) memory, for small datasets and tests."""
        return self.ids_at(epoch, self.positions(start, np.arange(self.shard_size(start))))[0]

    def batches(self, epoch: int, start: int = 0) -> EpochBatches:
        """This rank's batches for ``epoch`` (fewer after ``start``), computed as they are read."""
        return EpochBatches(self, epoch, start)


class EpochBatches(Sequence):
    """One rank's batches of one epoch, a lazy sequence of int64 arrays of sample ids.

    Nothing is computed up front: reading a batch computes the block of
    batches around it (``CHUNK_POSITIONS`` positions), so memory stays
    bounded and a resume reads only what its next batches need.
    """

    def __init__(self, plan: Plan, epoch: int, start: int = 0):
        if not 0 <= start <= plan.dataset_len:
            raise InvalidArgument(f"epoch start {start} is not within the {plan.dataset_len} samples")
        self.plan, self.epoch, self.start = plan, epoch, start
        self.shard_size = plan.shard_size(start)
        self.count = plan.batches_per_epoch(start)
        self.per_block = max(1, CHUNK_POSITIONS // plan.batch_size)
        # two blocks: the sampler (running ahead by the prefetch) and the consumer may straddle a boundary
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.count))]
        return self.keyed(i)[0]

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(self.count):
            yield self[i]

    def keyed(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Batch ``i``'s sample ids, and the epochs that key their randomness (None: this epoch)."""
        i = int(i)
        if i < 0:
            i += self.count
        if not 0 <= i < self.count:
            raise IndexError(f"batch {i} of an epoch of {self.count}")
        first = i - i % self.per_block
        if first not in self._blocks:
            bs = self.plan.batch_size
            slots = np.arange(first * bs, min((first + self.per_block) * bs, self.shard_size), dtype=np.int64)
            if len(self._blocks) >= 2:
                del self._blocks[max(self._blocks, key=lambda b: abs(b - first))]  # the farther one
            self._blocks[first] = self.plan.ids_at(self.epoch, self.plan.positions(self.start, slots))
        ids, epochs = self._blocks[first]
        lo = (i - first) * self.plan.batch_size
        hi = min(lo + self.plan.batch_size, len(ids))
        return ids[lo:hi].copy(), None if epochs is None else epochs[lo:hi].copy()


def ids_digest(epoch: int, cursor: int, ids: np.ndarray) -> str:
    """The fingerprint of one batch: its position and its sample ids."""
    h = hashlib.blake2b(digest_size=16, person=b"trainstate.batch")
    h.update(struct.pack("<qq", epoch, cursor))
    h.update(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    return h.hexdigest()
