"""``CheckpointManager(..., replicas=, node=, failure_domain=, mirror=, mirror_every=)``: the options of node-local
tiers, checked and attached to the manager's multi-rank session (see :mod:`.tiers`)."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgument, InvalidType


def attach(manager: Any, options: dict[str, Any]) -> None:
    """Node-local tiers (``replicas=``): each node its own directory, every node's files on ``replicas`` nodes;
    ``mirror=`` then names the remote tier behind them, written every ``mirror_every``-th generation."""
    replicas, every = options["replicas"], options["mirror_every"]
    replicas = 1 if replicas is None else replicas
    if type(replicas) is not int or replicas < 1:
        raise InvalidArgument(f"replicas must be a positive int (copies of each node's files), got {replicas!r}")
    if type(every) is not int or every < 1:
        raise InvalidArgument(f"mirror_every must be a positive int (upload every N-th generation), got {every!r}")
    if type(options["wait_replicas"]) is not bool:
        raise InvalidType(f"wait_replicas must be a bool, got {type(options['wait_replicas']).__name__}")
    if manager._session is None:
        raise InvalidArgument("replicas=, node=, failure_domain= and mirror_every= are for multi-node runs: "
                              "initialize torch.distributed (torchrun) first; a single process keeps one directory "
                              "(and mirror= uploads every generation)")
    if getattr(manager.store, "remote", False) or not hasattr(manager.store, "root"):
        raise InvalidArgument(f"node-local tiers need a local directory on each node, not {manager.store.location}")
    remote = None
    if options["mirror"] is not None:
        from ..storage.locate import open_store
        from .tierremote import Remote

        store = open_store(options["mirror"], manager.store.digest_algorithm, storage_options=options["mirror_options"])
        if not getattr(store, "remote", False):
            raise InvalidArgument(f"mirror= must be an object-store URL (s3://, gs://, az://), not {store.location}")
        remote = Remote(store, options["mirror_retention"] or manager.retention,
                        every, manager.key)
    manager._clock.on_saved = manager._session.record_blocking  # each save's blocking time, on the node's disk
    manager._session.attach_tier(manager.store, replicas, manager.retention.keep_last, options["node"],
                                 options["failure_domain"], options["wait_replicas"], options["preflight"],
                                 options["headroom"], remote, manager.retention)
    from .tierprune import holding_check

    manager.lifecycle.structure_check = holding_check(manager._session.tier, manager.key)  # pin, best, plan
