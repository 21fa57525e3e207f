"""A keyed pseudo-random permutation of ``[0, N)`` that maps a position to a sample index directly.

Pure logic, vectorised with NumPy over any array of positions; nothing grows
with ``N``. This is the ``feistel-v1`` order (see :mod:`trainstate.data.order`):

- **Domain.** The smallest ``2**(2h)`` at least ``N`` (``h >= 1``), a value
  split into two ``h``-bit halves. Values at or above ``N`` are *cycle-walked*:
  the cipher is applied again until the value falls below ``N``. On a finite
  domain the cipher is a bijection, so the walk from a position below ``N``
  returns below ``N`` (at worst at the position itself), and the walked map is a
  bijection of ``[0, N)``. The domain is under ``4 N``, so a position costs at
  most a few cipher applications on average.
- **Rounds.** Six balanced Feistel rounds ``(L, R) -> (R, L ^ F_i(R))``. A
  Feistel network is a bijection whatever ``F`` is; ``F_i(R)`` is the top ``h``
  bits of the SplitMix64 finaliser of ``R ^ k_i``, whose avalanche makes each
  round a keyed pseudo-random function. Luby and Rackoff's bound needs three
  rounds for a pseudo-random permutation and four for a strong one; six leave
  a margin that the quality tests (``tests/test_permutation.py``) measure.
- **Keys.** ``k_i`` is derived with BLAKE2b from ``(seed, epoch, i)``
  (:func:`~trainstate.data.keys.derive`), so every epoch of every seed is an
  unrelated permutation.

Only fixed-width integer arithmetic is used (uint64, wrapping), so the order is
the same on every platform and every NumPy; :func:`invert` maps indices back to
positions (used by the tests to prove bijectivity at sizes nobody can enumerate).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument
from .keys import derive

NAME = "feistel-v1"
ROUNDS = 6
PARAMS = {"rounds": ROUNDS, "round_function": "splitmix64-finaliser", "domain": "power-of-four-cycle-walk"}
MAX_LENGTH = 1 << 62  # positions and indices stay below int64's range after the walk

_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)


def _round(right: np.ndarray, key: np.uint64, shift: np.uint64) -> np.ndarray:
    """``F_i(R)``: the top ``h`` bits (``shift = 64 - h``) of SplitMix64's finaliser of ``R ^ k_i``.

    Array arithmetic in uint64 wraps modulo 2**64 without a warning (only NumPy scalars warn).
    """
    x = right ^ key
    x ^= x >> np.uint64(30)
    x *= _C1
    x ^= x >> np.uint64(27)
    x *= _C2
    x ^= x >> np.uint64(31)
    return x >> shift


@dataclass(frozen=True)
class Feistel:
    """The permutation of ``[0, length)`` for one ``(seed, epoch)``; build it with :func:`feistel`."""

    length: int
    half_bits: int
    keys: tuple[int, ...]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        h, shift, mask = self._widths()
        left, right = x >> h, x & mask
        for key in self._keys():
            left, right = right, left ^ _round(right, key, shift)
        return (left << h) | right

    def _decrypt(self, x: np.ndarray) -> np.ndarray:
        h, shift, mask = self._widths()
        left, right = x >> h, x & mask
        for key in reversed(self._keys()):
            left, right = right ^ _round(left, key, shift), left
        return (left << h) | right

    def _widths(self) -> tuple[np.uint64, np.uint64, np.uint64]:
        return (np.uint64(self.half_bits), np.uint64(64 - self.half_bits),
                np.uint64((1 << self.half_bits) - 1))

    def _keys(self) -> list[np.uint64]:
        return [np.uint64(k) for k in self.keys]

    def _walk(self, values: np.ndarray, step) -> np.ndarray:
        values = np.asarray(values)
        if values.size and (values.min() < 0 or values.max() >= self.length):
            raise InvalidArgument(f"positions must lie in [0, {self.length}), got {values.min()}..{values.max()}")
        if self.length < 2:
            return values.astype(np.int64)
        out = step(values.astype(np.uint64))
        limit = np.uint64(self.length)
        todo = np.flatnonzero(out >= limit)
        while todo.size:  # cycle walking: at most a few rounds, as the domain is under 4 x length
            again = step(out[todo])
            out[todo] = again
            todo = todo[again >= limit]
        return out.astype(np.int64)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The sample index at each position (int64, the shape of ``positions``)."""
        return self._walk(positions, self._encrypt)

    def invert(self, indices: np.ndarray) -> np.ndarray:
        """The position of each sample index: ``invert(self(p)) == p``."""
        return self._walk(indices, self._decrypt)


def half_bits(length: int) -> int:
    """``h``: the domain is ``2**(2h) >= length``, ``h >= 1``."""
    return max(1, -(-max(length - 1, 1).bit_length() // 2))


@functools.lru_cache(maxsize=64)
def feistel(length: int, seed: int, epoch: int, rounds: int = ROUNDS) -> Feistel:
    """The ``feistel-v1`` permutation of ``[0, length)`` for ``(seed, epoch)``."""
    if type(length) is not int or not 0 <= length <= MAX_LENGTH:
        raise InvalidArgument(f"a permutation's length must be an int in [0, 2**62], got {length!r}")
    keys = tuple(derive(NAME, seed, epoch, i) for i in range(rounds))
    return Feistel(length, half_bits(length), keys)
