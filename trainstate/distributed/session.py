"""A manager's multi-rank mode: what ``save`` and ``restore`` do when a process group is initialized.

The manager keeps its single-process shape (prepare at the boundary, an
optional owned copy for a background save, publish on the caller's thread or
the writer's); this class supplies the multi-rank version of each step.
Every method is collective: all ranks call it at the same update boundary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

from ..state.staging import tensor_leaves
from ..errors import CheckpointFailed, InvalidArgument, TrainStateError
from ..format.manifest import generation_name
from ..lifecycle.generations import new_timeline
from ..format.manifest import check_metrics
from ..publish import Pending
from ..records import GenerationInfo, RestoreInfo
from ..errors import Rejection
from ..state.train_state import TrainState
from . import commit, load
from .capture import RankSnapshot, capture, sharded_state
from .group import DEFAULT_TIMEOUT_S, Ranks, checkpoint_groups
from .increments import RankIncrements

log = logging.getLogger("trainstate")


@dataclass
class DistPending(Pending):
    """A prepared multi-rank generation: this rank's share besides the manifest fields."""

    snap: RankSnapshot | None = None
    increment: Any = None  # full_every: what this rank's shard may link (increments.ShardPlan)
    manifest: Any = None  # the committed manifest (rank 0's; elsewhere this rank's view, or as every rank parsed it)
    linked: bool | None = None  # whether any rank's file in it is linked (rank 0's word; None: read the manifest)
    own: Any = None  # full_every: this rank's files as it wrote them (increments.rank_view), prints included

    def changed_bytes(self, manifest: Any, store: Any = None) -> None:
        """Unknown until written: the shards' bytes exist only once DCP has planned and written them, so
        rank 0 compares every rank's staged file digests with ``manifest``'s before the commit."""
        return None


def initialized(process_group: Any) -> bool:
    return process_group is not None or (dist.is_available() and dist.is_initialized())


