"""Turn a TrainState into a pickle-free payload, and a verified payload back into live objects.

Capture reads live references (no copy); restore validates everything it
can against the live objects before the first ``load_state_dict`` call, and
restores RNG last so that nothing constructed or loaded can consume it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import contract as contract_mod
from . import rng as rng_mod
from ..format.codec import TensorTable, encode
from ..errors import StateMismatch, UnsupportedValue
from ..format import strictjson
from ..format.manifest import FORMAT_VERSION, MAX_JSON_BYTES
from .train_state import TrainState


def _type_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def capture(state: TrainState, *, kind: str = "full", include_grads: bool = False,
            unaccounted: dict[str, dict[str, torch.Tensor]] | None = None,
            view: Callable[[str, Any], Any] | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """The state skeleton (JSON-able) and the tensors it references, by name.

    A full generation holds every ``.grad`` with ``include_grads``, and otherwise the
    ``unaccounted`` ones (:meth:`TrainState.unaccounted_gradients`: no registered optimizer
    can tell whether they were consumed, so they are kept rather than dropped).
    ``view(name, state_dict)``: what of component ``name``'s state dict is encoded (a heal's local shards).
    """
    view = view or (lambda name, value: value)
    table = TensorTable()
    components = state.modules() if kind == "weights" else state.components
    skeleton: dict[str, Any] = {
        "format": "trainstate-state",
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "clocks": {"next_update": _count(state.next_update, "next_update"),
                   "tokens_seen": _count(state.tokens_seen, "tokens_seen")},
        "counters": {_name(k, "counters"): _count(v, f"counters.{k}") for k, v in state.counters.items()},
        "facts": encode(state.facts, "facts", table),  # anything the codec stores exactly (inf, tuples, int keys)
        "components": {name: {"type": _type_name(c), "state": encode(view(name, c.state_dict()), name, table)}
                       for name, c in components.items()},
        "contract": {"fields": state.contract_fields(), "versions": contract_mod.versions()},
        "history": contract_mod.canonical(state.history, "history"),
    }
    if kind == "full":
        state._warn_unregistered_schedulers()
        skeleton["rng"] = encode(rng_mod.capture(state.rngs, include_globals=state.capture_global_rngs), "rng", table)
        skeleton["pending_gradients"] = include_grads
        if include_grads:
            skeleton["grads"] = {
                name: encode({p: t.grad for p, t in m.named_parameters() if t.grad is not None}, f"grads.{name}", table)
                for name, m in state.modules().items()}
        elif unaccounted:
            skeleton["grads"] = {name: encode(grads, f"grads.{name}", table) for name, grads in unaccounted.items()}
    _check_readable(skeleton)
    return skeleton, table.tensors


def _check_readable(skeleton: dict) -> None:
    """Refuse now a state.json that restore would refuse: over the metadata size limit, or holding more
    objects and arrays than the reader's memory bound allows (see ``format.strictjson``)."""
    data = state_json(skeleton)
    if len(data) <= MAX_JSON_BYTES and strictjson.containers(data) <= strictjson.container_limit(len(data)):
        return
    parts = {name: c["state"] for name, c in skeleton["components"].items()}
    parts.update((k, v) for k, v in skeleton.items() if k != "components")
    texts = {k: state_json({"": v}) for k, v in parts.items()}
    bulk = len if len(data) > MAX_JSON_BYTES else strictjson.containers
    worst = max(texts, key=lambda k: bulk(texts[k]))
    raise UnsupportedValue(worst, parts[worst], (
        f"The state would be {len(data):,} bytes of JSON with {strictjson.containers(data):,} objects, lists "
        f"and tuples; restore reads at most {MAX_JSON_BYTES:,} bytes and one of those per "
        f"{strictjson.BYTES_PER_CONTAINER} bytes (at least {strictjson.MIN_CONTAINERS:,}). Store bulk data "
        "as a tensor or numpy array."))


def _name(key: object, path: str) -> str:
    if type(key) is not str:
        raise UnsupportedValue(f"{path}[{key!r}]", key, "Counters are named: their keys must be strings.")
    return key


def _count(value: object, path: str) -> int:
    if type(value) is not int or value < 0:
        raise UnsupportedValue(path, value, "Clocks and counters must be non-negative Python ints.")
    return value


def state_json(skeleton: dict) -> bytes:
    return json.dumps(skeleton, separators=(",", ":"), allow_nan=False).encode()


