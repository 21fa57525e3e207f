"""Pure ordering logic (trainstate.data.order) and index-addressed randomness (trainstate.data.samplerng).

Property tests with hypothesis, a comparison with ``DistributedSampler``, and
golden values: the order of an epoch and the per-sample seeds must never
change across versions, because a run resumed under a newer trainstate must
read the same samples in the same order with the same augmentation.
"""

from __future__ import annotations

import copy
import math
import pickle
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data.distributed import DistributedSampler

import trainstate as ts
from trainstate.data.order import ORDERS, SORT_V1, Plan, epoch_order, ids_digest, order_at
from trainstate.data.samplerng import SampleIndex, sample_seed

# Reproducible (derandomized), no example database, no deadline on shared CPUs; as in test_fuzz.py.
PROPERTY = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

lengths = st.integers(min_value=0, max_value=300)
seeds = st.integers(min_value=0, max_value=2**64 - 1)
epochs = st.integers(min_value=0, max_value=10**6)


# epoch_order ------------------------------------------------------------------

@given(lengths, seeds, epochs)
@PROPERTY
def test_epoch_order_is_a_deterministic_permutation(length, seed, epoch):
    order = epoch_order(length, seed, epoch, True)
    assert order.dtype == np.int64 and order.shape == (length,)
    assert np.array_equal(np.sort(order), np.arange(length))
    assert np.array_equal(epoch_order(length, seed, epoch, True), order)


@given(lengths, seeds, epochs)
@PROPERTY
def test_unshuffled_order_is_the_identity(length, seed, epoch):
    order = epoch_order(length, seed, epoch, False)
    assert order.dtype == np.int64
    assert np.array_equal(order, np.arange(length))


@given(st.integers(min_value=8, max_value=300), seeds, epochs, st.integers(min_value=1, max_value=1000))
@PROPERTY
def test_order_differs_across_epochs_and_seeds(length, seed, epoch, delta):
    # 8! = 40320 orders: equal orders for distinct keys would be a defect, not chance
    order = epoch_order(length, seed, epoch, True)
    assert not np.array_equal(epoch_order(length, seed, epoch + delta, True), order)
    assert not np.array_equal(epoch_order(length, (seed + delta) % 2**64, epoch, True), order)


def test_shuffled_order_is_not_the_identity_nor_reversed():
    for epoch in range(20):
        order = epoch_order(64, 0, epoch, True)
        assert not np.array_equal(order, np.arange(64))
        assert not np.array_equal(order, np.arange(64)[::-1])


@pytest.mark.parametrize("length", [0, 1])
def test_tiny_datasets(length):
    assert np.array_equal(epoch_order(length, 3, 4, True), np.arange(length))


# golden values: these must never change ------------------------------------

GOLDEN_ORDER = {0: [9, 3, 7, 5, 2, 0, 4, 1, 6, 8],
                1: [1, 0, 6, 3, 2, 9, 7, 5, 8, 4],
                2: [6, 2, 8, 0, 5, 4, 1, 3, 9, 7]}


def test_golden_epoch_order():
    """The order is part of every checkpoint's meaning: splitmix64-sort-v1 never changes (runs saved with it
    resume with it)."""
    assert SORT_V1 == "splitmix64-sort-v1"
    for epoch, expected in GOLDEN_ORDER.items():
        assert epoch_order(10, 1234, epoch, True).tolist() == expected, f"epoch {epoch}"
    assert epoch_order(1000, 0, 0, True)[:8].tolist() == [721, 677, 838, 344, 647, 59, 104, 991]
    assert epoch_order(1000, 2**64 - 1, 7, True)[:8].tolist() == [305, 327, 671, 990, 500, 236, 499, 192]
    plan = Plan(10, 3, 1234, True, False, 1, 2, "pad", SORT_V1)
    assert [b.tolist() for b in plan.batches(0)] == [[3, 5, 0], [1, 8]]


def test_golden_batch_fingerprint():
    """Saved in every checkpoint as next_batch.ids_digest and checked on restore."""
    assert ids_digest(2, 5, np.array([3, 1, 4])) == "91f1e69018ee3ec8ee1ec98c17eb1f82"
    assert ids_digest(2, 5, np.array([3, 1, 4], dtype=np.int32)) == "91f1e69018ee3ec8ee1ec98c17eb1f82"


