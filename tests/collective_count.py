"""What the checkpoint protocol costs one rank: collective rounds and the bytes they move, files and fsyncs.

Counted where the real calls happen, as requests are counted through the object-store proxy: every
``torch.distributed`` collective (``distributed_c10d``'s functions, which DCP's object collectives call too)
and every mutating filesystem call of the stores (:class:`~trainstate.storage.posix.PosixOps`), while a
:class:`Tally` is open. Each collective is charged to the trainstate function that issued it (the first
trainstate frame on the stack, or ``dcp.<function>`` for DCP's own rounds), so a table by phase shows what
a change added.

Bytes are the logical payload (what the collective's semantics move, not gloo's algorithm): a rank sends
its buffer, and receives every other rank's buffer in an all-gather, the root's in a broadcast, its own
piece in a scatter; rank 0 receives every rank's buffer in a gather; an all-reduce sends and receives its
buffer once. A round is one collective call. Point-to-point sends and receives are counted apart, as
messages and the bytes they move: they carry the chunks a rank needs or serves (its own data), or a record
too long for its round's room, and involve only the two ranks they join.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from trainstate.storage.posix import PosixOps

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "broadcast", "gather", "scatter", "all_reduce", "reduce",
               "barrier", "monitored_barrier", "all_to_all", "all_to_all_single", "reduce_scatter",
               "reduce_scatter_tensor", "send", "recv", "isend", "irecv")
FILE_CALLS = ("create", "fsync", "fsync_dir", "rename", "replace", "link", "mkdir")


POINT_TO_POINT = ("send", "recv", "isend", "irecv")


@dataclasses.dataclass
class Phase:
    rounds: int = 0  # collectives every rank of the group takes part in
    sent: int = 0
    received: int = 0
    messages: int = 0  # point-to-point sends and receives: only the two ranks they join take part
    moved: int = 0  # their bytes (chunks a rank needs or serves, an over-long record), counted apart
    ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class Tally:
    """Rounds, bytes, files and fsyncs of this rank while open (``with Tally() as t: ckpt.save(state)``)."""

    def __init__(self) -> None:
        self.phases: dict[str, Phase] = collections.defaultdict(Phase)
        self.files: collections.Counter = collections.Counter()
        self._inside = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    # totals ------------------------------------------------------------------------------------------
    @property
    def rounds(self) -> int:
        return sum(p.rounds for p in self.phases.values())

    @property
    def sent(self) -> int:
        return sum(p.sent for p in self.phases.values())

    @property
    def received(self) -> int:
        return sum(p.received for p in self.phases.values())

    def summary(self) -> dict:
        return {"rounds": self.rounds, "sent": self.sent, "received": self.received, "files": dict(self.files),
                "messages": sum(p.messages for p in self.phases.values()),
                "moved": sum(p.moved for p in self.phases.values()),
                "phases": {k: {"rounds": p.rounds, "sent": p.sent, "received": p.received, "messages": p.messages,
                               "moved": p.moved, "ops": dict(p.ops)} for k, p in sorted(self.phases.items())}}

    # counting ----------------------------------------------------------------------------------------
    def __enter__(self) -> "Tally":
        for name in COLLECTIVES:
            real = getattr(c10d, name)
            wrapped = self._collective(name, real)
            for module in (c10d, dist):
                if getattr(module, name, None) is real:
                    self._saved.append((module, name, real))
                    setattr(module, name, wrapped)
        for name in FILE_CALLS:
            real = getattr(PosixOps, name)
            self._saved.append((PosixOps, name, real))
            setattr(PosixOps, name, self._file(name, real))
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)
        self._saved.clear()

    def _file(self, name: str, real: Any) -> Any:
        def counted(ops: Any, *args: Any, **kwargs: Any) -> Any:
            self.files[name] += 1
            return real(ops, *args, **kwargs)
        return counted

    def _collective(self, name: str, real: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "busy", False):  # called by another collective: counted there
                return real(*args, **kwargs)
            self._inside.busy = True
            try:
                return real(*args, **kwargs)
            finally:
                self._inside.busy = False
                self._charge(name, args, kwargs)
        return counted

    def _charge(self, name: str, args: tuple, kwargs: dict) -> None:
        group = kwargs.get("group")
        world = dist.get_world_size(group) if group is not None else dist.get_world_size()
        me = dist.get_rank(group) if group is not None else dist.get_rank()
        sent, received = _payload(name, args, kwargs, world, me, group)
        phase = self.phases[_caller()]
        phase.ops[name] += 1
        if name in POINT_TO_POINT:
            phase.messages += 1
            phase.moved += sent + received
            return
        phase.rounds += 1
        phase.sent += sent
        phase.received += received


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else args[index] if len(args) > index else None


def _is(group: Any, me: int, kwargs: dict, args: tuple, index: int, key: str, group_key: str) -> bool:
    """Whether this rank is the root of a rooted collective (``src``/``dst`` global, or ``group_src``/...)."""
    if kwargs.get(group_key) is not None:
        return kwargs[group_key] == me
    root = _arg(args, kwargs, index, key)
    root = 0 if root is None else root
    return (dist.get_global_rank(group, me) if group is not None else me) == root


def _payload(name: str, args: tuple, kwargs: dict, world: int, me: int, group: Any) -> tuple[int, int]:
    """(sent, received) bytes of one collective on this rank (see the module docstring)."""
    if name in ("barrier", "monitored_barrier"):
        return 0, 0
    if name in ("all_gather", "all_gather_into_tensor"):
        size = _nbytes(args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_tensor")))
        return size, size * (world - 1)
    if name == "broadcast":
        size = _nbytes(_arg(args, kwargs, 0, "tensor"))
        return (size, 0) if _is(group, me, kwargs, args, 1, "src", "group_src") else (0, size)
    if name == "gather":
        size = _nbytes(_arg(args, kwargs, 0, "tensor"))
        return (0, size * (world - 1)) if _is(group, me, kwargs, args, 2, "dst", "group_dst") else (size, 0)
    if name == "scatter":
        size = _nbytes(_arg(args, kwargs, 0, "tensor"))
        return (size * (world - 1), 0) if _is(group, me, kwargs, args, 2, "src", "group_src") else (0, size)
    if name in ("send", "isend"):
        return _nbytes(_arg(args, kwargs, 0, "tensor")), 0
    if name in ("recv", "irecv"):
        return 0, _nbytes(_arg(args, kwargs, 0, "tensor"))
    size = _nbytes(args[0] if args else next(iter(kwargs.values()), None))
    return size, size  # all_reduce, reduce, all_to_all, reduce_scatter: O(buffer) each way


def _caller() -> str:
    """The trainstate function that issued the collective (``module.function``), or DCP's."""
    frame = sys._getframe(3)
    dcp = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("trainstate.") and not module.startswith("trainstate.distributed.group"):
            return f"{module.rsplit('.', 1)[-1]}.{frame.f_code.co_name}" + (f" ({dcp})" if dcp else "")
        if dcp is None and module.startswith("torch.distributed.checkpoint"):
            dcp = f"dcp.{frame.f_code.co_name}"
        frame = frame.f_back
    return dcp or "other"


@contextlib.contextmanager
def tally() -> Iterator[Tally]:
    with Tally() as counted:
        yield counted
