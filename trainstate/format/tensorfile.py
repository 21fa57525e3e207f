"""The safetensors container: layout for streaming writes, and a strict reader.

Files written here are ordinary safetensors files (the ``safetensors`` library
reads them), produced without building the whole file in memory: ``plan``
computes the header, and ``chunks`` yields zero-copy views of each tensor's
bytes for the writer to hash and write. Dtypes outside the safetensors table
(``float8_e8m0fnu``, ``complex128``, sub-byte types...) are stored as raw
``U8`` bytes and their real dtype and shape are recorded in the header's
``__metadata__`` so they round-trip exactly.

The reader never trusts the file: the declared header length, every offset,
shape and dtype are checked against the file size before anything is
allocated, so a hostile or truncated file is a :class:`CorruptGeneration`,
not a crash or a huge allocation.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import torch

from ..errors import CorruptGeneration, UnsupportedValue
from .strictjson import container_limit, containers, loads

MAX_HEADER_BYTES = 64 << 20
MAX_DIMS = 64  # torch's own limit; also bounds the cost of checking a hostile shape
CHUNK_BYTES = 16 << 20
_RAW_KEY = "trainstate.raw_dtypes"

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "C64": torch.complex64,
}
_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Looked up in a fixed table, never with getattr(torch, name): torch's module __getattr__
# lazily imports submodules (torch._inductor, ...) for unknown names, and a name read
# from a file must not trigger imports.
DTYPES: dict[str, torch.dtype] = {
    dtype_name(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def torch_dtype(name: str, where: str) -> torch.dtype:
    dtype = DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        raise CorruptGeneration(where, f"unknown dtype {name!r:.60}")
    return dtype


@dataclass(frozen=True)
class Entry:
    """One tensor in a file: where its bytes sit and what they mean."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # offset of the data, relative to the start of the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Layout:
    """A planned or parsed file: header bytes, and entries in data order."""

    header: bytes  # the 8-byte length prefix plus the padded JSON header (empty when parsed)
    entries: tuple[Entry, ...]
    data_start: int  # file offset of the data section

    @property
    def size(self) -> int:
        return self.data_start + (self.entries[-1].end if self.entries else 0)


# Integer dtypes to view a tensor's elements as before copying a non-contiguous one: a same-size view keeps
# every bit at any strides, and torch has no copy kernel for sub-byte, bits or some float8 dtypes.
_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.numel():  # no bytes; and an empty tensor's strides may be anything, which view() refuses
        return torch.empty(0, dtype=torch.uint8)
    # A conjugate or negative view's memory holds the values before the lazy conj/neg: store the values
    # the tensor reads as (as a background save's copy_ does), not its memory.
    tensor = tensor.detach().resolve_conj().resolve_neg()
    carrier = _CARRIERS.get(tensor.element_size())
    flat = (tensor.view(carrier) if carrier is not None else tensor).reshape(-1)
    if not flat.is_contiguous() or flat.stride(-1) != 1:  # a one-element slice is "contiguous" at any stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def plan(tensors: dict[str, torch.Tensor]) -> Layout:
    """Lay out ``tensors`` (name to CPU or CUDA tensor) in insertion order."""
    header: dict[str, object] = {}
    raw: dict[str, list] = {}
    entries = []
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        st_name = _ST_NAMES.get(tensor.dtype)
        if st_name is None:
            raw[name] = [dtype_name(tensor.dtype), list(tensor.shape)]
            st_name, st_shape = "U8", [nbytes]
        else:
            st_shape = list(tensor.shape)
        header[name] = {"dtype": st_name, "shape": st_shape, "data_offsets": [offset, offset + nbytes]}
        entries.append(Entry(name, tensor.dtype, tuple(tensor.shape), offset, offset + nbytes))
        offset += nbytes
    metadata = {"format": "pt"}
    if raw:
        metadata[_RAW_KEY] = json.dumps(raw, separators=(",", ":"))
    body = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    if len(body) > MAX_HEADER_BYTES or containers(body) > container_limit(len(body)):  # parse_header refuses it
        raise UnsupportedValue("tensors", tensors, f"{len(tensors):,} tensors need a {len(body):,}-byte "
                               f"safetensors header; a reader accepts {MAX_HEADER_BYTES:,} bytes at most.")
    header_bytes = struct.pack("<Q", len(body)) + body
    return Layout(header_bytes, tuple(entries), len(header_bytes))


