"""Turn a TrainState into a pickle-free payload, and a verified payload back into live objects.

Capture reads live references (no copy); restore validates everything it
can against the live objects before the first ``load_state_dict`` call, and
restores RNG last so that nothing constructed or loaded can consume it.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from . import contract as contract_mod
from . import rng as rng_mod
from ..format.codec import TensorTable, encode
from ..errors import StateMismatch, UnsupportedValue
from ..format.manifest import FORMAT_VERSION
from .train_state import TrainState


def _type_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def capture(state: TrainState, *, kind: str = "full", include_grads: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """The state skeleton (JSON-able) and the tensors it references, by name."""
    table = TensorTable()
    components = state.modules() if kind == "weights" else state.components
    skeleton: dict[str, Any] = {
        "format": "trainstate-state",
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "clocks": {"next_update": _count(state.next_update, "next_update"),
                   "tokens_seen": _count(state.tokens_seen, "tokens_seen")},
        "counters": {k: _count(v, f"counters.{k}") for k, v in state.counters.items()},
        "facts": encode(contract_mod.canonical(state.facts, "facts"), "facts", table),
        "components": {name: {"type": _type_name(c), "state": encode(c.state_dict(), name, table)}
                       for name, c in components.items()},
        "contract": {"fields": state.contract_fields(), "versions": contract_mod.versions()},
        "history": contract_mod.canonical(state.history, "history"),
    }
    if kind == "full":
        skeleton["rng"] = encode(rng_mod.capture(state.rngs, include_globals=state.capture_global_rngs), "rng", table)
        skeleton["pending_gradients"] = include_grads
        if include_grads:
            skeleton["grads"] = {
                name: encode({p: t.grad for p, t in m.named_parameters() if t.grad is not None}, f"grads.{name}", table)
                for name, m in state.modules().items()}
    return skeleton, table.tensors


def _count(value: object, path: str) -> int:
    if type(value) is not int or value < 0:
        raise UnsupportedValue(path, value, "Clocks and counters must be non-negative Python ints.")
    return value


def state_json(skeleton: dict) -> bytes:
    return json.dumps(skeleton, separators=(",", ":"), allow_nan=False).encode()


def check_components(state: TrainState, saved: dict[str, Any], generation: str) -> None:
    """Names and types of the saved components must match the live ones."""
    saved_components = saved["components"]
    if set(saved_components) != set(state.components):
        raise StateMismatch(
            f"{generation} holds components {sorted(saved_components)} but this TrainState has "
            f"{sorted(state.components)}; construct the TrainState with the same component names")
    for name, component in state.components.items():
        record = saved_components[name]
        if type(record) is not dict or record.get("type") != _type_name(component):
            raise StateMismatch(f"component {name!r}: {generation} saved a {record.get('type')!r}, "
                                f"this run has a {_type_name(component)!r}")
        if isinstance(component, torch.nn.Module):
            _check_module(name, component, record["state"], generation)
        elif isinstance(component, torch.optim.Optimizer):
            _check_optimizer(name, component, record["state"], generation)


# Per-parameter optimizer state shaped like the parameter (torch.optim's built-in optimizers).
_PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg",
                           "acc_delta", "grad_avg", "ax", "prev", "step_size", "exp_inf", "mu_product_buf"})


def _check_optimizer(name: str, optimizer: torch.optim.Optimizer, saved: object, generation: str) -> None:
    """Pair saved per-parameter state with the live parameters, as load_state_dict will, and check shapes.

    ``load_state_dict`` checks only the number of groups and of parameters per
    group: swapped groups of equal sizes load silently, each moment landing
    on the wrong parameter. Shapes catch that.
    """
    if type(saved) is not dict or type(saved.get("param_groups")) is not list or type(saved.get("state")) is not dict:
        raise StateMismatch(f"component {name!r} in {generation} is not an optimizer state dict")
    groups, live = saved["param_groups"], optimizer.param_groups
    sizes = [len(g.get("params", ())) if type(g) is dict else None for g in groups]
    if sizes != [len(g["params"]) for g in live]:
        raise StateMismatch(f"optimizer {name!r}: {generation} has parameter groups of sizes {sizes}, this run has "
                            f"{[len(g['params']) for g in live]}; build the optimizer with the same groups in order")
    for g, (saved_group, live_group) in enumerate(zip(groups, live)):
        for j, (pid, param) in enumerate(zip(saved_group["params"], live_group["params"])):
            entry = saved["state"].get(pid)
            for key, value in (entry.items() if type(entry) is dict else ()):
                if key in _PARAM_SHAPED and isinstance(value, torch.Tensor) and value.shape != param.shape:
                    raise StateMismatch(
                        f"optimizer {name!r}: group {g} parameter {j} has {key} of shape {tuple(value.shape)} in "
                        f"{generation}, but the live parameter is {tuple(param.shape)}: parameter groups are "
                        "in another order or hold other parameters")


def _check_module(name: str, module: torch.nn.Module, saved: object, generation: str) -> None:
    live = module.state_dict()
    if type(saved) is not dict:
        raise StateMismatch(f"component {name!r} in {generation} is not a state dict")
    missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
    if missing or unexpected:
        raise StateMismatch(f"component {name!r}: keys missing from {generation}: {missing[:10]}, "
                            f"unexpected: {unexpected[:10]}")
    for key, tensor in live.items():
        got = saved[key]
        if isinstance(tensor, torch.Tensor) and (
                not isinstance(got, torch.Tensor) or got.shape != tensor.shape or got.dtype != tensor.dtype):
            desc = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__
            raise StateMismatch(f"{name}.{key}: {generation} has {desc}, "
                                f"this run has {tuple(tensor.shape)} {tensor.dtype}")


def check_before_load(state: TrainState, payload: dict[str, Any], *, statistical_cuda: bool = False) -> list[str]:
    """Every check that must pass before the first live object changes; returns RNG warnings.

    The RNG record (validated on scratch generators), saved gradients, and
    each component's optional ``check_state_dict``. Works on a preview payload
    (meta tensors) too.
    """
    warnings = rng_mod.validate(payload.get("rng", {}), state.rngs, statistical_cuda=statistical_cuda)
    check_grads(state, payload)
    for name, component in state.components.items():
        check = getattr(component, "check_state_dict", None)
        if callable(check):
            check(payload["components"][name]["state"])
    return warnings


def apply(state: TrainState, payload: dict[str, Any], *, statistical_cuda: bool = False,
          apply_rng: bool = True, checked: list[str] | None = None) -> list[str]:
    """Load a decoded, verified, contract-checked payload into the live state.

    Returns warnings. Order: components (registration order), gradients,
    clocks, and RNG last. With ``apply_rng=False`` the RNG record is
    validated but no generator changes (a rehearsal in a live process).
    ``checked``: the warnings of a :func:`check_before_load` the caller already ran.
    """
    rng_saved = payload.get("rng", {})
    warnings = checked if checked is not None else check_before_load(state, payload,
                                                                      statistical_cuda=statistical_cuda)
    for name, component in state.components.items():
        saved = payload["components"][name]["state"]
        try:
            if isinstance(component, torch.nn.Module):
                component.load_state_dict(saved, strict=True)
            else:
                component.load_state_dict(saved)
        except (ValueError, KeyError, RuntimeError, TypeError, IndexError, AttributeError) as exc:
            raise StateMismatch(
                f"component {name!r} rejected the saved state ({type(exc).__name__}: {exc!s:.300}). Components "
                "loaded before it now hold checkpoint values: rebuild the live objects before trying another "
                "generation") from exc
    _restore_grads(state, payload)
    clocks = payload["clocks"]
    state.next_update = clocks["next_update"]
    state.tokens_seen = clocks["tokens_seen"]
    state.counters = dict(payload["counters"])
    state.facts = payload["facts"]
    state.history = list(payload["history"])
    if apply_rng:
        rng_mod.apply_validated(rng_saved, state.rngs, restore_cuda=not warnings)
    return warnings


def check_grads(state: TrainState, payload: dict[str, Any]) -> None:
    """Saved gradients must name live parameters and match their shape and dtype."""
    modules = state.modules()
    for name, grads in payload.get("grads", {}).items():
        if name not in modules:
            raise StateMismatch(f"saved gradients for {name!r}, which is not a module of this TrainState")
        params = dict(modules[name].named_parameters())
        for pname, grad in grads.items():
            param = params.get(pname)
            if param is None or grad.shape != param.shape or grad.dtype != param.dtype:
                raise StateMismatch(f"saved gradient {name}.{pname} does not fit the live parameter")


def destinations(state: TrainState) -> dict[str, torch.Tensor]:
    """Live tensors by the names a snapshot of ``state`` would give them: where an in-place restore reads to.

    Module parameters and buffers, and optimizer state that already exists
    (an optimizer that has not stepped has none: its moments are read into
    fresh tensors, which then become its state).
    """
    table = TensorTable()
    for name, component in state.components.items():
        try:
            encode(component.state_dict(), name, table)
        except UnsupportedValue:
            continue  # it could not be saved either; the load path reports it
    return {n: t.detach() for n, t in table.tensors.items() if t.device.type == "cpu"}


def _restore_grads(state: TrainState, payload: dict[str, Any]) -> None:
    grads = payload.get("grads")
    for name, module in state.modules().items():
        saved = (grads or {}).get(name, {})
        for pname, param in module.named_parameters():
            grad = saved.get(pname)
            param.grad = None if grad is None else grad.to(param.device)
    if grads:
        state._grads.mark_pending()
