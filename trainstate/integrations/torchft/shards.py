"""A replica group's ranks heal shard by shard: each sends and receives its own DTensors' local shards.

Inside a replica group of several ranks (FSDP2, tensor parallel), a
parameter or an optimizer moment is a ``DTensor``: each rank holds one
shard. torchft pairs rank *r* of a healing group with rank *r* of a live
one, whose shards sit at the same coordinates of the same mesh, so each
rank moves exactly its local shard, never the whole tensor (no collective
from torchft's quorum thread, no gather of the model). The sender replaces
each DTensor of a component's state by its local tensor and records its
layout (:func:`local_view`); the receiver checks that layout against its own
live DTensor (the same global shape, placements, mesh and coordinate) and
dresses the verified local tensor as that DTensor again (:func:`redress`)
before the component's own ``load_state_dict`` copies it in. A group laid
out differently is refused (:class:`~trainstate.errors.StateMismatch`): a
shard never lands at another coordinate.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ...errors import StateMismatch
from ...format.codec import child_path


def layout(tensor: DTensor) -> dict[str, Any]:
    """What places a DTensor's local shard: the JSON the sender records and the receiver compares."""
    mesh = tensor.device_mesh
    return {"shape": list(tensor.shape), "placements": [str(p) for p in tensor.placements],
            "mesh": list(mesh.shape), "coordinate": list(mesh.get_coordinate() or []),
            "local": list(tensor._local_tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


def local_view(value: Any, path: str, shards: dict[str, dict]) -> Any:
    """``value`` (a component's state dict) with every DTensor replaced by its local tensor, recorded in
    ``shards`` by key path. The local tensors are the live ones (no copy): the snapshot's contract."""
    if isinstance(value, DTensor):
        shards[path] = layout(value)
        return value._local_tensor
    if isinstance(value, dict):
        items = ((k, local_view(v, child_path(path, k), shards)) for k, v in value.items())
        return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
    if type(value) in (list, tuple):
        return type(value)(local_view(v, f"{path}[{i}]", shards) for i, v in enumerate(value))
    return value


def redress(saved: Any, live: Any, path: str, shards: dict[str, dict], where: str) -> Any:
    """``saved`` (a decoded, verified state) with each local tensor the sender recorded in ``shards`` dressed as
    the DTensor at the same path of ``live`` (this rank's state dict), after checking that both lay out the
    shard alike. A DTensor here where the sender had a plain tensor, or the reverse, is refused."""
    if path in shards:
        theirs = shards[path]
        if not isinstance(live, DTensor):
            raise StateMismatch(f"{where}: {path} is sharded on the peer ({theirs['placements']} over a mesh of "
                                f"{theirs['mesh']}) but a plain tensor here: the groups must be laid out alike")
        ours = layout(live)
        if ours != theirs or not isinstance(saved, torch.Tensor) or list(saved.shape) != ours["local"]:
            raise StateMismatch(f"{where}: the peer's shard of {path} is laid out as {theirs}, this rank's as "
                                f"{ours}: a replacement group must shard as the group it replaces (the same mesh, "
                                "placements and rank order)")
        return DTensor.from_local(saved.to(live._local_tensor.device), live.device_mesh, live.placements,
                                  run_check=False, shape=live.shape, stride=live.stride())
    if isinstance(live, DTensor):
        raise StateMismatch(f"{where}: {path} is sharded here ({[str(p) for p in live.placements]}) but the peer "
                            "sent it whole: the groups must be laid out alike")
    if isinstance(saved, dict) and isinstance(live, dict):
        out = {k: redress(v, live.get(k), child_path(path, k), shards, where) for k, v in saved.items()}
        return OrderedDict(out) if isinstance(saved, OrderedDict) else out
    if type(saved) in (list, tuple) and type(live) in (list, tuple) and len(saved) == len(live):
        return type(saved)(redress(v, w, f"{path}[{i}]", shards, where) for i, (v, w) in enumerate(zip(saved, live)))
    return saved


def live_state(component: Any, name: str, saved: Any, shards: dict[str, dict]) -> Any:
    """What :func:`redress` compares ``saved`` with: the component's state dict, and for an optimizer that has not
    stepped yet (a replacement group's, fresh), each moment the sender sharded stood for by its parameter, whose
    layout a moment shares."""
    live = component.state_dict()
    if not isinstance(component, torch.optim.Optimizer) or not isinstance(saved, dict):
        return live
    params = [p for group in component.param_groups for p in group["params"]]
    state = dict(live.get("state", {}))
    for index, entry in (saved.get("state") or {}).items():
        if index in state or type(index) is not int or not 0 <= index < len(params) or not isinstance(entry, dict):
            continue
        state[index] = {key: params[index] if f"{name}.state[{index}].{key}" in shards else None for key in entry}
    return {**live, "state": state}


def sharded(state_dict: Any) -> bool:
    """Whether a state dict holds any DTensor (then the heal moves its local shards)."""
    if isinstance(state_dict, DTensor):
        return True
    if isinstance(state_dict, dict):
        return any(sharded(v) for v in state_dict.values())
    if type(state_dict) in (list, tuple):
        return any(sharded(v) for v in state_dict)
    return False
