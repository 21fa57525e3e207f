"""The ranks of a run, and the collectives the checkpoint protocol runs between them.

Checkpoint collectives never run on the training process group: the manager
creates its own gloo groups once (CPU tensors, so they work beside NCCL), with
a timeout of their own, so that a hung or killed rank makes the survivors
raise :class:`CheckpointFailed` instead of waiting out the training group's
30-minute default. One group serves the caller's thread (restore, blocking
saves, ``wait``/``close``), another the background writer: two threads never
interleave collectives on one group. Each save opens with a join on the
caller's group, a monitored barrier with a short timeout of its own
(:meth:`Ranks.join`): a save that only some ranks entered (``if rank == 0:
save(...)``) fails there in seconds, naming the ranks that stayed away,
instead of waiting out the collective timeout and blaming a dead peer.

Values cross ranks as JSON in uint8 tensors, never as pickles.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import re
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointFailed, InvalidArgument, SaveNotJoined, TrainStateError

DEFAULT_TIMEOUT_S = 600.0
ROOM = 2048  # bytes of JSON a collective carries in its first (fixed-size) round
JOIN_TIMEOUT_S = 30.0  # how far behind the others a rank may enter save; at most the collective timeout
JOIN_TIMEOUT_ENV = "TRAINSTATE_SAVE_JOIN_TIMEOUT_S"


@dataclass
class Ranks:
    """This process's place in the run and the group its checkpoint collectives use."""

    rank: int
    world_size: int
    connected: Any  # a gloo ProcessGroup (see :attr:`group`)
    timeout_s: float
    join_timeout_s: float = 0.0  # > 0: this group opens each save with join()
    unjoined: SaveNotJoined | None = None  # a failed join: saves are out of step for good
    destroyed: bool = False  # by the manager's close: its checkpoint collectives are over
    probe: Any = None  # the set-up's connecting gather, in flight until the group's first use

    @property
    def group(self) -> Any:
        """The gloo group, its connections to rank 0 made: the set-up's gather (:func:`checkpoint_groups`) runs in
        gloo's own threads while the caller goes on; the first collective waits for it here."""
        if self.probe is not None:
            self._connect()
        return self.connected

    def _connect(self) -> None:
        probe, self.probe = self.probe, None
        timeout = self.join_timeout_s or self.timeout_s
        try:
            if not probe.wait(datetime.timedelta(seconds=timeout)):
                raise RuntimeError("timed out")
        except RuntimeError as exc:
            missing = "some rank" if self.rank else "a rank"
            self.unjoined = SaveNotJoined(
                f"the checkpoint groups' set-up did not finish within {timeout:g} s: {missing} never created its "
                f"CheckpointManager (or died since). Create the manager on every rank, with the same arguments "
                f"({type(exc).__name__}: {exc})", [], timeout)
            raise self.unjoined from exc

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    # JSON collectives ------------------------------------------------------------
    # Each takes one round when every value fits in ``room`` bytes (a fixed-size buffer that carries its length),
    # and a second round, of the exact size, only when one does not. Most values crossing ranks are a few dozen
    # bytes (a problem, a report, a count): a second round just to agree on the size was half their cost.
    def broadcast(self, value: Any, phase: str) -> Any:
        """Rank 0's ``value`` on every rank (JSON-able)."""
        return json.loads(self.broadcast_bytes(_encode(value) if self.rank == 0 else None, 0, phase))

    def broadcast_bytes(self, data: bytes | None, source: int, phase: str, room: int = ROOM) -> bytes:
        """``source``'s bytes on every rank (raw, not JSON)."""
        with collective(phase, self):
            mine = data if self.rank == source else b""
            head = _framed(mine, len(mine), room)
            dist.broadcast(head, src=_global_rank(self.group, source), group=self.group)
            size = _length(head)
            if self.rank == source:
                if size > room:
                    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                                   src=_global_rank(self.group, source), group=self.group)
                return data
            if size <= room:
                return bytes(head[8:8 + size].numpy())
            buffer = torch.empty(size, dtype=torch.uint8)
            dist.broadcast(buffer, src=_global_rank(self.group, source), group=self.group)
            return bytes(buffer.numpy())

    def all_gather(self, value: Any, phase: str, room: int = ROOM) -> list[Any]:
        """Every rank's ``value`` (JSON-able), in rank order, on every rank."""
        with collective(phase, self):
            data = _encode(value)
            mine = _framed(data, len(data), room)
            out = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(out, mine, group=self.group)
            sizes = [_length(t) for t in out]
            if max(sizes) <= room:  # every rank sees the same sizes, so every rank takes the same way
                return [_decoded(t[8:8 + n]) for t, n in zip(out, sizes)]
            padded = torch.zeros(max(sizes), dtype=torch.uint8)
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else padded[:0]
            out = [torch.empty_like(padded) for _ in range(self.world_size)]
            dist.all_gather(out, padded, group=self.group)
            return [_decoded(t[:n]) for t, n in zip(out, sizes)]

    def gather(self, value: Any, phase: str, room: int | None = ROOM) -> list[Any] | None:
        """Every rank's ``value`` (JSON-able) on rank 0, in rank order; ``None`` on every other rank.

        One round in which each rank sends ``room`` bytes and rank 0 alone receives (O(1) per rank, O(N) at rank
        0, where :meth:`all_gather` has every rank receive every value). A value longer than ``room`` follows
        point to point from its own rank, which alone knows it must: the others never wait for a second round.
        ``room=None``: values of any size (a rank's share of the metadata), in two rounds: an all-reduce of the
        largest size (8 bytes per rank), then a gather in that room.
        """
        with collective(phase, self):
            data = _encode(value)
            if room is None:
                largest = torch.tensor([len(data)], dtype=torch.int64)
                dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.group)
                room = int(largest.item())
            mine = _framed(data, len(data), room)
            root = _global_rank(self.group, 0)
            if self.rank != 0:
                dist.gather(mine, dst=root, group=self.group)
                if len(data) > room:
                    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=root, group=self.group)
                return None
            frames = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.gather(mine, gather_list=frames, dst=root, group=self.group)
            with paused_gc():  # N records decoded into many small objects: the collector would rescan them all
                return self._decode_gathered(frames, value, room)

    def _decode_gathered(self, frames: list[torch.Tensor], value: Any, room: int) -> list[Any]:
        """Rank 0: every rank's value from its frame (or, for one longer than ``room``, from its own message)."""
        out = []
        for rank, frame in enumerate(frames):
            size = _length(frame)
            if size <= room:
                out.append(_decoded(frame[8:8 + size]))
            elif rank == 0:
                out.append(value)
            else:
                buffer = torch.empty(size, dtype=torch.uint8)
                dist.recv(buffer, src=_global_rank(self.group, rank), group=self.group)
                out.append(_decoded(buffer))
        return out

    def scatter(self, values: list[Any] | None, phase: str, room: int = ROOM) -> Any:
        """Rank 0's ``values[r]`` (JSON-able, one per rank) on rank ``r``; ``values`` is read on rank 0 only.

        One round in which each rank receives its own value (O(1) per rank where a broadcast of every rank's
        value would be O(N)); a value longer than ``room`` follows point to point to its rank, which alone
        knows from the round's header that it must wait for it."""
        with collective(phase, self):
            root = _global_rank(self.group, 0)
            mine = torch.empty(room + 8, dtype=torch.uint8)
            if self.rank != 0:
                dist.scatter(mine, src=root, group=self.group)
                size = _length(mine)
                if size <= room:
                    return _decoded(mine[8:8 + size])
                buffer = torch.empty(size, dtype=torch.uint8)
                dist.recv(buffer, src=root, group=self.group)
                return _decoded(buffer)
            encoded = [_encode(v) for v in values]
            dist.scatter(mine, scatter_list=[_framed(d, len(d), room) for d in encoded], src=root, group=self.group)
            for rank, data in enumerate(encoded):
                if rank and len(data) > room:
                    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=_global_rank(self.group, rank),
                              group=self.group)
            return values[0]

    def failures(self, error: str, phase: str) -> dict[int, str]:
        """Every rank's ``error`` ("" for none) by rank, only where some rank has one: ``{}`` when none does.

        One round of 8 bytes per rank (a sum of failure flags) when every rank succeeded, the common case; the
        failures' texts cross in a second round only when some rank failed.
        """
        with collective(phase, self):
            flag = torch.tensor([1 if error else 0], dtype=torch.int64)
            dist.all_reduce(flag, group=self.group)
        if not int(flag.item()):
            return {}
        return {rank: text for rank, text in enumerate(self.all_gather(error, phase)) if text}

    def check(self, phase: str, error: BaseException | None) -> None:
        """All ranks learn whether ``phase`` succeeded everywhere; any failure raises on every rank.

        The rank that failed re-raises its own error; the others raise
        :class:`CheckpointFailed` naming the failing ranks and their errors.
        """
        text = "" if error is None else f"{type(error).__name__}: {error}"
        failed = self.failures(text[:2000], phase)
        if not failed:
            return
        if error is not None:
            raise error
        raise CheckpointFailed(phase, failed)

    def largest(self, values: list[int], phase: str) -> list[int]:
        """The element-wise largest of every rank's ``values`` (the same length on every rank), on every rank:
        with ``-x`` beside ``x``, also the smallest (equal iff every rank has the same ``x``)."""
        with collective(phase, self):
            top = torch.tensor(values, dtype=torch.int64)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in top.tolist()]

    def sum(self, values: list[int], phase: str) -> list[int]:
        """The element-wise sum of every rank's ``values`` (the same length on every rank), on every rank."""
        with collective(phase, self):
            total = torch.tensor(values, dtype=torch.int64)
            dist.all_reduce(total, group=self.group)
        return [int(v) for v in total.tolist()]

    def exchange(self, value: Any, error: BaseException | None, phase: str, room: int = ROOM) -> list[Any]:
        """Every rank's ``value`` and whether its part of ``phase`` failed, in one round; a failure anywhere raises
        on every rank as :meth:`check` does (the failed rank its own error, the others :class:`CheckpointFailed`)."""
        text = "" if error is None else f"{type(error).__name__}: {error}"[:1000]
        every = self.all_gather([None if error else value, text], phase, room)
        failed = {rank: report for rank, (_, report) in enumerate(every) if report}
        if failed:
            if error is not None:
                raise error
            raise CheckpointFailed(phase, failed)
        return [v for v, _ in every]

    def rank0_outcome(self, outcome: dict, error: BaseException | None, phase: str) -> dict:
        """Rank 0's ``outcome`` (a JSON-able dict) on every rank; when it carries ``"error"``, rank 0 raises its own
        ``error`` and the others :class:`CheckpointFailed` naming it."""
        outcome = self.broadcast(outcome, phase)
        if "error" in outcome:
            if error is not None:
                raise error
            raise CheckpointFailed(phase, {0: outcome["error"]})
        return outcome

    def destroy(self, clean: bool) -> None:
        """Destroy this rank's groups (the manager's close): local, no collective. A later checkpoint collective
        of this manager raises :class:`InvalidArgument` instead of running on a destroyed group.

        ``destroy_process_group`` only unregisters a gloo group: its threads and sockets live while anything
        references it. After a ``clean`` close (every collective of this manager finished) the references go
        too, so the group's threads are joined and its sockets closed here (a peer still waiting on it learns
        at once that the connection closed). Otherwise (a close while an exception propagates) a thread may
        still run one of its collectives, and a join would wait for it: the group lives until the process
        ends, which is what such a close leads to."""
        self.destroyed = True
        group = self.connected
        try:
            if group is not None and not isinstance(group, _Closed):
                dist.destroy_process_group(group)
        except ValueError:  # destroyed already: by destroy_process_group() of the whole world
            pass
        if clean:
            self.connected, self.probe = _CLOSED, None

    def barrier(self, phase: str) -> None:
        if self.unjoined is not None:  # a save some ranks never entered: they are elsewhere (training), so
            return  # waiting for them here would only hold back that error for the collective timeout
        with collective(phase, self):
            dist.barrier(group=self.group)

    # the join that opens a save ------------------------------------------------------
    def join(self, what: str = "save") -> None:
        """Return once every rank has entered ``what``; raise :class:`SaveNotJoined` after the join timeout.

        A monitored barrier with the join timeout: rank 0 names every rank
        that did not arrive; another rank learns only that rank 0 did not
        confirm. A timeout there breaks the group (gloo aborts its pending
        operations), so every later checkpoint collective of this manager
        refuses at once.
        """
        _refuse_destroyed(self, what)
        if not self.join_timeout_s or self.world_size == 1:
            return
        if self.unjoined is not None:
            raise SaveNotJoined(f"{self.unjoined} (raised earlier; this manager cannot {what} again in this "
                                "process: restart the job)", self.unjoined.missing, 0.0)
        group = self.group
        started = time.monotonic()
        try:
            dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=self.join_timeout_s),
                                   wait_all_ranks=True)
        except RuntimeError as exc:
            if self.rank != 0 and "timed out" not in str(exc).lower():  # a reset connection: rank 0 is gone
                raise CheckpointFailed("join", {-1: f"{type(exc).__name__}: {exc}"}, peer_lost=True) from exc
            self.unjoined = _not_joined(self.rank, what, self.join_timeout_s, str(exc), time.monotonic() - started)
            raise self.unjoined from exc


