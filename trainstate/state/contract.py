"""The experiment contract: what gives the saved numbers their meaning.

Pure logic. A contract is a flat mapping of field names to canonical JSON
values: the user's fields (``config``, ``class_names``, ``data_manifest``,
``tokenizer``, anything else) plus ``architecture.<component>`` for each
``nn.Module`` (parameter and buffer names, shapes, dtypes, ties). On restore
the saved and live contracts are compared field by field, descending into
nested config dicts so a change is named precisely (``config.optim.lr``).

An architecture entry is ``[name, shape, dtype, tied_to]``: ``tied_to`` names
the first entry of the module whose tensor it is (tied weights: one tensor
under two names), or is None. Generations written before ties were recorded
have three-element entries; against those, ties are not compared here (the
record cannot say whether they were tied) and the restore checks the
checkpoint's tensors instead (:func:`tie_groups`, ``snapshot``). A lazy
module's uninitialized parameter has shape None: whatever the checkpoint
holds materializes it, as ``load_state_dict`` does.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import ContractMismatch, FieldChange, UnsupportedValue
from ..version import __version__

_ABSENT = "<absent>"


def canonical(value: Any, path: str) -> Any:
    """A JSON-native copy of ``value`` (tuples become lists), or UnsupportedValue."""
    if value is None or type(value) in (bool, str, int):
        return value
    if type(value) is float:
        if not math.isfinite(value):
            raise UnsupportedValue(path, value, "Contract values must be finite numbers.")
        return value
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return canonical(value.item(), path)
    if isinstance(value, (list, tuple)):
        return [canonical(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise UnsupportedValue(f"{path} (key {k!r})", k, "Contract dict keys must be strings.")
            out[k] = canonical(v, f"{path}.{k}")
        return out
    raise UnsupportedValue(path, value, "Contract values must be JSON-like (dict, list, str, number, bool, None); "
                           "pass a fingerprint string for anything else.")


def fingerprint(value: Any) -> str:
    """SHA-256 of the canonical JSON of ``value``: for a tokenizer, vocabulary or any JSON-like object."""
    data = json.dumps(canonical(value, "value"), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(data.encode()).hexdigest()


def is_uninitialized(tensor: torch.Tensor) -> bool:
    """A lazy module's parameter or buffer before its first forward (or ``load_state_dict``) gives it a shape."""
    return isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin)


def storage_key(tensor: torch.Tensor) -> tuple:
    """Two tensors with equal keys are one tensor under two names (the codec stores such a tensor once)."""
    where: object = id(tensor)  # empty and meta tensors have no memory to share: only the same object is tied
    if tensor.numel() and tensor.device.type != "meta":
        try:
            where = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            pass  # a tensor type without plain storage (a wrapper subclass): identity alone
    return tensor.device, where, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype


def tie_groups(tensors: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names that hold one tensor, in order, for every tensor held under more than one name."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and not is_uninitialized(tensor):
            groups.setdefault(storage_key(tensor), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def architecture(module: torch.nn.Module) -> list[list]:
    """``[name, shape, dtype, tied_to]`` for every parameter and buffer in the module's state dict.

    Computed at every save, so remembered per module while nothing it is made of changes (see
    :func:`_layout`): a large model's ``state_dict()`` runs every submodule's state-dict hooks (FSDP's
    among them), milliseconds a blocking save would otherwise pay each time for the same answer."""
    layout = _layout(module)
    cached = _ARCHITECTURES.get(module) if layout is not None else None
    if cached is not None and cached[0] == layout:
        return [list(entry) for entry in cached[1]]
    entries = _architecture(module)
    if layout is not None:
        _ARCHITECTURES[module] = (layout, [list(entry) for entry in entries])
    return entries


_ARCHITECTURES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, list[list]]]" = weakref.WeakKeyDictionary()