def test_golden_sample_seeds():
    assert sample_seed(5, epoch=1, seed=1234) == 307660366672032112
    assert sample_seed(5, epoch=1, seed=1234, stream="crop") == 6497463724092884794
    assert sample_seed(0, epoch=0, seed=0) == 6072132964771769645
    assert sample_seed(SampleIndex(5, 1, 1234)) == 307660366672032112


def test_golden_sample_generator_draws():
    """If only this fails (not the seeds above), torch/NumPy/Python changed a generator's stream."""
    g = ts.sample_generator(5, epoch=1, seed=1234)
    assert torch.rand(3, generator=g).tolist() == [0.3231983780860901, 0.4611029624938965, 0.9494978785514832]
    g = ts.sample_generator(5, epoch=1, seed=1234, stream="crop")
    assert torch.randint(0, 2**31, (2,), generator=g).tolist() == [1650917767, 917938632]
    n = ts.sample_generator(5, epoch=1, seed=1234, kind="numpy")
    assert n.integers(0, 2**62, 2).tolist() == [2662307739520028245, 1056513616789530770]
    assert ts.sample_generator(5, epoch=1, seed=1234, kind="numpy").random(2).tolist() == [
        0.5772959670025174, 0.22909487171674536]
    p = ts.sample_generator(5, epoch=1, seed=1234, kind="python")
    assert p.getrandbits(64) == 4972426704706774867
    assert ts.sample_generator(5, epoch=1, seed=1234, kind="python").random() == 0.17856832049456073


# Plan --------------------------------------------------------------------------

plans = st.builds(
    lambda n, bs, seed, shuffle, drop_last, world, uneven, algorithm, data: Plan(
        n, bs, seed, shuffle, drop_last, data.draw(st.integers(0, world - 1)), world, uneven, algorithm),
    st.integers(0, 200), st.integers(1, 17), seeds, st.booleans(), st.booleans(), st.integers(1, 9),
    st.sampled_from(["pad", "drop"]), st.sampled_from(sorted(ORDERS)), st.data())


@given(plans, epochs)
@PROPERTY
def test_batches_cover_the_shard_with_correct_sizes(plan, epoch):
    shard = plan.shard(epoch)
    batches = plan.batches(epoch)
    assert len(shard) == plan.shard_size()
    assert len(batches) == plan.batches_per_epoch()
    bs = plan.batch_size
    if plan.drop_last:
        assert len(batches) == len(shard) // bs
        assert all(len(b) == bs for b in batches)
        covered = len(batches) * bs
    else:
        assert len(batches) == math.ceil(len(shard) / bs)
        assert all(len(b) == bs for b in batches[:-1])
        if batches:
            assert len(batches[-1]) == len(shard) - bs * (len(batches) - 1) and 1 <= len(batches[-1]) <= bs
        covered = len(shard)
    joined = np.concatenate(batches) if batches else np.empty(0, np.int64)
    assert np.array_equal(joined, shard[:covered])
    assert all(b.dtype == np.int64 for b in batches)


@given(st.integers(0, 120), st.integers(1, 9), st.sampled_from(["pad", "drop"]), epochs)
@PROPERTY
def test_unshuffled_shards_equal_distributed_sampler(n, world, uneven, epoch):
    for rank in range(world):
        plan = Plan(n, 1, 0, False, False, rank, world, uneven)
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False,
                                     drop_last=uneven == "drop")
        sampler.set_epoch(epoch)
        assert plan.shard(epoch).tolist() == list(sampler), f"rank {rank} of {world}"
        assert plan.shard_size() == len(sampler)


def _distributed_sampler_split(order: np.ndarray, world: int, rank: int, uneven: str) -> list[int]:
    """DistributedSampler.__iter__'s padding and striding, applied to a given order."""
    indices = order.tolist()
    if uneven == "pad":
        total = math.ceil(len(indices) / world) * world
        padding = total - len(indices)
        if padding and indices:
            indices += (indices * math.ceil(padding / len(indices)))[:padding]
    else:
        total = len(indices) // world * world
        indices = indices[:total]
    return indices[rank:total:world]


@given(st.integers(0, 120), st.integers(1, 9), st.sampled_from(["pad", "drop"]), seeds, epochs,
       st.sampled_from(sorted(ORDERS)))