def _encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def _framed(data: bytes, size: int, room: int = ROOM) -> torch.Tensor:
    """A collective's first-round buffer: ``size`` as 8 bytes, then ``data`` when it fits in ``room``."""
    buffer = torch.zeros(room + 8, dtype=torch.uint8)
    buffer[:8] = torch.tensor([size], dtype=torch.int64).view(torch.uint8)
    if 0 < len(data) <= room:
        buffer[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buffer


def _length(buffer: torch.Tensor) -> int:
    return int(buffer[:8].view(torch.int64).item())


def _decoded(buffer: torch.Tensor) -> Any:
    return json.loads(bytes(buffer.numpy()).decode()) if buffer.numel() else None


def _global_rank(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


@contextlib.contextmanager
def collective(phase: str, ranks: Ranks | None = None) -> Iterator[None]:
    """Turn what a failed collective raises into :class:`CheckpointFailed` naming the phase.

    A killed peer surfaces as a gloo ``RuntimeError`` (connection reset), a hung
    one as a timeout, and DCP reports rank failures as ``CheckpointException``,
    a ``BaseException`` that would escape ordinary handlers.
    """
    if ranks is not None:
        _refuse_destroyed(ranks, phase)
    try:
        yield
    except TrainStateError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):  # DCP's CheckpointException: {rank: (exception, traceback)}
            _drop_frames(exc, failures)
            own = [e for e, _ in failures.values() if isinstance(e, TrainStateError)]
            if ranks is not None and ranks.rank in failures and own:
                raise own[0] from None
            raise CheckpointFailed(phase, {r: f"{type(e).__name__}: {e}" for r, (e, _) in failures.items()}) from exc
        if isinstance(exc, (RuntimeError, OSError, ValueError)) and not isinstance(exc, TrainStateError):
            raise CheckpointFailed(phase, {-1: f"{type(exc).__name__}: {exc}"}, peer_lost=True) from exc
        raise


class _Closed:
    """A destroyed group, dropped: never ``None``, which torch's collectives read as the whole world."""


_CLOSED = _Closed()


def _refuse_destroyed(ranks: Ranks, phase: str) -> None:
    if ranks.destroyed:
        raise InvalidArgument(f"{phase}: this CheckpointManager is closed (its checkpoint groups are destroyed); "
                              "open a new CheckpointManager on every rank to save or restore again")


def _drop_frames(exc: BaseException, failures: dict) -> None:
    """DCP keeps each rank's failure in a frame its own traceback references: a cycle that would keep the
    manager, its groups and their threads alive until a full collection. The frames' locals are not needed."""
    for failure in failures.values():
        if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException):
            traceback.clear_frames(failure[0].__traceback__)
    traceback.clear_frames(exc.__traceback__)


