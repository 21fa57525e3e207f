"""What each rank contributes to a multi-rank generation, taken at one update boundary.

Three parts:

- **sharded** (through DCP): every module and optimizer, via DCP's
  distributed state-dict API (``get_model_state_dict``/``get_optimizer_state_dict``),
  so FSDP2 shards stay shards and replicated (DDP, plain) tensors are written
  once. Replicas are compared by digest first: DCP's deduplication would
  otherwise keep one rank's copy of a replica that silently diverged.
- **global** (``state.json`` and ``tensors.safetensors``, written by rank 0):
  clocks, the contract, history, and every other component whose state is
  the same on all ranks (schedulers, scalers, ...).
- **per rank** (``rank-<r>.json`` and ``rank-<r>.safetensors``): RNG streams,
  and whatever differs between ranks (a data loader's position, rank-owned
  counters or facts). Per-rank values never pass through DCP keys, which DCP
  would deduplicate across ranks.
"""

from __future__ import annotations

import itertools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from ..errors import CheckpointFailed, InvalidArgument, PendingGradients, StateMismatch
from ..format import tensorfile
from ..format.codec import TensorTable, encode
from ..format.digest import new_hasher
from ..format.manifest import FORMAT_VERSION
from ..state import contract as contract_mod
from ..state import rng as rng_mod
from ..state.snapshot import _type_name, state_json
from ..state.train_state import TrainState
from .group import Ranks

try:  # (private in torch since 2.2: how get_model_state_dict names a parameter, wrappers' prefixes removed)
    from torch.distributed.checkpoint.state_dict import _get_fqns
except ImportError:  # pragma: no cover - a torch without it loses the layout hint, never a save
    _get_fqns = None


@dataclass
class RankSnapshot:
    """One rank's share of a generation."""

    dcp: dict[str, Any]  # component -> state dict, for DCP
    sharded: dict[str, dict]  # component -> {"type", "kind", "owner"}
    global_skeleton: dict  # what state.json holds (identical on every rank)
    global_tensors: dict[str, torch.Tensor]
    rank_skeleton: dict
    rank_tensors: dict[str, torch.Tensor]
    data: dict = field(default_factory=dict)  # this rank's data positions (rank 0's go into the manifest)
    total_bytes: int = 0  # what every rank stages and writes, summed (for rank 0's disk preflight)
    frozen: frozenset[str] = frozenset()  # DCP names of parameters not requiring gradients (a layout guide)