def changed_parts(saved_state: bytes, skeleton: dict) -> list[str]:
    """Which parts of a state differ from a saved ``state.json``, in words (for a log line): ``counters``,
    ``facts``, ``rng``, ``components.optimizer``, ... Tensor values are not compared (tensors are
    references here); a shape or a new tensor shows as the component changing."""
    try:
        saved = json.loads(saved_state)
    except ValueError:
        return ["the state"]
    if type(saved) is not dict:
        return ["the state"]
    out = []
    for key in sorted(set(saved) | set(skeleton)):
        old, new = saved.get(key), skeleton.get(key)
        if key == "components" and type(old) is dict and type(new) is dict:
            out += [f"components.{n}" for n in sorted(set(old) | set(new)) if old.get(n) != new.get(n)]
        elif old != new:
            out.append(key)
    return out or ["the state"]


def check_components(state: TrainState, saved: dict[str, Any], generation: str) -> None:
    """Names and kinds of the saved components must match the live ones.

    The identity rule: a module is identified by its architecture (the
    contract, and the key, shape and dtype checks below), so its class is
    recorded but not enforced: ``__main__.Net`` from a training script
    restores into ``netdef.Net`` imported from a module, a LazyLinear into
    the Linear it became. torch's own classes must match exactly (SGD is not
    Adam). Any other class must keep its qualified name, wherever its module
    now lives. A module never stands in for another kind of component, or
    back: the saved contract records an architecture exactly for modules.
    """
    saved_components = saved["components"]
    if set(saved_components) != set(state.components):
        raise StateMismatch(
            f"{generation} holds components {sorted(saved_components)} but this TrainState has "
            f"{sorted(state.components)}; construct the TrainState with the same component names")
    fields = saved.get("contract", {}).get("fields", {})
    for name, component in state.components.items():
        record = saved_components[name]
        saved_type = record.get("type") if type(record) is dict else None
        why = _identity_problem(component, saved_type, f"architecture.{name}" in fields)
        if why:
            raise StateMismatch(f"component {name!r}: {generation} saved a {saved_type!r}, "
                                f"this run has a {_type_name(component)!r}; {why}")
        if isinstance(component, torch.nn.Module):
            _check_module(name, component, record["state"], generation, fields.get(f"architecture.{name}"))
        elif isinstance(component, torch.optim.Optimizer):
            _check_optimizer(name, component, record["state"], generation)


def _identity_problem(component: object, saved_type: object, saved_module: bool) -> str | None:
    """Why ``component`` cannot continue a component saved as ``saved_type``, or None if it can."""
    if isinstance(component, torch.nn.Module) or saved_module:
        if isinstance(component, torch.nn.Module) and saved_module:
            return None  # the architecture decides
        return "a saved module restores only into a module, and a module only from a saved module"
    live = _type_name(component)
    if saved_type == live:
        return None
    if type(saved_type) is str and not _torch_class(saved_type) and not _torch_class(live) \
            and saved_type.endswith("." + type(component).__qualname__):
        return None  # the class moved to another module (or out of __main__)
    return ("the component must be of the same class (torch's own classes exactly; your own classes by "
            "qualified name, wherever their module now lives)")


def _torch_class(type_name: str) -> bool:
    return type_name.startswith("torch.")


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
            if contract_mod.is_uninitialized(param):
                continue  # a lazy module's parameter: loading the module gives it the saved shape
            for key, value in (entry.items() if type(entry) is dict else ()):
                if key in _PARAM_SHAPED and isinstance(value, torch.Tensor) and value.shape != param.shape:
                    raise StateMismatch(
                        f"optimizer {name!r}: group {g} parameter {j} has {key} of shape {tuple(value.shape)} in "
                        f"{generation}, but the live parameter is {tuple(param.shape)}: parameter groups are "
                        "in another order or hold other parameters")


