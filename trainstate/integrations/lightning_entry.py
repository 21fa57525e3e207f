"""The small entry Lightning sees at a checkpoint path, and what one global step may save twice.

Pure logic, no I/O and no Lightning import. A ``.ckpt`` written by
:class:`~trainstate.integrations.lightning.TrainStateCheckpointIO` is not a
pickle but a few hundred bytes of JSON naming a trainstate generation::

    {"format": "trainstate-lightning-checkpoint", "format_version": 1,
     "run": "." , "generation": "gen-000000000020", "manifest_digest": "…",
     "next_update": 20, "overrides": [[["callbacks", "ModelCheckpoint{…}", "last_model_path"], "/…/last.ckpt"]]}

``run`` is the run directory relative to the entry's own directory, so a
checkpoint folder moved as a whole still resolves. ``overrides`` carry what
the second save of a global step changed: ModelCheckpoint saves the top-k
file and then ``last.ckpt`` from the same state, having updated only its own
path bookkeeping (``last_model_path``) in between. That second save becomes
an entry naming the first save's generation, with the changed paths here,
instead of a second generation of the same tensors.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptGeneration, GenerationExists
from ..format import strictjson
from ..format.manifest import parse_generation_name

FORMAT = "trainstate-lightning-checkpoint"
FORMAT_VERSION = 1
MAX_ENTRY_BYTES = 1 << 20
# ModelCheckpoint's state holds these besides paths; a difference in any of them is a different state.
_CALLBACK_PREFIX = "ModelCheckpoint"
_LAST_RE = re.compile(r"last(-v?\d+)?$")  # ModelCheckpoint.CHECKPOINT_NAME_LAST, with a version suffix


@dataclass(frozen=True)
class Entry:
    """What a checkpoint path names: a generation of a run directory."""

    run: str  # relative to the entry's directory
    generation: str
    manifest_digest: str
    next_update: int
    overrides: tuple[tuple[tuple[str, ...], Any], ...] = ()


def entry_bytes(entry: Entry) -> bytes:
    data = {"format": FORMAT, "format_version": FORMAT_VERSION, "run": entry.run, "generation": entry.generation,
            "manifest_digest": entry.manifest_digest, "next_update": entry.next_update,
            "overrides": [[list(path), value] for path, value in entry.overrides],
            "note": "a trainstate generation; load it with trainstate.integrations.lightning.TrainStateCheckpointIO"}
    return json.dumps(data, indent=1).encode() + b"\n"


def looks_like_entry(head: bytes) -> bool:
    """Whether a file's first bytes are an entry's (a torch pickle or zip starts otherwise)."""
    return head.lstrip()[:1] == b"{" and FORMAT.encode() in head


def parse_entry(data: bytes, where: str) -> Entry:
    """The entry in ``data``, or :class:`CorruptGeneration` naming ``where`` and what is wrong."""
    if len(data) > MAX_ENTRY_BYTES:
        raise CorruptGeneration(where, f"{len(data)} bytes: larger than any checkpoint entry")
    obj = strictjson.loads(data, where)
    if type(obj) is not dict or obj.get("format") != FORMAT:
        raise CorruptGeneration(where, f"not a {FORMAT} entry")
    if obj.get("format_version") != FORMAT_VERSION:
        raise CorruptGeneration(where, f"entry format version {obj.get('format_version')!r}; this trainstate reads "
                                       f"{FORMAT_VERSION}. Upgrade trainstate to read it")
    run, generation, digest, update = (obj.get(k) for k in ("run", "generation", "manifest_digest", "next_update"))
    if type(run) is not str or type(digest) is not str or type(update) is not int or type(generation) is not str \
            or parse_generation_name(generation) is None:
        raise CorruptGeneration(where, "an entry needs run, generation, manifest_digest and next_update")
    overrides = obj.get("overrides")
    if type(overrides) is not list:
        raise CorruptGeneration(where, "overrides must be a list")
    parsed = []
    for item in overrides:
        if (type(item) is not list or len(item) != 2 or type(item[0]) is not list
                or not all(type(k) is str for k in item[0]) or not _path_value(item[1])):
            raise CorruptGeneration(where, f"malformed override {item!r:.80}")
        parsed.append((tuple(item[0]), item[1]))
    return Entry(run, generation, digest, update, tuple(parsed))


def _path_value(value: Any) -> bool:
    return value is None or type(value) is str


def is_last(filename: str) -> bool:
    """Whether ModelCheckpoint would find this file for ``ckpt_path="last"`` (``last.ckpt``, ``last-v1.ckpt``)."""
    stem = filename[:-5] if filename.endswith(".ckpt") else filename
    return bool(_LAST_RE.match(stem))


def pin_name(entry_path: str) -> str:
    """The pin that keeps an entry's generation from retention: readable, a valid pin name, unique per path.

    ``entry_path`` is relative to the run directory, so a checkpoint folder
    moved or copied as a whole keeps its pins.
    """
    base = re.sub(r"[^A-Za-z0-9._-]", "_", entry_path.rsplit("/", 1)[-1])[:40]
    return f"lightning-{base}-{hashlib.sha256(entry_path.encode()).hexdigest()[:8]}"


def same_state_overrides(published: dict[str, Any], again: dict[str, Any], generation: str
                         ) -> tuple[tuple[tuple[str, ...], Any], ...]:
    """What a second save at the same global step may change: ModelCheckpoint's paths, nothing else.

    Both arguments are the codec's encoding of a Lightning checkpoint (tensors
    replaced by name, as the manager compares them). Returns the changed
    paths as overrides; raises :class:`GenerationExists` naming the first
    other difference.
    """
    out: list[tuple[tuple[str, ...], Any]] = []
    for path, old, new in _differences(published, again, ()):
        if (len(path) == 3 and path[0] == "callbacks" and path[1].startswith(_CALLBACK_PREFIX)
                and _path_value(old) and _path_value(new)):
            out.append((path, new))
            continue
        where = ".".join(path) or "(the checkpoint)"
        raise GenerationExists(
            f"Lightning saved a different state at the global step of {generation}, which is already published "
            f"({where}: {_short(old)}, now {_short(new)}). A generation holds one state per update "
            "and is never overwritten; save once per global step (trainer.save_checkpoint after fit saves at the "
            "step ModelCheckpoint already saved), or save with another CheckpointIO.")
    return tuple(out)


class _Absent:
    def __str__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _differences(a: Any, b: Any, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any, Any]]:
    if type(a) is dict and type(b) is dict:
        keys = list(a) + [k for k in b if k not in a]
        return [d for k in keys for d in _differences(a.get(k, _ABSENT), b.get(k, _ABSENT), path + (str(k),))]
    if type(a) is list and type(b) is list and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, path + (str(i),))]
    return [] if type(a) is type(b) and a == b else [(path, a, b)]


def apply_overrides(checkpoint: dict[str, Any], overrides: tuple[tuple[tuple[str, ...], Any], ...],
                    where: str) -> None:
    """Put an entry's path bookkeeping into the loaded checkpoint; a path that no longer fits is refused."""
    for path, value in overrides:
        node = checkpoint
        for key in path[:-1]:
            node = node.get(key) if type(node) is dict else None
        if type(node) is not dict or path[-1] not in node or not _path_value(node[path[-1]]):
            raise CorruptGeneration(where, f"override {'.'.join(path)} does not fit the generation it names")
        node[path[-1]] = value
