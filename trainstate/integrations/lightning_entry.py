"""The files Lightning sees at its checkpoint paths: entries, the links beside them, what one step may save twice.

No Lightning import. Everything up to the "On disk" section is pure logic;
that section writes, links, reads and removes these files, each change
atomic and durable (fsynced, with its directory). A ``.ckpt`` written by
:class:`~trainstate.integrations.lightning.TrainStateCheckpointIO` is not a
pickle but a few hundred bytes of JSON naming a trainstate generation::

    {"format": "trainstate-lightning-checkpoint", "format_version": 1,
     "run": "." , "generation": "gen-000000000020", "manifest_digest": "…",
     "next_update": 20, "overrides": [[["callbacks", "ModelCheckpoint{…}", "last_model_path"], "/…/last.ckpt"]]}

Beside the entries, one symbolic link per checkpoint directory,
``last.trainstate-gen-<step>.ckpt`` (:func:`bridge_name`), names the run's
newest generation: ModelCheckpoint's search for ``ckpt_path="last"`` takes it
for a last checkpoint, and it exists exactly when that generation does (see
``TrainStateCheckpointIO``'s docstring for why).

``run`` is the run directory relative to the entry's own directory, so a
checkpoint folder moved as a whole still resolves. ``overrides`` carry what
the second save of a global step changed: ModelCheckpoint saves the top-k
file and then ``last.ckpt`` from the same state, having updated only its own
path bookkeeping (``last_model_path``) in between. That second save becomes
an entry naming the first save's generation, with the changed paths here,
instead of a second generation of the same tensors.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CorruptGeneration, GenerationExists, GenerationNotFound, InvalidArgument
from ..format import strictjson
from ..format.manifest import generation_name, parse_generation_name
from ..storage.posix import PosixOps

FORMAT = "trainstate-lightning-checkpoint"
FORMAT_VERSION = 1
MAX_ENTRY_BYTES = 1 << 20
# ModelCheckpoint's state holds these besides paths; a difference in any of them is a different state.
_CALLBACK_PREFIX = "ModelCheckpoint"
_LAST_RE = re.compile(r"last(-v?\d+)?$")  # ModelCheckpoint.CHECKPOINT_NAME_LAST, with a version suffix
_BRIDGE_RE = re.compile(r"last\.trainstate-(gen-\d{12}(?:-r\d{3})?)\.ckpt")
# The key under which a generation records the entry it was published for (stripped before Lightning sees it).
PUBLISHED_FOR = "trainstate_published_for"
log = logging.getLogger("trainstate")
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}  # a filesystem without symbolic links
TMP = ".trainstate-tmp-"  # the infix of a file or link being written: ".<name>.trainstate-tmp-<hex>"


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


def found_as_last(filename: str) -> bool:
    """Whether ModelCheckpoint's ``ckpt_path="last"`` search takes this file for a candidate.

    Lightning 2.x lists the checkpoint directory and keeps each name whose
    suffix is ``.ckpt`` and whose stem *starts* with ``last`` (``re.match``),
    then the newest existing one by modification time.
    """
    return filename.endswith(".ckpt") and filename[:-len(".ckpt")].startswith("last")


def bridge_name(generation: str) -> str:
    """The link that lets ``ckpt_path="last"`` find ``generation``: a last-checkpoint name ModelCheckpoint never writes.

    ModelCheckpoint writes ``last.ckpt`` and ``last-v1.ckpt``...; its search
    for the last checkpoint also takes ``last.trainstate-gen-….ckpt``.
    """
    return f"last.trainstate-{generation}.ckpt"


def bridged(filename: str) -> str | None:
    """The generation a bridge's name names, or None when ``filename`` is no bridge."""
    match = _BRIDGE_RE.fullmatch(filename)
    return match.group(1) if match else None


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


def referenced_paths(checkpoint: dict[str, Any]) -> list[str]:
    """The checkpoint paths each ModelCheckpoint's saved state refers to: its top-k, best, kth and last paths."""
    callbacks = checkpoint.get("callbacks")
    out: list[str] = []
    for key, state in callbacks.items() if type(callbacks) is dict else ():
        if not (type(key) is str and key.startswith(_CALLBACK_PREFIX) and type(state) is dict):
            continue
        top_k = state.get("best_k_models")
        names = [*(top_k if type(top_k) is dict else ()),
                 *(state.get(k) for k in ("best_model_path", "kth_best_model_path", "last_model_path"))]
        out.extend(name for name in names if type(name) is str and name)
    return out


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