def _layout(module: torch.nn.Module) -> tuple | None:
    """What a module's state dict names, shapes and ties follow from: each submodule (by identity),
    its parameters and buffers (identity, class, where the bytes are, offset, shape, stride, dtype:
    what :func:`storage_key` ties by), which buffers are persistent, its children, and its state-dict
    hooks. None (never remembered) where the answer may follow from something else: a class with its own
    ``state_dict`` or ``get_extra_state``."""
    parts: list = []
    for sub in module.modules():
        cls = type(sub)
        if cls.state_dict is not torch.nn.Module.state_dict or cls.get_extra_state is not torch.nn.Module.get_extra_state:
            return None
        tensors = []
        for group in (sub._parameters, sub._buffers):
            for name, t in group.items():
                if t is None or is_uninitialized(t):
                    tensors.append((name, id(t), type(t)))
                    continue
                plain = type(t) is torch.Tensor or type(t) is torch.nn.Parameter
                try:  # a wrapper subclass (DTensor) is tied by identity alone: no storage to ask about
                    where = t.data_ptr() if plain and t.numel() else None
                    tensors.append((name, id(t), type(t), where, t.device, t.storage_offset(), tuple(t.shape),
                                    tuple(t.stride()), t.dtype))
                except Exception:  # noqa: BLE001 - a tensor type that cannot say where it lives: never remembered
                    return None
        parts.append((id(sub), tuple(tensors), tuple(sorted(sub._non_persistent_buffers_set)),
                      tuple(sub._state_dict_hooks), tuple(sub._state_dict_pre_hooks), tuple(sub._modules)))
    return tuple(parts)


def _architecture(module: torch.nn.Module) -> list[list]:
    tensors = {n: t for n, t in module.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}
    tied_to = {name: names[0] for names in tie_groups(tensors) for name in names[1:]}
    return [[name, None if is_uninitialized(t) else list(t.shape), str(t.dtype).removeprefix("torch."),
             tied_to.get(name)] for name, t in tensors.items()]


def has_tie_record(entries: object) -> bool:
    """Whether an architecture field records ties (every generation since they were recorded does)."""
    return type(entries) is list and all(type(e) is list and len(e) == 4 for e in entries)


def build(user_fields: Mapping[str, Any], modules: Mapping[str, torch.nn.Module]) -> dict[str, Any]:
    fields = {name: canonical(value, f"contract.{name}") for name, value in user_fields.items()}
    for name, module in modules.items():
        fields[f"architecture.{name}"] = architecture(module)
    return fields


