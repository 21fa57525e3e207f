"""A weighted mixture of datasets whose stream is index-addressable: any position, O(1), no state but the plan.

The stream position ``g`` (loader epoch ``e``, position ``p`` of it: ``g = e * length + p``) is routed
down a balanced binary tree over the sources. At a node whose left subtree holds the fraction
``a / b`` of the weight, position ``g`` of the node's stream goes left iff ``F(g + 1) > F(g)``
with ``F(x) = floor((x a + phi) / b)``, and it is then position ``F(g)`` of the left stream, else
position ``g - F(g)`` of the right one (``phi`` in ``[0, b)`` is derived from the seed). ``F`` is a
Beatty sequence: over any ``m`` consecutive positions the left count is ``floor`` or ``ceil`` of
``m a / b``, so it is within 1 of its share, and those positions are consecutive in the left
stream. Composed down the tree, **over any window of m consecutive positions, source k appears
within (strictly less than) ``depth(k)`` samples of ``w_k m``**, ``depth(k) <= ceil(log2 K)``: within
1 for two sources, 2 for three or four, 3 for up to eight (:meth:`MixtureOrder.bound`).

A source's own stream position ``j`` is sample ``perm(j mod n_k)`` of its *own* epoch ``j // n_k``,
with a ``feistel-v1`` permutation keyed by ``(seed, source, epoch)``: a small source repeats,
reshuffled, while a large one is still in its first pass. Weights are quantised to integer parts
of ``2**30`` (largest remainder), so every computation is exact int64 arithmetic.

A weight changed on resume (allowed through the contract) starts a new *segment* at the resume
position: each source continues from the samples it had consumed, with the new weights from there.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from ..errors import InvalidArgument, InvalidType
from .keys import derive
from .permute import MAX_LENGTH, feistel
from .samplerng import SampleIndex

INTERLEAVE = "beatty-tree-v1"
RESOLUTION_BITS = 30


def quantise(weights: Sequence[float]) -> tuple[int, ...]:
    """Integer parts of ``2**30`` in the weights' proportions (largest remainder), each at least 1."""
    total = math.fsum(weights)
    scale = 1 << RESOLUTION_BITS
    exact = [w / total * scale for w in weights]
    parts = [max(1, math.floor(x)) for x in exact]
    order = sorted(range(len(parts)), key=lambda i: (parts[i] - exact[i], i))  # largest remainder first
    i = 0
    while sum(parts) != scale:
        k = order[i % len(order)]
        step = 1 if sum(parts) < scale else -1
        if parts[k] + step >= 1:
            parts[k] += step
        i += 1
    return tuple(parts)


