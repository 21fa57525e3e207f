"""Which samples each rank reads in each epoch, and in which batches: pure logic.

The order of an epoch is a function of ``(seed, epoch)`` alone. It is computed
here, not by ``torch.randperm`` or ``numpy.random.permutation``, because their
streams may change between library versions (NumPy's NEP 19 allows it for
``Generator``), and a resumed run may run a newer version: the order must not.
A shuffled epoch sorts the sample indices by a keyed SplitMix64 hash, a
bijection on 64-bit integers, so no two keys tie and the permutation is the
same on every platform and every NumPy.

Sharding follows ``torch.utils.data.DistributedSampler``: rank ``r`` of ``W``
takes every W-th index starting at ``r``; ``uneven="pad"`` repeats the first
indices so every rank gets the same count (DistributedSampler's default), and
``uneven="drop"`` drops the tail instead (its ``drop_last=True``).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import InvalidArgument

ORDER_ALGORITHM = "splitmix64-sort-v1"


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, vectorised; uint64 arithmetic wraps modulo 2**64."""
    x = x.copy()
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def derive(*words: int | str) -> int:
    """A 64-bit seed derived from any tuple of ints and labels (BLAKE2b, so unrelated tuples do not collide)."""
    h = hashlib.blake2b(digest_size=8, person=b"trainstate.v1")
    for w in words:
        data = b"s" + w.encode() if isinstance(w, str) else b"i" + str(int(w)).encode()
        h.update(struct.pack("<I", len(data)) + data)
    return int.from_bytes(h.digest(), "little")


def epoch_order(length: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The global order of sample indices for one epoch (int64)."""
    indices = np.arange(length, dtype=np.int64)
    if not shuffle or length < 2:
        return indices
    with np.errstate(over="ignore"):
        keys = _mix(indices.astype(np.uint64) + np.uint64(derive("order", seed, epoch)))
    return np.argsort(keys, kind="stable").astype(np.int64)


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
    algorithm: str = ORDER_ALGORITHM

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

    def as_dict(self) -> dict:
        return asdict(self)

    def shard_size(self) -> int:
        n, w = self.dataset_len, self.world_size
        return -(-n // w) if self.uneven == "pad" else n // w

    def batches_per_epoch(self) -> int:
        per_rank = self.shard_size()
        return per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)

    def shard(self, epoch: int, start: int = 0) -> np.ndarray:
        """This rank's sample indices for ``epoch``, in reading order.

        ``start`` skips the first samples of the epoch's global order: a run
        resharded to another world size mid-epoch continues the same order
        from the samples the old ranks consumed.
        """
        order = epoch_order(self.dataset_len, self.seed, epoch, self.shuffle)[start:]
        n, w = len(order), self.world_size
        total = (-(-n // w) if self.uneven == "pad" else n // w) * w
        if total > len(order):  # pad, as DistributedSampler does, repeating from the start
            order = np.resize(order, total) if len(order) else order
        return order[self.rank:total:self.world_size]

    def batches(self, epoch: int, start: int = 0) -> list[np.ndarray]:
        """This rank's batches for ``epoch``: ``batches_per_epoch()`` arrays of sample indices (fewer after ``start``)."""
        shard = self.shard(epoch, start)
        count = len(shard) // self.batch_size if self.drop_last else -(-len(shard) // self.batch_size)
        return [shard[i * self.batch_size:(i + 1) * self.batch_size] for i in range(count)]


def ids_digest(epoch: int, cursor: int, ids: np.ndarray) -> str:
    """The fingerprint of one batch: its position and its sample ids."""
    h = hashlib.blake2b(digest_size=16, person=b"trainstate.batch")
    h.update(struct.pack("<qq", epoch, cursor))
    h.update(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    return h.hexdigest()
