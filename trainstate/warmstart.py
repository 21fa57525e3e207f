"""Warm start: load weights into a module. Never a resume.

A warm start sets no clock, restores no RNG and loads no optimizer state, so
the run that follows is a new run initialised from old weights. It accepts
full and weights-only generations alike.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import NoValidGeneration, Rejection, StateMismatch
from .errors import CorruptGeneration
from .format import signing
from .storage.local import LocalStore
from .format.signing import SigningKey
from .manager import GenerationInfo
from .format.manifest import MANIFEST, parse_generation_name
from .storage.verify import load_verified


def warm_start(source: str | Path, module: torch.nn.Module, *, component: str = "model",
               strict: bool = True, signing_key: SigningKey | bytes | str | None = None) -> GenerationInfo:
    """Load ``component``'s weights from a run directory or one generation directory into ``module``.

    From a run directory, the newest generation (full or weights-only) that
    verifies is used. ``strict`` is passed to ``load_state_dict``.

    >>> ts.warm_start("runs/pretrain", model, strict=False)
    """
    path = Path(source)
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
            rejected.append(Rejection(name, str(exc)))
            continue
        if type(state) is not dict or "state" not in state:
            raise StateMismatch(f"component {component!r} in {name} is malformed")
        module.load_state_dict(state["state"], strict=strict)
        return GenerationInfo.from_verified(store, verified)
    raise NoValidGeneration(str(source), rejected)
