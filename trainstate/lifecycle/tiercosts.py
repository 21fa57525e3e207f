"""What node-local tiers add to a run's storage bill: pure arithmetic, no I/O (``trainstate cost NODE_DIR``).

A tiered run (``CheckpointManager(node_dir, replicas=, mirror=, mirror_every=)``)
keeps its generations in three places, and each is paid differently:

- **Local tier** (each node's own disk or RAM disk): no bill per GB, but a
  capacity every node must have: ``keep_last`` generations of its own holding
  and of the replicas it keeps, plus one more being written before the oldest
  is pruned: ``(keep_last + 1) x (own + replicas held)``.
- **Replicated tier**: every save sends each node's files to ``replicas - 1``
  other nodes. Placement puts a copy in a failure domain that holds none yet
  first, so ``min(replicas - 1, domains - 1)`` of those copies cross a domain
  boundary (a zone: billed per GB by most clouds, in and out); the others stay
  inside one domain (not billed). The generation's bytes stand in for a
  node's files: the manifest and global files, a few KiB, are counted with them.
- **Remote tier** (the object store): only every ``mirror_every``-th save is
  uploaded, and it keeps its own ``remote_keep`` generations; priced with
  :mod:`.costs` at that cadence. A restore reads it only when the nodes cannot
  serve (every node, or a node and every holder of its replicas, lost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidArgument
from .costs import GB, MONTH_S, KindFigures, TierRates


@dataclass(frozen=True)
class Tiering:
    """How the run is tiered, as its nodes recorded it (``tier-timings.json``'s ``config``)."""

    nodes: int
    ranks: int
    domains: int
    replicas: int
    keep_last: int
    mirror_every: int  # 0: no remote tier
    remote_keep: int

    def __post_init__(self) -> None:
        if min(self.nodes, self.ranks, self.domains, self.replicas, self.keep_last) < 1 or self.mirror_every < 0:
            raise InvalidArgument(f"a tiering needs at least one node, rank, domain, replica and kept generation, "
                                  f"got {self}")


@dataclass(frozen=True)
class NodeVolumes:
    """A month of a tiered run, before prices: capacity per node, replication traffic, uploads."""

    own_bytes: int  # this node's holding of the newest generation
    replica_bytes: int  # other nodes' files this node keeps for that generation
    node_capacity_bytes: int  # (keep_last + 1) x (own + replicas): what the local tier needs on this node
    saves_per_month: float
    replicated_gb: float  # sent to replicas per month, over every node
    cross_domain_gb: float  # of which between failure domains
    uploads_per_month: float


@dataclass(frozen=True)
class ReplicationCost:
    """The cross-domain traffic priced on one tier of the rates file (``--replication-tier``): in and out."""

    tier: str
    transfer: float


def node_volumes(tiering: Tiering, full: KindFigures, own_bytes: int, replica_bytes: int) -> NodeVolumes:
    """The local and replicated tiers' month for one node (see the module docstring).

    >>> t = Tiering(nodes=4, ranks=8, domains=2, replicas=3, keep_last=2, mirror_every=4, remote_keep=2)
    >>> f = KindFigures("full", size_bytes=8 * GB, files=9, interval_s=MONTH_S / 100, updates_per_save=10, keep=2)
    >>> v = node_volumes(t, f, own_bytes=2 * GB, replica_bytes=4 * GB)
    >>> v.node_capacity_bytes == 18 * GB, v.replicated_gb, v.cross_domain_gb, v.uploads_per_month
    (True, 1600.0, 800.0, 25.0)
    """
    saves = MONTH_S / full.interval_s
    copies = tiering.replicas - 1
    crossing = min(copies, tiering.domains - 1)
    replicated = saves * full.size_bytes * copies / GB
    return NodeVolumes(own_bytes=own_bytes, replica_bytes=replica_bytes,
                       node_capacity_bytes=(tiering.keep_last + 1) * (own_bytes + replica_bytes),
                       saves_per_month=saves, replicated_gb=replicated,
                       cross_domain_gb=replicated * crossing / copies if copies else 0.0,
                       uploads_per_month=saves / tiering.mirror_every if tiering.mirror_every else 0.0)


def remote_figures(tiering: Tiering, full: KindFigures) -> KindFigures:
    """The remote tier's save cadence and retention: one upload every ``mirror_every`` saves, ``remote_keep``
    kept; what :func:`.costs.estimate` prices on the object-store tiers."""
    if not tiering.mirror_every:
        raise InvalidArgument("this run has no remote tier (no mirror=): nothing is stored on an object store")
    every = full.updates_per_save * tiering.mirror_every if full.updates_per_save else None
    return KindFigures(kind="full", size_bytes=full.size_bytes, files=full.files,
                       interval_s=full.interval_s * tiering.mirror_every, updates_per_save=every,
                       keep=max(1, tiering.remote_keep), size_source=full.size_source,
                       interval_source=f"{full.interval_source}, x {tiering.mirror_every} (mirror_every)")


def replication_cost(volumes: NodeVolumes, rates: TierRates) -> ReplicationCost:
    """Cross-domain replication priced per GB, sent (``per_gb_out``) and received (``per_gb_in``)."""
    transfer = volumes.cross_domain_gb * (rates.per_gb_in + rates.per_gb_out)
    if not math.isfinite(transfer):
        raise InvalidArgument(f"{rates.name}: the replication transfer price is not finite")
    return ReplicationCost(rates.name, transfer)


__all__ = ["NodeVolumes", "ReplicationCost", "Tiering", "node_volumes", "remote_figures", "replication_cost"]