def sharded_bytes(value: Any) -> int:
    """The bytes of a DCP state dict's tensors on this rank (a DTensor's local shard)."""
    if hasattr(value, "to_local"):
        return value.to_local().nbytes
    if hasattr(value, "nbytes") and not isinstance(value, (bytes, bytearray)):
        return int(value.nbytes)
    if isinstance(value, dict):
        return sum(sharded_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(sharded_bytes(v) for v in value)
    return 0


def owners(state: TrainState) -> dict[str, str]:
    """For each registered optimizer, the registered module all of whose parameters it updates."""
    modules = state.modules()
    out = {}
    for name, component in state.components.items():
        if not isinstance(component, torch.optim.Optimizer):
            continue
        params = {id(p) for group in component.param_groups for p in group["params"]}
        owner = [m for m, module in modules.items() if params <= {id(p) for p in module.parameters()}]
        if not owner:
            raise InvalidArgument(
                f"optimizer {name!r} updates parameters that are not all in one registered module; in a multi-rank "
                "run each optimizer's parameters must belong to one module registered in the TrainState (its "
                "sharded state is keyed by that module's parameter names)")
        out[name] = owner[0]
    return out


def sharded_state(state: TrainState, *, weights_only: bool = False) -> tuple[dict[str, Any], dict[str, dict]]:
    """The DCP state dict (component -> state dict) and what each sharded component is."""
    modules = state.modules()
    dcp = {name: module.state_dict() if name in state.own_keys else get_model_state_dict(module)
           for name, module in modules.items()}
    described = {name: {"type": _type_name(module), "kind": "module", "owner": None} for name, module in modules.items()}
    if not weights_only:
        for name, owner in owners(state).items():
            dcp[name] = get_optimizer_state_dict(modules[owner], state.components[name])
            described[name] = {"type": _type_name(state.components[name]), "kind": "optimizer", "owner": owner}
    return dcp, described


def loaded_in_place(module: torch.nn.Module, loaded: dict[str, Any]) -> bool:
    """Whether every tensor of ``loaded`` (the module's state dict that DCP loaded into) is one of the module's
    own parameters or buffers, whole: then the load already wrote the live tensors, and ``set_model_state_dict``
    would only copy each onto itself (through DTensor's dispatch, milliseconds per restore)."""
    def where(tensor: torch.Tensor) -> tuple:
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank
        return local.device, local.dtype, local.data_ptr(), tuple(local.shape), tuple(local.stride())

    live = {where(t) for t in itertools.chain(module.parameters(), module.buffers())}
    return all(isinstance(v, torch.Tensor) and where(v) in live for v in loaded.values())


def contract_fields(state: TrainState, world_size: int) -> dict[str, Any]:
    """The contract of a multi-rank run: the same on every rank (a loader's rank is dropped), plus the world size."""
    fields = state.contract_fields()
    for key, value in list(fields.items()):
        if key.startswith("loader.") and type(value) is dict:
            fields[key] = {k: v for k, v in value.items() if k not in ("rank", "world_size")}
    fields["world_size"] = world_size
    return fields


def _digest(skeleton: Any, tensors: dict[str, torch.Tensor]) -> str:
    hasher = new_hasher("blake3")
    hasher.update(json.dumps(skeleton, sort_keys=True, separators=(",", ":"), allow_nan=False).encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        hasher.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        hasher.update(tensorfile.byte_view(tensor.detach().cpu().contiguous()))
    return hasher.hexdigest()


def _replica_digests(dcp: dict[str, Any]) -> dict[str, str]:
    """A fingerprint of every replicated (non-DTensor) tensor of the sharded part, by flattened key: what rank 0
    compares across ranks to find replicas that diverged (under DDP, every parameter and moment).

    It runs on the training thread at every save, background saves included, so it is made cheap: XXH3-128 (a
    divergence is not an attack; the fingerprints never leave this save's rounds), the tensors spread over
    threads (the hash releases the GIL), a CPU tensor read in place."""
    found: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, DTensor):
            return
        if isinstance(node, torch.Tensor):
            found[path] = node
        elif isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}")
    for name, value in dcp.items():
        walk(value, name)
    if len(found) < 2 or sum(t.nbytes for t in found.values()) < (8 << 20):
        return {path: _fingerprint(t) for path, t in found.items()}
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="trainstate-replicas") as pool:
        return dict(zip(found, pool.map(_fingerprint, found.values())))


