"""trainstate inside torchft: a replacement replica group heals from a live peer, every byte verified, no pickle.

torchft keeps a job training while a failed replica group restarts: the
replacement joins the next quorum and copies the state from a live peer.
:class:`Healing` makes that copy a trainstate transfer: the whole restart
state of each rank (model, optimizer, schedulers, every RNG stream, the
data position of a :class:`~trainstate.ResumableLoader`, the clocks),
encoded as a generation's ``state.json`` and safetensors bytes are
(:mod:`.wire`), sent by :class:`.transport.TrainStateTransport` and
verified by the receiver before any byte reaches a live tensor::

    heal = Healing(state)
    manager = torchft.Manager(pg=..., min_replica_size=1, load_state_dict=heal.load_state_dict,
                              state_dict=heal.state_dict, checkpoint_transport=heal.transport, ...)
    batches = heal.batches(state["loader"])  # a fresh iterator after each heal
    while ...:
        heal.boundary()              # the step boundary: what a heal of this step sends
        manager.start_quorum()       # (use_async_quorum=False: a healing group applies the state here)
        loss = forward_backward(next(batches)); average the gradients with manager.allreduce
        if manager.should_commit():
            optimizer.step(); state.next_update += 1
        optimizer.zero_grad()

:meth:`Healing.boundary` takes the snapshot on the training thread at the
step boundary, so that torchft's quorum thread, which sends it while the
next forward pass runs, never reads a module mid-step (under FSDP2 that
read sees unsharded parameters and fails). The tensors are the live ones,
not copies: nothing changes them before ``should_commit``, whose
``disallow_checkpoint`` waits for every stream the quorum named. Durable
generations go beside it through the same :class:`~trainstate.CheckpointManager`
as any run. Install with ``pip install "trainstate[torchft]"``.
"""

from __future__ import annotations

import time
from datetime import timedelta
from collections.abc import Iterator
from typing import Any

from ...errors import StateMismatch
from ...format.signing import SigningKey, resolve
from ...state import contract as contract_mod
from ...state import snapshot
from ...state.train_state import TrainState
from ...storage.verify import check_decoded, check_state_schema, decode_state
from . import shards, wire
from .transport import TrainStateTransport


class ManagerState:
    """torchft's own clocks (the manager's step and batches committed) as a component of the
    :class:`~trainstate.TrainState`, so that a generation restores them with the rest (torchft asks for this:
    "save and restore the Manager's state_dict as well"). Register it, then set :attr:`manager`::

        clocks = ManagerState()
        state = ts.TrainState(model=model, optimizer=opt, torchft=clocks)
        ...
        clocks.manager = manager
    """

    def __init__(self) -> None:
        self.manager: Any = None
        self._pending: dict | None = None

    def state_dict(self) -> dict[str, int]:
        if self.manager is None:
            return dict(self._pending or {"step": 0, "batches_committed": 0})
        return {k: int(v) for k, v in self.manager.state_dict().items()}

    def load_state_dict(self, value: dict[str, int]) -> None:
        if self.manager is None:  # restored before the manager exists: handed to it when it is set
            self._pending = dict(value)
        else:
            self.manager.load_state_dict(dict(value))

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "manager" and value is not None and getattr(self, "_pending", None):
            value.load_state_dict(dict(self._pending))
            self._pending = None


class Healing:
    """The functions and the transport a ``torchft.Manager`` takes, for one :class:`~trainstate.TrainState`.

    ``key``: the run's signing key (as :class:`~trainstate.CheckpointManager` resolves it: the argument, else
    ``TRAINSTATE_SIGNING_KEY``); ``bind``: the address peers reach this rank's transport on."""

    def __init__(self, state: TrainState, *, key: SigningKey | bytes | str | bool | None = None,
                 bind: str = "127.0.0.1", timeout: timedelta = timedelta(seconds=60),
                 heal_wait_s: float | None = None):
        self.state = state
        self.key = resolve(key)
        self.transport = TrainStateTransport(key=self.key, bind=bind, timeout=timeout, heal_wait_s=heal_wait_s)
        self._snapshot: dict[str, Any] | None = None
        self._at: int | None = None
        self.boundaries: list[float] = []  # seconds each boundary() took (its blocking cost)
        self.healed: list[dict] = []  # each heal applied: the step, the update, the warnings, seconds

    def boundary(self) -> None:
        """Take what a heal of the coming step sends: call on the training thread after the optimizer step and
        ``zero_grad``, before ``manager.start_quorum()``. The tensors are referenced, not copied (see the module
        docstring); the rest (RNG states, positions, scalars) is encoded now."""
        started = time.perf_counter()
        layouts: dict[str, dict] = {}
        skeleton, tensors = snapshot.capture(self.state, view=lambda name, value: shards.local_view(value, name, layouts))
        self._snapshot = {"skeleton": skeleton, "tensors": tensors, "shards": layouts}
        self._at = self.state.next_update
        self.boundaries.append(time.perf_counter() - started)

    def state_dict(self) -> dict[str, Any]:
        """What torchft sends a healing peer (from its quorum thread): the last :meth:`boundary`'s snapshot."""
        if self._snapshot is None or self._at != self.state.next_update:
            raise StateMismatch(
                f"no snapshot of update {self.state.next_update} to send a healing peer (the last boundary() was at "
                f"{self._at}): call heal.boundary() at every step boundary, before manager.start_quorum()")
        return self._snapshot

    def load_state_dict(self, incoming: wire.Incoming) -> None:
        """Apply a peer's verified snapshot to the live state (torchft calls it on the training thread): the
        experiment contract must match, every component, RNG stream, position and clock is restored."""
        started = time.perf_counter()
        where = f"heal of step {incoming.step}"
        check_state_schema(incoming.skeleton, where, "full", incoming.skeleton.get("clocks", {}).get("next_update", 0))
        payload = decode_state(incoming.skeleton, incoming.tensors)
        check_decoded(payload, where)
        for name, component in self.state.components.items():  # local shards dressed as this rank's DTensors
            if any(path == name or path.startswith((f"{name}.", f"{name}[")) for path in incoming.shards) or \
                    shards.sharded(component.state_dict()):
                entry = payload["components"].get(name)
                if entry is None:
                    continue  # (the contract and component checks below name what is missing)
                live = shards.live_state(component, name, entry["state"], incoming.shards)
                entry["state"] = shards.redress(entry["state"], live, name, incoming.shards, where)
        contract_mod.check(payload["contract"]["fields"], self.state.contract_fields(), where, ())
        warnings = snapshot.apply(self.state, payload)
        self._snapshot = self._at = None  # the next boundary() takes the healed state
        self.healed.append({"step": incoming.step, "update": self.state.next_update, "warnings": warnings,
                            "seconds": time.perf_counter() - started})

    def batches(self, loader: Any) -> Iterator[Any]:
        """Batches from ``loader`` (a :class:`~trainstate.ResumableLoader`), epoch after epoch, taking a fresh
        iterator after each heal: a heal restores the loader's position, which leaves an iterator taken before it
        stale."""
        while True:
            seen = len(self.healed)
            for batch in loader:
                yield batch
                if len(self.healed) != seen:
                    break

    def shutdown(self) -> None:
        self.transport.shutdown()


__all__ = ["Healing", "ManagerState", "TrainStateTransport"]
