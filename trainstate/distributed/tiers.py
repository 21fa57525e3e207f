"""Node-local tiers: which node each rank is on, where replicas go, and what each node holds.

A tiered run (``CheckpointManager(dir, replicas=N)`` under a process group)
gives every node its own directory (node-local NVMe, or a RAM disk such as
``/dev/shm``); no filesystem is shared. Each node keeps two stores:

- ``dir`` (the **local tier**): the generations its own ranks wrote: the
  manifest, the global files (``state.json``, ``tensors.safetensors``,
  DCP's metadata) and its ranks' files, and ``latest``;
- ``dir/replicas`` (the **replicated tier**): copies of other nodes' rank
  files, for the generations this node keeps replicas of, and their own
  ``latest``.

A directory there holds the full manifest but only part of the files: a
*holding*. A holding is committed like any generation (staged, fsynced,
renamed), so a node either holds a file whole, as the manifest records it,
or not at all; every byte is still checked against the manifest's chunk
digests when it is read. A restore unions what every node holds.

Placement (:func:`placement`): each node's files are copied to
``replicas - 1`` other nodes, chosen first from failure domains that hold
no copy yet, then by distance around the ring of nodes (node ``n + 1``,
``n + 2``...), like resiliency-ext's replication jump; with no domains given,
every node is its own domain.

Everything here is pure logic or reads of the node's own disk; the
collectives are in :mod:`.tiersave` and :mod:`.tierload`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptGeneration, InvalidArgument
from ..format.digest import digest_bytes
from ..format.manifest import MANIFEST, POINTER, Manifest, Pointer, parse_generation_name, parse_manifest
from ..format.signing import SigningKey
from ..storage.local import LocalStore
from ..storage.verify import Verified, read_manifest, read_pointed
from .group import Ranks

REPLICAS = "replicas"  # the replicated tier's store, inside the node's directory
GLOBAL_FILES = ("state.json", "tensors.safetensors", "dcp-metadata.json")


@dataclass(frozen=True)
class Topology:
    """Where every rank runs: its node, each node's failure domain, and the node leaders (lowest rank per node)."""

    rank: int
    node_of: tuple[int, ...]  # rank -> node index (0..nodes-1, in order of each node's lowest rank)
    domains: tuple[str, ...]  # node -> failure-domain label

    @property
    def nodes(self) -> int:
        return len(self.domains)

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    @functools.cached_property
    def _members(self) -> tuple[tuple[int, ...], ...]:
        """Each node's ranks, in order: indexed once (rank 0 asks for every node's at restore and refill)."""
        members: list[list[int]] = [[] for _ in range(self.nodes)]
        for r, n in enumerate(self.node_of):
            members[n].append(r)
        return tuple(tuple(m) for m in members)

    def ranks_on(self, node: int) -> list[int]:
        return list(self._members[node])

    def leader(self, node: int) -> int:
        return self._members[node][0]

    @property
    def is_leader(self) -> bool:
        return self.leader(self.node) == self.rank


@dataclass
class Tier:
    """One node's part of a tiered run: its two stores, the topology and the policy."""

    own: LocalStore
    topology: Topology
    replicas: int
    keep_last: int
    wait_replicas: bool = False
    preflight: bool = True
    headroom: float = 0.05
    remote: Any = None  # a .tierremote.Remote: the object store behind the nodes, or None
    policy: Any = None  # the retention policy (a Retention): milestones, best and pins besides keep_last

    def __post_init__(self) -> None:
        self.replica = replica_store(self.own)
        self.lifecycle: Any = None  # the own store's Lifecycle, made by the first prune

    def stores(self) -> dict[str, LocalStore]:
        return {"own": self.own, "replica": self.replica}


def launcher_node(node: Any = None) -> str:
    """This process's node identity: ``node=`` if given, else the launcher's ``GROUP_RANK`` (torchrun), else the
    host name (several ranks on one host are one node)."""
    if node is not None:
        if isinstance(node, bool) or not isinstance(node, (int, str)) or str(node) == "":
            raise InvalidArgument(f"node must be a non-empty str or an int naming this machine, got {node!r}")
        return str(node)
    return os.environ.get("GROUP_RANK") or os.uname().nodename


def discover(ranks: Ranks, node: Any = None, failure_domain: Any = None) -> Topology:
    """Gather every rank's node identity and failure domain (collective); nodes are numbered in the order of
    their lowest rank."""
    if failure_domain is not None and (not isinstance(failure_domain, str) or not failure_domain):
        raise InvalidArgument(f"failure_domain must be a non-empty str (a rack, a zone), got {failure_domain!r}")
    mine = [launcher_node(node), failure_domain]
    every = ranks.all_gather(mine, "topology")
    order: dict[str, int] = {}
    for ident, _ in every:
        order.setdefault(ident, len(order))
    domains: dict[int, str] = {}
    for rank, (ident, domain) in enumerate(every):
        label = domain if domain is not None else f"node:{ident}"
        if domains.setdefault(order[ident], label) != label:
            raise InvalidArgument(f"ranks of node {ident!r} name different failure domains ({domains[order[ident]]!r} "
                                  f"and {label!r} on rank {rank}); pass the same failure_domain on every rank of a "
                                  "node")
    return Topology(ranks.rank, tuple(order[i] for i, _ in every), tuple(domains[n] for n in range(len(order))))


