"""Whether a live state may be saved or trained on: a restore that fails after live tensors changed leaves it
*unusable* until a restore loads completely (single-process format 3 and the multi-rank one-pass load alike)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

from ..errors import NoValidGeneration, Rejection, StateUnusable
from .train_state import TrainState

_UNUSABLE: weakref.WeakKeyDictionary[TrainState, str] = weakref.WeakKeyDictionary()


def unusable(state: TrainState) -> str | None:
    """Why ``state`` must not be saved or trained on (a restore failed after live tensors changed), or None."""
    return _UNUSABLE.get(state)


def mark_unusable(state: TrainState, reason: str) -> None:
    """A restore failed after live tensors changed: saves refuse ``state`` until a restore loads completely."""
    _UNUSABLE[state] = reason


def mark_usable(state: TrainState) -> None:
    """Every component of ``state`` loaded completely from one verified generation."""
    _UNUSABLE.pop(state, None)


@contextlib.contextmanager
def telling_unusable(state: TrainState, failed: list[Rejection], location: str) -> Iterator[None]:
    """Choosing again after ``failed`` loads: a :class:`NoValidGeneration` then says whether those left the
    state unusable."""
    try:
        yield
    except NoValidGeneration as exc:
        if not failed:
            raise
        raise NoValidGeneration(location, exc.rejections, unusable=unusable(state)) from None


def refuse_unusable(state: TrainState) -> None:
    """Raise :class:`StateUnusable` for a state a failed restore left partly loaded."""
    reason = _UNUSABLE.get(state)
    if reason is not None:
        raise StateUnusable(f"this TrainState is unusable: {reason}. Saving it would publish a mix of two states. "
                            "Rebuild the live objects (model, optimizer, ...) and restore again, or restore a "
                            "generation that loads completely.")
