"""Which tensors changed since the generation a save descends from: told by their bytes, never by a cheap signal.

An incremental save (issue 32) writes only the tensors whose bytes differ
from the generation it descends from and references the rest. A wrong
"unchanged" is silent data loss, so the answer comes from the bytes
themselves. The cheap signals a framework offers each miss a way tensors
change in practice:

- the autograd version counter (``tensor._version``) does not move for a
  write through ``.data`` (a separate counter), through a NumPy array or a
  DLPack capsule sharing the memory, nor for the fused CPU Adam, which
  writes parameters and moments without moving it (torch 2.13; see
  ``tests/test_changes.py``);
- the storage pointer (``data_ptr``) does not move for any in-place write:
  ``add_`` under ``no_grad``, an optimizer's foreach or fused kernels,
  ``copy_``, ``load_state_dict``;
- ``requires_grad=False`` says nothing: frozen weights are written by
  whoever holds them (a merged adapter, an EMA, a hand-edited embedding).

A :class:`Fingerprint` is a tensor's dtype, shape and the 128-bit XXH3 of
its bytes, taken piece by piece (``PIECE_BYTES``): about 16 GB/s on one core
here, against about 3 GB/s for BLAKE3. One thread by default: hashing on
two threads here was slower than on one (python-xxhash holds the GIL for
part of each call), and one core already reads memory about as fast as it
comes. XXH3 is not the integrity digest: what is written is still
digested with the manifest's BLAKE3 chunks, and what is referenced was
verified when it was written and is verified again when it is read. XXH3
answers one question only, "did these bytes change since we hashed them?";
an accidental collision of 128 bits is not a risk a run will meet, and the
bytes are the run's own, not an adversary's. A tensor whose dtype or shape
changed is changed whatever its bytes.

Memory layout does not matter: a non-contiguous tensor is hashed by its
values in row-major order (a contiguous copy, piece by piece), a conjugate
or negative view by its resolved values. A tensor that moved to new storage
with the same values (a device round trip, ``module.double().float()``,
``p.data = p.data.clone()``) is unchanged, and rightly so: the bytes a
restore needs are the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

PIECE_BYTES = 16 << 20  # one hashing task: small enough to spread a large tensor over every core
THREADS = 1  # see the module docstring; ``fingerprints(threads=N)`` spreads the pieces over N threads
COPY_BATCH_BYTES = 256 << 20  # the most a fingerprint pass copies at once (a GPU state, views): then hashed, let go


@dataclass(frozen=True)
class Fingerprint:
    """What a tensor's value is, as far as a save is concerned: its dtype, shape and the hash of its bytes."""

    dtype: str
    shape: tuple[int, ...]
    xxh3: str  # hex of the 128-bit XXH3 over the piece hashes (one piece: that piece's hash)

    def to_json(self) -> list:
        return [self.dtype, list(self.shape), self.xxh3]

    @classmethod
    def from_json(cls, value: list) -> Fingerprint:
        dtype, shape, digest = value
        return cls(str(dtype), tuple(int(n) for n in shape), str(digest))


def _values(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values on the CPU, in row-major order, as the bytes a save writes."""
    t = tensor.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else np.empty(0, np.uint8)


def _pieces(data: np.ndarray) -> list[np.ndarray]:
    return [data[at:at + PIECE_BYTES] for at in range(0, len(data), PIECE_BYTES)] or [data]


def _combine(hashes: list[bytes]) -> str:
    return hashes[0].hex() if len(hashes) == 1 else xxhash.xxh3_128(b"".join(hashes)).hexdigest()


def fingerprints(tensors: Mapping[str, torch.Tensor], *, threads: int | None = None) -> dict[str, Fingerprint]:
    """The fingerprint of every tensor, its pieces hashed on ``threads`` threads (default ``THREADS``).

    A tensor read in place (contiguous, on the CPU) costs no memory; one that needs a copy first (on a GPU, or
    a non-contiguous view) is copied in batches of at most ``COPY_BATCH_BYTES``, hashed and let go before the
    next batch, so the host never holds a copy of the whole state (a GPU state's peak was all of it)."""
    out: dict[str, Fingerprint] = {}
    batch: dict[str, torch.Tensor] = {}
    held = 0
    for name, tensor in tensors.items():
        if not _copied(tensor):
            batch[name] = tensor
            continue
        if held and held + tensor.nbytes > COPY_BATCH_BYTES:
            out.update(_fingerprints({n: _values(t) for n, t in batch.items()}, threads))
            batch, held = {}, 0
        batch[name] = tensor
        held += tensor.nbytes
    out.update(_fingerprints({n: _values(t) for n, t in batch.items()}, threads))
    return {name: out[name] for name in tensors}


def _copied(tensor: torch.Tensor) -> bool:
    """Whether :func:`_values` copies ``tensor`` (another device, another layout, a lazy conj or neg)."""
    return tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg()


def _fingerprints(values: Mapping[str, torch.Tensor], threads: int | None) -> dict[str, Fingerprint]:
    jobs = [(name, i, piece) for name, v in values.items() for i, piece in enumerate(_pieces(_bytes(v)))]
    hashed: dict[str, dict[int, bytes]] = {name: {} for name in values}

    def one(job: tuple[str, int, np.ndarray]) -> None:
        name, index, piece = job
        hashed[name][index] = xxhash.xxh3_128(piece).digest()  # (a dict item set per job: safe under the GIL)

    workers = max(1, min(threads or THREADS, len(jobs)))
    if workers == 1:
        for job in jobs:
            one(job)
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="trainstate-changes") as pool:
            list(pool.map(one, jobs))
    return {name: Fingerprint(str(v.dtype).removeprefix("torch."), tuple(v.shape),
                              _combine([hashed[name][i] for i in range(len(hashed[name]))]))
            for name, v in values.items()}


def of_bytes(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> Fingerprint:
    """The fingerprint of a tensor whose values are the row-major bytes ``data`` (a region of a stored file)."""
    return Fingerprint(dtype, tuple(shape), _combine([xxhash.xxh3_128(piece).digest() for piece in _pieces(data)]))


def changed(now: Mapping[str, Fingerprint], before: Mapping[str, Fingerprint]) -> set[str]:
    """The names whose value differs from ``before`` (a name ``before`` lacks counts as changed)."""
    return {name for name, print_ in now.items() if before.get(name) != print_}