@dataclass(frozen=True)
class _Tree:
    """The routing tree of one segment: per node the left fraction num/den, its offset, and children."""

    num: np.ndarray
    den: np.ndarray
    phi: np.ndarray
    left: np.ndarray
    right: np.ndarray
    leaf: np.ndarray  # the source at a leaf, -1 at an internal node
    depth: tuple[int, ...]  # per source

    @classmethod
    def build(cls, parts: tuple[int, ...], seed: int) -> _Tree:
        nodes: list[list[int]] = []  # num, den, phi, left, right, leaf
        depth = [0] * len(parts)

        def node(lo: int, hi: int, level: int) -> int:
            index = len(nodes)
            nodes.append([1, 1, 0, -1, -1, -1])
            if hi - lo == 1:
                nodes[index][5] = lo
                depth[lo] = level
                return index
            mid = (lo + hi) // 2
            den = sum(parts[lo:hi])
            nodes[index][:3] = [sum(parts[lo:mid]), den, derive("mixture-node", seed, index) % den]
            nodes[index][3] = node(lo, mid, level + 1)
            nodes[index][4] = node(mid, hi, level + 1)
            return index

        node(0, len(parts), 0)
        cols = [np.array(c, dtype=np.int64) for c in zip(*nodes)]
        return cls(*cols, tuple(depth))

    def route(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The source of each stream position, and its position in that source's stream."""
        node = np.zeros(len(g), dtype=np.int64)
        g = g.copy()
        while True:
            inner = np.flatnonzero(self.leaf[node] < 0)
            if not inner.size:
                return self.leaf[node], g
            at, x = node[inner], g[inner]
            num, den, phi = self.num[at], self.den[at], self.phi[at]
            before = _beatty(x, num, den, phi)
            go_left = _beatty(x + 1, num, den, phi) > before
            g[inner] = np.where(go_left, before, x - before)
            node[inner] = np.where(go_left, self.left[at], self.right[at])

    def counts(self, g: int) -> list[int]:
        """How many of the stream positions ``[0, g)`` each source receives."""
        out = [0] * len(self.depth)

        def walk(index: int, m: int) -> None:
            if self.leaf[index] >= 0:
                out[int(self.leaf[index])] = m
                return
            lefts = int(_beatty(np.array([m], np.int64), self.num[index], self.den[index], self.phi[index])[0])
            walk(int(self.left[index]), lefts)
            walk(int(self.right[index]), m - lefts)

        walk(0, g)
        return out


def _beatty(x: np.ndarray, num: Any, den: Any, phi: Any) -> np.ndarray:
    """``floor((x num + phi) / den)`` exactly in int64 for any ``x < 2**62`` (num, phi < den <= 2**30)."""
    q, r = np.divmod(x, den)
    return q * num + (r * num + phi) // den


@dataclass(frozen=True)
class Segment:
    """From stream position ``start`` on, these weight parts, each source continuing at ``base[k]``."""

    start: int
    parts: tuple[int, ...]
    base: tuple[int, ...]


@dataclass(frozen=True)
class MixtureOrder:
    """The mixture's order for a loader: sample ids at stream positions; pure and hashable."""

    lengths: tuple[int, ...]
    weights: tuple[float, ...]
    length: int  # positions per loader epoch
    seed: int
    shuffle: bool
    segments: tuple[Segment, ...] = ()
    offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        offsets = [0]
        for n in self.lengths:
            offsets.append(offsets[-1] + n)
        object.__setattr__(self, "offsets", tuple(offsets))
        if not self.segments:
            object.__setattr__(self, "segments", (Segment(0, quantise(self.weights), (0,) * len(self.lengths)),))

    def plan(self) -> dict[str, Any]:
        """The mixture's part of the loader plan (and so of the contract); segments are loader state."""
        return {"interleave": INTERLEAVE, "lengths": list(self.lengths), "weights": list(self.weights),
                "seed": self.seed, "resolution": f"2**-{RESOLUTION_BITS}"}

    def bound(self, source: int) -> int:
        """Over any window of m consecutive positions, |count - w m| < bound(source)."""
        return max(1, _tree(self.segments[-1].parts, self.seed).depth[source])

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For stream positions ``g``: the source of each, and its position in that source's own stream."""
        g = np.asarray(g, dtype=np.int64)
        if g.size and (g.min() < 0 or g.max() >= MAX_LENGTH):
            raise InvalidArgument(f"mixture stream positions must lie in [0, 2**62), got {g.min()}..{g.max()}")
        sources, local = np.empty_like(g), np.empty_like(g)
        starts = [s.start for s in self.segments]
        which = np.searchsorted(np.array(starts, dtype=np.int64), g, side="right") - 1
        for s in np.unique(which):
            seg, mask = self.segments[s], which == s
            src, pos = _tree(seg.parts, self.seed).route(g[mask] - seg.start)
            sources[mask], local[mask] = src, pos + np.array(seg.base, dtype=np.int64)[src]
        return sources, local

    def counts(self, g: int) -> tuple[int, ...]:
        """Samples each source has given over stream positions ``[0, g)``."""
        seg = self.segments[bisect.bisect_right([s.start for s in self.segments], g) - 1]
        within = _tree(seg.parts, self.seed).counts(g - seg.start)
        return tuple(b + c for b, c in zip(seg.base, within))

    def ids_at(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sample ids (offset into the concatenated sources) at positions of a loader epoch, and source epochs."""
        sources, local = self.locate(epoch * self.length + np.asarray(positions, dtype=np.int64))
        ids, epochs = np.empty_like(local), np.empty_like(local)
        lengths = np.array(self.lengths, dtype=np.int64)
        source_epochs, within = np.divmod(local, lengths[sources])
        for k, e in {(int(k), int(e)) for k, e in zip(sources.tolist(), source_epochs.tolist())}:
            mask = (sources == k) & (source_epochs == e)
            picked = within[mask]
            if self.shuffle and self.lengths[k] > 1:
                picked = feistel(self.lengths[k], derive("mixture-source", self.seed, k), e)(picked)
            ids[mask] = picked + self.offsets[k]
        epochs[:] = source_epochs
        return ids, epochs

    def reweighted(self, start: int, weights: tuple[float, ...]) -> MixtureOrder:
        """This order up to ``start``, then ``weights``, each source continuing from what it had given."""
        kept = tuple(s for s in self.segments if s.start < start)
        segment = Segment(start, quantise(weights), self.counts(start))
        return MixtureOrder(self.lengths, weights, self.length, self.seed, self.shuffle, kept + (segment,))

    def with_segments(self, saved: Any) -> MixtureOrder:
        segments = tuple(Segment(int(s[0]), tuple(map(int, s[1])), tuple(map(int, s[2]))) for s in saved)
        if not segments or segments[0].start != 0 or any(len(s.parts) != len(self.lengths) != len(s.base)
                                                            for s in segments):
            raise InvalidArgument("malformed mixture segments")
        return MixtureOrder(self.lengths, self.weights, self.length, self.seed, self.shuffle, segments)

    def saved_segments(self) -> list[list]:
        return [[s.start, list(s.parts), list(s.base)] for s in self.segments]


_TREES: dict[tuple, _Tree] = {}


def _tree(parts: tuple[int, ...], seed: int) -> _Tree:
    key = (parts, seed)
    if key not in _TREES:
        if len(_TREES) > 64:
            _TREES.clear()
        _TREES[key] = _Tree.build(parts, seed)
    return _TREES[key]


class Mixture(Dataset):
    """Several datasets drawn in set proportions, as one map-style dataset for :class:`~trainstate.ResumableLoader`::

        mix = ts.Mixture([(web, 0.7), (code, 0.2), (books, 0.1)])
        loader = ts.ResumableLoader(mix, batch_size=32, seed=1234)

    The loader's stream interleaves the sources deterministically: over any
    window of ``m`` samples, source ``k`` appears within ``mix.bound(k)``
    samples of ``weight_k * m`` (1 for two sources, ``ceil(log2 K)`` for K).
    Each source keeps its own epochs: a small one repeats, reshuffled
    (``shuffle=True`` on the loader), while a large one is still in its first
    pass. ``length`` is the number of samples per loader epoch (default: the
    sources' total). ``seed`` defaults to the loader's. Sample ids are
    offsets into the concatenated sources (``mix.source_of(id)`` splits one);
    ``__getitem__`` hands the source a :class:`~trainstate.SampleIndex` keyed by
    that source's own epoch, so ``ts.sample_generator`` differs on every pass.

    The weights, lengths and seed are part of the loader's plan (the
    contract field ``loader.<name>.mixture``): a changed weight is refused on
    resume unless ``allow_changes=["loader.<name>.mixture.weights"]``; then every
    source continues from the samples it had given, with the new weights.
    """

    def __init__(self, sources: Sequence[tuple[Any, float]], *, length: int | None = None, seed: int | None = None):
        sources = list(sources)
        if not sources:
            raise InvalidArgument("a Mixture needs at least one (dataset, weight) source")
        for i, item in enumerate(sources):
            if type(item) not in (tuple, list) or len(item) != 2:
                raise InvalidType(f"source {i} must be a (dataset, weight) pair, got {type(item).__qualname__}")
            weight = item[1]
            if type(weight) not in (int, float) or not math.isfinite(weight) or weight <= 0:
                raise InvalidArgument(f"source {i}'s weight must be a positive finite number, got {weight!r}")
        self.datasets = [d for d, _ in sources]
        try:
            self.lengths = tuple(len(d) for d in self.datasets)
        except TypeError:
            raise InvalidType("every Mixture source needs __len__ (a map-style dataset)") from None
        if min(self.lengths) < 1:
            raise InvalidArgument(f"every Mixture source needs at least one sample; lengths {list(self.lengths)}")
        total = math.fsum(w for _, w in sources)
        self.weights = tuple(float(w) / total for _, w in sources)
        self.length = sum(self.lengths) if length is None else length
        if type(self.length) is not int or self.length < 1:
            raise InvalidArgument(f"length must be a positive int, got {length!r}")
        if seed is not None and (type(seed) is not int or not 0 <= seed < 1 << 64):
            raise InvalidArgument(f"seed must be a non-negative 64-bit int or None, got {seed!r}")
        self.seed = seed
        self._offsets = MixtureOrder(self.lengths, self.weights, 1, 0, False).offsets

    def __len__(self) -> int:
        """Samples per loader epoch."""
        return self.length

    def sample_order(self, seed: int, shuffle: bool) -> MixtureOrder:
        """The order a ResumableLoader with this seed reads (the mixture's own seed, if it has one)."""
        return MixtureOrder(self.lengths, self.weights, self.length, seed if self.seed is None else self.seed,
                            shuffle)

    def bound(self, source: int) -> int:
        """Over any window of m samples, source ``source`` appears within this many samples of ``w m``."""
        return self.sample_order(0, False).bound(source)

    def source_of(self, sample_id: int) -> tuple[int, int]:
        """``(source, index within it)`` of a sample id."""
        k = bisect.bisect_right(self._offsets, int(sample_id)) - 1
        if not 0 <= k < len(self.datasets):
            raise IndexError(f"sample id {sample_id} is outside the {self._offsets[-1]} samples of the sources")
        return k, int(sample_id) - self._offsets[k]

    def __getitem__(self, sample_id: int) -> Any:
        k, index = self.source_of(sample_id)
        if isinstance(sample_id, SampleIndex):  # the source's epoch, and a seed of the source's own
            index = SampleIndex(index, sample_id.epoch, derive("mixture-sample", sample_id.seed, k) >> 1)
        return self.datasets[k][index]