class Session:
    """The checkpoint groups of one manager, and the multi-rank steps of save and restore."""

    def __init__(self, process_group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S, full_every: int | None = None):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise InvalidArgument(f"collective_timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.fg, self.bg = checkpoint_groups(process_group, float(timeout_s))
        self.tier: Any = None  # node-local tiers (attach_tier), or None: one directory every rank shares
        self.increments = None if full_every is None else RankIncrements(full_every)  # shards by what changes

    def attach_tier(self, store: Any, replicas: int, keep_last: int, node: Any, failure_domain: Any,
                    wait_replicas: bool, preflight: bool, headroom: float, remote: Any = None,
                    policy: Any = None) -> None:
        """Node-local tiers: each node's ranks share ``store``, a directory no other node sees (collective)."""
        from . import tiers

        self.tier = tiers.Tier(store, tiers.discover(self.fg, node, failure_domain), replicas, keep_last,
                               wait_replicas, preflight, headroom, remote, policy)
        topo = self.tier.topology
        if topo.is_leader:
            from . import tiertimes

            tiertimes.configure(store, {"nodes": topo.nodes, "ranks": len(topo.node_of),
                                        "domains": len(set(topo.domains)), "replicas": replicas,
                                        "keep_last": keep_last, "mirror_every": remote.every if remote else 0,
                                        "remote_keep": remote.retention.keep_last if remote else 0})
        single = tiers.single_domain_shards(self.tier.topology.domains, replicas)
        if single:
            log.warning("with replicas=%d the copies of nodes %s all lie in one failure domain", replicas, single)

    @property
    def owns_directory(self) -> bool:
        """Whether this rank locks and cleans the directory: rank 0, or with tiers each node's lowest rank."""
        return self.rank == 0 if self.tier is None else self.tier.topology.is_leader

    @property
    def rank(self) -> int:
        return self.fg.rank

    # saving --------------------------------------------------------------------------------------------
    def prepare(self, manager: Any, state: TrainState, weights_only: bool, include_grads: bool,
                metrics: Mapping[str, float] | None) -> DistPending:
        """Everything this rank contributes, taken at one boundary (collective, on the caller's group)."""
        if include_grads:
            raise InvalidArgument("include_grads=True is not supported in a multi-rank run; save after "
                                  "optimizer.step() (and zero_grad)")
        self.fg.join("save")  # first: a save only some ranks entered fails here in seconds, by name
        error, head = None, None
        if self.rank == 0:
            try:
                manager.store.lock()
                manager._check_same_run(state)
            except TrainStateError as exc:
                error = exc
            if state.lineage is None:
                state.lineage = [[new_timeline(), None]]
            head = state.lineage
        # one round: every rank's report, rank 0's check and its timeline ids (which every rank takes)
        snap, state.lineage = capture(state, self.fg, weights_only=weights_only, head=head, error=error)
        kind = "weights" if weights_only else "full"
        name = generation_name(state.next_update, kind)
        pending = DistPending(name, kind, state.next_update, state.parent, snap.global_skeleton, {}, {
            "data": snap.data if kind == "full" else {}, "metrics": check_metrics(metrics),
            "retention": manager.retention.record(),
            "lineage": [list(e) for e in state.lineage] if kind == "full" else []}, snap)
        if kind == "full":
            state.parent = name
        return pending

    @staticmethod
    def preallocate(writer: Any, state: TrainState) -> int:
        """Every free slot's owned copy of this rank's share of the sharded state (what :meth:`stage` copies into),
        allocated and its pages faulted in; returns their bytes. DCP's state dicts are built, as a save builds them:
        every rank calls it."""
        dcp_state = sharded_state(state)[0]
        total = 0
        for buffers in writer.free_buffers():
            owned = _owned_state(dcp_state)
            for tensor in tensor_leaves(owned):
                if tensor.numel() and tensor.is_contiguous():
                    tensor.view(-1).view(torch.uint8).fill_(0)  # every page written once: faulted in
                total += tensor.nbytes
            buffers.sharded = owned
        return total

    @staticmethod
    def stage(pending: DistPending, buffers: Any) -> None:
        """An owned CPU copy of this rank's share (for a background save): the live objects may change at once."""
        snap = pending.snap
        copies = buffers.stage({**{f"r/{k}": v for k, v in snap.rank_tensors.items()},
                                **{f"g/{k}": v for k, v in snap.global_tensors.items()}})
        snap.rank_tensors = {k[2:]: v for k, v in copies.items() if k.startswith("r/")}
        snap.global_tensors = {k[2:]: v for k, v in copies.items() if k.startswith("g/")}
        owned = getattr(buffers, "sharded", None)
        try:
            if owned is None:
                raise KeyError
            snap.dcp = _copy_state_dict(snap.dcp, owned)
        except (KeyError, RuntimeError, ValueError, TypeError, AssertionError):  # another layout: new buffers
            owned = _owned_state(snap.dcp)
            buffers.sharded = owned
            snap.dcp = _copy_state_dict(snap.dcp, owned)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies must be complete before training changes the sources

    def publish(self, manager: Any, pending: DistPending, background: bool) -> GenerationInfo:
        ranks = self.bg if background else self.fg
        if self.increments is not None and pending.kind == "full":
            store = self.tier.own if self.tier is not None else manager.store
            pending.increment = self.increments.begin(store, manager.key, pending.parent, pending.snap.frozen)
        if self.tier is not None:
            info = self._publish_tiered(manager, pending, ranks, background)
        else:
            info = commit.publish(pending.snap, pending, ranks, manager.store,
                                  manager._publisher if self.rank == 0 else None, manager.key,
                                  content=manager._publisher.verify_mode == "full")
        if self.increments is not None:
            # this rank's own view (its files' fingerprints, which a generation by rule leaves out of the manifest),
            # once published under its own name (not when every byte equalled an older generation's)
            mine = pending.own if pending.manifest is not None and pending.own is not None else pending.manifest
            self.increments.published(mine, pending.increment, pending.prepared, pending.linked)
        return info

    def _publish_tiered(self, manager: Any, pending: DistPending, ranks: Ranks, background: bool) -> GenerationInfo:
        """The local tier's commit on this thread. The replicas and an upload follow on the writer thread (behind
        which the next save, ``wait`` and ``close`` wait), or here for a background save (``wait_replicas``: the
        replicas here, an upload still on the writer)."""
        from . import tiersave

        tier, key = self.tier, manager.key
        info, manifest_bytes = tiersave.publish(pending.snap, pending, ranks, tier, manager._publisher, key)
        manager._publisher.published = info.name
        if not manifest_bytes:  # the state this update's generation already holds: nothing new to replicate
            return info
        self._published_bytes = info.size  # for the blocking time the manager's clock reports (record_blocking)
        upload = tier.remote is not None and tier.remote.due(info.name)

        def replicate(group: Ranks) -> None:
            if tier.replicas > 1:
                self._timed("replicate", lambda: tiersave.replicate(info.name, manifest_bytes, group, tier, key),
                            lambda _: info.size)

        def finish(group: Ranks) -> GenerationInfo:
            if upload:
                from .tierremote import upload as send

                manifest = tiersave.read_manifest_bytes(manifest_bytes, info.name, key)
                self._timed("upload", lambda: send(info.name, manifest, manifest_bytes, group, tier, tier.remote),
                            lambda _: info.size, leader_only=False)
            tiersave.prune(tier, key, group)
            return info

        if background:
            replicate(ranks)
            return finish(ranks)
        if tier.wait_replicas:
            replicate(ranks)
        if tier.wait_replicas and not upload or tier.replicas < 2 and not upload:
            tiersave.prune(tier, key, ranks)
            return info
        later = finish if tier.wait_replicas else lambda group: (replicate(group), finish(group))[1]
        self._later(manager, f"{info.name} (replicas, upload)", later)
        return info

    def prune_tiers(self, manager: Any, dry_run: bool) -> Any:
        """``ckpt.prune()`` with tiers, on every rank: once this rank's background work (replicas, an upload) is
        done, every node prunes as after a save (:func:`.tierprune.prune_now`); a background failure is left for
        the next ``wait``/``save`` to raise, on every rank alike."""
        from .tierprune import prune_now

        manager._writer.drain()
        return prune_now(self.tier, manager.key, self.fg, dry_run)

    def write_done(self, manager: Any, generation: str, tokens_seen: int, metrics: Any) -> Any:
        """The DONE record in every node's directory, each node's leader checking its own holding; rank 0's record
        on every rank (a failure on any node raises on every rank)."""
        from ..lifecycle import done as done_mod

        record, error = None, None
        if self.tier.topology.is_leader:
            try:
                record = done_mod.write(manager.store, manager.key, generation, tokens_seen, metrics,
                                        holding=manager.lifecycle.structure_check).to_json()
            except (TrainStateError, OSError) as exc:
                error = exc
        return done_mod.DoneRecord(**self.fg.exchange(record, error, "finish", 8192)[0])

    def _later(self, manager: Any, what: str, job: Any) -> None:
        """``job(ranks)`` on the manager's writer thread, on the background group: the next save, ``wait``,
        ``restore`` and ``close`` wait for it, and raise its failure once."""
        from ..asyncsave import Ticket

        ticket = Ticket()
        manager._writer.reserve(ticket)
        manager._writer.hand_off(ticket, what, lambda: job(self.bg))

    def record_blocking(self, seconds: float) -> None:
        """A save's whole blocking time (capture, the wait for the previous save's replicas, the local commit),
        as the manager's clock measured it, recorded in the node's directory as ``save_local``."""
        from . import tiertimes

        if self.tier is not None and self.tier.topology.is_leader:
            tiertimes.record(self.tier.own, "save_local", seconds, getattr(self, "_published_bytes", 0))

    def _timed(self, kind: str, work: Any, size: Any, leader_only: bool = True) -> Any:
        """``work()``, its duration recorded in the node's directory (rank 0's alone where ``leader_only`` is
        False: an upload is rank 0's to finish)."""
        from . import tiertimes

        started = time.monotonic()
        out = work()
        if (self.tier.topology.is_leader if leader_only else self.rank == 0):
            tiertimes.record(self.tier.own, kind, time.monotonic() - started, size(out))
        return out

    def tier_status(self, manager: Any) -> dict | None:
        """Per tier, the newest generation that survives its failure class, as this node's pointers name it:
        ``local`` a process crash, ``replicated`` the loss of any one failure domain, ``remote`` the loss of every
        node (as of this manager's last upload). Each with its update, and its lag behind ``local`` in updates and
        in seconds between the two saves. ``None`` without tiers. A generation still replicating or uploading is
        never named: its pointer moves only once it is complete."""
        if self.tier is None:
            return None
        import datetime

        from ..format.manifest import POINTER
        from ..storage.verify import read_manifest, read_pointed

        def named(store: Any) -> dict | None:
            pointer = read_pointed(store, POINTER, manager.key)
            if pointer is None:
                return None
            try:
                created = read_manifest(store, pointer.generation, pointer, manager.key)[0].created
            except (TrainStateError, OSError):
                created = None
            return {"generation": pointer.generation, "update": pointer.next_update, "created": created}

        out = {"local": named(self.tier.own), "replicated": named(self.tier.replica) if self.tier.replicas > 1
               else None, "remote": dict(self.tier.remote.latest) if self.tier.remote and self.tier.remote.latest
               else None}
        local = out["local"]
        for name in ("local", "replicated", "remote"):
            entry = out[name]
            if entry is None or local is None:
                continue
            entry["lag_updates"] = local["update"] - entry["update"]
            try:
                entry["lag_s"] = round((datetime.datetime.fromisoformat(local["created"]) -
                                        datetime.datetime.fromisoformat(entry["created"])).total_seconds(), 3)
            except (TypeError, ValueError):
                entry["lag_s"] = None
        return out

    # restoring -------------------------------------------------------------------------------------------
    def restore(self, manager: Any, state: TrainState, generation: str | None, allow_changes: Iterable[str],
                statistical_cuda: bool, in_place: bool | None = None
                ) -> tuple[RestoreInfo | None, tuple[Rejection, ...]]:
        if self.tier is not None:
            from . import tierload, tiertimes

            started = time.monotonic()
            # the refill (a node that came back empty gets its holding and the replicas it keeps, durably, and the
            # pointers move) runs here, before restore returns: training goes on only once the tiers protect the
            # restored generation again, and a refill that fails raises here, on every rank
            info, rejected = tierload.restore(state, self.fg, self.tier, manager.key, generation=generation,
                                              allow_changes=allow_changes, statistical_cuda=statistical_cuda,
                                              one_pass=in_place is not False)
            if info is not None and info.sources is not None and self.tier.topology.is_leader:
                timed = (tiertimes.restore_kind(info.sources), time.monotonic() - started, sum(info.sources.values()))
                self._later(manager, "restore timing", lambda group: tiertimes.record(self.tier.own, *timed))
            return info, rejected
        return load.restore(state, self.fg, manager.store, manager.key, generation=generation,
                            allow_changes=allow_changes, statistical_cuda=statistical_cuda,
                            one_pass=in_place is not False)

    def barrier(self, phase: str) -> None:
        self.fg.barrier(phase)

    def leave(self, manager: Any, failing: BaseException) -> None:
        """The manager's close while ``failing`` propagates on this rank: no collective at all (the other ranks
        may be waiting for this one in a training collective, and would hold it there until a timeout). No
        background save is waited for (one in flight is left as a crash leaves it: nothing partial is ever
        published), nor an upload; the directory (unless a save of this rank still writes) and the groups are
        released, and the close returns at once, so that the launcher sees the failure and stops the job as it
        would without trainstate."""
        from ..lifecycle import mirror as mirror_mod

        left = manager._writer.abandon()
        if left:
            log.warning("closing on %s: background save(s) %s left in flight, as a crash would leave them "
                        "(nothing partial is published)", type(failing).__name__, ", ".join(left))
        if manager._mirror is not None:
            mirror_mod.finish(manager._mirror, 0.0)
        manager._release(bool(left), clean=False)
        manager._writer.note_unreported(failing)

    @property
    def closed(self) -> bool:
        """Whether the manager's close released this session (its groups destroyed)."""
        return self.fg.destroyed

    def release(self, writing: bool, clean: bool) -> None:
        """Destroy the gloo groups this session created (local to this rank: no collective; :meth:`Ranks.destroy`:
        after a ``clean`` close their threads and sockets go too). The writer's group stays while a background
        save still ``writing`` uses it."""
        self.fg.destroy(clean)
        if not writing:
            self.bg.destroy(clean)


__all__ = ["CheckpointFailed", "DistPending", "Ranks", "Session", "initialized"]


def _owned_state(dcp_state: Any) -> Any:
    """CPU buffers for an owned copy of ``dcp_state`` (what a background save stages into), none of them the live
    tensor: torch's ``_create_cpu_state_dict`` hands a 0-d DTensor back as it is (the live one), so the copy
    would be made onto itself and the writer thread would save whatever the next step left in it."""
    owned = _create_cpu_state_dict(dcp_state, pin_memory=torch.cuda.is_available())
    live = {t.untyped_storage().data_ptr() for t in tensor_leaves(dcp_state) if t.numel()}
    return _unaliased(owned, live)


def _unaliased(tree: Any, live: set[int]) -> Any:
    if isinstance(tree, dict):
        return type(tree)((k, _unaliased(v, live)) for k, v in tree.items())
    if isinstance(tree, list):
        return [_unaliased(v, live) for v in tree]
    if not isinstance(tree, torch.Tensor) or not tree.numel():
        return tree
    local = tree.to_local() if hasattr(tree, "to_local") else tree
    if local.untyped_storage().data_ptr() not in live:
        return tree
    copy = torch.empty_like(local, device="cpu", pin_memory=torch.cuda.is_available())
    if not hasattr(tree, "to_local"):
        return copy
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(copy, tree.device_mesh, tree.placements, run_check=False, shape=tree.shape,
                              stride=tree.stride())
