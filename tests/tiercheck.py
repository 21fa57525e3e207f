"""Check the node-local tiers' invariants on disk, over every node's directory at once (no process group).

``check(node_dirs)`` returns the violations (strings; empty: fine):

(a) every node's ``latest`` names a generation that the union of the nodes'
    holdings (both tiers) serves whole: every file of its manifest held by
    some node, at its recorded size, under the manifest digest the pointer
    records, and every held copy's bytes verify against the manifest;
(b) every node's ``replicas/latest`` names a generation that stays servable
    whole after any ONE node's directory is removed (each node its own
    failure domain);
(c) no holding is partial or torn: each ``gen-*`` entry of either tier is a
    directory whose manifest parses (names it, self-digest intact) and every
    file it has is listed, at its recorded size and digest. Leftovers of an
    interrupted save or removal (``.trainstate-staging-*``, ``-trash-*``,
    ``-tmp-*``) and copies set aside (``gen-*.rejected-*``) are allowed.

Also: a pointer that does not parse, and one generation name held under two
different manifests (a restore would refuse it), are violations.

The holdings are read with :func:`trainstate.distributed.tiers.holdings`, the
structural view a restore starts from; a file counts as held only where that
view lists it AND the copy's bytes verify (each chunk of a ``blake3-chunked``
file against its chunk digest). ``survey(node_dirs)`` returns what was found
(pointers, holdings, leftovers per tier) for reports.

``check_remote(url, storage_options)`` checks the remote tier behind the
nodes (an object store, read through ``open_store``) on its own, as a restore
after losing every node would read it:

(r1) the remote ``latest``, if there is one, parses and names a generation the
     remote serves whole: committed, its manifest the one the pointer records
     (digest and size), every file present at its size and every byte verified
     (``verify_generation(content=True)``: the state decodes as a restore's);
(r2) no generation the remote lists (``store.generations()``: those a commit
     record names) is partial: each verifies whole in the same way.

Leftovers of an interrupted upload (staging attempts no commit record names,
``store.leftovers()``) and generations set aside are allowed.
``survey_remote`` returns what was found (pointer, generations, leftovers,
aside). Run as a script: ``python tests/tiercheck.py NODE_DIR [NODE_DIR ...]``
(``--remote URL [--options JSON]`` adds the remote check).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trainstate.distributed.tiers import REPLICAS, holdings
from trainstate.errors import CorruptGeneration
from trainstate.format.digest import digest_stream
from trainstate.format.manifest import (MANIFEST, POINTER, Manifest, Pointer, generation_order,
                                        parse_generation_name)
from trainstate.storage import chunked
from trainstate.storage.local import LocalStore
from trainstate.storage.verify import read_manifest, read_pointed, verify_generation

LEFTOVER = re.compile(r"\.trainstate-(staging|trash|tmp)-.+")
ASIDE = re.compile(r"gen-\d{12}(?:-weights|-r\d{3})?\.(rejected|abandoned|superseded)-[0-9a-f]{16}")


@dataclass
class Node:
    """One node directory as found: its pointers, what it holds (verified), its leftovers."""

    path: Path
    pointers: dict = field(default_factory=dict)  # tier -> Pointer or None
    holds: dict = field(default_factory=dict)  # generation -> {"digest", "files": {file: [tiers whose copy verified]}}
    leftovers: dict = field(default_factory=dict)  # tier -> [names]
    aside: dict = field(default_factory=dict)  # tier -> [names]
    manifests: dict = field(default_factory=dict)  # generation -> Manifest


def stores(node_dir: Path) -> dict[str, LocalStore]:
    """The node's two stores, opened without creating anything."""
    return {"own": LocalStore(node_dir, create=False), "replica": LocalStore(node_dir / REPLICAS, create=False)}


def _verify_copy(store: LocalStore, manifest: Manifest, name: str) -> str | None:
    """None when ``store``'s copy of ``name`` has the manifest's size and bytes, else what is wrong."""
    record = manifest.file(name)
    where = f"{store.location}/{manifest.generation}/{name}"
    try:
        with store.open(manifest.generation, name) as stream:
            if record.chunks:
                chunked.verify_file(stream, record, where, manifest.digest_algorithm, workers=1)
                return None
            size, digest = digest_stream(stream, manifest.digest_algorithm, record.size)
    except CorruptGeneration as exc:
        return f"{exc}"
    except OSError as exc:
        return f"{where}: unreadable ({exc})"
    if size != record.size or digest != record.digest:
        return f"{where}: {manifest.digest_algorithm} digest mismatch ({size} bytes, manifest says {record.size})"
    return None


