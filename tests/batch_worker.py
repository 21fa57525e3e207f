"""A world-size change that keeps the global batch (issue 48), under a real ``torchrun`` (gloo on CPU).

Run by tests/test_world_size_batch.py, one launch per world size; reuses tests/dist_worker.py's runner. The
global batch is G = 12 throughout the chain: world size 2, 4, 1, 3 with batch sizes 6, 3, 12, 4. Every
scenario records, per update, the sample ids this rank's batch held (the dataset returns each sample's index), so
the test can compare each update's global sample set with an uninterrupted run's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainstate as ts  # noqa: E402
from dist_worker import main, manager, scenario  # noqa: E402
from trainstate.state import contract as contract_mod  # noqa: E402

GLOBAL_BATCH = 12
SAMPLES = 48  # four updates an epoch: the chain's legs cut mid-epoch and cross epoch boundaries
LEGS = {2: (0, 3), 4: (3, 6), 1: (6, 9), 3: (9, 12)}  # world size -> the updates [first, end) it trains
UPDATES = 12
G_CHANGED = 5  # the per-rank batch at world size 4 that changes the global batch (4 x 5 = 20)


class Indexed(torch.utils.data.Dataset):
    """Each sample carries its own index, so a batch says which samples it holds."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        return torch.full((4,), float(index)) / SAMPLES, int(index)


def build(batch_size: int) -> ts.TrainState:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = ts.ResumableLoader(Indexed(), batch_size=batch_size, seed=5)
    return ts.TrainState(model=model, optimizer=opt, data=loader, contract={"config": {"lr": 0.1}})


def train(state: ts.TrainState, end: int) -> dict[int, list[int]]:
    """Train through the loader until update ``end``; each update's sample ids on this rank."""
    seen: dict[int, list[int]] = {}
    while state.next_update < end:
        for x, ids in state["data"]:
            loss = state["model"](x).pow(2).mean()
            loss.backward()
            state["optimizer"].step()
            state["optimizer"].zero_grad()
            seen[state.next_update] = ids.tolist()
            state.next_update += 1
            if state.next_update == end:
                break
    return seen


def runs() -> Path:
    return Path(os.environ["TRAINSTATE_TEST_RUNS"])


def untouched(state: ts.TrainState) -> bool:
    """Nothing of a checkpoint was loaded: the clock, the loader's position and the model are a fresh build's."""
    fresh = build(state["data"].batch_size)
    loader = state["data"]
    return (state.next_update == 0 and (loader.epoch, loader.cursor, loader.start) == (0, 0, 0)
            and all(torch.equal(a, b) for a, b in zip(state["model"].state_dict().values(),
                                                      fresh["model"].state_dict().values())))


def refusal(ckpt: ts.CheckpointManager, state: ts.TrainState, allow: list[str]) -> dict:
    try:
        ckpt.restore(state, allow_changes=allow)
    except ts.ContractMismatch as exc:
        return {"fields": [c.field for c in exc.changes], "fixed": exc.fixed, "message": str(exc),
                "untouched": untouched(state)}
    return {"fields": None}


@scenario
def reference(out: Path) -> dict:
    """The uninterrupted run at world size 2: every update's ids."""
    state = build(GLOBAL_BATCH // dist.get_world_size())
    return {"seen": train(state, UPDATES)}


@scenario
def chain(out: Path) -> dict:
    """One leg of the chain: restore what the previous world size saved (keeping G), train, save."""
    world = dist.get_world_size()
    first, end = LEGS[world]
    state = build(GLOBAL_BATCH // world)
    result: dict = {}
    with manager(runs() / "chain") as ckpt:
        if first:
            result["refused"] = refusal(ckpt, state, [])
            info = ckpt.restore(state, allow_changes=["world_size"])
            result.update(changes=[c.field for c in info.contract_changes], warnings=list(info.warnings),
                          restored=info.generation.name)
        result["next_update"] = state.next_update
        result["seen"] = train(state, end)
        result["saved"] = ckpt.save(state).name
    return result


@scenario
def chain_old_rule(out: Path) -> dict:
    """Control: the contract's old rule (every ``loader.`` field fixed) put back refuses the chain's next leg."""
    saved = contract_mod._keeps_global_batch, contract_mod._fixed
    contract_mod._keeps_global_batch = lambda *args: False
    contract_mod._fixed = lambda field: field.startswith("loader.")
    try:
        state = build(GLOBAL_BATCH // dist.get_world_size())
        with manager(runs() / "chain") as ckpt:
            return refusal(ckpt, state, ["world_size"])
    finally:
        contract_mod._keeps_global_batch, contract_mod._fixed = saved


@scenario
def gchange_start(out: Path) -> dict:
    """A run at world size 2 (G = 12) saved after 2 updates, for the world size 4 launch to change G."""
    state = build(GLOBAL_BATCH // dist.get_world_size())
    with manager(runs() / "gchange") as ckpt:
        seen = train(state, 2)
        return {"seen": seen, "saved": ckpt.save(state).name}


@scenario
def gchange_same_world(out: Path) -> dict:
    """At the saved world size with batch size 4 (G = 8): the per-rank records regrouped, every rank alike."""
    state = build(4)
    with manager(runs() / "gchange") as ckpt:
        refused = refusal(ckpt, state, [])
        info = ckpt.restore(state, allow_changes=["loader.data.batch_size"])
        return {"refused": refused, "changes": [c.field for c in info.contract_changes],
                "warnings": list(info.warnings), "next_update": state.next_update, "seen": train(state, 5)}


@scenario
def gchange(out: Path) -> dict:
    """At world size 4 with batch size 5 (G = 20): refused under ``world_size`` alone, loading nothing;
    accepted with ``loader.data.batch_size`` too, with the warning; the next updates' ids."""
    state = build(G_CHANGED)
    with manager(runs() / "gchange") as ckpt:
        refused = refusal(ckpt, state, ["world_size"])
        info = ckpt.restore(state, allow_changes=["world_size", "loader.data.batch_size"])
        return {"refused": refused, "changes": [c.field for c in info.contract_changes],
                "warnings": list(info.warnings), "next_update": state.next_update, "seen": train(state, 4)}


if __name__ == "__main__":
    sys.exit(main())