def _not_joined(rank: int, what: str, timeout_s: float, error: str, waited_s: float) -> SaveNotJoined:
    """The error of a failed join, from what gloo's monitored barrier reported on this rank."""
    named = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", error) if rank == 0 else None
    missing = [int(r) for r in named.group(1).replace(" ", "").split(",") if r] if named else None
    who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not enter {what}"
           if missing else f"rank 0, which coordinates the join, did not confirm that every rank entered {what} "
           "(either rank 0 did not call it, or another rank did not: rank 0's error names it)")
    return SaveNotJoined(
        f"{what} is collective: every rank must call ckpt.{what}(state) at the same update, but {who} within "
        f"{timeout_s:g} s of rank {rank} entering it. A guard like `if rank == 0: ckpt.{what}(...)`, kept from "
        f"torch.save code, does this: call it on every rank (each rank writes its own shard, rank 0 the rest). "
        f"Nothing was written; the previous generation stands. If every rank does call {what} but one arrives "
        f"more than {timeout_s:g} s after the others (rank-0-only work before it), set {JOIN_TIMEOUT_ENV} higher.",
        missing, round(waited_s, 3))


def join_timeout(timeout_s: float) -> float:
    """``$TRAINSTATE_SAVE_JOIN_TIMEOUT_S``, else the default; never above the collective timeout."""
    raw = os.environ.get(JOIN_TIMEOUT_ENV)
    if raw is None:
        return min(timeout_s, JOIN_TIMEOUT_S)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise InvalidArgument(f"{JOIN_TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return min(timeout_s, value)


def checkpoint_groups(group: Any, timeout_s: float) -> tuple[Ranks, Ranks]:
    """Gloo groups over the ranks of ``group`` (default: the world): the caller's (whose first round of each save
    is the join) and the writer's.

    Both connect lazily (:func:`_lazy_connections`). The join's monitored barrier must name a rank that stays
    away within the join timeout, and a first connection to that rank would instead wait out gloo's connect
    timeout, saying nothing: its connections (rank 0 to each rank, the barrier's only ones, and the ones every
    round of the protocol uses) are made by one gather started here, which gloo's threads run while the caller
    goes on. The caller's group waits for it at its first use (:attr:`Ranks.group`)."""
    joining = join_timeout(timeout_s)
    members = None if group is None else dist.get_process_group_ranks(group)

    def made() -> Any:
        return dist.new_group(ranks=members, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s),
                              use_local_synchronization=False)

    with _lazy_connections():
        caller, writer = made(), made()
    rank, world = dist.get_rank(caller), dist.get_world_size(caller)
    probe = None
    if world > 1:
        probe = dist.gather(torch.zeros(1, dtype=torch.uint8), dst=_global_rank(caller, 0), group=caller,
                            gather_list=[torch.zeros(1, dtype=torch.uint8) for _ in range(world)] if rank == 0 else None,
                            async_op=True)
    return (Ranks(rank, world, caller, timeout_s, joining, probe=probe), Ranks(rank, world, writer, timeout_s))


LAZY_ENV = "TORCH_GLOO_LAZY_INIT"


@contextlib.contextmanager
def _lazy_connections() -> Iterator[None]:
    """Gloo groups made here connect each pair of ranks at its first message, not all pairs at once: the checkpoint
    rounds are rank 0's gathers, broadcasts and scatters, so a rank other than 0 talks to a few peers, and the
    N(N-1) connections of two more eager full meshes (tens of milliseconds per rank at 8 ranks, seconds at
    thousands) are never made. A ``TORCH_GLOO_LAZY_INIT`` the user set is left as it is."""
    if LAZY_ENV in os.environ:
        yield
        return
    os.environ[LAZY_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(LAZY_ENV, None)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector off while rank 0 builds one object per rank (or per rank and item): each
    collection rescans every object still alive, so building N records costs O(N^2) with it on (at 1,024 ranks
    of a 7B model, 10 of the 12 seconds of decoding the write's records). Nothing built here holds a cycle."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
