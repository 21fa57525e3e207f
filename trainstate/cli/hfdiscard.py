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

The same command discards a trainstate run's set-aside generations;
:func:`choose_mode` decides which kind of directory it was given, from what the
directory holds (see its docstring), never from one stray ``checkpoint-N``.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from ..errors import InvalidArgument
from ..format.manifest import PINS, POINTER, RUN, WEIGHTS_POINTER
from ..storage.local import LocalStore
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


def choose_mode(directory: str, names: list[str], forced: str | None = None) -> str:
    """``"run"`` or ``"hf"``: whether ``trainstate discard`` is about a trainstate run or a Hugging Face output
    directory (``forced``: the user's ``--mode``).

    Names that are all in one mode's set-aside pattern choose it. Otherwise the directory does: a run's
    markers (generations, pointers, set-aside generations) make it a run, whatever else lies beside it (a
    stray ``checkpoint-N`` folder is no sign of an output directory there); the callback's set-aside folders
    or its seal pointer make it an output directory; both at once is refused, naming both and ``--mode``.
    A directory with neither is an output directory when it holds ``checkpoint-N`` folders, else a run
    (whose own command then says what is missing); a URL is always a run.
    """
    root = Path(directory)
    local = "://" not in directory and root.is_dir()
    if forced == "hf" and not local:
        raise InvalidArgument(f"--mode hf needs the Trainer's output directory, a local directory; {directory} is not")
    if forced is not None or not local:
        return forced or "run"
    store = LocalStore(root, create=False)
    if names and all(ASIDE_RE.fullmatch(n) for n in names):
        return "hf"
    if names and set(names) <= set(store.aside()):
        return "run"
    listing = sorted(os.listdir(root))
    run = [n for n in listing if n in (POINTER, WEIGHTS_POINTER, RUN, PINS)] + store.generations() + store.aside()
    hf = [n for n in listing if ASIDE_RE.fullmatch(n) or n == _MARKER]
    if run and hf:
        raise InvalidArgument(
            f"{root} holds both a trainstate run ({_some(run)}) and what the Hugging Face callback leaves in an "
            f"output directory ({_some(hf)}); nothing was discarded. Say which to discard from: --mode run for the "
            "run's set-aside generations (as `trainstate ls` lists them), --mode hf for the "
            "incomplete-/abandoned-checkpoint-N-<hex> folders; or name the entries")
    if run or hf:
        return "run" if run else "hf"
    return "hf" if any(_CHECKPOINT_RE.fullmatch(n) for n in listing) else "run"


def _some(names: list[str]) -> str:
    return ", ".join(sorted(set(names))[:3]) + (", ..." if len(set(names)) > 3 else "")


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