def versions() -> dict[str, str]:
    """Recorded with every generation, never enforced."""
    return {"trainstate": __version__, "torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def compare(saved: Mapping[str, Any], live: Mapping[str, Any]) -> list[FieldChange]:
    """Every differing field, with nested dicts compared key by key."""
    changes: list[FieldChange] = []
    for name in sorted(set(saved) | set(live)):
        _diff(name, saved.get(name, _ABSENT), live.get(name, _ABSENT), changes)
    return changes


def _diff(path: str, old: Any, new: Any, out: list[FieldChange]) -> None:
    if type(old) is dict and type(new) is dict:
        for key in list(old) + [k for k in new if k not in old]:
            _diff(f"{path}.{key}", old.get(key, _ABSENT), new.get(key, _ABSENT), out)
    elif path.startswith("architecture.") and type(old) is list and type(new) is list:
        _diff_architecture(path, old, new, out)
    elif old != new or type(old) is not type(new):
        out.append(FieldChange(path, old, new))


def _diff_architecture(path: str, old: list, new: list, out: list[FieldChange]) -> None:
    width = None if has_tie_record(old) and has_tie_record(new) else 3  # older record: no ties to compare
    old_map = {e[0]: e[1:width] for e in old if type(e) is list and e and type(e[0]) is str}
    new_map = {e[0]: e[1:width] for e in new if type(e) is list and e and type(e[0]) is str}
    before = len(out)
    for key in list(old_map) + [k for k in new_map if k not in old_map]:
        saved, live = old_map.get(key, _ABSENT), new_map.get(key, _ABSENT)
        if not _same_entry(saved, live):
            out.append(FieldChange(f"{path}.{key}", saved, live))
    if len(out) == before and (list(old_map) != list(new_map) or len(old_map) != len(old) or len(new_map) != len(new)):
        out.append(FieldChange(path, "parameter order differs", "parameter order differs"))


def _same_entry(saved: object, live: object) -> bool:
    """Equal entries; a live shape of None (an uninitialized lazy parameter) takes the saved shape."""
    if type(saved) is list and type(live) is list and len(saved) == len(live) and live and live[0] is None:
        return saved[1:] == live[1:]
    return saved == live and type(saved) is type(live)


def allowed(change: FieldChange, allow: Iterable[str]) -> bool:
    """True if ``change.field`` equals an allowed name or lies beneath one."""
    return any(change.field == a or change.field.startswith(a + ".") for a in allow)


def check(saved: Mapping[str, Any], live: Mapping[str, Any], generation: str,
          allow: Iterable[str] = ()) -> list[FieldChange]:
    """Every change between the saved and live contracts; raise ContractMismatch unless each is allowed.

    In a multi-rank contract, a loader's ``batch_size`` that changes with the
    world size so that the global batch (world size times batch size) stays
    the same is accepted with ``world_size``: the loader then continues the
    uninterrupted run's updates exactly. Any other change of a loader's batch
    size changes the global batch, so it needs its own
    ``allow_changes=["loader.<name>.batch_size"]``.
    """
    allow = list(allow)
    changes = compare(saved, live)
    # accepted with the world size, or refused through it: never a refusal of its own
    follows = [c for c in changes if _keeps_global_batch(c.field, saved, live)]
    refused = [c for c in changes if not allowed(c, allow) and c not in follows]
    if refused:
        raise ContractMismatch(generation, refused, fixed=[c.field for c in refused if _fixed(c.field)],
                               notes=_batch_notes(refused, saved, live, allow))
    return changes


# A loader's plan gives its saved position a meaning: a change of most of it would make the position name other
# samples (DataMismatch at the loader), so the mismatch message never suggests allowing it. ADJUSTABLE keys are
# those the loader continues across, from the samples consumed.
FIXED = ("loader.",)
ADJUSTABLE = ("batch_size", "mixture.weights")


def _fixed(field: str) -> bool:
    parts = field.split(".", 2)
    return field.startswith(FIXED) and not (len(parts) == 3 and parts[2] in ADJUSTABLE)


def _global_batch(fields: Mapping[str, Any], loader: str) -> tuple[int, int] | None:
    """``(world size, batch size)`` of loader ``loader``: a multi-rank contract records the world size on its own
    (its loader plans leave it out), a single process's loader plan holds its own."""
    plan = fields.get(f"loader.{loader}")
    if type(plan) is not dict:
        return None
    world, batch = fields.get("world_size", plan.get("world_size", 1)), plan.get("batch_size")
    return (world, batch) if type(world) is int and type(batch) is int and world > 0 and batch > 0 else None


def _keeps_global_batch(field: str, saved: Mapping[str, Any], live: Mapping[str, Any]) -> bool:
    """``field`` is a loader's batch size, changed with the world size of a multi-rank run, its global batch kept."""
    parts = field.split(".")
    if len(parts) != 3 or parts[0] != "loader" or parts[2] != "batch_size" or "world_size" not in saved:
        return False
    old, new = _global_batch(saved, parts[1]), _global_batch(live, parts[1])
    return old is not None and new is not None and old[0] != new[0] and old[0] * old[1] == new[0] * new[1]


def _batch_notes(refused: list[FieldChange], saved: Mapping[str, Any], live: Mapping[str, Any],
                 allow: list[str]) -> list[str]:
    """For each loader whose global batch a refused field (its batch size, the world size) concerns: what the
    change does to the global batch, and how to keep it, the exact continuation."""
    fields = {c.field for c in refused}
    notes = []
    for key in sorted(k for k in live if k.startswith("loader.") and k.count(".") == 1):
        name = key.split(".")[1]
        old, new = _global_batch(saved, name), _global_batch(live, name)
        field = f"{key}.batch_size"
        if old is None or new is None or old == new or not fields & {field, "world_size"}:
            continue
        (w0, b0), (w1, b1) = old, new
        if _keeps_global_batch(field, saved, live):
            notes.append(f"{field} changes with the world size and keeps the global batch (world_size x batch_size: "
                         f"{w0} x {b0} = {w1} x {b1}): allow_changes=['world_size'] accepts both, and the data order "
                         "then continues the uninterrupted run's updates exactly.")
            continue
        wanted = list(dict.fromkeys(allow + ["world_size"] * (w0 != w1) + [field] * (b0 != b1)))
        keep = (f"To continue the uninterrupted run's updates exactly, keep it: construct the loader with "
                f"batch_size={w0 * b0 // w1}." if w0 * b0 % w1 == 0 else
                f"No batch size keeps it at world size {w1}, which does not divide {w0 * b0}: only a world size that "
                "divides it continues the uninterrupted run's updates exactly.")
        notes.append(f"The global batch of {key} (world_size x batch_size) changes from {w0 * b0} ({w0} x {b0}) to "
                     f"{w1 * b1} ({w1} x {b1}). {keep} "
                     f"To accept another global batch, pass allow_changes={wanted!r}: the samples then continue in "
                     "the same order, grouped into updates of another size (not the uninterrupted run's), and the "
                     "restore warns so (RestoreInfo.warnings).")
    return notes


def digest(fields: Mapping[str, Any]) -> str:
    return fingerprint(dict(fields))