def _check_module(name: str, module: torch.nn.Module, saved: object, generation: str,
                  saved_architecture: object = None) -> None:
    live = module.state_dict(keep_vars=True)
    if not isinstance(saved, dict):  # an OrderedDict from format 2 on
        raise StateMismatch(f"component {name!r} in {generation} is not a state dict")
    missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
    if missing or unexpected:
        raise StateMismatch(f"component {name!r}: keys missing from {generation}: {missing[:10]}, "
                            f"unexpected: {unexpected[:10]}")
    for key, tensor in live.items():
        got = saved[key]
        if not isinstance(tensor, torch.Tensor):
            continue
        lazy = contract_mod.is_uninitialized(tensor)  # load_state_dict materializes it with the saved shape
        if not isinstance(got, torch.Tensor) or got.dtype != tensor.dtype or (not lazy and got.shape != tensor.shape):
            desc = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__
            shape = "(uninitialized)" if lazy else tuple(tensor.shape)
            raise StateMismatch(f"{name}.{key}: {generation} has {desc}, this run has {shape} {tensor.dtype}")
    if not contract_mod.has_tie_record(saved_architecture):
        _check_unrecorded_ties(name, live, saved, generation)


def _check_unrecorded_ties(name: str, live: dict[str, Any], saved: dict[str, Any], generation: str) -> None:
    """A generation from before ties were recorded: its tensors say whether they were tied.

    The codec stores a tied tensor once, so a tied checkpoint decodes to one
    tensor object under every name. Distinct tensors loaded into one live
    tensor would lose all but the last, unless they hold the same values.
    """
    for names in contract_mod.tie_groups(live):
        first = saved[names[0]]
        for other in names[1:]:
            got = saved[other]
            if got is first or (not got.is_meta and not first.is_meta and torch.equal(got, first)):
                continue
            raise StateMismatch(
                f"architecture.{name}.{other}: this run ties it to {names[0]}, but {generation} (written before "
                "ties were recorded) holds two different tensors: loading would lose one of them. Build the "
                "model untied, as it was saved (and tie it after restoring, if that is the change you want)")


def check_before_load(state: TrainState, payload: dict[str, Any], *, statistical_cuda: bool = False) -> list[str]:
    """Every check that must pass before the first live object changes; returns RNG warnings.

    The RNG record (validated on scratch generators), saved gradients, and
    each component's optional ``check_state_dict``. Works on a preview payload
    (meta tensors) too.
    """
    warnings = rng_mod.validate(payload.get("rng", {}), state.rngs, statistical_cuda=statistical_cuda,
                                restore_globals=state.capture_global_rngs)
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
        rng_mod.apply_validated(rng_saved, state.rngs, restore_globals=state.capture_global_rngs)
        if state.capture_global_rngs and rng_saved.get("torch_cuda"):
            rng_mod.keep_dtensor_streams(state.modules())  # TP dropout continues each rank's restored stream
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
    fresh tensors, which then become its state). Memory the state does not
    own for writing is never a destination: read-only NumPy arrays (over
    ``bytes``, or marked non-writeable) and inference tensors are loaded by
    replacement instead.
    """
    table = TensorTable()
    readonly: list[tuple[int, int]] = []
    for name, component in state.components.items():
        try:
            saved = component.state_dict()
            encode(saved, name, table)
        except Exception:  # noqa: BLE001 - it could not be saved either; loading it by replacement reports it
            continue
        _readonly_arrays(saved, readonly)

    def writable(t: torch.Tensor) -> bool:
        start = t.data_ptr()
        return not t.is_inference() and not any(lo <= start < hi for lo, hi in readonly)

    return {n: t.detach() for n, t in table.tensors.items() if t.device.type == "cpu" and writable(t)}


def _readonly_arrays(value: Any, out: list[tuple[int, int]]) -> None:
    """Address ranges of every non-writeable NumPy array inside ``value``."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, np.ndarray):
            if not node.flags.writeable and node.nbytes:
                start = node.__array_interface__["data"][0]
                out.append((start, start + node.nbytes))
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)


def _restore_grads(state: TrainState, payload: dict[str, Any]) -> None:
    grads = payload.get("grads")
    for name, module in state.modules().items():
        saved = (grads or {}).get(name, {})
        for pname, param in module.named_parameters():
            grad = saved.get(pname)
            param.grad = None if grad is None else grad.to(param.device)
    if grads:
        state._grads.mark_pending()


def frozen(state: TrainState, tensors: dict[str, torch.Tensor]) -> frozenset[str]:
    """The names among ``tensors`` (a capture's) that are parameters not requiring gradients: a frozen base's.
    A guide for the first layout of an incremental generation, never proof that their bytes stay the same."""
    def place(t: torch.Tensor) -> tuple | None:
        if t.layout != torch.strided or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return None
        return t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())

    still = {place(p) for m in state.modules().values() for p in m.parameters() if not p.requires_grad} - {None}
    return frozenset(n for n, t in tensors.items() if place(t) in still) if still else frozenset()
