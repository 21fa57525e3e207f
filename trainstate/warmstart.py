"""Warm start: load weights into a module. Never a resume.

A warm start sets no clock, restores no RNG and loads no optimizer state, so
the run that follows is a new run initialised from old weights. It accepts
full and weights-only generations alike. Every key and shape is checked
before the first weight is copied: a strict warm start that cannot load
everything loads nothing, and a non-strict one loads exactly the entries that
fit and says which it skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import CorruptGeneration, NoValidGeneration, Rejection, StateMismatch
from .format import signing
from .format.manifest import MANIFEST, parse_generation_name
from .format.signing import SigningKey
from .records import GenerationInfo
from .storage.local import LocalStore
from .storage.verify import load_verified
from .tools import export as export_mod

log = logging.getLogger("trainstate")
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile, DDP/DataParallel


@dataclass(frozen=True)
class WarmStartInfo:
    """What a warm start loaded and what it left alone.

    ``missing``: the module's entries the checkpoint does not have (left as
    they were); ``unexpected``: the checkpoint's entries the module does not
    have; ``mismatched``: entries of both whose shapes differ, as
    ``(key, saved shape, module shape)`` (left as they were).
    """

    generation: GenerationInfo
    loaded: tuple[str, ...]
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    renamed: tuple[tuple[str, str], ...] = ()  # (saved name, module name): a ``_orig_mod.``/``module.`` prefix

    @property
    def complete(self) -> bool:
        """True when every entry of the module was loaded and nothing in the checkpoint was left over."""
        return not (self.missing or self.unexpected or self.mismatched)

    def describe(self) -> str:
        """One line: what fit, what was renamed, missing, unexpected or of another shape."""
        parts = [f"{len(self.loaded)} entries of {self.generation.name} fit"]
        if self.renamed:
            parts.append("renamed: " + ", ".join(f"{a} -> {b}" for a, b in self.renamed[:10])
                         + (f" and {len(self.renamed) - 10} more" if len(self.renamed) > 10 else ""))
        if self.missing:
            parts.append(f"missing from the checkpoint: {_names(self.missing)}")
        if self.unexpected:
            parts.append(f"not in the module: {_names(self.unexpected)}")
        if self.mismatched:
            parts.append("different shapes: " + ", ".join(f"{k} (checkpoint {tuple(a)}, module {tuple(b)})"
                                                           for k, a, b in self.mismatched[:10])
                         + (f" and {len(self.mismatched) - 10} more" if len(self.mismatched) > 10 else ""))
        return "; ".join(parts)


def _names(keys: tuple[str, ...], limit: int = 10) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def warm_start(source: str | Path, module: torch.nn.Module, *, component: str = "model",
               strict: bool = True, signing_key: SigningKey | bytes | str | None = None) -> WarmStartInfo:
    """Load ``component``'s weights from a run directory, one generation directory or an export into ``module``.

    From a run directory, the newest generation (full or weights-only) that
    verifies is used. With ``strict=True`` every entry must match by name and
    shape, or :class:`StateMismatch` is raised before anything is loaded.
    With ``strict=False`` (fine-tuning with a new head, say) the entries that
    match are loaded and the rest are reported in the returned
    :class:`WarmStartInfo`.

    >>> info = ts.warm_start("runs/pretrain", model, strict=False)
    >>> info.mismatched     # e.g. (("head.weight", (1000, 512), (10, 512)), ...)

    An export directory (``trainstate export``, or any safetensors weights in
    the Hugging Face layout) is read as it is; its ``generation`` is the one
    the export recorded (``kind="export"``; ``next_update`` -1 when it
    recorded none). Names that differ only by a ``torch.compile``
    (``_orig_mod.``) or DDP (``module.``) prefix are matched, and listed in
    ``info.renamed``.
    """
    path = Path(source)
    if export_mod.is_export(path):
        return _from_export(path, module, strict)
    if parse_generation_name(path.name) and (path / MANIFEST).exists():
        store, names = LocalStore(path.parent, create=False), [path.name]
    else:
        store = LocalStore(path, create=False)
        names = store.generations()
    key = signing.resolve(signing_key, store.location)
    rejected = []
    for name in names:
        try:
            verified, state = load_verified(store, name, component=component, key=key)
        except CorruptGeneration as exc:
            if _multi_rank(store, name):
                raise StateMismatch(f"{name} was written by several ranks: its weights are sharded; warm start "
                                    "under torchrun with CheckpointManager.restore(state, generation=...), or "
                                    "export the weights first") from exc
            rejected.append(Rejection(name, str(exc)))
            continue
        if type(state) is not dict or not isinstance(state.get("state"), Mapping):
            raise StateMismatch(f"component {component!r} in {name} is not a module's state dict")
        return _load(module, state["state"], GenerationInfo.from_verified(store, verified), strict)
    raise NoValidGeneration(str(source), rejected)


def _from_export(path: Path, module: torch.nn.Module, strict: bool) -> WarmStartInfo:
    tensors, meta, size = export_mod.read_export(path)
    digest = meta.get("trainstate.manifest_digest", "")
    algorithm, _, digest = digest.partition(":") if ":" in digest else ("", "", digest)
    try:
        update = int(meta.get("trainstate.next_update", "-1"))
    except ValueError:
        update = -1
    info = GenerationInfo(meta.get("trainstate.generation", path.name), str(path), "export", update,
                          meta.get("trainstate.created", ""), size, digest, algorithm)
    return _load(module, tensors, info, strict)


def _strip(key: str) -> str:
    while True:
        for prefix in _WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        else:
            return key


def _align(saved: Mapping[str, Any], live: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[tuple[str, str], ...]]:
    """``saved`` with each name the module lacks matched to the module's name that differs from it only by
    wrapper prefixes, when exactly one does and nothing saved has that name already."""
    by_bare: dict[str, list[str]] = {}
    for key in live:
        by_bare.setdefault(_strip(key), []).append(key)
    out: dict[str, Any] = {}
    renamed = []
    for key, value in saved.items():
        targets = by_bare.get(_strip(key), []) if key not in live else []
        if len(targets) == 1 and targets[0] not in saved and targets[0] not in out:
            out[targets[0]] = value
            renamed.append((key, targets[0]))
        else:
            out[key] = value
    return out, tuple(renamed)


def _multi_rank(store: LocalStore, name: str) -> bool:
    try:
        from .storage.verify import read_manifest
        return bool(read_manifest(store, name)[0].ranks)
    except (CorruptGeneration, OSError):
        return False


def _load(module: torch.nn.Module, saved: Mapping[str, Any], info: GenerationInfo, strict: bool) -> WarmStartInfo:
    live = module.state_dict()
    saved, renamed = _align(saved, live)
    missing = tuple(k for k in live if k not in saved)
    unexpected = tuple(k for k in saved if k not in live)
    mismatched, fits = [], {}
    for key_, value in saved.items():
        if key_ not in live:
            continue
        target = live[key_]
        if isinstance(target, torch.nn.parameter.UninitializedParameter) or not isinstance(target, torch.Tensor):
            fits[key_] = value  # materialised (lazy modules) or handled by the module itself
        elif not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(target.shape):
            saved_shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
            mismatched.append((key_, saved_shape, tuple(target.shape)))
        else:
            fits[key_] = value
    report = WarmStartInfo(info, tuple(fits), missing, unexpected, tuple(mismatched), renamed)
    if strict and not report.complete:
        raise StateMismatch(
            f"warm start from {info.name} does not fit the module; nothing was loaded ({report.describe()}). "
            "Pass strict=False to load the entries that fit and leave the rest as they are.")
    module.load_state_dict(fits, strict=False)
    if renamed or not report.complete:
        log.info("warm start: %s", report.describe())
    return report