def placement(domains: tuple[str, ...] | list[str], replicas: int) -> list[list[int]]:
    """For each node, the other nodes that keep a replica of its files (``replicas - 1`` of them, fewer when there
    are not enough nodes). Nodes of failure domains that hold no copy yet come first; among those, the node keeping
    the fewest replicas so far, then the nearest on the ring of nodes. A pure function of the domains, the same on
    every rank; every node keeps about ``replicas - 1`` nodes' files."""
    nodes = len(domains)
    kept = [0] * nodes  # replicas each node keeps so far: spread them, so every node needs the same room
    out = []
    for source in range(nodes):
        chosen: list[int] = []
        used = {domains[source]}
        ring = [(source + step) % nodes for step in range(1, nodes)]
        while len(chosen) < min(replicas - 1, nodes - 1):
            open_ = [n for n in ring if n not in chosen]
            fresh = [n for n in open_ if domains[n] not in used] or open_
            pick = min(fresh, key=lambda n: (kept[n], ring.index(n)))
            chosen.append(pick)
            kept[pick] += 1
            used.add(domains[pick])
        out.append(chosen)
    return out


def single_domain_shards(domains: tuple[str, ...] | list[str], replicas: int) -> list[int]:
    """The nodes whose every copy lies in one failure domain although another domain exists (empty when placement
    spreads each node's copies over at least two domains wherever the run has two)."""
    if len(set(domains)) < 2:
        return []
    return [n for n, targets in enumerate(placement(domains, replicas))
            if len({domains[n], *(domains[t] for t in targets)}) < 2]


def rank_files(manifest: Manifest, rank: int) -> list[str]:
    """The files rank ``rank`` wrote (its records and shards), without the global files every node keeps."""
    return [f for f in manifest.ranks[rank] if f not in GLOBAL_FILES]


def replica_store(store: LocalStore) -> LocalStore:
    return LocalStore(store.root / REPLICAS, store.digest_algorithm)


def holdings(stores: dict[str, LocalStore], key: SigningKey | None) -> dict[str, dict]:
    """What this node holds: ``{generation: {"digest", "run", "update", "lineage", "files": {file: [size, tier]}}}``
    over both tiers. A holding whose manifest does not parse (or whose digest differs between the tiers) is left out:
    it cannot be trusted to say what its files are."""
    out: dict[str, dict] = {}
    for tier, store in stores.items():
        for name in store.generations():
            if parse_generation_name(name) is None or parse_generation_name(name)[1] != "full":
                continue
            try:
                manifest, digest, _ = read_manifest(store, name, None, key)
                present = store.files(name)
            except (CorruptGeneration, OSError):
                continue
            expected = {f.name: f.size for f in manifest.files}
            entry = out.setdefault(name, {"digest": digest, "run": manifest.run, "update": manifest.next_update,
                                          "tier": tier, "count": len(manifest.files), "files": {},
                                          "lineage": manifest.lineage})
            if entry["digest"] != digest:
                continue
            for file, size in present.items():
                if file in expected and size == expected[file]:
                    entry["files"].setdefault(file, [size, tier])
    return out


def pointed(store: LocalStore, key: SigningKey | None) -> Pointer | None:
    return read_pointed(store, POINTER, key)


# bytes between ranks --------------------------------------------------------------------------------------
def broadcast_bytes(ranks: Ranks, data: bytes | None, source: int, phase: str, room: int = 64 << 10) -> bytes:
    """``source``'s bytes on every rank: one round when they fit in ``room`` (a manifest does, but for a run of
    thousands of files), else a second of their exact size (:meth:`Ranks.broadcast_bytes`)."""
    return ranks.broadcast_bytes(data, source, phase, room)


def node_files(manifest: Manifest, ranks_on_node: list[int]) -> list[str]:
    """What a node holds of a generation: the global files and its ranks' files."""
    present = {f.name for f in manifest.files}
    return [f for f in GLOBAL_FILES if f in present] + [f for r in ranks_on_node if r < len(manifest.ranks)
                                                          for f in rank_files(manifest, r)]


def verified_from(manifest: Manifest, manifest_bytes: bytes) -> Verified:
    """A manifest checked where it was parsed (digest, signature), with the digest and size of its bytes."""
    return Verified(manifest, digest_bytes(manifest.digest_algorithm, manifest_bytes), len(manifest_bytes))


def parse_shared_manifest(data: bytes, name: str, digest: str, key: SigningKey | None) -> Manifest:
    """A manifest handed over by another rank, checked against the digest its holders reported."""
    manifest = parse_manifest(data, f"{name}/{MANIFEST}", key)
    if digest_bytes(manifest.digest_algorithm, data) != digest or manifest.generation != name:
        raise CorruptGeneration(f"{name}/{MANIFEST}", "differs from the manifest its holders reported")
    return manifest
