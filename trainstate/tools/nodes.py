"""A tiered run read from its nodes' directories together: what each holds, what the union serves, what each
pointer claims, and whether every held byte still matches its manifest. No process group, nothing written.

One node's directory holds only part of each generation (its holding), so a
single-directory ``verify`` would call every generation incomplete; the
nodes must be read together (:func:`check_nodes`, ``trainstate nodes DIR...``):

- every held copy of every file is digested against the manifest (chunk by
  chunk for ``blake3-chunked``); a copy that fails is named, node and tier;
- a generation is *servable* when every file of its manifest has an intact
  copy on some node, and *survives the loss of any one node* when that still
  holds with any one directory removed;
- every node's ``latest`` must name a servable generation, every
  ``replicas/latest`` one that survives the loss of any one node (each
  directory is taken as its own failure domain here: the labels are not on
  disk); a pointer that claims more is a failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CorruptGeneration, InvalidArgument
from ..format.digest import digest_stream
from ..format.manifest import POINTER, generation_order
from ..storage import chunked
from ..storage.local import LocalStore
from ..storage.verify import read_manifest, read_pointed

REPLICAS = "replicas"  # as trainstate.distributed.tiers.REPLICAS (not imported: that would import torch.distributed)


@dataclass
class Node:
    location: str
    pointers: dict[str, str | None]  # {"local": ..., "replicated": ...}
    held: dict[str, dict[str, Any]] = field(default_factory=dict)  # gen -> {"digest", "files": {file: tier}}
    damaged: list[str] = field(default_factory=list)


def is_node_directory(directory: str | Path) -> bool:
    """A node-local tier's directory: it has a ``replicas`` store beside its own generations."""
    return (Path(directory) / REPLICAS).is_dir()


def read_node(directory: str | Path, key: Any = None, content: bool = True) -> tuple[Node, dict[str, Any]]:
    """One node: its holdings (every copy digested with ``content``) and pointers; and the manifests by digest."""
    own = LocalStore(directory, create=False)
    if not own.root.is_dir():
        raise InvalidArgument(f"{own.root} is not a directory")
    stores = {"own": own, "replica": LocalStore(own.root / REPLICAS, own.digest_algorithm, create=False)}
    node = Node(own.location, {})
    manifests: dict[str, Any] = {}
    for tier, store in stores.items():
        pointer = read_pointed(store, POINTER, key) if store.root.is_dir() else None
        node.pointers["local" if tier == "own" else "replicated"] = pointer and pointer.generation
        for name in store.generations() if store.root.is_dir() else ():
            try:
                manifest, digest, _ = read_manifest(store, name, None, key)
                present = store.files(name)
            except (CorruptGeneration, OSError) as exc:
                node.damaged.append(f"{store.location}/{name}: {exc}")
                continue
            manifests[digest] = manifest
            entry = node.held.setdefault(name, {"digest": digest, "files": {}})
            if entry["digest"] != digest:
                node.damaged.append(f"{store.location}/{name}: another manifest than {own.location}/{name}")
                continue
            for record in manifest.files:
                if record.name not in present:
                    continue
                problem = _check_copy(store, name, record, manifest.digest_algorithm, present[record.name], content)
                if problem:
                    node.damaged.append(problem)
                else:
                    entry["files"].setdefault(record.name, tier)
    return node, manifests


def _check_copy(store: LocalStore, name: str, record: Any, algorithm: str, size: int | None, content: bool) -> str:
    where = f"{store.location}/{name}/{record.name}"
    if size != record.size:
        return f"{where}: {size} bytes, the manifest says {record.size}"
    if not content:
        return ""
    try:
        with store.open(name, record.name) as stream:
            if record.chunks:
                chunked.verify_file(stream, record, where, algorithm)
                return ""
            got = digest_stream(stream, algorithm, record.size)
    except (CorruptGeneration, OSError) as exc:
        return f"{exc}"
    return "" if got == (record.size, record.digest) else f"{where}: {algorithm} digest mismatch"


def check_nodes(directories: Sequence[str | Path], key: Any = None, content: bool = True) -> dict[str, Any]:
    """Every node read and every claim checked (see the module docstring); ``report["failures"]`` empty when sound."""
    nodes, manifests = [], {}
    for directory in directories:
        node, found = read_node(directory, key, content)
        nodes.append(node)
        manifests.update(found)
    names = sorted({n for node in nodes for n in node.held}, key=generation_order, reverse=True)
    generations = {}
    for name in names:
        digests = {node.held[name]["digest"] for node in nodes if name in node.held}
        if len(digests) > 1:
            generations[name] = {"servable": False, "survives_one_node": False,
                                 "problem": "nodes hold different manifests under this name"}
            continue
        files = [f.name for f in manifests[digests.pop()].files]
        holders = {f: [i for i, node in enumerate(nodes) if f in node.held.get(name, {}).get("files", {})]
                   for f in files}
        lacking = [f for f, where in holders.items() if not where]
        generations[name] = {"servable": not lacking, "lacking": lacking,
                             "survives_one_node": not lacking and all(len(w) > 1 for w in holders.values()),
                             "copies": min((len(w) for w in holders.values()), default=0)}
    failures = [d for node in nodes for d in node.damaged]
    for node in nodes:
        for tier, claim in (("local", "servable"), ("replicated", "survives_one_node")):
            named = node.pointers.get(tier)
            if named is not None and not generations.get(named, {}).get(claim):
                pointer, verdict = (("latest", "cannot serve whole") if tier == "local"
                                    else ("replicas/latest", "lose with one node"))
                failures.append(f"{node.location}: {pointer} names {named}, which the nodes {verdict}")
    return {"nodes": [{"location": n.location, "pointers": n.pointers, "holds": {g: sorted(h["files"])
                                                                                 for g, h in n.held.items()}}
                      for n in nodes], "generations": generations, "failures": failures,
            "recovery_point": next((g for g in names if generations[g]["servable"]), None)}