def chunks(layout: Layout, tensors: dict[str, torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """Yield the file's bytes as views of the tensors' memory (no full copy).

    CUDA tensors are copied to host one at a time. The views are valid only
    until the next item is requested.
    """
    yield memoryview(layout.header)
    for entry in layout.entries:
        data = _byte_view(tensors[entry.name])
        if data.device.type != "cpu":
            data = data.cpu()
        view = memoryview(data.numpy())
        for start in range(0, len(view), chunk_bytes):
            yield view[start : start + chunk_bytes]


def parse_header(stream: BinaryIO, file_size: int, where: str) -> Layout:
    """Read and validate the header of a safetensors file of ``file_size`` bytes."""
    if file_size < 8:
        raise CorruptGeneration(where, f"{file_size} bytes is too short for a safetensors file")
    (length,) = struct.unpack("<Q", _read_exact(stream, 8, where))
    if length > min(MAX_HEADER_BYTES, file_size - 8):
        raise CorruptGeneration(where, f"declared header length {length} exceeds the file ({file_size} bytes)")
    header = loads(_read_exact(stream, length, where), f"{where} (header)")
    if type(header) is not dict:
        raise CorruptGeneration(where, "header is not a JSON object")
    raw = _raw_dtypes(header.pop("__metadata__", {}), where)
    entries = sorted((_entry(name, spec, raw, where) for name, spec in header.items()), key=lambda e: (e.begin, e.end))
    expected = 0
    for entry in entries:
        if entry.begin != expected:
            raise CorruptGeneration(where, f"tensor {entry.name!r:.80} starts at {entry.begin}, expected {expected}")
        expected = entry.end
    if 8 + length + expected != file_size:
        raise CorruptGeneration(where, f"file is {file_size} bytes but its header describes {8 + length + expected}")
    return Layout(b"", tuple(entries), 8 + length)


def _raw_dtypes(metadata: object, where: str) -> dict:
    if type(metadata) is not dict or not all(type(v) is str for v in metadata.values()):
        raise CorruptGeneration(where, "__metadata__ must map strings to strings")
    if _RAW_KEY not in metadata:
        return {}
    raw = loads(metadata[_RAW_KEY].encode("utf-8", "surrogatepass"), f"{where} ({_RAW_KEY} metadata)")
    if type(raw) is not dict:
        raise CorruptGeneration(where, f"{_RAW_KEY} metadata is not an object")
    return raw


def _entry(name: str, spec: object, raw: dict, where: str) -> Entry:
    here = f"{where}: tensor {name!r:.80}"
    if type(spec) is not dict or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise CorruptGeneration(here, "entry must have exactly dtype, shape and data_offsets")
    dtype = _ST_DTYPES.get(spec["dtype"]) if type(spec["dtype"]) is str else None
    shape, offsets = spec["shape"], spec["data_offsets"]
    if dtype is None:
        raise CorruptGeneration(here, f"unsupported dtype {spec['dtype']!r:.40}")
    if not _int_list(shape) or not _int_list(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise CorruptGeneration(here, "shape and data_offsets must be lists of non-negative integers")
    begin, end = offsets
    if math.prod(max(d, 1) for d in shape) >= 2**62:  # torch cannot even compute strides for it
        raise CorruptGeneration(here, f"shape {shape!r:.80} is too large")
    if math.prod(shape) * dtype.itemsize != end - begin:
        raise CorruptGeneration(here, f"shape {shape} of {spec['dtype']} does not fill {end - begin} bytes")
    if name in raw:
        real = raw[name]
        if type(real) is not list or len(real) != 2 or type(real[0]) is not str or not _int_list(real[1]):
            raise CorruptGeneration(here, "malformed raw-dtype record")
        dtype = torch_dtype(real[0], here)
        shape = real[1]
        if math.prod(max(d, 1) for d in shape) >= 2**62:
            raise CorruptGeneration(here, f"shape {shape!r:.80} is too large")
        if dtype.itemsize * math.prod(shape) != end - begin:
            raise CorruptGeneration(here, f"raw dtype {real[0]} with shape {shape} does not fill {end - begin} bytes")
    return Entry(name, dtype, tuple(shape), begin, end)


def _int_list(value: object) -> bool:
    return (type(value) is list and len(value) <= MAX_DIMS
            and all(type(v) is int and 0 <= v < 2**62 for v in value))


def _read_exact(stream: BinaryIO, n: int, where: str) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise CorruptGeneration(where, f"file ends after {len(data)} of {n} expected bytes")
    return data


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy (any dtype, 0-dim included)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")


def fill(stream: BinaryIO, view: memoryview) -> int:
    """Read into ``view`` until it is full or ``stream`` ends (``readinto`` returns nothing): the bytes read."""
    got = 0
    while got < len(view):
        n = stream.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def read_tensor_into(stream: BinaryIO, layout: Layout, entry: Entry, where: str, dest: torch.Tensor) -> torch.Tensor:
    """Read one entry straight into ``dest`` (contiguous, CPU, same dtype and shape): no extra copy."""
    stream.seek(layout.data_start + entry.begin)
    if fill(stream, byte_view(dest)) < entry.nbytes:
        raise CorruptGeneration(where, f"file ends inside tensor {entry.name!r:.80}")
    return dest


def skip_tensor(stream: BinaryIO, layout: Layout, entry: Entry, where: str, chunk: int = 4 << 20) -> None:
    """Read past one entry's bytes (the reader still digests them); bounded memory."""
    stream.seek(layout.data_start + entry.begin)
    left = entry.nbytes
    while left:
        data = stream.read(min(chunk, left))
        if not data:
            raise CorruptGeneration(where, f"file ends inside tensor {entry.name!r:.80}")
        left -= len(data)


def read_tensor(stream: BinaryIO, layout: Layout, entry: Entry, where: str) -> torch.Tensor:
    """Read one entry into a freshly allocated CPU tensor (one copy, no pickle)."""
    if not entry.nbytes:
        stream.seek(layout.data_start + entry.begin)
        return torch.empty(entry.shape, dtype=entry.dtype)
    buffer = read_tensor_into(stream, layout, entry, where, torch.empty(entry.nbytes, dtype=torch.uint8))
    return buffer.view(entry.dtype).reshape(entry.shape)