"""A manager's multi-rank mode: what ``save`` and ``restore`` do when a process group is initialized.

The manager keeps its single-process shape (prepare at the boundary, an
optional owned copy for a background save, publish on the caller's thread or
the writer's); this class supplies the multi-rank version of each step.
Every method is collective: all ranks call it at the same update boundary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

from ..errors import CheckpointFailed, InvalidArgument, TrainStateError
from ..format.manifest import generation_name
from ..lifecycle.generations import new_timeline
from ..publish import Pending, check_metrics, policy_record
from ..records import GenerationInfo, RestoreInfo
from ..errors import Rejection
from ..state.train_state import TrainState
from . import commit, load
from .capture import RankSnapshot, capture
from .group import DEFAULT_TIMEOUT_S, Ranks, checkpoint_groups


@dataclass
class DistPending(Pending):
    """A prepared multi-rank generation: this rank's share besides the manifest fields."""

    snap: RankSnapshot | None = None

    def changed_bytes(self, manifest: Any) -> None:
        """Unknown until written: the shards' bytes exist only once DCP has planned and written them, so
        rank 0 compares every rank's staged file digests with ``manifest``'s before the commit."""
        return None


def initialized(process_group: Any) -> bool:
    return process_group is not None or (dist.is_available() and dist.is_initialized())


class Session:
    """The checkpoint groups of one manager, and the multi-rank steps of save and restore."""

    def __init__(self, process_group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise InvalidArgument(f"collective_timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.fg, self.bg = checkpoint_groups(process_group, float(timeout_s))

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
        error = None
        if self.rank == 0:
            try:
                manager.store.lock()
                manager._check_same_run(state)
            except TrainStateError as exc:
                error = exc
        self.fg.check("prepare", error)
        if state.lineage is None:
            state.lineage = [[new_timeline(), None]]
        state.lineage = self.fg.broadcast(state.lineage, "prepare")  # rank 0's timeline ids on every rank
        snap = capture(state, self.fg, weights_only=weights_only)
        kind = "weights" if weights_only else "full"
        name = generation_name(state.next_update, kind)
        pending = DistPending(name, kind, state.next_update, state.parent, snap.global_skeleton, {}, {
            "data": snap.data if kind == "full" else {}, "metrics": check_metrics(metrics),
            "retention": policy_record(manager.retention),
            "lineage": [list(e) for e in state.lineage] if kind == "full" else []}, snap)
        if kind == "full":
            state.parent = name
        return pending

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
            owned = _create_cpu_state_dict(snap.dcp, pin_memory=torch.cuda.is_available())
            buffers.sharded = owned
            snap.dcp = _copy_state_dict(snap.dcp, owned)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies must be complete before training changes the sources

    def publish(self, manager: Any, pending: DistPending, background: bool) -> GenerationInfo:
        ranks = self.bg if background else self.fg
        return commit.publish(pending.snap, pending, ranks, manager.store,
                              manager._publisher if self.rank == 0 else None, manager.key,
                              content=manager._publisher.verify_mode == "full")

    # restoring -------------------------------------------------------------------------------------------
    def restore(self, manager: Any, state: TrainState, generation: str | None, allow_changes: Iterable[str],
                statistical_cuda: bool) -> tuple[RestoreInfo | None, tuple[Rejection, ...]]:
        return load.restore(state, self.fg, manager.store, manager.key, generation=generation,
                            allow_changes=allow_changes, statistical_cuda=statistical_cuda)

    def barrier(self, phase: str) -> None:
        self.fg.barrier(phase)


__all__ = ["CheckpointFailed", "DistPending", "Ranks", "Session", "initialized"]
