"""Pickle-free encoding of nested state: a JSON skeleton plus a table of tensors.

Pure logic, no I/O. ``encode`` walks a value (a ``state_dict()``, RNG state,
counters...) and returns JSON-able data in which every tensor is replaced by a
reference ``{"$t": name}``; the tensors themselves go into a :class:`TensorTable`.
``decode`` reverses it. Values JSON cannot carry exactly are tagged with a
single ``$``-prefixed key:

===============  =========================================================
``$t``           a torch tensor, by name in the tensor table
``$nd``          a numpy array, stored as a tensor
``$np``          a numpy scalar: ``[dtype, value]``
``$int``         an int outside the exactly-representable JSON range
``$float``       ``"nan"``, ``"inf"`` or ``"-inf"``
``$tuple``       a tuple (optimizer betas must come back as a tuple)
``$map``         a dict whose keys are not all plain strings (optimizer state
                 is keyed by int), as ``[[key, value], ...]``
``$dtype``       a ``torch.dtype``
``$device``      a ``torch.device``
``$bytes``       bytes, base64
===============  =========================================================

Types are matched exactly (``type(v) is int``), so nothing comes back as a
different type than it went in; anything else raises
:class:`~trainstate.errors.UnsupportedValue` naming its key path, such as
``scheduler.lr_lambdas[0]``.
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import CorruptGeneration, UnsupportedValue

JSON_SAFE_INT = 2**53
_TAGS = ("$t", "$nd", "$np", "$int", "$float", "$tuple", "$map", "$dtype", "$device", "$bytes")


class TensorTable:
    """Collects the tensors of one snapshot, storing each shared tensor once.

    Two references to the same tensor memory with the same view (tied weights)
    get one entry; decoding hands both places the same tensor object again.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._by_identity: dict[tuple, str] = {}

    def add(self, path: str, tensor: torch.Tensor) -> str:
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_meta:
            raise UnsupportedValue(path, tensor, "Only dense (strided) tensors with data can be stored.")
        identity = (
            tensor.device,
            tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
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
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, torch.Tensor):
        if t is not torch.Tensor and t is not torch.nn.Parameter:
            raise UnsupportedValue(path, value, "Tensor subclasses are not stored; pass a plain tensor.")
        return {"$t": table.add(path, value)}
    if t is np.ndarray:
        if value.dtype.kind not in "biufc" or value.dtype.byteorder == ">":
            raise UnsupportedValue(path, value, f"numpy arrays of dtype {value.dtype} are not stored.")
        return {"$nd": table.add(path, torch.from_numpy(np.ascontiguousarray(value)))}
    if isinstance(value, np.generic):
        if value.dtype.kind not in "biuf":
            raise UnsupportedValue(path, value)
        return {"$np": [value.dtype.str, encode(value.item(), path, table)]}
    if t is tuple:
        return {"$tuple": [encode(v, f"{path}[{i}]", table) for i, v in enumerate(value)]}
    if t is list:
        return [encode(v, f"{path}[{i}]", table) for i, v in enumerate(value)]
    if t is dict or t is OrderedDict:
        if all(type(k) is str and not k.startswith("$") for k in value):
            return {k: encode(v, child_path(path, k), table) for k, v in value.items()}
        return {"$map": [[_encode_key(k, path), encode(v, child_path(path, k), table)] for k, v in value.items()]}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if t is torch.device:
        return {"$device": str(value)}
    if t is bytes:
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    raise UnsupportedValue(path, value)


def _encode_key(key: object, path: str) -> Any:
    if type(key) in (str, int, bool) or key is None:
        return key if type(key) is not int or abs(key) <= JSON_SAFE_INT else {"$int": str(key)}
    if type(key) is float and math.isfinite(key):
        return key
    if type(key) is tuple:
        return {"$tuple": [_encode_key(k, path) for k in key]}
    raise UnsupportedValue(f"{path} (a dict key)", key)


def decode(data: Any, path: str, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild a value from its skeleton; ``tensors`` maps names to loaded tensors."""
    t = type(data)
    if data is None or t in (bool, str, int, float):
        return data
    if t is list:
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
        if tag == "$t":
            return tensors[inner]
        if tag == "$nd":
            tensor = tensors[inner]
            if tensor.is_meta:  # a preview: the right shape and dtype, no memory
                zero = np.zeros(1, dtype=torch.empty(0, dtype=tensor.dtype).numpy().dtype)
                return np.lib.stride_tricks.as_strided(zero, tensor.shape, (0,) * tensor.dim(), writeable=False)
            return tensor.numpy()
        if tag == "$np":
            dtype, value = inner
            dtype = np.dtype(dtype) if type(dtype) is str and len(dtype) <= 8 else None
            if dtype is None or dtype.kind not in "biuf" or type(value) not in (bool, int, float):
                raise ValueError(f"unsupported numpy scalar {inner!r:.60}")
            return dtype.type(value)
        if tag == "$int":
            return int(inner)
        if tag == "$float":
            if inner not in ("nan", "inf", "-inf"):
                raise ValueError(inner)
            return float(inner)
        if tag == "$tuple":
            return tuple(decode(v, f"{path}[{i}]", tensors) for i, v in enumerate(inner))
        if tag == "$map":
            out = {}
            for key, value in inner:
                key = _decode_key(key)
                out[key] = decode(value, child_path(path, key), tensors)
            return out
        if tag == "$dtype":
            from .tensorfile import DTYPES  # a fixed table: no getattr(torch, name) on file input

            if type(inner) is not str or inner not in DTYPES:
                raise ValueError(inner)
            return DTYPES[inner]
        if tag == "$device":
            return torch.device(inner)
        if tag == "$bytes":
            return base64.b64decode(inner, validate=True)
    except CorruptGeneration:
        raise
    except (KeyError, ValueError, TypeError, AttributeError, RuntimeError, OverflowError) as exc:
        raise CorruptGeneration(path, f"malformed {tag} value: {exc!r:.200}") from None
    raise AssertionError(tag)  # unreachable: tag is in _TAGS


def _decode_key(key: Any) -> Any:
    if type(key) is dict and len(key) == 1:
        if "$int" in key:
            return int(key["$int"])
        if "$tuple" in key:
            return tuple(_decode_key(k) for k in key["$tuple"])
    if key is None or type(key) in (str, int, bool, float):
        return key
    raise ValueError(f"unsupported dict key {key!r:.100}")
