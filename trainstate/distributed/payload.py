"""One rank's payload of a multi-rank generation: the global state plus its own per-rank record, or at another
world size every rank's records resharded (what :mod:`.load` checks and applies besides the sharded part)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CorruptGeneration, StateMismatch
from ..format.codec import decode
from ..restore import HeldFiles
from ..state import snapshot
from ..state.train_state import TrainState
from ..storage.verify import read_json_file, read_tensors
from .commit import rank_json, rank_tensors


def sharded_record(payload: dict, where: str) -> dict:
    sharded = payload.get("sharded")
    ok = (type(sharded) is dict and set(sharded) == {"world_size", "components", "settings", "rank_local"}
          and type(sharded["world_size"]) is int and sharded["world_size"] >= 1
          and type(sharded["components"]) is dict and type(sharded["rank_local"]) is dict
          and all(type(d) is dict and d.get("kind") in ("module", "optimizer") for d in sharded["components"].values()))
    if not ok:
        raise CorruptGeneration(f"{where}/state.json", "malformed multi-rank record")
    return sharded


def check_sharded(state: TrainState, saved: dict, name: str) -> None:
    """The sharded components: the same names, kinds and (for optimizers) classes as the live ones."""
    live = {n: "module" if isinstance(c, torch.nn.Module) else "optimizer" for n, c in state.components.items()
            if isinstance(c, (torch.nn.Module, torch.optim.Optimizer))}
    if {n: d["kind"] for n, d in saved.items()} != live:
        raise StateMismatch(f"{name} holds sharded components {sorted(saved)} but this TrainState has modules and "
                            f"optimizers {sorted(live)}; construct it with the same component names")
    for component, described in saved.items():
        live_type = snapshot._type_name(state.components[component])
        if described["kind"] == "optimizer" and described["type"] != live_type:
            raise StateMismatch(f"component {component!r}: {name} saved a {described['type']!r}, this run has a "
                                f"{live_type!r}")


def merge(state: TrainState, payload: dict, sharded: dict, records: dict[int, dict], rank: int,
           same_world: bool) -> tuple[dict, list[str]]:
    """The payload of everything but the sharded part, for this rank: global sections plus its per-rank record."""
    merged = {k: v for k, v in payload.items() if k not in ("sharded",)}
    merged["components"] = dict(payload["components"])
    local = sharded["rank_local"]
    if same_world:
        record = records[rank]
        merged["rng"] = record["rng"]
        merged["components"].update(record["components"])
        for key in ("counters", "facts"):
            if local.get(key):
                merged[key] = record[key]
        if local.get("tokens_seen"):
            merged["clocks"] = {**merged["clocks"], "tokens_seen": record["tokens_seen"]}
        return merged, []
    saved_world = sharded["world_size"]
    records = [records[r] for r in range(saved_world)]
    streams = (["python", "numpy", "torch"] if state.capture_global_rngs else []) + sorted(state.rngs)
    notes = [f"the run was saved at world size {saved_world} and restored at another: the per-rank RNG streams "
             f"({', '.join(streams) or 'none'}) cannot be mapped onto other ranks and continue from this process's "
             "own, statistically, not bitwise"]
    for component in local.get("components", []):
        live = state.components.get(component)
        if not callable(getattr(live, "resharded_state", None)):
            raise StateMismatch(f"component {component!r} differs between ranks and cannot be resharded to another "
                                "world size (only a ResumableLoader can); restore at the saved world size")
        resharded, more = live.resharded_state([r["components"][component]["state"] for r in records])
        notes += more
        merged["components"][component] = {"type": records[0]["components"][component]["type"], "state": resharded}
    for key in ("counters", "facts"):
        if local.get(key):
            merged[key] = records[min(rank, saved_world - 1)][key]
            notes.append(f"{key} differed between ranks; this rank continues with rank {min(rank, saved_world - 1)}'s")
    merged.pop("rng", None)
    return merged, notes


def rank_record(held: HeldFiles, manifest: Any, rank: int) -> dict:
    raw = read_json_file(held, manifest, rank_json(rank))
    where = f"{manifest.generation}/{rank_json(rank)}"
    if raw.get("format") != "trainstate-rank" or raw.get("rank") != rank:
        raise CorruptGeneration(where, "not this rank's record")
    tensors = read_tensors(held, manifest, rank_tensors(rank))
    out = {"rng": decode(raw.get("rng", {}), "rng", tensors), "components": {}}
    for name, component in (raw.get("components") or {}).items():
        if type(component) is not dict or set(component) != {"type", "state"}:
            raise CorruptGeneration(where, f"malformed component {name!r:.60}")
        out["components"][name] = {"type": component["type"], "state": decode(component["state"], name, tensors)}
    if "counters" in raw:
        out["counters"] = raw["counters"]
    if "facts" in raw:
        out["facts"] = decode(raw["facts"], "facts", tensors)
    if "tokens_seen" in raw:
        out["tokens_seen"] = raw["tokens_seen"]
    return out
