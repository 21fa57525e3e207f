"""The ranks of a run, and the collectives the checkpoint protocol runs between them.

Checkpoint collectives never run on the training process group: the manager
creates its own gloo groups once (CPU tensors, so they work beside NCCL), with
a timeout of their own, so that a hung or killed rank makes the survivors
raise :class:`CheckpointFailed` instead of waiting out the training group's
30-minute default. One group serves the caller's thread (restore, blocking
saves, ``wait``/``close``), another the background writer: two threads never
interleave collectives on one group.

Values cross ranks as JSON in uint8 tensors, never as pickles.
"""

from __future__ import annotations

import contextlib
import datetime
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointFailed, TrainStateError

DEFAULT_TIMEOUT_S = 600.0


@dataclass
class Ranks:
    """This process's place in the run and the group its checkpoint collectives use."""

    rank: int
    world_size: int
    group: Any  # a gloo ProcessGroup
    timeout_s: float

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    # JSON collectives ------------------------------------------------------------
    def broadcast(self, value: Any, phase: str) -> Any:
        """Rank 0's ``value`` on every rank (JSON-able)."""
        with collective(phase, self):
            data = _encode(value) if self.rank == 0 else b""
            size = torch.tensor([len(data)], dtype=torch.int64)
            dist.broadcast(size, src=_global_rank(self.group, 0), group=self.group)
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else \
                torch.empty(int(size.item()), dtype=torch.uint8)
            if buffer.numel():
                dist.broadcast(buffer, src=_global_rank(self.group, 0), group=self.group)
            return json.loads(bytes(buffer.numpy()).decode()) if buffer.numel() else None

    def all_gather(self, value: Any, phase: str) -> list[Any]:
        """Every rank's ``value`` (JSON-able), in rank order, on every rank."""
        with collective(phase, self):
            data = _encode(value)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
            longest = max(int(s.item()) for s in sizes)
            padded = torch.zeros(longest, dtype=torch.uint8)
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else padded[:0]
            out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(out, padded, group=self.group)
            return [json.loads(bytes(t[: int(s.item())].numpy()).decode()) for t, s in zip(out, sizes)]

    def agree(self, ok: bool, phase: str, error: str = "") -> list[str]:
        """Every rank reports whether its part of ``phase`` succeeded; returns every rank's error ("" for none).

        Raises nothing itself: the caller decides (see :meth:`check`).
        """
        return self.all_gather(error if not ok else "", phase)

    def check(self, phase: str, error: BaseException | None) -> None:
        """All ranks learn whether ``phase`` succeeded everywhere; any failure raises on every rank.

        The rank that failed re-raises its own error; the others raise
        :class:`CheckpointFailed` naming the failing ranks and their errors.
        """
        text = "" if error is None else f"{type(error).__name__}: {error}"
        reports = self.agree(error is None, phase, text[:2000])
        failed = {rank: report for rank, report in enumerate(reports) if report}
        if not failed:
            return
        if error is not None:
            raise error
        raise CheckpointFailed(phase, failed)

    def barrier(self, phase: str) -> None:
        with collective(phase, self):
            dist.barrier(group=self.group)


def _encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def _global_rank(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


@contextlib.contextmanager
def collective(phase: str, ranks: Ranks | None = None) -> Iterator[None]:
    """Turn what a failed collective raises into :class:`CheckpointFailed` naming the phase.

    A killed peer surfaces as a gloo ``RuntimeError`` (connection reset), a hung
    one as a timeout, and DCP reports rank failures as ``CheckpointException``,
    a ``BaseException`` that would escape ordinary handlers.
    """
    try:
        yield
    except TrainStateError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):  # DCP's CheckpointException: {rank: (exception, traceback)}
            own = [e for e, _ in failures.values() if isinstance(e, TrainStateError)]
            if ranks is not None and ranks.rank in failures and own:
                raise own[0] from None
            raise CheckpointFailed(phase, {r: f"{type(e).__name__}: {e}" for r, (e, _) in failures.items()}) from exc
        if isinstance(exc, (RuntimeError, OSError, ValueError)) and not isinstance(exc, TrainStateError):
            raise CheckpointFailed(phase, {-1: f"{type(exc).__name__}: {exc}"}, peer_lost=True) from exc
        raise


def checkpoint_groups(group: Any, timeout_s: float) -> tuple[Ranks, Ranks]:
    """Two gloo groups over the ranks of ``group`` (default: the world), for the caller and the writer."""
    timeout = datetime.timedelta(seconds=timeout_s)
    members = None if group is None else dist.get_process_group_ranks(group)
    made = [dist.new_group(ranks=members, backend="gloo", timeout=timeout, use_local_synchronization=False)
            for _ in range(2)]
    rank, world = dist.get_rank(made[0]), dist.get_world_size(made[0])
    return Ranks(rank, world, made[0], timeout_s), Ranks(rank, world, made[1], timeout_s)
