"""Pickle-free encoding of nested state: a JSON skeleton plus a table of tensors.

Pure logic, no I/O. ``encode`` walks a value (a ``state_dict()``, RNG state,
counters...) and returns JSON-able data in which every tensor is replaced by a
reference ``{"$t": name}``; the tensors themselves go into a :class:`TensorTable`.
``decode`` reverses it. Values JSON cannot carry exactly are tagged with a
single ``$``-prefixed key:

===============  =========================================================
``$t``           a torch tensor, by name in the tensor table
``$nd``          a numpy array, stored as a tensor
``$np``          a numpy scalar: ``[dtype, value]``; the value is a JSON
                 number, ``{"$int": ...}`` beyond 2**53, or (a non-finite
                 float) the scalar's bytes in hex, so NaN payloads survive
``$int``         an int outside the exactly-representable JSON range
``$float``       ``"nan"``, ``"inf"``, ``"-inf"``, or ``"nan:"`` and the
                 16 hex digits of another NaN's bits (sign, payload)
``$tuple``       a tuple (optimizer betas must come back as a tuple)
``$map``         a dict whose keys are not all plain strings (optimizer state
                 is keyed by int), as ``[[key, value], ...]``
``$odict``       an ``OrderedDict`` (``Module.state_dict()``): the encoding of
                 the same items as a dict, wrapped (format 2)
``$dtype``       a ``torch.dtype``
``$device``      a ``torch.device``
``$bytes``       bytes, base64
===============  =========================================================

Types are matched exactly (``type(v) is int``), so nothing comes back as a
different type than it went in; anything else raises
:class:`~trainstate.errors.UnsupportedValue` naming its key path, such as
``scheduler.lr_lambdas[0]``. The decoder is as strict as the encoder is
exact: it refuses every form the encoder never writes (an unknown tag, a
``$tuple`` of an object, a device string that ``str(torch.device(...))``
could not have produced...), so whatever decodes is something a save wrote.
"""

from __future__ import annotations

import base64
import math
import re
import struct
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import CorruptGeneration, UnsupportedValue

JSON_SAFE_INT = 2**53
_TAGS = ("$t", "$nd", "$np", "$int", "$float", "$tuple", "$map", "$odict", "$dtype", "$device", "$bytes")

# numpy dtypes stored exactly: scalars by value, arrays through torch.from_numpy (neither can hold a longdouble)
_NUMPY = tuple(np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                     np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128))
_NP_SCALARS = {d.str: d for d in _NUMPY if d.kind in "biuf"}  # a fixed table: np.dtype() never sees file input
_INT_RE = re.compile(r"-?(0|[1-9][0-9]*)")
_NAN_RE = re.compile(r"nan:[0-9a-f]{16}")
_QUIET_NAN = 0x7FF8000000000000  # the bits of float("nan"): written as plain "nan"
_DEVICE_RE = re.compile(r"([a-z][a-z0-9_]*)(?::(0|[1-9][0-9]{0,2}))?")
_DEVICE_TYPES = ("cpu", "cuda", "mps", "meta", "xpu", "xla", "hpu", "mtia", "ipu", "lazy", "ve", "fpga", "maia",
                 "vulkan", "mkldnn", "opengl", "opencl", "ideep", "hip")


