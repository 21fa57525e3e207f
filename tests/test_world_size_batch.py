"""A world-size change that keeps the global batch continues the uninterrupted run's updates (issue 48, item 2).

Real ``torchrun`` launches (gloo on CPU), one per world size, scenarios in ``tests/batch_worker.py``: a DDP run
whose loader keeps the global batch G = world_size x batch_size = 12 across world sizes 2 -> 4 -> 1 -> 3
(batch sizes 6, 3, 12, 4), saving and restoring at each change under ``allow_changes=["world_size"]`` alone. Every
update's global sample set (and order) equals an uninterrupted world-size-2 run's. A change of G (at world size 4,
or at the saved world size 2) is refused unless ``loader.data.batch_size`` is allowed, loading nothing; allowed, it
warns and the samples continue in the same order, grouped into updates of another size. Controls: the contract's old rule (every ``loader.`` field fixed) put
back refuses the chain; the per-update comparison tells the changed-G continuation from the uninterrupted run.
Single-process cases (a batch size changed at the same world size) need no launch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainstate as ts
from distlaunch import launch

WORKER = Path(__file__).resolve().parent / "batch_worker.py"
G = 12
LEGS = {2: (0, 3), 4: (3, 6), 1: (6, 9), 3: (9, 12)}  # as in batch_worker.py


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    env = {"TRAINSTATE_TEST_RUNS": str(root / "runs")}
    out = {2: launch(root / "two", ["reference", "chain", "gchange_start", "gchange_same_world"], worker=WORKER,
                     env=env)}
    for world, name in ((4, "four"), (1, "one"), (3, "three")):  # in the chain's order: each restores the last
        scenarios = ["chain_old_rule", "chain", "gchange"] if world == 4 else ["chain"]
        out[world] = launch(root / name, scenarios, ranks=world, worker=WORKER, env=env)
    return out


def global_order(results: list[dict]) -> dict[int, list[int]]:
    """Each update's samples in global order: rank r of W reads the update's positions r, r + W, ..."""
    world = len(results)
    updates = sorted({int(u) for r in results for u in r["seen"]})
    return {u: [results[p % world]["seen"][str(u)][p // world]
                for p in range(sum(len(r["seen"][str(u)]) for r in results))] for u in updates}


@pytest.fixture(scope="module")
def reference(launches):
    order = global_order(launches[2].ok("reference", 2))
    assert sorted(order) == list(range(12)) and all(len(ids) == G for ids in order.values())
    return order


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4, 1, 3])
def test_every_update_of_the_chain_holds_the_uninterrupted_runs_samples(launches, reference, world):
    results = launches[world].ok("chain", world)
    first, end = LEGS[world]
    assert all(len(ids) == G // world for r in results for ids in r["seen"].values()), results  # b = G / W
    order = global_order(results)
    assert sorted(order) == list(range(first, end)), order
    for update, ids in order.items():
        assert sorted(ids) == sorted(reference[update]), (world, update)  # the global sample set
        assert ids == reference[update], (world, update)  # and its global order
    assert all(r["next_update"] == first for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 1, 3])
def test_each_change_is_accepted_under_world_size_alone_and_exact(launches, world):
    for result in launches[world].ok("chain", world):
        assert result["changes"] == ["loader.data.batch_size", "world_size"], result  # both recorded
        assert not any("global batch" in w for w in result["warnings"]), result["warnings"]
        assert any("per-rank RNG" in w for w in result["warnings"]), result["warnings"]
        refused = result["refused"]  # without allow_changes: the world size, with how to accept it
        assert refused["fields"] == ["world_size"] and refused["untouched"], refused
        assert "allow_changes=['world_size'] accepts both" in refused["message"], refused["message"]


@pytest.mark.slow
def test_control_the_old_rule_put_back_refuses_the_chain(launches):
    for result in launches[4].ok("chain_old_rule", 4):
        assert result["fields"] == ["loader.data.batch_size"] == result["fixed"], result
        assert "loader.data.batch_size cannot change within a run" in result["message"] and result["untouched"]


@pytest.mark.slow
def test_a_changed_global_batch_needs_its_allow_value_and_then_warns(launches, reference):
    results = launches[4].ok("gchange", 4)
    for result in results:
        refused = result["refused"]
        assert refused["fields"] == ["loader.data.batch_size"] and refused["untouched"], refused  # loads nothing
        message = refused["message"]
        assert "changes from 12 (2 x 6) to 20 (4 x 5)" in message, message
        assert "construct the loader with batch_size=3" in message, message  # the exact way: keep G = W x b
        assert "allow_changes=['world_size', 'loader.data.batch_size']" in message, message
        assert result["changes"] == ["loader.data.batch_size", "world_size"] and result["next_update"] == 2
        assert any("global batch size changed from 12 (2 x 6) to 20 (4 x 5)" in w and "not the uninterrupted" in w
                   for w in result["warnings"]), result["warnings"]
    order = global_order(results)
    # the samples continue in the same order (the rest of epoch 0: 20, then 4), grouped into updates of another size
    assert order[2] + order[3] == reference[2] + reference[3] and [len(order[2]), len(order[3])] == [20, 4]
    # control: the per-update comparison the chain passes tells this continuation from the uninterrupted run
    assert sorted(order[2]) != sorted(reference[2])


@pytest.mark.slow
def test_a_changed_global_batch_at_the_same_world_size_regroups_every_ranks_position(launches, reference):
    results = launches[2].ok("gchange_same_world", 2)
    for result in results:
        refused = result["refused"]
        assert refused["fields"] == ["loader.data.batch_size"] and refused["untouched"], refused
        assert "construct the loader with batch_size=6" in refused["message"], refused["message"]
        assert result["changes"] == ["loader.data.batch_size"] and result["next_update"] == 2, result
        assert any("global batch size changed from 12 (2 x 6) to 8 (2 x 4)" in w for w in result["warnings"])
    order = global_order(results)
    assert [len(order[u]) for u in (2, 3, 4)] == [8, 8, 8]  # the rest of epoch 0 in updates of 8
    assert order[2] + order[3] + order[4] == reference[2] + reference[3]


# single process: a batch size changed at the same world size -----------------------------------------------------
class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 60

    def __getitem__(self, index):
        return int(index)


def _saved(tmp_path: Path, batch_size: int, updates: int) -> list[int]:
    loader = ts.ResumableLoader(Ids(), batch_size, seed=3)
    it = iter(loader)
    consumed = [i for _ in range(updates) for i in next(it).tolist()]
    state = ts.TrainState(data=loader)
    state.next_update = updates
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    return consumed


def test_a_changed_batch_size_at_the_same_world_size_is_refused_then_continues_the_order(tmp_path):
    consumed = _saved(tmp_path, 4, 5)
    uninterrupted = [i for epoch in range(2) for b in ts.ResumableLoader(Ids(), 4, seed=3).epoch_batches(epoch)
                     for i in b.tolist()]
    loader = ts.ResumableLoader(Ids(), 6, seed=3)
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.ContractMismatch) as caught:
            ckpt.restore(ts.TrainState(data=loader))
        assert (loader.epoch, loader.cursor, loader.start) == (0, 0, 0)  # nothing loaded
        assert "allow_changes=['loader.data.batch_size']" in str(caught.value)
        assert "construct the loader with batch_size=4" in str(caught.value)
        assert caught.value.fixed == []  # a batch size the loader can continue across is never called fixed
        info = ckpt.restore(ts.TrainState(data=loader), allow_changes=["loader.data.batch_size"])
    assert [c.field for c in info.contract_changes] == ["loader.data.batch_size"] and not info.identical_continuation
    assert any("global batch size changed from 4 (1 x 4) to 6 (1 x 6)" in w for w in info.warnings), info.warnings
    batches = [b.tolist() for b in loader] + [b.tolist() for b in loader]  # the rest of epoch 0, then epoch 1
    assert [len(b) for b in batches[:7]] == [6] * 6 + [4]  # 40 samples left in epoch 0: in batches of 6
    assert consumed + [i for b in batches for i in b] == uninterrupted  # the same order, nothing skipped or repeated


def test_control_a_direct_load_of_another_batch_size_is_still_refused(tmp_path):
    """Without the restore's permission the loader refuses the saved position of another batch size."""
    _saved(tmp_path, 4, 5)
    old = ts.ResumableLoader(Ids(), 4, seed=3)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(ts.TrainState(data=old))
    with pytest.raises(ts.DataMismatch, match="batch_size"):
        ts.ResumableLoader(Ids(), 6, seed=3).load_state_dict(old.state_dict())