def _scan_tier(node: Node, tier: str, store: LocalStore, violations: list[str]) -> None:
    """(c): every entry of one tier's directory; every file of every holding digested."""
    root = store.root
    node.leftovers[tier], node.aside[tier] = [], []
    try:
        entries = sorted(p.name for p in root.iterdir())
    except FileNotFoundError:
        return
    for name in entries:
        path = root / name
        if LEFTOVER.fullmatch(name):
            node.leftovers[tier].append(name)
            continue
        if ASIDE.fullmatch(name):
            node.aside[tier].append(name)
            continue
        if parse_generation_name(name) is None:  # not a holding: pointers, the run's identity, the lock, timings...
            if name.startswith("gen-"):
                violations.append(f"{path}: neither a holding, a leftover nor a copy set aside")
            continue
        if not path.is_dir() or path.is_symlink():
            violations.append(f"{path}: a generation name that is not a directory")
            continue
        try:
            manifest, digest, _ = read_manifest(store, name, None, None)
            present = store.files(name)
        except (CorruptGeneration, OSError) as exc:
            violations.append(f"{path}: torn holding, its manifest does not read ({exc})")
            continue
        expected = {f.name: f.size for f in manifest.files}
        node.manifests.setdefault(name, manifest)
        entry = node.holds.setdefault(name, {"digest": digest, "files": {}})
        if entry["digest"] != digest:
            violations.append(f"{path}: this node's two tiers hold {name} under different manifests")
            continue
        for file, size in sorted(present.items()):
            if file == MANIFEST:
                continue
            if file not in expected:
                violations.append(f"{path}/{file}: a file its manifest does not list")
            elif size != expected[file]:
                violations.append(f"{path}/{file}: torn, {size} bytes where the manifest records {expected[file]}")
            else:
                problem = _verify_copy(store, manifest, file)
                if problem:
                    violations.append(f"{path}/{file}: held copy does not verify: {problem}")
                else:
                    entry["files"].setdefault(file, []).append(tier)


def survey(node_dirs: list[Path], violations: list[str] | None = None) -> list[Node]:
    """Every node's pointers, verified holdings and leftovers; violations of (c) and of unreadable pointers are
    appended to ``violations``."""
    violations = [] if violations is None else violations
    nodes = []
    for path in node_dirs:
        node = Node(Path(path))
        tiers = stores(node.path)
        for tier, store in tiers.items():
            _scan_tier(node, tier, store, violations)
            if store.read_pointer(POINTER) is not None or (store.root / POINTER).is_symlink():
                pointer = read_pointed(store, POINTER, None)
                if pointer is None:
                    violations.append(f"{store.root / POINTER}: does not parse")
                node.pointers[tier] = pointer
            else:
                node.pointers[tier] = None
        # what a restore sees (structure only): a file our digest pass verified but holdings() leaves out, or the
        # other way round, is a disagreement worth naming
        seen = holdings(tiers, None)
        for name, entry in node.holds.items():
            listed = set(seen.get(name, {}).get("files", {}))
            verified = set(entry["files"])
            if verified - listed:
                violations.append(f"{node.path}: {name}: files {sorted(verified - listed)} verify but holdings() "
                                  "does not list them")
        nodes.append(node)
    return nodes


def coverage(nodes: list[Node], name: str, digest: str, without: int | None = None) -> tuple[list[str], int]:
    """(files of ``name`` that no node, ``without`` left out, holds verified under ``digest``; the file count)."""
    manifest = next((n.manifests[name] for n in nodes if name in n.manifests and n.holds[name]["digest"] == digest),
                    None)
    if manifest is None:
        return [MANIFEST], 1
    held: set[str] = set()
    for index, node in enumerate(nodes):
        if index != without and node.holds.get(name, {}).get("digest") == digest:
            held |= set(node.holds[name]["files"])
    return sorted(f.name for f in manifest.files if f.name not in held), len(manifest.files)


def servable(nodes: list[Node], without: int | None = None) -> list[str]:
    """The generations the nodes (``without`` left out) serve whole, newest first, as a restore would choose."""
    names = sorted({n for node in nodes for n in node.holds}, key=generation_order, reverse=True)
    out = []
    for name in names:
        digests = {node.holds[name]["digest"] for i, node in enumerate(nodes) if name in node.holds and i != without}
        if len(digests) == 1 and not coverage(nodes, name, digests.pop(), without)[0]:
            out.append(name)
    return out