@PROPERTY
def test_shuffled_shards_split_like_distributed_sampler(n, world, uneven, seed, epoch, algorithm):
    order = order_at(algorithm, n, seed, epoch, True, np.arange(n))
    if algorithm == SORT_V1:
        assert np.array_equal(order, epoch_order(n, seed, epoch, True))
    seen: list[int] = []
    for rank in range(world):
        shard = Plan(n, 1, seed, True, False, rank, world, uneven, algorithm).shard(epoch)
        assert shard.tolist() == _distributed_sampler_split(order, world, rank, uneven)
        seen += shard.tolist()
    if uneven == "drop":
        assert len(set(seen)) == len(seen) == n // world * world  # disjoint
    else:
        assert set(seen) == set(range(n))  # every sample read, the first few twice


@pytest.mark.parametrize("kwargs, message", [
    ({"rank": 2, "world_size": 2}, "rank 2 is not below world_size 2"),
    ({"batch_size": 0}, "batch_size must be a positive int"),
    ({"world_size": 0, "rank": 0}, "world_size must be a positive int"),
    ({"dataset_len": -1}, "dataset_len must be a non-negative int"),
    ({"seed": 2**64}, "seed must fit in 64 bits"),
    ({"seed": 1.0}, "seed must be a non-negative int"),
    ({"uneven": "wrap"}, "uneven must be 'pad' or 'drop'"),
])
def test_plan_rejects_bad_values(kwargs, message):
    base = {"dataset_len": 10, "batch_size": 2, "seed": 0, "shuffle": True, "drop_last": False, "rank": 0,
            "world_size": 1, "uneven": "pad"}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Plan(**{**base, **kwargs})


def test_ids_digest_depends_on_position_and_ids():
    ids = np.array([1, 2, 3])
    base = ids_digest(0, 0, ids)
    assert ids_digest(0, 0, ids.copy()) == base
    assert len({base, ids_digest(1, 0, ids), ids_digest(0, 1, ids), ids_digest(0, 0, ids[::-1]),
                ids_digest(0, 0, ids[:2])}) == 5


# sample_generator -------------------------------------------------------------

indices = st.integers(0, 10**9)
streams = st.sampled_from(["", "crop", "noise", "mask"])
KINDS = ("torch", "numpy", "python")


def _draws(g) -> tuple:
    if isinstance(g, torch.Generator):
        return tuple(torch.randint(0, 2**62, (4,), generator=g).tolist())
    if isinstance(g, np.random.Generator):
        return tuple(g.integers(0, 2**62, 4).tolist())
    return tuple(g.getrandbits(62) for _ in range(4))


@given(indices, epochs, seeds, streams, st.sampled_from(KINDS))
@PROPERTY
def test_sample_generator_is_deterministic(index, epoch, seed, stream, kind):
    a = ts.sample_generator(index, epoch=epoch, seed=seed, stream=stream, kind=kind)
    b = ts.sample_generator(index, epoch=epoch, seed=seed, stream=stream, kind=kind)
    assert a is not b
    assert _draws(a) == _draws(b)
    # the SampleIndex spelling is the same generator
    c = ts.sample_generator(SampleIndex(index, epoch, seed), stream=stream, kind=kind)
    assert _draws(c) == _draws(ts.sample_generator(index, epoch=epoch, seed=seed, stream=stream, kind=kind))


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 5), st.integers(0, 3), streams),
                min_size=2, max_size=12, unique=True), st.sampled_from(KINDS))
@PROPERTY
def test_sample_generators_are_independent_across_indices_epochs_seeds_streams(keys, kind):
    draws = [_draws(ts.sample_generator(i, epoch=e, seed=s, stream=st_, kind=kind)) for i, e, s, st_ in keys]
    assert len(set(draws)) == len(draws)
    # nor do neighbouring keys give shifted copies of one stream
    firsts = [d[0] for d in draws]
    assert len(set(firsts)) == len(firsts)


def test_sample_generator_streams_look_uncorrelated():
    """Crude sanity: first draws over consecutive indices are uniform, not a ramp."""
    values = np.array([torch.rand((), generator=ts.sample_generator(i, epoch=0, seed=0)).item()
                       for i in range(2000)])
    assert abs(values.mean() - 0.5) < 0.03
    assert abs(np.corrcoef(values[:-1], values[1:])[0, 1]) < 0.1
    assert abs(np.corrcoef(np.arange(2000), values)[0, 1]) < 0.1


