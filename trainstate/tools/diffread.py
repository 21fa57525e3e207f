"""Reading for ``trainstate diff``: which generation a target names, and tensors compared chunk by chunk.

Both generations go through the trusted reader (:func:`verify_generation` with
``content=True`` checks every digest and decodes the state as restore would,
keeping no large tensor), and then tensor bytes are read back in bounded
chunks per tensor: memory stays at a few chunks however large the generations.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..errors import InvalidArgument
from ..format import signing, tensorfile
from ..format.manifest import Manifest, generation_name, parse_generation_name
from ..storage.base import Store
from ..storage.locate import open_existing, split_generation
from ..progress import OnBytes
from ..storage.verify import read_layouts, read_state_json, verify_generation

CHUNK_BYTES = 16 << 20  # per side and per read: the bound on what a tensor comparison holds at once
_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Side:
    """One verified generation: its manifest, state skeleton and tensor-file layouts."""

    target: str
    store: Store
    manifest: Manifest
    state: dict[str, Any]
    entries: dict[str, tuple[str, tensorfile.Layout, tensorfile.Entry]] = field(default_factory=dict)


def resolve(target: str | Path) -> tuple[Store, str]:
    """``run/gen-…`` (path or URL), ``run@update`` (that update's full generation) or a run (its recovery point)."""
    from ..lifecycle.candidates import recovery_point

    text = str(target)
    run, generation = split_generation(text)
    at_update = None
    if generation is None and "@" in text:
        head, _, update = text.rpartition("@")
        if not update.isdigit():
            raise InvalidArgument(f"{text}: after '@' comes an update number, e.g. runs/x@12")
        run, generation, at_update = head, generation_name(int(update)), int(update)
    store = open_existing(run)
    if at_update is not None:  # its newest revision (gen-U-r001...): the state the run continued from
        generation = next((n for n in store.generations() if parse_generation_name(n) == (at_update, "full")),
                          generation)
    if generation is None:
        generation = recovery_point(store, signing.resolve(None, store.location))
        if generation is None:
            raise InvalidArgument(f"{text} has no recovery point (no valid full generation); name a generation "
                                  "directory or DIR@UPDATE")
    return store, generation


def load_side(target: str | Path, on_bytes: OnBytes | None = None) -> Side:
    """Verify a generation (every digest) and read its skeleton and tensor headers, no tensor data kept
    (``on_bytes``: told each batch of bytes verified)."""
    store, generation = resolve(target)
    key = signing.resolve(None, store.location)
    manifest = verify_generation(store, generation, content=True, key=key, on_bytes=on_bytes).manifest
    side = Side(str(target), store, manifest, read_state_json(store, manifest))
    for file, layout in read_layouts(store, manifest).items():
        for entry in layout.entries:
            side.entries[entry.name] = (file, layout, entry)
    return side


@dataclass(frozen=True)
class TensorDiff:
    """How two stored tensors differ (``differing == 0``: bitwise equal)."""

    elements: int
    differing: int
    first_index: int | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    mismatch: str | None = None  # dtype or shape differ: nothing else was compared


class TensorReader:
    """Open tensor files of both sides once, and compare tensors by name in bounded chunks."""

    def __init__(self, a: Side, b: Side, chunk_bytes: int = CHUNK_BYTES, on_bytes: OnBytes | None = None):
        self.sides = (a, b)
        self.on_bytes = on_bytes  # told the bytes read from both sides for each chunk compared
        self.chunk_bytes = chunk_bytes
        self._streams: dict[tuple[int, str], BinaryIO] = {}
        self._exit = contextlib.ExitStack()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._exit.close()

    def _stream(self, i: int, file: str) -> BinaryIO:
        if (i, file) not in self._streams:
            side = self.sides[i]
            self._streams[i, file] = self._exit.enter_context(side.store.open(side.manifest.generation, file))
        return self._streams[i, file]

    def compare(self, name_a: str, name_b: str) -> TensorDiff:
        (fa, la, ea), (fb, lb, eb) = self.sides[0].entries[name_a], self.sides[1].entries[name_b]
        if ea.dtype != eb.dtype or tuple(ea.shape) != tuple(eb.shape):
            return TensorDiff(_numel(ea.shape), 0,
                              mismatch=f"{tensorfile.dtype_name(ea.dtype)}{list(ea.shape)} vs "
                                       f"{tensorfile.dtype_name(eb.dtype)}{list(eb.shape)}")
        elements = _numel(ea.shape)
        if not elements:
            return TensorDiff(0, 0)
        size = ea.nbytes // elements  # bytes per element as stored (sub-byte packed types: 1)
        step = max(size, self.chunk_bytes // size * size)
        sa, sb = self._stream(0, fa), self._stream(1, fb)
        acc = _Accumulator(ea.dtype, size)
        for offset in range(0, ea.nbytes, step):
            n = min(step, ea.nbytes - offset)
            sa.seek(la.data_start + ea.begin + offset)
            sb.seek(lb.data_start + eb.begin + offset)
            ca, cb = sa.read(n), sb.read(n)
            if len(ca) != n or len(cb) != n:
                raise OSError(f"tensor {name_a!r} ended early while comparing (file changed under the diff?)")
            if ca != cb:
                acc.add(ca, cb, offset // size)
            if self.on_bytes is not None:
                self.on_bytes(2 * n)
        return TensorDiff(elements, acc.differing, acc.first, acc.max_abs, acc.max_rel)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Accumulator:
    """Per-tensor totals over the chunks that differ: elements compared by their bits, never by ``==``."""

    def __init__(self, dtype: torch.dtype, size: int):
        self.dtype, self.size = dtype, size
        self.differing, self.first = 0, None
        self.max_abs: float | None = None
        self.max_rel: float | None = None

    def add(self, ca: bytes, cb: bytes, base: int) -> None:
        ta = torch.frombuffer(bytearray(ca), dtype=torch.uint8)
        tb = torch.frombuffer(bytearray(cb), dtype=torch.uint8)
        carrier = _CARRIERS.get(self.size)
        if carrier is not None:
            mask = ta.view(carrier) != tb.view(carrier)
        else:  # 16-byte elements (complex128): an element differs when any of its bytes does
            mask = (ta != tb).view(-1, self.size).any(dim=1)
        index = mask.nonzero().flatten()
        self.differing += int(index.numel())
        if self.first is None and index.numel():
            self.first = base + int(index[0])
        if self.dtype.is_floating_point or self.dtype.is_complex:
            self._numbers(ta, tb, index)

    def _numbers(self, ta: torch.Tensor, tb: torch.Tensor, index: torch.Tensor) -> None:
        try:
            va, vb = ta.view(self.dtype)[index], tb.view(self.dtype)[index]
            wide = torch.complex128 if self.dtype.is_complex else torch.float64
            va, vb = va.to(wide), vb.to(wide)
        except (RuntimeError, TypeError):  # a dtype torch cannot widen (packed or exotic): bits only
            return
        diff = (va - vb).abs()
        scale = torch.maximum(va.abs(), vb.abs())
        rel = torch.where(scale > 0, diff / scale, torch.zeros_like(diff))
        finite = torch.isfinite(diff)
        if finite.any():
            self.max_abs = max(self.max_abs or 0.0, float(diff[finite].max()))
            self.max_rel = max(self.max_rel or 0.0, float(rel[finite].max()))
        if not bool(finite.all()):  # NaN or inf on one side: the difference itself is not a number
            self.max_abs = self.max_rel = float("nan")
