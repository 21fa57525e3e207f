"""Which order a run uses, and that old runs keep theirs: the algorithm is in the plan and the contract.

``tests/golden/sort-v1-run`` was written by trainstate at commit 0d40aa9, before
feistel-v1 existed (a ResumableLoader over 22 samples, batches of 4, seed 1234,
saved at update 9 = epoch 1, batch 3), with the ten batches that run read next.
Never regenerate it: it is what a user's old run directory looks like.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import trainstate as ts
from trainstate.data.order import FEISTEL_V1, SORT_V1, Plan

GOLDEN = Path(__file__).parent / "golden" / "sort-v1-run"


class Ids(torch.utils.data.Dataset):
    def __init__(self, n: int = 22):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return int(index)


def _state(order: str | None = None, n: int = 22) -> tuple[ts.TrainState, ts.ResumableLoader]:
    torch.manual_seed(0)
    loader = ts.ResumableLoader(Ids(n), batch_size=4, seed=1234, shuffle=True, order=order)
    return ts.TrainState(model=torch.nn.Linear(1, 1), data=loader), loader


def _endless(loader: ts.ResumableLoader):
    while True:
        yield from loader


def test_new_runs_default_to_feistel_and_record_it():
    _, loader = _state()
    contract = loader.data_contract()
    assert loader.plan.algorithm == FEISTEL_V1 == contract["algorithm"]
    assert contract["order_params"] == {"rounds": 6, "round_function": "splitmix64-finaliser",
                                        "domain": "power-of-four-cycle-walk"}
    assert ts.ResumableLoader(Ids(), 4, seed=1, order=SORT_V1).data_contract()["algorithm"] == SORT_V1
    assert "order_params" not in ts.ResumableLoader(Ids(), 4, seed=1, order=SORT_V1).data_contract()


def test_unknown_order_refused():
    with pytest.raises(ValueError, match="order must be one of 'feistel-v1', 'splitmix64-sort-v1'"):
        ts.ResumableLoader(Ids(), 4, seed=1, order="randperm")


def test_golden_run_saved_before_feistel_resumes_with_the_same_ids(tmp_path):
    expected = json.loads((GOLDEN / "expected_ids.json").read_text())
    run = tmp_path / "run"
    shutil.copytree(GOLDEN, run)
    state, loader = _state()  # order left at None, as in the user's unchanged script
    with ts.CheckpointManager(run) as ckpt:
        info = ckpt.restore(state)
    assert info.identical_continuation and info.contract_changes == ()
    assert loader.plan.algorithm == SORT_V1 and (loader.epoch, loader.cursor) == (1, 3)
    batches = _endless(loader)
    got = [next(batches).tolist() for _ in range(len(expected["next_batches"]))]
    assert got == expected["next_batches"]  # the rest of epoch 1, then epochs 2 and 3, as the old code read them
    assert loader.data_contract()["algorithm"] == SORT_V1  # and later saves keep recording the sort
    # The run continues in the same directory: a format-4 (incremental, the default) generation beside the format-2
    # one it came from.
    with torch.no_grad():
        state["model"].weight.add_(1.0)
    state.next_update += 1
    with ts.CheckpointManager(run) as ckpt:
        saved = ckpt.save(state)
    manifest = json.loads((run / saved.name / "manifest.json").read_text())
    assert (manifest["format_version"], manifest["digest_algorithm"]) == (4, "xxh3-chunked")
    again, again_loader = _state()
    with ts.CheckpointManager(run) as ckpt:
        assert ckpt.restore(again).generation.name == saved.name
    assert all(torch.equal(a, b) for a, b in zip(again["model"].state_dict().values(),
                                                  state["model"].state_dict().values()))
    assert (again_loader.epoch, again_loader.cursor) == (loader.epoch, loader.cursor)


def test_golden_run_refuses_an_explicitly_different_order(tmp_path):
    shutil.copytree(GOLDEN, tmp_path / "run")
    state, _ = _state(order=FEISTEL_V1)
    with ts.CheckpointManager(tmp_path / "run") as ckpt:
        with pytest.raises(ts.ContractMismatch, match=r"loader\.data\.algorithm") as caught:
            ckpt.restore(state)
    assert "loader.data.algorithm" in caught.value.fixed


def test_negative_control_the_golden_ids_are_not_the_feistel_order():
    expected = json.loads((GOLDEN / "expected_ids.json").read_text())["next_batches"]
    plan = Plan(22, 4, 1234, True, False, 0, 1, "pad", FEISTEL_V1)
    assert [b.tolist() for b in plan.batches(1)][3:] != expected[:3]


@pytest.mark.parametrize("resumed_with", [None, SORT_V1])
def test_run_saved_with_the_sort_resumes_bitwise_across_epochs(tmp_path, resumed_with):
    reference = _state(SORT_V1)[1]
    batches = _endless(reference)
    expected = [next(batches).tolist() for _ in range(30)]
    state, loader = _state(SORT_V1)
    batches = _endless(loader)
    got = [next(batches).tolist() for _ in range(8)]
    state.next_update = 8
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    fresh_state, fresh = _state(resumed_with)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(fresh_state)
    batches = _endless(fresh)
    got += [next(batches).tolist() for _ in range(22)]
    assert got == expected


def test_plan_saved_without_an_algorithm_name_means_the_sort():
    _, old = _state(SORT_V1)
    next(iter(old))
    saved = old.state_dict()
    del saved["plan"]["algorithm"]  # as a plan written before there was a choice would read
    _, fresh = _state()
    fresh.load_state_dict(saved)
    assert fresh.plan.algorithm == SORT_V1
    assert next(iter(fresh)).tolist() == old.epoch_batches(0)[1].tolist()
    _, pinned = _state(FEISTEL_V1)
    with pytest.raises(ts.DataMismatch, match="algorithm: checkpoint 'splitmix64-sort-v1', this run 'feistel-v1'"):
        pinned.load_state_dict(saved)


def test_resume_never_builds_the_epoch(tmp_path):
    """A plan over 10**12 samples resumes at the middle of epoch 3: an O(N) array would need 8 TB."""
    plan = Plan(10 ** 12, 32, 5, True, False, 3, 8, "pad")
    batches = plan.batches(3, start=5 * 10 ** 11)
    assert len(batches) == -(-(10 ** 12 - 5 * 10 ** 11) // 8 // 32)
    ids = batches[10 ** 9]
    assert ids.shape == (32,) and ids.min() >= 0 and ids.max() < 10 ** 12
    positions = plan.positions(5 * 10 ** 11, np.arange(10 ** 9 * 32, 10 ** 9 * 32 + 32))
    assert np.array_equal(plan.ids_at(3, positions)[0], ids)


def test_loader_over_a_huge_virtual_dataset_saves_and_resumes(tmp_path):
    class Virtual(torch.utils.data.Dataset):
        def __len__(self):
            return 10 ** 12

        def __getitem__(self, index):
            return int(index)

    loader = ts.ResumableLoader(Virtual(), batch_size=8, seed=3, rank=1, world_size=4)
    state = ts.TrainState(data=loader)
    it = iter(loader)
    first = [next(it).tolist() for _ in range(3)]
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    resumed = ts.ResumableLoader(Virtual(), batch_size=8, seed=3, rank=1, world_size=4)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(ts.TrainState(data=resumed))
    assert next(iter(resumed)).tolist() == loader.epoch_batches(0)[3].tolist() == next(it).tolist()
    assert len({i for b in first for i in b}) == 24


def test_global_positions_shard_like_before_for_both_algorithms():
    """Rank r of W reads global positions r, r + W, ... after any start, with pad wrapping to the start."""
    for algorithm in (SORT_V1, FEISTEL_V1):
        for start in (0, 5, 13):
            whole = Plan(23, 1, 9, True, False, 0, 1, "pad", algorithm).shard(2)
            for world in (1, 3, 4):
                for rank in range(world):
                    shard = Plan(23, 1, 9, True, False, rank, world, "pad", algorithm).shard(2, start)
                    rest = whole[start:]
                    padded = np.resize(rest, -(-len(rest) // world) * world)
                    assert shard.tolist() == padded[rank::world].tolist(), (algorithm, start, world, rank)


@pytest.mark.parametrize("algorithm", [SORT_V1, FEISTEL_V1])
def test_elastic_resume_continues_the_global_order_from_the_count_consumed(algorithm):
    """Saved by 2 ranks after 4 batches of 3 each (12 global positions... 24), restored on 3 ranks."""
    old = [ts.ResumableLoader(Ids(50), 3, seed=8, rank=r, world_size=2, order=algorithm) for r in range(2)]
    for loader in old:
        it = iter(loader)
        for _ in range(4):
            next(it)
    saved = [loader.state_dict() for loader in old]
    new = [ts.ResumableLoader(Ids(50), 3, seed=8, rank=r, world_size=3) for r in range(3)]  # order left at None
    for loader in new:
        state, notes = loader.resharded_state(saved)
        loader.load_state_dict(state)
        assert loader.plan.algorithm == algorithm and loader.start == 24 and notes  # global batch 6 -> 9
    whole = Plan(50, 1, 8, True, False, 0, 1, "pad", algorithm).shard(0)
    consumed = [i for loader in old for b in loader.epoch_batches(0)[:4] for i in b.tolist()]
    assert sorted(consumed) == sorted(whole[:24].tolist())
    rest = [np.concatenate(list(loader.epoch_batches(0))) for loader in new]
    interleaved = [rest[r][slot] for slot in range(len(rest[0])) for r in range(3)]
    assert interleaved[:26] == whole[24:].tolist()  # then pad repeats from position 24