def test_sample_generator_kinds():
    assert type(ts.sample_generator(1, epoch=0, seed=0)) is torch.Generator
    assert ts.sample_generator(1, epoch=0, seed=0).device == torch.device("cpu")
    assert type(ts.sample_generator(1, epoch=0, seed=0, kind="numpy")) is np.random.Generator
    assert type(ts.sample_generator(1, epoch=0, seed=0, kind="python")) is random.Random
    with pytest.raises(ValueError, match="kind must be 'torch', 'numpy' or 'python'"):
        ts.sample_generator(1, epoch=0, seed=0, kind="jax")


@pytest.mark.parametrize("kwargs", [{}, {"epoch": 0}, {"seed": 0}])
def test_plain_int_needs_epoch_and_seed(kwargs):
    with pytest.raises(TypeError, match="is a plain int: pass epoch= and seed=.*ResumableLoader"):
        ts.sample_generator(3, **kwargs)
    with pytest.raises(TypeError, match="plain int"):
        ts.sample_generator(np.int64(3), **kwargs)


def test_explicit_keywords_override_a_sample_index():
    index = SampleIndex(3, 1, 9)
    assert sample_seed(index, epoch=2) == sample_seed(3, epoch=2, seed=9)
    assert sample_seed(index, seed=4) == sample_seed(3, epoch=1, seed=4)


@pytest.mark.parametrize("args", [(-1, 0, 0), (0, -1, 0), (0, 0, -1)])
def test_negative_values_are_refused(args):
    index, epoch, seed = args
    with pytest.raises(ValueError, match="non-negative"):
        ts.sample_generator(index, epoch=epoch, seed=seed)


@given(indices, epochs, seeds, streams)
@PROPERTY
def test_sample_seed_fits_torch_manual_seed(index, epoch, seed, stream):
    value = sample_seed(index, epoch=epoch, seed=seed, stream=stream)
    assert 0 <= value < 2**63


# SampleIndex ------------------------------------------------------------------

@given(indices, epochs, seeds)
@PROPERTY
def test_sample_index_pickles_and_copies(index, epoch, seed):
    si = SampleIndex(index, epoch, seed)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(si, protocol=protocol))
        assert type(back) is SampleIndex and back == index
        assert (back.epoch, back.seed) == (epoch, seed)
    for clone in (copy.copy(si), copy.deepcopy(si)):
        assert type(clone) is SampleIndex and (int(clone), clone.epoch, clone.seed) == (index, epoch, seed)
    assert repr(si) == f"SampleIndex({index}, epoch={epoch}, seed={seed})"


def test_sample_index_is_an_int_everywhere():
    si = SampleIndex(3, 1, 9)
    assert isinstance(si, int) and si == 3 and hash(si) == hash(3) and type(int(si)) is int
    data = list(range(10, 20))
    assert data[si] == 13
    assert {3: "x"}[si] == "x"
    array = np.arange(10, 20)
    assert array[si] == 13
    assert array[[si, SampleIndex(5, 1, 9)]].tolist() == [13, 15]
    tensor = torch.arange(10, 20)
    assert tensor[si].item() == 13
    assert torch.tensor([si, SampleIndex(5, 1, 9)]).tolist() == [3, 5]
    assert torch.tensor([si]).dtype == torch.int64
    assert np.array([si]).dtype == np.int64
    assert torch.utils.data.default_collate([si, SampleIndex(4, 1, 9)]).tolist() == [3, 4]
    assert tensor[torch.tensor([si])].tolist() == [13]
    assert range(10)[si] == 3
    assert type(si + 1) is int  # arithmetic gives plain ints, which then need epoch= and seed=


def test_sample_index_reaches_workers_intact():
    """Across a DataLoader worker boundary (pickled), __getitem__ still sees epoch and seed."""

    class Echo(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, index):
            assert type(index) is SampleIndex
            return torch.tensor([int(index), index.epoch, index.seed % 1000,
                                 torch.randint(0, 2**30, (), generator=ts.sample_generator(index)).item()])

    loader = ts.ResumableLoader(Echo(), batch_size=4, seed=123456, shuffle=True, num_workers=2)
    rows = torch.cat(list(loader))
    plain = ts.ResumableLoader(Echo(), batch_size=4, seed=123456, shuffle=True)
    assert torch.equal(rows, torch.cat(list(plain)))
    assert rows[:, 0].tolist() == np.concatenate(plain.epoch_batches(0)).tolist()
    assert set(rows[:, 1].tolist()) == {0} and set(rows[:, 2].tolist()) == {456}
