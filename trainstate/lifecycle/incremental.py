"""Incremental generations: a save writes the tensors that changed and links the files that did not.

By default (``CheckpointManager(..., full_every=8)``; ``None`` turns it off),
each full generation records the fingerprint of its tensors
(:mod:`trainstate.state.changes`; :func:`take` says which) and lays its
tensors out in files by what changes (:mod:`trainstate.state.parts`). The next
save compares fingerprints with its parent's and *links* each parent file
whose tensors are all unchanged: on a local filesystem a hard link, so the
bytes are stored once, whatever number of generations name them, and are
freed by the filesystem when the last generation naming them is removed
(retention needs no reference counts a crash could tear: the link count is
the filesystem's own). Every generation still lists every file it needs,
with its digests, in its own directory: restore, verify, export, copy, diff
and the mirror read it as any other.

Sharing removes redundancy: one damaged shared file damages every generation
that names it. So every ``N``-th generation along a timeline links nothing
(it writes fresh copies of every file), retention keeps a :func:`fallback`
that shares no file with the newest, and a restore that finds a damaged
shared file falls back past every generation naming it to one with its own
copy. ``shares`` in each manifest records, for each linked file, the
generation that first wrote it, which ``trainstate verify`` and ``ls`` use to
tell what is owned and what is shared.

An object store links by a server-side copy: none of the bytes is uploaded
again, but each generation keeps objects of its own (the store bills them).
A backend that cannot link at all writes the file: the generation is then
self-contained, and correct, but not smaller. A file is linked only from
bytes proven intact, so damage is never passed on to a generation whose
state was whole in memory: a local file by its bytes at every save
(:func:`intact`, :func:`prove`), a server-side copy by the object store
(:meth:`trainstate.storage.objects.ObjectStaging.link`). A file that fails
is written afresh from the live tensors.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import CorruptGeneration, InvalidArgument
from ..format import sharing, tensorfile
from ..format.digest import digest_stream
from ..format.manifest import FileRecord, Manifest, generation_order
from ..format.signing import SigningKey
from ..state import changes, parts
from ..state.changes import Fingerprint
from ..storage import chunked
from ..storage.base import Staging, Store
from ..storage.verify import read_manifest

log = logging.getLogger("trainstate")
DEFAULT_FULL_EVERY = 0  # incremental by default, each part kept in two copies; no generation forced whole
PROBE_EVERY = 8  # with full_every=0: every tensor fingerprinted at the first save of a process, then every 8th


def check_full_every(full_every: int | None) -> int | None:
    """``full_every``: ``None`` (every generation self-contained), 0 (incremental, the default) or N >= 1
    (incremental, and every N-th generation links nothing)."""
    if full_every is None:
        return None
    if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 0:
        raise InvalidArgument(f"full_every must be a whole number of saves >= 0, or None; got {full_every!r}")
    return full_every


@dataclass
class Plan:
    """What one incremental save links and writes, decided before any byte is written."""

    now: dict[str, Fingerprint]
    layout: parts.Layout
    parent: Manifest | None
    depth: int  # generations in a row that link files, ending with the parent (0: the parent links none)
    shares: dict[str, str] = field(default_factory=dict)
    proven: bool = False  # every file ``layout.linked`` names was proven intact (:func:`prove`)
    spares: bool = False  # each part kept in two copies (a spare beside it; see trainstate.format.sharing)
    links: dict[str, str] = field(default_factory=dict)  # once proven: file -> the parent's file it links


def origins(manifest: Manifest) -> set[tuple[str, str]]:
    """Where the bytes of each file ``manifest``'s restore reads were first written: (generation, file) pairs
    (a spare is not read). Two generations need the same bytes exactly when these sets meet."""
    return {sharing.origin(manifest.generation, manifest.shares, f.name) for f in manifest.files
            if not sharing.is_spare(f.name)}


def fallback(newest: str | None, manifests: Mapping[str, Manifest], lineage: Collection[str]) -> str | None:
    """The newest ancestor of ``newest`` that shares no file with it, when ``newest`` links any: the generation
    that stays whole whichever single shared file is damaged (``None`` when ``newest`` links nothing).

    Retention keeps it beside ``keep_last`` (:func:`trainstate.lifecycle.retention.plan`), so the fallback a
    damaged shared part needs exists whatever ``full_every`` and ``keep_last`` are: with ``keep_last=2`` and a
    frozen base, two copies of the base are kept (the current span's and the one before), as two self-contained
    generations would hold."""
    top = manifests.get(newest) if newest else None
    if top is None or not top.shares:
        return None
    mine = origins(top)
    older = sorted((n for n in lineage if n != newest and n in manifests and manifests[n].kind == "full"),
                   key=generation_order, reverse=True)
    return next((n for n in older if not origins(manifests[n]) & mine), None)


def fingerprints_of(manifest: Manifest) -> dict[str, dict[str, Fingerprint]]:
    return {file: {n: Fingerprint.from_json(v) for n, v in prints.items()}
            for file, prints in manifest.fingerprints.items()}


def _manifest(store: Store, key: SigningKey | None, name: str | None) -> Manifest | None:
    if name is None:
        return None
    try:
        return read_manifest(store, name, None, key)[0]
    except (OSError, CorruptGeneration) as exc:  # pruned, or damaged: this save links nothing from it
        log.info("writing every tensor file: the parent %s cannot be read (%s)", name, exc)
        return None


def depth(store: Store, key: SigningKey | None, manifest: Manifest, limit: int) -> int:
    """How many generations in a row, ending with ``manifest``, link files (at most ``limit``)."""
    count = 0
    current: Manifest | None = manifest
    while current is not None and current.shares and count < limit:
        count += 1
        current = _manifest(store, key, current.parent)
    return count


def parent_of(store: Store, key: SigningKey | None, parent: str | None, full_every: int,
              known: dict[str, tuple[Manifest, int]] | None = None) -> tuple[Manifest | None, int, bool]:
    """The parent's manifest (``None`` when it cannot be read or has no fingerprints: an older format, or saved
    without ``full_every``), how many generations in a row ending with it link files, and whether the next
    generation may link: not when the ``full_every - 1`` before it all did (it is then self-contained).
    ``known``: manifests this process published, with their depth, by name (read from the store otherwise)."""
    if known is not None and parent in known:
        manifest, chain = known[parent]
    else:
        manifest = _manifest(store, key, parent)
        chain = depth(store, key, manifest, full_every) if manifest is not None else 0
    if manifest is not None and manifest.digest_algorithm != store.digest_algorithm:
        log.info("writing every tensor file: the parent %s digests with %s, this run with %s", parent,
                 manifest.digest_algorithm, store.digest_algorithm)  # a linked file keeps its own digests
        manifest = None
    if manifest is not None and not manifest.fingerprints:
        manifest = None
    return manifest, chain, manifest is not None and (full_every == 0 or chain + 1 < full_every)


def probing(saves: int, full_every: int) -> bool:
    """Whether the ``saves``-th incremental save of a process (from 0) probes: the first, then every
    ``full_every``-th (``PROBE_EVERY``-th with 0). The first of a process has no fingerprints of its own to go
    by, and the save after it lays out in parts what did not change between the two."""
    return saves % (full_every or PROBE_EVERY) == 0


def take(tensors: Mapping[str, torch.Tensor], previous: Mapping[str, Mapping[str, Fingerprint]] | None,
         probe: bool) -> dict[str, Fingerprint]:
    """The fingerprints a save takes before it writes: every tensor's when it ``probe``s (:func:`probing`), else
    those of the tensors the parent recorded one for and of every small one. The parent records none for a
    large tensor that had changed when it was last compared (:func:`recorded`), nor for one nobody compared
    yet: it is written whole without a pass over its bytes. So a state whose every tensor changes (full
    fine-tuning, pretraining) pays the pass in about 2 saves in ``full_every`` (the probe and the save after
    it, which compares), and a tensor that stops changing is found then and laid out in a part. Skipping a
    pass never skips a write: a tensor without a fingerprint is always written whole."""
    if probe:
        return changes.fingerprints(tensors)
    before = parts.flatten(previous) if previous else {}
    return changes.fingerprints({n: t for n, t in tensors.items() if n in before or t.nbytes < parts.SMALL_BYTES})


def recorded(now: Mapping[str, Fingerprint], previous: Mapping[str, Mapping[str, Fingerprint]] | None,
             sizes: Mapping[str, int]) -> dict[str, Fingerprint]:
    """The fingerprints a generation records: those taken, less a large tensor's whose bytes changed since the
    parent (the next save then skips its pass: :func:`take`). One whose dtype or shape changed (a restore at
    another world size reshards it) is recorded: that is no sign it keeps changing."""
    before = parts.flatten(previous) if previous else {}

    def kept(name: str, fp: Fingerprint) -> bool:
        old = before.get(name)
        return sizes[name] < parts.SMALL_BYTES or old is None or old == fp or (old.dtype, old.shape) != (
            fp.dtype, fp.shape)

    return {n: fp for n, fp in now.items() if kept(n, fp)}


def plan(store: Store, key: SigningKey | None, tensors: dict[str, torch.Tensor], parent: str | None,
         full_every: int, now: dict[str, Fingerprint] | None = None,
         known: dict[str, tuple[Manifest, int]] | None = None, probe: bool = True, fresh: bool = False,
         frozen: Collection[str] = ()) -> Plan:
    """Read the parent's manifest (:func:`parent_of`), fingerprint ``tensors`` (:func:`take`; ``now``: every
    tensor's, taken already) and lay the generation out (see :mod:`trainstate.state.parts`), each part with a
    spare. ``fresh``: link nothing (the save after one whose verification failed writes every file from the
    live tensors). ``frozen``: tensors of parameters that do not require gradients (the first layout's guide)."""
    manifest, chain, link = parent_of(store, key, parent, full_every, known)
    return lay_out(tensors, manifest, link and not fresh, chain, probe, now, frozen=frozen, spares=True)


def lay_out(tensors: Mapping[str, torch.Tensor], manifest: Manifest | None, link: bool, depth: int, probe: bool,
            now: dict[str, Fingerprint] | None = None, main: str = parts.TENSORS, prefix: str = "part-",
            frozen: Collection[str] = (), spares: bool = False) -> Plan:
    """The plan of a save whose parent's manifest is ``manifest``: its fingerprints (:func:`take`, unless ``now``
    holds every tensor's), the layout over the parent's files named ``main`` and ``prefix``* (a multi-rank
    shard's own), and what the generation records (:func:`recorded`). ``spares``: each part in two copies."""
    previous = None
    if manifest is not None:
        previous = {f: p for f, p in fingerprints_of(manifest).items() if f == main or f.startswith(prefix)}
    now = now if now is not None else take(tensors, previous, probe)
    sizes = {n: t.nbytes for n, t in tensors.items()}
    layout = parts.plan(now, sizes, previous, link=link, main=main, prefix=prefix, frozen=frozen)
    return Plan(recorded(now, previous, sizes), layout, manifest if link else None, depth, spares=spares)


def intact(store: Store, manifest: Manifest, file: str) -> bool:
    """Whether ``manifest``'s local file still holds what was recorded, proven by its bytes before a save links
    it: a file damaged since it was written would otherwise pass its damage on to a generation whose state was
    whole in memory.

    Under a chunked digest the header's chunk is checked against its digest and every tensor's bytes against
    its XXH3 fingerprint (memory speed, from the page cache); under a whole-file digest, the whole file. At every
    save: bit rot moves neither a file's size nor its modification time, so nothing short of its bytes tells
    that it still holds them. An object store's file is proven where it is copied
    (:meth:`trainstate.storage.objects.ObjectStaging.link`): the copy, not the source, becomes the new
    generation's file.
    """
    if getattr(store, "remote", False):
        return True
    record, where = manifest.file(file), f"{manifest.generation}/{file}"
    try:
        opened = store.open(manifest.generation, file)
    except OSError as exc:  # gone (a node-local tier that never held it, a prune): written afresh
        log.info("not linking %s: %s", where, exc)
        return False
    try:
        with opened as stream:
            fd = chunked.positional(stream)
            ok = fd is not None and _holds(stream, fd, manifest, record, where)
    except (CorruptGeneration, ValueError, OSError) as exc:
        log.warning("not linking %s: %s; this save writes the file afresh", where, exc)
        return False
    if not ok:
        log.warning("not linking %s: its bytes no longer match what was recorded when it was written (damaged on "
                    "disk); this save writes the file afresh. Every generation naming it is damaged: "
                    "`trainstate verify` lists them", where)
    return ok


def _holds(stream: Any, fd: int, manifest: Manifest, record: FileRecord, where: str) -> bool:
    if not record.chunks:  # a whole-file digest (blake3, sha256): only the whole file can be checked
        return digest_stream(stream, manifest.digest_algorithm, record.size) == (record.size, record.digest)
    recorded = manifest.fingerprints.get(sharing.twin_of(record.name) if sharing.is_spare(record.name) else record.name)
    if recorded is None:  # a file of a generation without fingerprints (a mirror's holder): every chunk's digest
        chunked.holds(stream, record, where, manifest.digest_algorithm)
        return True
    prints = {n: Fingerprint.from_json(v) for n, v in recorded.items()}
    return _prints(stream, fd, record, where, manifest.digest_algorithm, None) == prints


def prove(store: Store, p: Plan) -> Plan:
    """``p`` with what it links decided (:attr:`Plan.links`), each parent file that becomes one of its parts
    proven intact (:func:`intact`); one that is not is written afresh from the live tensors instead. Before
    the preflight, which counts the bytes the save writes.

    With spares, each part the parent holds unchanged is linked crosswise: the parent's spare becomes the part
    (proven here) and the parent's part the spare (proven when it next becomes a part), so this generation
    and its parent need no copy in common. A part whose spare is missing or damaged is written afresh, the
    parent's part kept as its spare."""
    if p.proven:
        return p
    p.proven = True
    if not p.layout.linked:
        return p
    parent = p.parent
    assert parent is not None
    held = {f.name for f in parent.files}
    links: dict[str, str] = {}
    written = dict(p.layout.written)
    for file in p.layout.linked:
        spare = sharing.spare_of(file)
        if not p.spares:
            if intact(store, parent, file):
                links[file] = file
            else:
                written[file] = tuple(parent.fingerprints[file])
        elif spare in held and intact(store, parent, spare):
            links[file], links[spare] = spare, file
        else:
            written[file], links[spare] = tuple(parent.fingerprints[file]), file
    p.layout = parts.Layout(tuple(f for f in links if not sharing.is_spare(f)), written)
    p.links = links
    return p


def spared(p: Plan, written: Collection[str], main: str, linked: Collection[str]) -> list[str]:
    """Of the parts ``written``, those whose spare is written too (not among the files ``linked``)."""
    return [f for f in written if p.spares and f != main and sharing.spare_of(f) not in linked]


def written_bytes(p: Plan, tensors: Mapping[str, torch.Tensor], main: str = parts.TENSORS) -> int:
    """The tensor bytes the files ``p`` writes hold, spares included (a linked file writes none: a hard link or
    a server-side copy), with a header allowance per tensor as :attr:`trainstate.publish.Pending.estimated_bytes`
    counts."""
    files = [*p.layout.written, *spared(p, p.layout.written, main, p.links)]
    return sum(tensors[n].nbytes + 128 for file in files for n in p.layout.written[file])


def linked_bytes(p: Plan) -> int:
    """The bytes of the parent files ``p`` links."""
    return sum(p.parent.file(source).size for source in p.links.values()) if p.parent is not None else 0


def write(staging: Staging, p: Plan, tensors: dict[str, torch.Tensor], counted: Any, stable: bool,
          store: Store, write_empty: bool = True, total: Callable[[int], Any] | None = None,
          main: str = parts.TENSORS) -> tuple[list[FileRecord], dict[str, Any]]:
    """Link and write the tensor files of ``p`` into ``staging``, each part's spare beside it (linked or
    written); their records and the manifest's format-4/5 fields. A parent file is linked only once proven
    intact (:func:`prove`, here unless done already); one the backend cannot link is written after all.
    ``write_empty=False``: a file left with no tensor is not written (a multi-rank shard whose items are all
    linked). ``total``: told the bytes to be written, once the links are made."""
    prove(store, p)
    records: list[FileRecord] = []
    written = dict(p.layout.written)
    for file, source in p.links.items():
        assert p.parent is not None
        linked = staging.link(file, p.parent.generation, p.parent.file(source))
        if linked is None:  # written after all: a part from the live tensors, a spare beside its part
            if not sharing.is_spare(file):
                written[file] = tuple(p.parent.fingerprints[file])
            continue
        records.append(linked)
        p.shares[file] = sharing.share_value(sharing.origin(p.parent.generation, p.parent.shares, source), file)
    written = {file: names for file, names in written.items() if names or write_empty}
    chosen = {file: {n: tensors[n] for n in names} for file, names in written.items()}
    layouts = {file: tensorfile.plan(chosen[file]) for file in written}
    twice = spared(p, written, main, p.shares)  # (a spare whose link failed is written)
    if total is not None:
        total(sum(layouts[f].size for f in [*written, *twice]))
    for file, layout in layouts.items():
        records.append(staging.write(file, counted(tensorfile.chunks(layout, chosen[file])), stable=stable,
                                     size_hint=layout.size))
        if file in twice:  # the same bytes again, a copy of their own (another inode, another object)
            records.append(staging.write(sharing.spare_of(file), counted(tensorfile.chunks(layout, chosen[file])),
                                         stable=stable, size_hint=layout.size))
    files = {file: names for file, names in written.items()}
    files.update({file: tuple(p.parent.fingerprints[file]) for file in p.shares if not sharing.is_spare(file)}
                 if p.parent else {})
    prints = {file: {n: p.now[n].to_json() for n in names if n in p.now} for file, names in files.items()}
    return records, manifest_fields(prints, p.shares, [r.name for r in records])


def manifest_fields(prints: dict[str, dict], shares: dict[str, str], files: Collection[str] = ()) -> dict[str, Any]:
    """The format-4/5 fields of a manifest whose tensor files hold tensors with fingerprints ``prints`` (file ->
    tensor -> fingerprint), link ``shares`` (file -> where it was first written) and list ``files`` (a spare
    among them needs format 5); none without ``prints``."""
    fmt = sharing.version(prints, shares, files)
    if fmt is None:
        return {}
    return {"fingerprints": prints, "shares": dict(shares), "format_version": fmt}


def unchanged(tensors_now: dict[str, Fingerprint], manifest: Manifest, store: Store | None = None) -> bool:
    """Whether ``manifest`` (format 4) holds exactly these tensors with these values. A tensor it records no
    fingerprint for (:func:`recorded`) is fingerprinted from ``store``'s file, when local; else it counts as
    changed."""
    stored = parts.flatten(fingerprints_of(manifest))
    missing = set(tensors_now) - set(stored)
    if missing and store is not None:
        stored.update(stored_prints(store, manifest, missing))
    return stored == tensors_now


def stored_prints(store: Store, manifest: Manifest, names: Collection[str]) -> dict[str, Fingerprint]:
    """The fingerprints of ``names`` taken from ``manifest``'s local tensor files (header chunk verified); none
    from a file that is remote, gone or damaged."""
    out: dict[str, Fingerprint] = {}
    for file in manifest.fingerprints:
        where = f"{manifest.generation}/{file}"
        try:
            with store.open(manifest.generation, file) as stream:
                fd = chunked.positional(stream)
                if fd is not None and manifest.file(file).chunks:
                    out.update(_prints(stream, fd, manifest.file(file), where, manifest.digest_algorithm, names))
        except (CorruptGeneration, ValueError, OSError) as exc:
            log.info("no stored fingerprints from %s: %s", where, exc)
    return out


def _prints(stream: Any, fd: int, record: FileRecord, where: str, algorithm: str,
            names: Collection[str] | None) -> dict[str, Fingerprint]:
    """The fingerprints of the tensors (``names``, or all) of a local chunked tensor file, its header verified."""
    layout = chunked.verified_header(stream, record, where, algorithm)
    entries = [e for e in layout.entries if names is None or e.name in names]
    if not entries:
        return {}
    with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapped:  # (a tensor file is never empty: it has a header)
        data = np.frombuffer(mapped, np.uint8)
        try:
            return {e.name: changes.of_bytes(data[layout.data_start + e.begin:layout.data_start + e.end],
                                             str(e.dtype).removeprefix("torch."), tuple(e.shape)) for e in entries}
        finally:
            del data