# On disk ---------------------------------------------------------------------
def local_path(path: Any) -> str:
    """``path`` as a local path; an object-store URL is refused, naming how to keep a remote copy."""
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        raise InvalidArgument(f"TrainStateCheckpointIO writes to a local directory, not {text!r}; to keep a remote "
                              "copy, mirror the run directory (CheckpointManager(..., mirror=URL))")
    return text.removeprefix("file://")


def read_entry(target: str) -> Entry:
    """The entry at ``target``: :class:`GenerationNotFound` when there is none, and a pickle is refused unread."""
    try:
        with open(target, "rb") as stream:
            data = stream.read(MAX_ENTRY_BYTES + 1)
    except FileNotFoundError:
        raise GenerationNotFound(f"Checkpoint file not found: {target}") from None
    if not looks_like_entry(data):
        raise CorruptGeneration(target, "is not a trainstate checkpoint entry (a torch.save pickle?); trainstate never "
                                        "unpickles. Load it once with Lightning's TorchCheckpointIO, then save")
    return parse_entry(data, target)


def names(directory: str) -> list[str]:
    """The names in ``directory``, sorted; none when it does not exist."""
    try:
        return sorted(os.listdir(directory))
    except FileNotFoundError:
        return []


def bridge_ahead(generations: list[str], directory: str, run: str, step: int) -> str | None:
    """Before publishing ``gen-<step>``: its link in ``directory``, which dangles until the generation's commit.

    Only where the generation will be published under that plain name (no
    generation at ``step`` yet); a revision is linked once it is published
    (:func:`settle_bridges`), while the link to the generation before it
    still stands.
    """
    if any(parse_generation_name(name) == (step, "full") for name in generations):
        return None
    generation = generation_name(step)
    bridge = os.path.join(directory, bridge_name(generation))
    return bridge if _link(os.path.relpath(os.path.join(run, generation), directory), bridge) else None


def settle_bridges(directory: str, run: str, generation: str) -> None:
    """After an entry is written: the link to ``generation`` (the newest) stays, or is made; older ones go."""
    keep = bridge_name(generation)
    if not os.path.exists(os.path.join(directory, keep)):  # a revision: valid at once, as it is published
        _link(os.path.relpath(os.path.join(run, generation), directory), os.path.join(directory, keep))
    unlink_durably([os.path.join(directory, name) for name in names(directory) if bridged(name) and name != keep])


def last_entry(directory: str) -> str | None:
    """The ``last*.ckpt`` entry ModelCheckpoint's search would pick if no link were there: the newest by mtime."""
    found = []
    for name in names(directory):
        path = os.path.join(directory, name)
        if not found_as_last(name) or bridged(name):
            continue
        try:
            with open(path, "rb") as stream:
                if looks_like_entry(stream.read(MAX_ENTRY_BYTES + 1)):
                    found.append((os.stat(path).st_mtime_ns, path))
        except OSError:  # a directory, a dangling link, or gone meanwhile: no candidate
            continue
    return max(found)[1] if found else None


def _link(source: str, path: str) -> bool:
    """:func:`link_durably`, or False (said once) where the filesystem has no symbolic links: saves go on, and a
    kill between a generation's commit and its ``last.ckpt`` then needs ``ckpt_path=<run directory>`` to resume."""
    try:
        link_durably(source, path)
        return True
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        if not getattr(_link, "warned", False):
            _link.warned = True  # type: ignore[attr-defined]
            log.warning("%s: this filesystem refuses symbolic links (%s), so no last.trainstate-gen-*.ckpt link is "
                        "kept: a kill between a generation's commit and its last.ckpt leaves a run that "
                        "ckpt_path='last' does not find; resume it with ckpt_path=<the run directory>",
                        os.path.dirname(path), exc.strerror)
        return False


def link_durably(source: str, path: str) -> None:
    """Make ``path`` a symbolic link to ``source``: atomically (a temporary link renamed over it) and durably."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}{TMP}{secrets.token_hex(4)}")
    os.symlink(source, tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def unlink_durably(paths: list[str]) -> None:
    """Remove ``paths`` (all in one directory), then fsync that directory."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    if paths:
        fsync_dir(os.path.dirname(paths[0]))


def write_durably(target: str, data: bytes) -> None:
    """Replace ``target`` atomically: a temporary file, fsync, rename, fsync of the directory."""
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(target)}{TMP}{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    """Make the names in ``directory`` (a rename, a link, a removal) durable."""
    PosixOps().fsync_dir(Path(directory))