def check(node_dirs: list[Path]) -> list[str]:
    """Every violation of (a), (b), (c) over these node directories (see the module docstring)."""
    violations: list[str] = []
    nodes = survey(node_dirs, violations)
    for name in sorted({n for node in nodes for n in node.holds}):
        digests = {node.holds[name]["digest"] for node in nodes if name in node.holds}
        if len(digests) > 1:
            violations.append(f"{name}: nodes hold it under {len(digests)} different manifests")
    for index, node in enumerate(nodes):
        for tier, pointer in node.pointers.items():
            if pointer is None:
                continue
            where = node.path / REPLICAS / POINTER if tier == "replica" else node.path / POINTER
            name, digest = pointer.generation, pointer.manifest_digest
            missing, count = coverage(nodes, name, digest)
            if missing:  # (a) for latest; a replicas/latest must be whole with every node too
                violations.append(f"{where} names {name}, which the nodes do not serve whole: "
                                  f"{len(missing)} of {count} files held by no node ({', '.join(missing[:4])})")
                continue
            if tier != "replica":
                continue
            for lost in range(len(nodes)):  # (b)
                missing, count = coverage(nodes, name, digest, without=lost)
                if missing:
                    violations.append(f"{where} names {name}, which does not survive losing {nodes[lost].path}: "
                                      f"{len(missing)} of {count} files only there ({', '.join(missing[:4])})")
    return violations


# the remote tier ------------------------------------------------------------------------------------------------
@dataclass
class Remote:
    """The remote tier as found: its ``latest`` (None: no pointer), committed generations (newest first), the
    whole ones among them, leftovers of interrupted uploads and generations set aside."""

    url: str
    pointer: Pointer | None = None
    generations: list = field(default_factory=list)
    whole: list = field(default_factory=list)
    leftovers: list = field(default_factory=list)
    aside: list = field(default_factory=list)


def open_remote(url: str, storage_options: dict | None = None):
    """The remote's store, read the way a restore reads it."""
    from trainstate.storage.locate import open_store

    return open_store(url, storage_options=storage_options)


def survey_remote(url: str, storage_options: dict | None = None, violations: list[str] | None = None) -> Remote:
    """What the remote holds; violations of (r1) and (r2) are appended to ``violations``."""
    violations = [] if violations is None else violations
    store = open_remote(url, storage_options)
    found = Remote(url)
    found.generations = list(store.generations())
    found.leftovers = list(store.leftovers())
    found.aside = list(store.aside())
    for name in found.generations:  # (r2)
        try:
            verify_generation(store, name, content=True)
        except (CorruptGeneration, OSError) as exc:
            violations.append(f"{url}: {name} is listed (committed) but partial or corrupt: {exc}")
        else:
            found.whole.append(name)
    if store.read_pointer(POINTER) is None:
        return found
    found.pointer = read_pointed(store, POINTER, None)
    if found.pointer is None:
        violations.append(f"{url}/{POINTER}: does not parse")
        return found
    name = found.pointer.generation  # (r1)
    if name not in found.generations:
        violations.append(f"{url}/{POINTER} names {name}, which the remote does not serve: no commit record "
                          f"(the remote lists {found.generations[:4]})")
        return found
    try:
        verify_generation(store, name, found.pointer, content=True)
    except (CorruptGeneration, OSError) as exc:
        violations.append(f"{url}/{POINTER} names {name}, which the remote does not serve whole: {exc}")
    return found


def check_remote(url: str, storage_options: dict | None = None) -> list[str]:
    """Every violation of (r1) and (r2) on the remote tier at ``url`` (see the module docstring)."""
    violations: list[str] = []
    survey_remote(url, storage_options, violations)
    return violations


if __name__ == "__main__":
    args, remote_url, options = sys.argv[1:], None, None
    if "--remote" in args:
        at = args.index("--remote")
        remote_url, args = args[at + 1], args[:at] + args[at + 2:]
    if "--options" in args:
        import json

        at = args.index("--options")
        options, args = json.loads(args[at + 1]), args[:at] + args[at + 2:]
    found = check([Path(p) for p in args]) + (check_remote(remote_url, options) if remote_url else [])
    print("\n".join(found) if found else "ok")
    sys.exit(1 if found else 0)