def _fingerprint(tensor: torch.Tensor) -> str:
    hasher = xxhash.xxh3_128(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    hasher.update(tensorfile.byte_view(tensor.detach().cpu().contiguous()))
    return hasher.hexdigest()


def _settings(dcp: dict[str, Any]) -> str:
    """A digest of everything in the sharded part but tensor values (param groups, step counts' shapes, ...).

    It goes into ``state.json``, so that a second save at the same update
    notices a changed learning rate as it notices a changed counter.
    """
    def strip(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return ["tensor", str(node.dtype), list(node.shape)]
        if isinstance(node, dict):
            return {str(k): strip(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [strip(v) for v in node]
        if isinstance(node, float) and node != node or node in (float("inf"), float("-inf")):
            return repr(node)
        return node if node is None or isinstance(node, (bool, int, float, str)) else repr(node)
    return _digest(strip(dcp), {})


def capture(state: TrainState, ranks: Ranks, *, weights_only: bool = False, head: Any = None,
            error: BaseException | None = None) -> tuple[RankSnapshot, Any]:
    """This rank's share, with every cross-rank check done, and rank 0's ``head`` (a collective: every rank calls it).

    Two rounds, each O(1) bytes per rank: every rank's compact report (digests only, and any failure: ``error``,
    or one raised here while capturing) gathered to rank 0, then rank 0's decision broadcast (which components
    differ between ranks, its ``head``, or the failure that every rank raises at once). Only when the ranks
    disagree does a third round carry each rank's full report, so that rank 0 can name what differs.
    """
    detail: dict = {}
    if _gathers_objects(state):  # FSDP1's state dicts run object collectives on its own group: a rank that would
        try:                     # skip them (its error, or rank 0's) must say so first, or the others hang there
            error = error or _refusal(state, weights_only)
        except Exception as exc:  # noqa: BLE001 - agreed below, then raised as it was
            error = exc
        ranks.check("capture", error)
    try:
        if error is None:
            dcp, sharded, others, encoded, fields, detail = _local(state, ranks, weights_only)
    except Exception as exc:  # noqa: BLE001 - carried to every rank, then raised here as it was
        error = exc
    text = "" if error is None else f"{type(error).__name__}: {error}"[:1000]
    every = ranks.gather({"report": compact(detail) if detail else {}, "error": text}, "capture")
    decision = ranks.broadcast(decide(every, head) if ranks.rank == 0 else None, "capture")
    if decision.get("detail"):  # the ranks disagree: rank 0 names what, from every rank's full report
        details = ranks.gather(detail, "capture")
        decision = ranks.broadcast({"mismatch": mismatch(details)} if ranks.rank == 0 else None, "capture")
    if "failed" in decision:
        if error is not None:
            raise error
        raise CheckpointFailed("capture", {int(r): t for r, t in decision["failed"].items()})
    if "mismatch" in decision:
        raise StateMismatch(decision["mismatch"])
    return _snapshot(state, ranks, weights_only, dcp, sharded, others, encoded, fields, detail, decision), \
        decision["head"]


def compact(detail: dict) -> dict:
    """What rank 0 needs of a rank's report to decide a save, in a size that does not grow with the model: what
    must agree on every rank as one digest, and each non-sharded component's digest (to tell which differ)."""
    agree = {k: detail[k] for k in ("contract", "settings", "replicas", "weights_only")}
    agree["names"] = sorted(detail["components"])
    return {"next_update": detail["next_update"], "agree": _digest(agree, {}),
            "components": detail["components"], "counters": detail["counters"], "facts": detail["facts"],
            "tokens_seen": detail["tokens_seen"], "bytes": detail["bytes"]}


def decide(every: list[dict], head: Any) -> dict:
    """Rank 0's decision from every rank's ``{"report": compact, "error": text}``: the failures, a disagreement
    (``{"detail": True}``: every rank then sends its full report), or what the snapshots need (which of the
    clocks, counters, facts and components differ between ranks) with rank 0's ``head``."""
    failed = {r: e["error"] for r, e in enumerate(every) if e["error"]}
    if failed:
        return {"failed": failed}
    reports = [e["report"] for e in every]
    updates = sorted({r["next_update"] for r in reports})
    if len(updates) != 1:
        first = {u: next(i for i, r in enumerate(reports) if r["next_update"] == u) for u in updates[:5]}
        return {"mismatch": f"ranks are at different updates ({', '.join(f'rank {r} at {u}' for u, r in first.items())}"
                            f"{' ...' if len(updates) > 5 else ''}): save() is collective and every rank must call "
                            "it at the same update boundary"}
    if len({r["agree"] for r in reports}) != 1:
        return {"detail": True}
    first = reports[0]
    same = {key: all(r[key] == first[key] for r in reports) for key in ("counters", "facts", "tokens_seen")}
    differ = sorted(n for n in first["components"] if any(r["components"][n] != first["components"][n]
                                                          for r in reports))
    return {"same": same, "differ": differ, "head": head, "bytes": sum(r["bytes"] for r in reports)}


def mismatch(details: list[dict]) -> str:
    """What the ranks disagree on (the contract, the optimizer settings, a replicated tensor), named."""
    try:
        _check_agreement(details)
    except StateMismatch as exc:
        return str(exc)
    return "ranks disagree on the components they register; every rank must build the same TrainState"


def _gathers_objects(state: TrainState) -> bool:
    """Whether building the DCP state dicts runs collectives (FSDP1's ``all_gather_object`` on its group)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for module in state.modules().values()
               for m in module.modules())


def _refusal(state: TrainState, weights_only: bool) -> PendingGradients | None:
    """Why this rank cannot be captured now, found without any collective (``None``: it can)."""
    if not weights_only and state.pending_gradients:
        return PendingGradients(
            "gradients are pending: a backward pass accumulated into .grad since the last optimizer.step(). "
            "A multi-rank checkpoint does not store gradients: save after optimizer.step() (and zero_grad).")
    unaccounted = [f"{m}.{p}" for m, grads in state.unaccounted_gradients().items() for p in grads]
    if not weights_only and unaccounted:
        return PendingGradients(
            f"{', '.join(unaccounted[:5])}{' ...' if len(unaccounted) > 5 else ''} hold gradients that no registered "
            "optimizer steps, so nothing can tell whether they were consumed, and a multi-rank checkpoint does not "
            "store gradients. Set them to None after your update (model.zero_grad(set_to_none=True)), or register "
            "the optimizer that steps them.")
    return None


def _local(state: TrainState, ranks: Ranks, weights_only: bool) -> tuple:
    """What this rank reports before the round: its sharded state, its other components encoded, its contract."""
    refused = _refusal(state, weights_only)
    if refused is not None:
        raise refused
    dcp, sharded = sharded_state(state, weights_only=weights_only)
    others = {} if weights_only else {n: c for n, c in state.components.items() if n not in sharded}
    encoded = {}
    for name, component in others.items():
        table = TensorTable()
        encoded[name] = ({"type": _type_name(component), "state": encode(component.state_dict(), name, table)},
                         table.tensors)
    fields = contract_fields(state, ranks.world_size)
    facts_table = TensorTable()
    facts = encode(state.facts, "facts", facts_table)
    report = {
        "next_update": state.next_update,
        "replicas": _replica_digests(dcp), "settings": _settings(dcp),
        "components": {n: _digest(*encoded[n]) for n in encoded},
        "contract": {k: _digest(v, {}) for k, v in fields.items()},
        "counters": _digest(state.counters, {}), "facts": _digest(facts, facts_table.tensors),
        "tokens_seen": state.tokens_seen, "weights_only": weights_only,
        # what this rank will stage and write, for rank 0's disk preflight (replicated tensors counted on each rank)
        "bytes": sharded_bytes(dcp) + sum(t.nbytes for _, tensors in encoded.values() for t in tensors.values())
        + sum(t.nbytes for t in facts_table.tensors.values()),
    }
    return dcp, sharded, others, encoded, fields, report


def _snapshot(state: TrainState, ranks: Ranks, weights_only: bool, dcp: dict, sharded: dict, others: dict,
              encoded: dict, fields: dict, report: dict, decision: dict) -> RankSnapshot:
    """This rank's share, once rank 0 has decided from every rank's report which components differ between ranks."""
    same = decision["same"]
    positions = state.data_positions()  # a data position is per rank by nature, even at world size 1
    rank_local = sorted(n for n in encoded if n in positions or n in decision["differ"])
    global_table, rank_table = TensorTable(), TensorTable()

    def place(value: Any, path: str, on_rank: bool) -> Any:
        return encode(value, path, rank_table if on_rank else global_table)

    global_skeleton: dict[str, Any] = {
        "format": "trainstate-state", "format_version": FORMAT_VERSION, "kind": "weights" if weights_only else "full",
        "clocks": {"next_update": state.next_update, "tokens_seen": state.tokens_seen if same["tokens_seen"] else 0},
        "counters": dict(state.counters) if same["counters"] else {},
        "facts": place(state.facts, "facts", False) if same["facts"] else {},
        "components": {n: {"type": encoded[n][0]["type"], "state": place(others[n].state_dict(), n, False)}
                       for n in encoded if n not in rank_local},
        "contract": {"fields": fields, "versions": contract_mod.versions()},
        "history": contract_mod.canonical(state.history, "history"),
        "sharded": {"world_size": ranks.world_size, "components": sharded, "settings": report["settings"],
                    "rank_local": {
            "components": rank_local, "counters": not same["counters"], "facts": not same["facts"],
            "tokens_seen": not same["tokens_seen"]}},
    }
    rank_skeleton: dict[str, Any] = {"format": "trainstate-rank", "format_version": FORMAT_VERSION,
                                     "rank": ranks.rank, "world_size": ranks.world_size}
    if not weights_only:
        rank_skeleton["rng"] = place(rng_mod.capture(state.rngs, include_globals=state.capture_global_rngs), "rng", True)
        rank_skeleton["components"] = {n: {"type": encoded[n][0]["type"], "state": place(others[n].state_dict(), n, True)}
                                       for n in rank_local}
        if not same["counters"]:
            rank_skeleton["counters"] = dict(state.counters)
        if not same["facts"]:
            rank_skeleton["facts"] = place(state.facts, "facts", True)
        if not same["tokens_seen"]:
            rank_skeleton["tokens_seen"] = state.tokens_seen
    data = {} if weights_only else {n: c.data_position() for n, c in positions.items()}
    state_json(global_skeleton)  # refuses now what JSON cannot carry
    return RankSnapshot(dcp, sharded, global_skeleton, global_table.tensors, rank_skeleton, rank_table.tensors, data,
                        decision["bytes"], frozen_names(state))


def frozen_names(state: TrainState) -> frozenset[str]:
    """The DCP names (``<module>.<parameter>``, as DCP flattens the state dict) of the registered modules'
    parameters that do not require gradients: a frozen base's. A guide for the first layout of an incremental
    shard (:class:`.increments.ShardPlan`), never proof that their bytes stay the same."""
    out: set[str] = set()
    if _get_fqns is None:
        return frozenset()
    for name, module in state.modules().items():
        for parameter, value in module.named_parameters():
            if value.requires_grad:
                continue
            fqns = {parameter} if name in state.own_keys else _get_fqns(module, parameter)
            out.update(f"{name}.{fqn}" for fqn in fqns)
    return frozenset(out)


def _check_agreement(reports: list[dict]) -> None:
    """Every rank is at the same boundary, with the same contract and identical replicas."""
    updates = [r["next_update"] for r in reports]
    if len(set(updates)) != 1:
        raise StateMismatch(f"ranks are at different updates {updates}: save() is collective and every rank must "
                            "call it at the same update boundary")
    fields = sorted({k for r in reports for k in r["contract"]})
    differ = [k for k in fields if len({r["contract"].get(k) for r in reports}) != 1]
    if differ:
        raise StateMismatch(f"ranks disagree on the experiment contract: {', '.join(differ)}; every rank must build "
                            "the same model, config and loader plan")
    if len({r["settings"] for r in reports}) != 1:
        raise StateMismatch("ranks disagree on the optimizer settings (param groups: learning rate, betas, ...); "
                            "every rank must update its optimizer the same way")
    keys = sorted({k for r in reports for k in r["replicas"]})
    diverged = [k for k in keys if len({r["replicas"].get(k) for r in reports}) != 1]
    if diverged:
        raise StateMismatch(
            f"replicated tensors differ between ranks: {', '.join(diverged[:10])}"
            + (f" and {len(diverged) - 10} more" if len(diverged) > 10 else "")
            + ". A replicated (DDP or unsharded) model must be identical on every rank; a checkpoint would keep "
            "one rank's copy and lose the others. Find what updates one replica only (a buffer such as BatchNorm "
            "statistics under FSDP: use SyncBatchNorm or broadcast it), then save.")
