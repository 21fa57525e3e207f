"""``trainstate discard OUTPUT_DIR``: the checkpoint folders the Hugging Face callback set aside.

At train begin :class:`~trainstate.integrations.hf.DurableCheckpoints` renames
every ``checkpoint-M`` newer than the resumed step to
``incomplete-checkpoint-M-<hex>`` (never sealed) or
``abandoned-checkpoint-M-<hex>`` (sealed, on a timeline the run left), keeping
it as evidence; a kill drill leaves several per run. The names are made here
(:func:`aside_name`) and recognised here (:data:`ASIDE_RE`), so the two cannot
drift apart; this module imports no framework, so the command works without
transformers installed.

Only a real directory whose whole name matches is ever deleted: a
``checkpoint-N`` folder Trainer could resume from, the seal pointer, a
symbolic link or anything else is refused by name.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from ..errors import InvalidArgument
from ..storage.posix import PosixOps

REASONS = ("incomplete", "abandoned")
PREFIX = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR (a test checks they agree)
ASIDE_RE = re.compile(rf"(?:{'|'.join(REASONS)})-{PREFIX}-\d+-[0-9a-f]{{16}}")
_CHECKPOINT_RE = re.compile(rf"{PREFIX}-\d+")
_MARKER = "trainstate-latest"  # the seal pointer (trainstate.format.seal.SEAL_POINTER) beside the folders


def aside_name(reason: str, checkpoint: str) -> str:
    """The name ``checkpoint`` (``checkpoint-M``) is set aside under."""
    if reason not in REASONS:
        raise ValueError(f"reason must be one of {REASONS}, got {reason!r}")
    return f"{reason}-{checkpoint}-{secrets.token_hex(8)}"


def set_aside(output_dir: Path) -> list[str]:
    """The folders set aside in ``output_dir`` (real directories only, sorted)."""
    return sorted(n for n in os.listdir(output_dir)
                  if ASIDE_RE.fullmatch(n) and not (output_dir / n).is_symlink() and (output_dir / n).is_dir())


def is_output_dir(directory: str, names: list[str]) -> bool:
    """Whether ``trainstate discard`` is about a Hugging Face output directory rather than a run: a local
    directory holding the callback's folders or its seal pointer, or every name given in the set-aside pattern."""
    root = Path(directory)
    if "://" in directory or not root.is_dir():
        return False
    if names and all(ASIDE_RE.fullmatch(n) for n in names):
        return True
    return any(ASIDE_RE.fullmatch(n) or _CHECKPOINT_RE.fullmatch(n) or n == _MARKER for n in os.listdir(root))


def discard(directory: str, names: list[str], every: bool) -> list[str]:
    """Delete the named set-aside folders (``every``: all of them); returns what was deleted. Anything not in
    the pattern, or not present, is refused before anything is deleted."""
    root = Path(directory)
    aside = set_aside(root)
    chosen = aside if every else list(names)
    unknown = [n for n in chosen if n not in aside]
    if unknown or not chosen:
        found = ", ".join(aside) or "none"
        raise InvalidArgument(
            f"nothing to discard: {', '.join(unknown) or '(no names given)'} "
            f"{'is' if len(unknown) == 1 else 'are'} not folders the Hugging Face callback set aside in {root} "
            f"(incomplete-checkpoint-N-<hex>, abandoned-checkpoint-N-<hex>; checkpoint-N folders are never "
            f"discarded). Set aside there now: {found}. Name them, or pass --all for every one")
    ops = PosixOps()
    for name in chosen:
        ops.rmtree(root / name)
    ops.fsync_dir(root)
    return chosen
