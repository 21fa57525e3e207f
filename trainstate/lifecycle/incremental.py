"""Incremental generations: a save writes the tensors that changed and links the files that did not.

With ``CheckpointManager(..., full_every=N)``, each full generation records
the fingerprint of every tensor (:mod:`trainstate.state.changes`) and lays its
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
(it writes fresh copies of every file), and a restore that finds a damaged
shared file falls back past every generation naming it to one with its own
copy. ``shares`` in each manifest records, for each linked file, the
generation that first wrote it, which ``trainstate verify`` and ``ls`` use to
tell what is owned and what is shared.

An object store links by a server-side copy: none of the bytes is uploaded
again, but each generation keeps objects of its own (the store bills them).
A backend that cannot link at all writes the file: the generation is then
self-contained, and correct, but not smaller. Before a local file is
linked it is checked (:func:`intact`), so damage on disk is never passed on
to a generation whose state was whole in memory.
"""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import CorruptGeneration
from ..format import tensorfile
from ..format.digest import digest_stream
from ..format.manifest import INCREMENTAL_VERSION, FileRecord, Manifest
from ..format.signing import SigningKey
from ..state import changes, parts
from ..state.changes import Fingerprint
from ..storage import chunked
from ..storage.base import Staging, Store
from ..storage.verify import read_manifest

log = logging.getLogger("trainstate")


@dataclass
class Plan:
    """What one incremental save links and writes, decided before any byte is written."""

    now: dict[str, Fingerprint]
    layout: parts.Layout
    parent: Manifest | None
    written_bytes: int
    depth: int  # generations in a row that link files, ending with the parent (0: the parent links none)
    shares: dict[str, str] = field(default_factory=dict)


_WARNED: set[tuple[int, int]] = set()


def warn_short_retention(keep_last: int, full_every: int) -> None:
    """Once per process and setting: with ``keep_last <= full_every`` every kept generation may name the same
    part files, and one damaged part would leave no generation with its own copy to fall back to."""
    if keep_last > full_every or (keep_last, full_every) in _WARNED:
        return
    _WARNED.add((keep_last, full_every))
    log.warning("keep_last=%d with full_every=%d: every kept generation may link the same part files, so one damaged "
                "part would leave no fallback with its own copy. Keep more than full_every generations (keep_last=%d), "
                "or save a self-contained one more often", keep_last, full_every, full_every + 1)


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
    if manifest is not None and not manifest.fingerprints:
        manifest = None
    return manifest, chain, manifest is not None and chain + 1 < full_every


def plan(store: Store, key: SigningKey | None, tensors: dict[str, torch.Tensor], parent: str | None,
         full_every: int, now: dict[str, Fingerprint] | None = None,
         known: dict[str, tuple[Manifest, int]] | None = None) -> Plan:
    """Fingerprint ``tensors``, read the parent's (:func:`parent_of`), and lay the generation out (see
    :mod:`trainstate.state.parts`)."""
    now = now if now is not None else changes.fingerprints(tensors)
    manifest, chain, link = parent_of(store, key, parent, full_every, known)
    previous = fingerprints_of(manifest) if manifest is not None else None
    layout = parts.plan(now, {n: t.nbytes for n, t in tensors.items()}, previous, link=link)
    written = sum(tensors[n].nbytes for names in layout.written.values() for n in names)
    return Plan(now, layout, manifest if link else None, written, chain)


