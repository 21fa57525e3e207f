"""A replica group sharded by FSDP2 heals shard by shard (``trainstate.integrations.torchft.shards``).

In this process, a one-rank gloo group and FSDP2 (``fully_shard``): parameters and AdamW moments are DTensors.
The heal sends each DTensor's local shard with its layout and the receiver dresses it as its own DTensor again;
a receiver laid out otherwise (sharded where the sender was not, or the reverse) is refused before any live
tensor changes. The multi-rank heal under torchrun with the real torchft is in tests/test_torchft.py.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchft")

import trainstate as ts  # noqa: E402
from trainstate.errors import StateMismatch  # noqa: E402
from trainstate.integrations.torchft import Healing, wire  # noqa: E402


@pytest.fixture
def group(tmp_path):
    """A one-rank gloo process group for this test only (destroyed after it, so no other test sees one)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _state(seed: int, sharded: bool, stepped: bool = True) -> ts.TrainState:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    if sharded:
        fully_shard(model[0])  # the first layer sharded, the last one plain (replicated in the group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if stepped:
        model(torch.randn(5, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    state = ts.TrainState(model=model, optimizer=opt, rngs={"noise": torch.Generator().manual_seed(seed)})
    state.next_update = 1
    return state


def _send(heal: Healing, step: int = 3) -> wire.Incoming:
    heal.boundary()
    snap = heal.state_dict()
    out = bytearray()
    for piece in wire.frame(snap["skeleton"], snap["tensors"], step=step, torchft={"step": step},
                            shards=snap["shards"]).pieces():
        out += piece
    return wire.receive(io.BytesIO(bytes(out)), step=step, key=None, where="test stream")


def _local(state: ts.TrainState) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    for index, entry in state["optimizer"].state_dict()["state"].items():
        out.update({f"optimizer.{index}.{k}": v for k, v in entry.items()})
    return {k: getattr(v, "_local_tensor", v) for k, v in out.items()}


@pytest.mark.parametrize("fresh", [False, True], ids=["stepped", "fresh-optimizer"])
def test_a_sharded_group_sends_local_shards_and_the_receiver_keeps_its_dtensors(group, fresh):
    """A replacement group's optimizer has no state yet (``fresh``): its moments take their parameters' layout."""
    from torch.distributed.tensor import DTensor

    sender, receiver = _state(0, True), _state(1, True, stepped=not fresh)
    incoming = _send(Healing(sender))
    assert incoming.shards and all(not isinstance(t, DTensor) for t in incoming.tensors.values())
    assert {"model.0.weight", "optimizer.state[0].exp_avg"} <= set(incoming.shards), sorted(incoming.shards)
    assert "model.2.weight" not in incoming.shards  # the plain layer travels as it is
    params = [p for p in receiver["model"].parameters()]
    heal = Healing(receiver)
    heal.load_state_dict(incoming)
    assert [p for p in receiver["model"].parameters()] == params  # loaded into the live parameters
    assert isinstance(receiver["model"][0].weight, DTensor) and not isinstance(receiver["model"][2].weight, DTensor)
    theirs, ours = _local(sender), _local(receiver)
    assert set(theirs) == set(ours) and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    assert torch.equal(receiver.rngs["noise"].get_state(), sender.rngs["noise"].get_state())
    assert receiver.next_update == sender.next_update
    moments = receiver["optimizer"].state_dict()["state"][0]
    assert isinstance(moments["exp_avg"], DTensor) and isinstance(moments["exp_avg_sq"], DTensor), moments
    for state in (sender, receiver):  # both take the same next step, bitwise
        torch.manual_seed(7)
        state["model"](torch.randn(5, 8)).square().mean().backward()
        state["optimizer"].step()
    theirs, ours = _local(sender), _local(receiver)
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)


@pytest.mark.parametrize("sender_sharded", [True, False])
def test_a_group_laid_out_otherwise_is_refused_before_anything_changes(group, sender_sharded):
    sender, receiver = _state(0, sender_sharded), _state(1, not sender_sharded)
    incoming = _send(Healing(sender))
    before = {k: v.clone() for k, v in _local(receiver).items()}
    with pytest.raises(StateMismatch, match="laid out alike"):
        Healing(receiver).load_state_dict(incoming)
    after = _local(receiver)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_control_without_the_layout_a_shard_would_be_refused_by_the_module(group):
    """Sent without its layout, a local shard reaches ``load_state_dict`` as a plain tensor where the module holds
    a DTensor: what the layout check names first (rather than torch's "mixed Tensor and DTensor")."""
    sender, receiver = _state(0, True), _state(1, True)
    incoming = _send(Healing(sender))
    incoming.shards.clear()
    with pytest.raises(StateMismatch, match="sent it whole"):
        Healing(receiver).load_state_dict(incoming)