class TensorTable:
    """Collects the tensors of one snapshot, storing each shared tensor once.

    Two references to the same tensor memory with the same view (tied weights)
    get one entry; decoding hands both places the same tensor object again.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._by_identity: dict[tuple, str] = {}

    def add(self, path: str, tensor: torch.Tensor) -> str:
        if tensor.is_nested or tensor.layout != torch.strided or tensor.is_quantized or tensor.is_meta:
            raise UnsupportedValue(path, tensor, "Only dense (strided) tensors with data can be stored.")
        identity = (
            tensor.device,
            tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
            tensor.is_conj(),  # x and x.conj() share memory but not values
            tensor.is_neg(),
        )
        name = self._by_identity.get(identity)
        if name is None:
            name = path
            suffix = 1
            while name in self.tensors:  # two key paths can spell the same string
                suffix += 1
                name = f"{path}#{suffix}"
            self.tensors[name] = tensor
            self._by_identity[identity] = name
        return name


def child_path(path: str, key: object) -> str:
    """Human-readable key path: ``optimizer.state[3].exp_avg``, ``model.fc.weight``."""
    if type(key) is str:
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def encode(value: Any, path: str, table: TensorTable) -> Any:
    """Encode ``value`` found at key path ``path``; tensors go into ``table``."""
    t = type(value)
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return value if -JSON_SAFE_INT <= value <= JSON_SAFE_INT else {"$int": str(value)}
    if t is float:
        return value if math.isfinite(value) else {"$float": _float_name(value)}
    if isinstance(value, torch.Tensor):
        if t is not torch.Tensor and t is not torch.nn.Parameter:
            raise UnsupportedValue(path, value, "Tensor subclasses are not stored; pass a plain tensor.")
        return {"$t": table.add(path, value)}
    if t is np.ndarray:
        return {"$nd": table.add(path, _array_tensor(value, path))}
    if isinstance(value, np.generic):
        return {"$np": [_np_dtype(value, path).str, _np_value(value)]}
    if t is tuple:
        return {"$tuple": [encode(v, f"{path}[{i}]", table) for i, v in enumerate(value)]}
    if t is list:
        return [encode(v, f"{path}[{i}]", table) for i, v in enumerate(value)]
    if t is dict:
        if all(type(k) is str and not k.startswith("$") for k in value):
            return {k: encode(v, child_path(path, k), table) for k, v in value.items()}
        return {"$map": [[_encode_key(k, path), encode(v, child_path(path, k), table)] for k, v in value.items()]}
    if t is OrderedDict:
        return {"$odict": encode(dict(value), path, table)}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if t is torch.device:
        return {"$device": str(value)}
    if t is bytes:
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    raise UnsupportedValue(path, value)


def _float_name(value: float) -> str:
    """``"inf"``, ``"-inf"``, ``"nan"``, or ``"nan:<bits>"`` for a NaN of another sign or payload."""
    if not math.isnan(value):
        return repr(value)
    bits = struct.unpack("<Q", struct.pack("<d", value))[0]
    return "nan" if bits == _QUIET_NAN else f"nan:{bits:016x}"


def _array_tensor(value: np.ndarray, path: str) -> torch.Tensor:
    if value.dtype not in _NUMPY or not value.dtype.isnative:
        raise UnsupportedValue(path, value, f"numpy arrays of dtype {value.dtype} are not stored.")
    if not (value.flags.c_contiguous and value.flags.writeable) or min(value.strides, default=0) < 0:
        value = value.copy(order="C")  # not np.ascontiguousarray, which makes a 0-d array 1-d
    return torch.from_numpy(value)


def _np_dtype(value: np.generic, path: str) -> np.dtype:
    dtype = _NP_SCALARS.get(value.dtype.str)
    if dtype is None or type(value) is not dtype.type:  # np.longlong is an int64 that is not np.int64
        raise UnsupportedValue(path, value, f"numpy scalars of type {type(value).__name__} are not stored; "
                               "convert to a sized type such as numpy.int64 or numpy.float32.")
    return dtype


def _np_value(value: np.generic) -> Any:
    """A JSON number where that is exact, ``{"$int": ...}`` beyond 2**53, a non-finite float's bytes in hex."""
    number = value.item()
    if type(number) is float and not math.isfinite(number):
        return value.tobytes().hex()
    return encode(number, "", _NO_TENSORS)


def _encode_key(key: object, path: str) -> Any:
    if type(key) in (str, int, bool, float) or key is None:
        return encode(key, path, _NO_TENSORS)
    if type(key) is tuple:
        return {"$tuple": [_encode_key(k, path) for k in key]}
    raise UnsupportedValue(f"{path} (a dict key)", key)


_NO_TENSORS = TensorTable()  # for scalars, which never add one


_SCALARS = frozenset((type(None), bool, str, int, float))  # JSON values that decode as themselves