def intact(store: Store, manifest: Manifest, file: str, checked: dict[tuple[int, int], tuple[int, int]]) -> bool:
    """Whether ``manifest``'s local file still holds what was recorded, before a save links it: a file damaged
    since it was written would otherwise pass its damage on to a generation whose state was whole in memory.

    Under ``blake3-chunked`` the header's chunk is checked against its digest and every tensor's bytes against
    its XXH3 fingerprint (memory speed, from the page cache); under a whole-file digest, the whole file.
    ``checked``: files this process already found intact, by device and inode, with their size and
    modification time then: a file checked once is not read again until one of them moves (a write moves the
    modification time). A remote file is not read (that would download it): the server copies its own bytes,
    and a restore checks every chunk.
    """
    record, where = manifest.file(file), f"{manifest.generation}/{file}"
    try:
        opened = store.open(manifest.generation, file)
    except OSError as exc:  # gone (a node-local tier that never held it, a prune): written afresh
        log.info("not linking %s: %s", where, exc)
        return False
    with opened as stream:
        fd = chunked.positional(stream)
        if fd is None:
            return True
        st = os.fstat(fd)
        if checked.get((st.st_dev, st.st_ino)) == (st.st_size, st.st_mtime_ns):
            return True
        try:
            ok = _holds(stream, fd, manifest, record, where)
        except (CorruptGeneration, ValueError, OSError) as exc:
            log.warning("not linking %s: %s", where, exc)
            return False
    if ok:
        checked[(st.st_dev, st.st_ino)] = (st.st_size, st.st_mtime_ns)
    else:
        log.warning("not linking %s: its bytes no longer match what was recorded when it was written (damaged on "
                    "disk); this save writes the file afresh. Every generation naming it is damaged: "
                    "`trainstate verify` lists them", where)
    return ok


def _holds(stream: Any, fd: int, manifest: Manifest, record: FileRecord, where: str) -> bool:
    if not record.chunks:  # a whole-file digest (blake3, sha256): only the whole file can be checked
        return digest_stream(stream, manifest.digest_algorithm, record.size) == (record.size, record.digest)
    prints = {n: Fingerprint.from_json(v) for n, v in manifest.fingerprints[record.name].items()}
    layout = chunked.verified_header(stream, record, where, manifest.digest_algorithm)
    if {e.name for e in layout.entries} != set(prints):
        return False
    with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapped:  # (a tensor file is never empty: it has a header)
        data = np.frombuffer(mapped, np.uint8)
        try:
            return all(changes.of_bytes(data[layout.data_start + e.begin:layout.data_start + e.end],
                                        str(e.dtype).removeprefix("torch."), tuple(e.shape)) == prints[e.name]
                       for e in layout.entries)
        finally:
            del data


def write(staging: Staging, p: Plan, tensors: dict[str, torch.Tensor], counted: Any, stable: bool,
          store: Store, checked: dict[tuple[int, int], tuple[int, int]],
          write_empty: bool = True) -> tuple[list[FileRecord], dict[str, Any]]:
    """Link and write the tensor files of ``p`` into ``staging``; their records and the manifest's format-4
    fields. A file the backend cannot link, or that no longer holds what was recorded (:func:`intact`), is
    written after all. ``write_empty=False``: a file left with no tensor is not written (a multi-rank shard
    whose items are all linked)."""
    records: list[FileRecord] = []
    written = dict(p.layout.written)
    for file in p.layout.linked:
        assert p.parent is not None
        linked = staging.link(file, p.parent.generation, p.parent.file(file)) if intact(
            store, p.parent, file, checked) else None
        if linked is None:
            written[file] = tuple(p.parent.fingerprints[file])
            continue
        records.append(linked)
        p.shares[file] = p.parent.shares.get(file, p.parent.generation)  # where its bytes were first written
    written = {file: names for file, names in written.items() if names or write_empty}
    for file, names in written.items():
        chosen = {n: tensors[n] for n in names}
        layout = tensorfile.plan(chosen)
        records.append(staging.write(file, counted(tensorfile.chunks(layout, chosen)), stable=stable,
                                     size_hint=layout.size))
    files = {file: names for file, names in written.items()}
    files.update({file: tuple(p.parent.fingerprints[file]) for file in p.shares} if p.parent else {})
    prints = {file: {n: p.now[n].to_json() for n in names} for file, names in files.items()}
    return records, manifest_fields(prints, p.shares)


def manifest_fields(prints: dict[str, dict], shares: dict[str, str]) -> dict[str, Any]:
    """The format-4 fields of a manifest whose tensor files hold tensors with fingerprints ``prints`` (file ->
    tensor -> fingerprint) and link ``shares`` (file -> the generation that wrote it); none without ``prints``."""
    if not prints:
        return {}
    return {"fingerprints": prints, "shares": dict(shares), "format_version": INCREMENTAL_VERSION}


def unchanged(tensors_now: dict[str, Fingerprint], manifest: Manifest) -> bool:
    """Whether ``manifest`` (format 4) holds exactly these tensors with these values."""
    return parts.flatten(fingerprints_of(manifest)) == tensors_now