def decode(data: Any, path: str, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild a value from its skeleton; ``tensors`` maps names to loaded tensors."""
    t = type(data)
    if data is None or t in (bool, str, int, float):
        return data
    if t is list:
        if _SCALARS.issuperset(map(type, data)):  # an RNG's state words, say: no per-item path to build
            return data[:]
        return [decode(v, f"{path}[{i}]", tensors) for i, v in enumerate(data)]
    if t is not dict:
        raise CorruptGeneration(path, f"unexpected JSON value of type {t.__name__}")
    if len(data) == 1:
        (tag, inner), = data.items()
        if tag in _TAGS:
            return _decode_tag(tag, inner, path, tensors)
    return {k: decode(v, child_path(path, k), tensors) for k, v in data.items()}


def _decode_tag(tag: str, inner: Any, path: str, tensors: Mapping[str, torch.Tensor]) -> Any:
    try:
        if tag in ("$t", "$nd"):
            tensor = tensors[_need(inner, str)]
            return tensor if tag == "$t" else _array(tensor)
        if tag == "$np":
            return _decode_np(inner)
        if tag in ("$int", "$float"):
            return _decode_number(tag, inner)
        if tag == "$tuple":
            items = _need(inner, list)
            if _SCALARS.issuperset(map(type, items)):
                return tuple(items)
            return tuple(decode(v, f"{path}[{i}]", tensors) for i, v in enumerate(items))
        if tag == "$map":
            return _decode_map(_need(inner, list), path, tensors)
        if tag == "$odict":
            return OrderedDict(_need(decode(_need(inner, dict), path, tensors), dict))
        if tag == "$dtype":
            from .tensorfile import DTYPES  # a fixed table: no getattr(torch, name) on file input

            if type(inner) is not str or inner not in DTYPES:
                raise ValueError(inner)
            return DTYPES[inner]
        if tag == "$device":
            return _decode_device(inner)
        if tag == "$bytes":
            return base64.b64decode(_need(inner, str), validate=True)
    except CorruptGeneration:
        raise
    except (KeyError, ValueError, TypeError, AttributeError, RuntimeError, OverflowError) as exc:
        raise CorruptGeneration(path, f"malformed {tag} value: {exc!r:.200}") from None
    raise AssertionError(tag)  # unreachable: tag is in _TAGS


def _need(value: Any, kind: type) -> Any:
    if type(value) is not kind:
        raise TypeError(f"expected a {kind.__name__}, found a {type(value).__name__}")
    return value


def _array(tensor: torch.Tensor) -> np.ndarray:
    if tensor.is_meta:  # a preview: the right shape and dtype, no memory
        zero = np.zeros(1, dtype=torch.empty(0, dtype=tensor.dtype).numpy().dtype)
        return np.lib.stride_tricks.as_strided(zero, tensor.shape, (0,) * tensor.dim(), writeable=False)
    return tensor.numpy()


def _decode_map(pairs: list, path: str, tensors: Mapping[str, torch.Tensor]) -> dict:
    out = {}
    for pair in pairs:
        if type(pair) is not list or len(pair) != 2:
            raise ValueError(f"a $map item must be a [key, value] pair, not {pair!r:.60}")
        key = _decode_key(pair[0])
        if key in out:
            raise ValueError(f"duplicate key {key!r:.60}")
        out[key] = decode(pair[1], child_path(path, key), tensors)
    return out


def _decode_number(tag: str, inner: Any) -> int | float:
    if tag == "$int":
        if type(inner) is not str or not _INT_RE.fullmatch(inner):
            raise ValueError(f"not a decimal integer: {inner!r:.60}")
        return int(inner)
    if inner in ("inf", "-inf", "nan"):
        return float(inner)
    if type(inner) is str and _NAN_RE.fullmatch(inner):
        value = struct.unpack("<d", struct.pack("<Q", int(inner[4:], 16)))[0]
        if math.isnan(value):
            return value
    raise ValueError(f"not a non-finite float: {inner!r:.60}")


def _decode_np(inner: Any) -> np.generic:
    if type(inner) is not list or len(inner) != 2 or type(inner[0]) is not str or inner[0] not in _NP_SCALARS:
        raise ValueError(f"unsupported numpy scalar {inner!r:.60}")
    dtype, value = _NP_SCALARS[inner[0]], inner[1]
    if type(value) is str and dtype.kind == "f" and len(value) == 2 * dtype.itemsize:  # a non-finite float
        scalar = np.frombuffer(bytes.fromhex(value), dtype)[0]
        if np.isfinite(scalar):
            raise ValueError(f"a finite {dtype} stored as bytes")
        return scalar
    if type(value) is dict and len(value) == 1 and next(iter(value)) in ("$int", "$float"):
        value = _decode_number(*next(iter(value.items())))  # $float here: what format-1 writers produced
    if type(value) is not {"b": bool, "i": int, "u": int, "f": float}[dtype.kind]:
        raise ValueError(f"a {type(value).__name__} value for a numpy {dtype}")
    if dtype.kind in "iu" and not np.iinfo(dtype).min <= value <= np.iinfo(dtype).max:
        raise ValueError(f"{value} is out of range for {dtype}")
    with np.errstate(all="ignore"):
        scalar = dtype.type(value)
    if dtype.kind == "f" and math.isfinite(value) and float(scalar) != value:
        raise ValueError(f"{value!r} is not a {dtype} value")
    return scalar


def _decode_device(inner: Any) -> torch.device:
    """Only a string ``str(torch.device(...))`` writes for a real device type reaches ``torch.device``."""
    match = _DEVICE_RE.fullmatch(inner) if type(inner) is str else None
    if (match is None or match[1] not in (*_DEVICE_TYPES, torch._C._get_privateuse1_backend_name())
            or (match[2] is not None and int(match[2]) > 127)):  # the index is an int8
        raise ValueError(f"not a device: {inner!r:.60}")
    device = torch.device(inner)
    if str(device) != inner:
        raise ValueError(f"not a device: {inner!r:.60}")
    return device


def _decode_key(key: Any) -> Any:
    if type(key) is dict and len(key) == 1:
        (tag, inner), = key.items()
        if tag in ("$int", "$float"):
            return _decode_number(tag, inner)
        if tag == "$tuple":
            return tuple(_decode_key(k) for k in _need(inner, list))
    if key is None or type(key) in (str, int, bool, float):
        return key
    raise ValueError(f"unsupported dict key {key!r:.100}")
