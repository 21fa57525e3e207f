"""ResumableLoader: bitwise data resume, and the checks that keep a resume honest.

Resumes are judged by exact equality (bytes of the sample ids, the augmented
tensors and the final weights), never by tolerance. The new-process resumes
run in ``data_run.py``: one interpreter imports torch once and forks a fresh
process per resume. The negative controls show that the comparisons fail
when the position is counted at the sampler, or not restored at all.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, SequentialSampler

import trainstate as ts
import trainstate.data.order
from trainstate.data.loader import _EpochBatches
from data_run import (BATCH, N, SEED, TOTAL, Config, GlobalRandDataset, Recorder, build, load, run, seed_globals,
                      train, train_step)

HERE = Path(__file__).parent
BATCHES_PER_EPOCH = math.ceil(N / BATCH)  # 6, the last one of 2 samples

CONFIGS = {
    "workers0": Config(0),
    "workers2-persistent": Config(2, persistent=True, prefetch=2),
    "workers2": Config(2, persistent=False, prefetch=3),
}
# Stop after K updates; (epoch, cursor) the checkpoint then records.
STOPS = {"mid-epoch": 3, "across-epoch-boundary": 11, "at-epoch-boundary": 12}
STOP_POSITION = {"mid-epoch": (0, 3), "across-epoch-boundary": (1, 5), "at-epoch-boundary": (2, 0)}
# Every stop with 0 and with 2 persistent workers; 2 workers that restart each epoch, across the boundary.
RESUMES = [(config, stop) for config in ("workers0", "workers2-persistent") for stop in STOPS] + [
    ("workers2", "across-epoch-boundary")]
INSPECTED = ("workers2-persistent", "mid-epoch")


def assert_bitwise(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    if a.tobytes() != b.tobytes():
        flat_a, flat_b = a.reshape(len(a), -1) if a.ndim else a, b.reshape(len(b), -1) if b.ndim else b
        first = next(i for i in range(len(flat_a)) if flat_a[i].tobytes() != flat_b[i].tobytes())
        raise AssertionError(f"{what} differs first at row {first}: {flat_a[first]} vs {flat_b[first]}")


def plan_ids(loader: ts.ResumableLoader, batches: int) -> list[np.ndarray]:
    """The first ``batches`` batches of sample ids, epoch after epoch, from the plan alone."""
    out, epoch = [], 0
    while len(out) < batches:
        out += loader.epoch_batches(epoch)
        epoch += 1
    return out[:batches]


# 1 and 6. Bitwise resume in a new process, and the counters ----------------------------------------------------


class Runs:
    def __init__(self, root: Path):
        self.root = root
        self.out = root / "out"
        self.out.mkdir()

    def ref(self, config: str):
        return load(self.out / f"{config}-ref")

    def part(self, config: str, stop: str, part: int):
        return load(self.out / f"{config}-{stop}-part{part}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    """Per config: the uninterrupted reference and, per stop, the run up to the stop, in this process; then
    every resume in a process of its own, and ``trainstate inspect --json`` of one stop checkpoint."""
    r = Runs(tmp_path_factory.mktemp("data-resume"))
    inspected = r.root / "inspected"
    jobs: list[dict] = [{"cli": ["inspect", str(inspected), "--json"], "stdout": str(r.out / "inspect.json")}]
    for config, cfg in CONFIGS.items():
        run(r.root / f"{config}-ref", r.out / f"{config}-ref", cfg)
    for config, stop in RESUMES:
        directory = r.root / f"{config}-{stop}"
        run(directory, r.out / f"{config}-{stop}-part1", CONFIGS[config], stop_at=STOPS[stop])
        jobs.append({"dir": str(directory), "out": str(r.out / f"{config}-{stop}-part2"),
                     "config": asdict(CONFIGS[config]), "total": TOTAL, "fresh_seed": 999})
    shutil.copytree(r.root / "-".join(INSPECTED), inspected)
    (r.root / "jobs.json").write_text(json.dumps(jobs))
    child = subprocess.run([sys.executable, str(HERE / "data_run.py"), str(r.root / "jobs.json"),
                            str(r.root / "results.json")], capture_output=True, text=True, timeout=300, check=False)
    assert child.returncode == 0, f"the resume process failed:\n{child.stdout}\n{child.stderr[-4000:]}"
    r.results = json.loads((r.root / "results.json").read_text())
    assert len({res["pid"] for res in r.results}) == len(jobs), "every job must run in a process of its own"
    failed = [res["out"] for res in r.results[1:] if res["exit"] != 0]
    assert not failed, f"resumes failed: {failed}\n{child.stderr[-4000:]}"
    r.stderr = child.stderr
    return r


@pytest.mark.parametrize("config,stop", RESUMES, ids=[f"{c}-{s}" for c, s in RESUMES])
def test_new_process_resume_is_bitwise(runs, config, stop):
    """Interrupted at K and resumed by a fresh process: the same samples, the same augmented tensors, in the
    same order, for more than 3 epochs, and the same final weights as the uninterrupted run."""
    ref, ref_meta = runs.ref(config)
    part1, meta1 = runs.part(config, stop, 1)
    part2, meta2 = runs.part(config, stop, 2)
    k = STOPS[stop]
    assert len(ref["sizes"]) == TOTAL > 3 * BATCHES_PER_EPOCH and ref_meta["epoch"] == 3
    saved = meta1["saved_position"]
    assert (saved["epoch"], saved["cursor"]) == STOP_POSITION[stop]
    assert len(part1["sizes"]) == k and meta1["next_update"] == k
    assert meta2["restored"] and meta2["start"] == {"next_update": k, "epoch": saved["epoch"],
                                                   "cursor": saved["cursor"]}
    assert meta2["identical_continuation"] is True
    assert meta2["warnings"] == [] and meta2["restore_warnings"] == []
    assert len(part2["sizes"]) == TOTAL - k
    for key in ("ids", "sizes", "x"):
        assert_bitwise(np.concatenate([part1[key], part2[key]]), ref[key], key)
    weights = [key for key in ref if key.startswith("w.")]
    assert weights
    for key in weights:
        assert_bitwise(part2[key], ref[key], key)


@pytest.mark.parametrize("config", CONFIGS)
def test_counters_consistent_across_resume(runs, config):
    """samples_seen, tokens_seen and next_update after a resume equal the uninterrupted run's, and count
    exactly what was consumed."""
    ref, ref_meta = runs.ref(config)
    plan = build(Config(0))[1]
    expected_ids = np.concatenate(plan_ids(plan, TOTAL))
    assert_bitwise(ref["ids"], expected_ids, "reference ids against the plan")
    clocks = ("next_update", "samples_seen", "tokens_seen", "epoch", "cursor")
    expected = {"next_update": TOTAL, "samples_seen": len(expected_ids),
                "tokens_seen": int(sum(1 + i % 5 for i in expected_ids.tolist())), "epoch": 3, "cursor": 2}
    assert {c: ref_meta[c] for c in clocks} == expected
    for stop in (s for c, s in RESUMES if c == config):
        part1, meta1 = runs.part(config, stop, 1)
        _, meta2 = runs.part(config, stop, 2)
        assert {c: meta2[c] for c in clocks} == expected, stop
        saved = meta1["saved_position"]
        assert saved["samples_seen"] == len(part1["ids"]) == int(part1["sizes"].sum())
        assert saved["tokens_seen"] == int(sum(1 + i % 5 for i in part1["ids"].tolist()))


def test_worker_settings_do_not_change_the_data(runs):
    """With per-sample generators the data is a function of (seed, epoch, index) alone: worker count,
    prefetch depth and persistence give the same bytes (and so the same weights)."""
    base, _ = runs.ref("workers0")
    for config in CONFIGS:
        other, _ = runs.ref(config)
        assert set(other) == set(base)
        for key in base:
            assert_bitwise(other[key], base[key], f"{config}: {key}")


def test_inspect_json_shows_data_position(runs):
    """`trainstate inspect DIR --json` shows the loader's position as recorded at the save."""
    assert runs.results[0]["exit"] == 0, runs.stderr[-4000:]
    report = json.loads((runs.out / "inspect.json").read_text())
    _, meta1 = runs.part(*INSPECTED, 1)
    assert report["clocks"]["next_update"] == STOPS[INSPECTED[1]]
    assert report["contract"]["fields"]["loader.data"]["dataset_len"] == N
    assert "data" in report, "inspect --json has no data section"
    assert report["data"] == {"data": meta1["saved_position"]}
    assert report["data"]["data"]["batches_per_epoch"] == BATCHES_PER_EPOCH
    assert (report["data"]["data"]["epoch"], report["data"]["data"]["cursor"]) == STOP_POSITION[INSPECTED[1]]


def test_rollback_into_live_loader_with_prefetch_in_flight(tmp_path):
    """Restoring into the live objects (a rollback) while persistent workers hold prefetched batches of a later
    position continues exactly from the saved position."""
    cfg = Config(2, persistent=True, prefetch=2)
    run(tmp_path / "ref", tmp_path / "ref", cfg)
    ref, _ = load(tmp_path / "ref")
    seed_globals(7)
    state, loader = build(cfg)
    with ts.CheckpointManager(tmp_path / "run") as ckpt:
        train(state, loader, ckpt, total=TOTAL, stop_at=3)
        train(state, loader, None, total=8)  # on past the save: mid-epoch, batches prefetched
        assert ckpt.restore(state).identical_continuation
    assert (state.next_update, loader.epoch, loader.cursor) == (3, 0, 3)
    rec = Recorder()
    train(state, loader, None, total=TOTAL, recorder=rec)
    got = rec.arrays()
    rows = int(ref["sizes"][:3].sum())
    assert_bitwise(got["ids"], ref["ids"][rows:], "ids")
    assert_bitwise(got["x"], ref["x"][rows:], "x")
    for key in (k for k in ref if k.startswith("w.")):
        assert_bitwise(state["model"].state_dict()[key[2:]].numpy(), ref[key], key)


# 2. Negative controls ------------------------------------------------------------------------------------------


class _CountingBatches(_EpochBatches):
    """The loader's batch sampler, counting what the DataLoader took from it (the workers' prefetch included)."""

    produced = 0

    def __iter__(self):
        for batch in super().__iter__():
            self.produced += 1
            yield batch


def _ids(recorder: Recorder) -> list[list[int]]:
    return [ids.tolist() for ids in recorder.ids]


def _restored(directory: Path, cfg: Config, **kwargs) -> tuple[ts.TrainState, ts.ResumableLoader]:
    seed_globals(4242)
    state, loader = build(cfg, init_seed=999, **kwargs)
    with ts.CheckpointManager(directory) as ckpt:
        assert ckpt.restore(state) is not None
    return state, loader


def _position(loader: ts.ResumableLoader, epoch: int, cursor: int) -> dict:
    """The state a loader counting somewhere else would have saved: this one's, at another position."""
    saved = loader.state_dict()
    scratch = build(Config(0), n=loader.plan.dataset_len)[1]
    scratch.epoch, scratch.cursor = epoch, cursor
    return {**saved, "epoch": epoch, "cursor": cursor, "next_batch": scratch.next_batch()}


def test_counting_at_the_sampler_would_skip_samples(tmp_path):
    """With 2 workers and prefetch_factor=2 the DataLoader's sampler runs 4 batches ahead of the loop. The
    loader counts where batches are received; a resume from the sampler's count skips the prefetched batches."""
    n, k, total = 64, 3, 20  # 16 batches per epoch: the prefetch stays inside the epoch
    cfg = Config(2, persistent=False, prefetch=2)
    reference = Recorder()
    seed_globals(7)
    state, loader = build(cfg, n=n)
    train(state, loader, None, total=total, recorder=reference)
    assert _ids(reference) == [ids.tolist() for ids in plan_ids(loader, total)]

    seed_globals(7)
    state, loader = build(cfg, n=n)
    loader._sampler.__class__ = _CountingBatches
    before = Recorder()
    with ts.CheckpointManager(tmp_path) as ckpt:
        train(state, loader, ckpt, total=total, stop_at=k, recorder=before)
    produced = loader._sampler.produced
    assert k < produced <= k + 2 * 2, "the sampler should run up to prefetch_factor * num_workers batches ahead"
    assert (loader.epoch, loader.cursor) == (0, k)

    # Positive control: the position as saved (counted at consumption) continues exactly.
    state, loader = _restored(tmp_path, cfg, n=n)
    after = Recorder()
    train(state, loader, None, total=total, recorder=after)
    assert _ids(before) + _ids(after) == _ids(reference)

    # The same resume from the sampler's count: the prefetched batches are never trained on.
    state, loader = _restored(tmp_path, cfg, n=n)
    loader.load_state_dict(_position(loader, 0, produced))
    naive = Recorder()
    train(state, loader, None, total=total, recorder=naive)
    got = _ids(before) + _ids(naive)
    assert got != _ids(reference)
    planned = [ids.tolist() for ids in plan_ids(loader, produced + total)]
    assert got == planned[:k] + planned[produced:produced + total - k]
    epoch0 = [i for ids in got[:loader.plan.batches_per_epoch() - (produced - k)] for i in ids]
    skipped = sorted(set(range(n)) - set(epoch0))
    assert skipped == sorted(i for ids in _ids(reference)[k:produced] for i in ids)


@pytest.mark.parametrize("how", ["fresh-loader-after-restore", "component-omitted"])
def test_not_restoring_the_position_repeats_samples(tmp_path, how):
    """A loader whose position is not restored starts its epoch over: the batches before the stop come again."""
    k, cfg = 3, Config(0)
    reference = Recorder()
    seed_globals(7)
    state, loader = build(cfg)
    train(state, loader, None, total=TOTAL, recorder=reference)

    seed_globals(7)
    state, loader = build(cfg)
    if how == "component-omitted":
        state = ts.TrainState(model=state["model"], optimizer=state["optimizer"])
    before = Recorder()
    with ts.CheckpointManager(tmp_path) as ckpt:
        train(state, loader, ckpt, total=TOTAL, stop_at=k, recorder=before)

    seed_globals(4242)
    state, loader = build(cfg, init_seed=999)
    if how == "component-omitted":
        state = ts.TrainState(model=state["model"], optimizer=state["optimizer"])
    with ts.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(state) is not None
    if how == "fresh-loader-after-restore":
        assert (loader.epoch, loader.cursor) == (0, k)
        loader = build(cfg)[1]
    after = Recorder()
    train(state, loader, None, total=TOTAL, recorder=after)
    got = _ids(before) + _ids(after)
    assert state.next_update == TOTAL and len(got) == TOTAL
    assert got != _ids(reference)
    assert got[k:2 * k] == _ids(reference)[:k], "the first batches should repeat"
    epoch0 = [i for ids in got[:BATCHES_PER_EPOCH] for i in ids]
    assert len(set(epoch0)) < len(epoch0), "samples should repeat within the first epoch"


# 3. Contract and fingerprint -----------------------------------------------------------------------------------

CHANGES = {"dataset_len": ("n", N, N - 1), "seed": ("seed", SEED, SEED + 1), "batch_size": ("batch_size", BATCH, 5)}


def _save_at(directory: Path, k: int = 3) -> ts.ResumableLoader:
    seed_globals(7)
    state, loader = build(Config(0))
    with ts.CheckpointManager(directory) as ckpt:
        train(state, loader, ckpt, total=TOTAL, stop_at=k)
    return loader


def _snapshot(state: ts.TrainState, loader: ts.ResumableLoader) -> tuple:
    return ({k: v.clone() for k, v in state["model"].state_dict().items()}, state.next_update,
            (loader.epoch, loader.cursor, loader.samples_seen, loader.tokens_seen), torch.get_rng_state())


def _assert_unchanged(before: tuple, state: ts.TrainState, loader: ts.ResumableLoader) -> None:
    after = _snapshot(state, loader)
    for name, tensor in before[0].items():
        assert torch.equal(tensor, after[0][name]), f"model.{name} was loaded"
    assert after[1:3] == before[1:3]
    assert torch.equal(after[3], before[3]), "the global RNG was restored"


@pytest.mark.parametrize("field", CHANGES)
def test_changed_data_plan_is_refused_by_contract(tmp_path, field):
    key, old, new = CHANGES[field]
    _save_at(tmp_path)
    seed_globals(4242)
    state, loader = build(Config(0), init_seed=999, **{key: new})
    before = _snapshot(state, loader)
    with ts.CheckpointManager(tmp_path) as ckpt, pytest.raises(ts.ContractMismatch) as exc:
        ckpt.restore(state)
    name = f"loader.data.{field}"
    assert [(c.field, c.old, c.new) for c in exc.value.changes] == [(name, old, new)]
    assert name in str(exc.value)
    _assert_unchanged(before, state, loader)


@pytest.mark.parametrize("field", [f for f in CHANGES if f != "batch_size"])  # a batch size continues: test_world_size_batch
def test_allowed_contract_change_is_still_refused_by_the_loader(tmp_path, field):
    """Allowing the contract change does not make the old position mean anything: DataMismatch, nothing loaded."""
    key, old, new = CHANGES[field]
    _save_at(tmp_path)
    seed_globals(4242)
    state, loader = build(Config(0), init_seed=999, **{key: new})
    before = _snapshot(state, loader)
    with ts.CheckpointManager(tmp_path) as ckpt, pytest.raises(ts.DataMismatch) as exc:
        ckpt.restore(state, allow_changes=[f"loader.data.{field}"])
    assert f"{field}: checkpoint {old!r}, this run {new!r}" in str(exc.value)
    _assert_unchanged(before, state, loader)
    assert state.history == []


def _stopped_loader(k: int = 3) -> ts.ResumableLoader:
    state, loader = build(Config(0))
    train(state, loader, None, total=TOTAL, stop_at=k)
    return loader


def test_next_batch_fingerprint_tampered(recwarn):
    k = 3
    saved = copy.deepcopy(_stopped_loader(k).state_dict())
    expected = build(Config(0))[1].epoch_batches(0)[k].tolist()

    good = build(Config(0))[1]
    good.load_state_dict(copy.deepcopy(saved))
    assert next(iter(good))["id"].tolist() == expected  # positive control

    tampered = copy.deepcopy(saved)
    tampered["next_batch"]["ids_digest"] = "0" * 32
    bad = build(Config(0))[1]
    bad.load_state_dict(copy.deepcopy(tampered))  # the fingerprint is checked at the first batch
    with pytest.raises(ts.DataMismatch, match="not the one the checkpoint recorded"):
        next(iter(bad))
    assert (bad.epoch, bad.cursor, bad.samples_seen) == (0, k, saved["samples_seen"])

    warn = build(Config(0), on_mismatch="warn")[1]
    warn.load_state_dict(copy.deepcopy(tampered))
    recwarn.clear()
    batches = [b["id"].tolist() for b in warn]
    assert [str(w.message) for w in recwarn if issubclass(w.category, ts.ContinuationWarning)] != []
    assert sum(issubclass(w.category, ts.ContinuationWarning) for w in recwarn) == 1
    assert batches[0] == expected and len(batches) == BATCHES_PER_EPOCH - k


def test_changed_order_code_is_caught_at_the_first_batch(tmp_path, monkeypatch):
    """An order that changed without a new algorithm name (say, a library upgrade) passes the contract, and
    the saved next-batch fingerprint stops it at the first batch; on_mismatch="warn" warns instead."""
    _save_at(tmp_path)
    original = trainstate.data.order.order_at
    monkeypatch.setattr(trainstate.data.order, "order_at", lambda *a: original(*a)[::-1].copy())
    for mode in ("error", "warn"):
        state, loader = build(Config(0), on_mismatch=mode)
        with ts.CheckpointManager(tmp_path) as ckpt:
            info = ckpt.restore(state)
        assert info.identical_continuation and (loader.epoch, loader.cursor) == (0, 3)
        if mode == "error":
            with pytest.raises(ts.DataMismatch):
                next(iter(loader))
        else:
            with pytest.warns(ts.ContinuationWarning, match="not the one the checkpoint recorded"):
                batch = next(iter(loader))
            assert batch["id"].tolist() == loader.epoch_batches(0)[3].tolist()


# 4. Sharding ---------------------------------------------------------------------------------------------------


class Ids(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return int(index)


def _rank_ids(n: int, world: int, rank: int, uneven: str, shuffle: bool, epoch: int, seed: int = 5) -> list[int]:
    loader = ts.ResumableLoader(Ids(n), 3, seed=seed, shuffle=shuffle, rank=rank, world_size=world, uneven=uneven)
    return np.concatenate(loader.epoch_batches(epoch)).tolist()


@pytest.mark.parametrize("uneven", ["pad", "drop"])
@pytest.mark.parametrize("n,world", [(10, 3), (7, 4), (12, 4), (2, 5), (9, 2), (5, 1), (13, 6)])
def test_sharding_matches_distributed_sampler(n, world, uneven):
    if uneven == "drop" and n < world:
        with pytest.raises(ValueError, match="no batch"):
            ts.ResumableLoader(Ids(n), 3, seed=0, rank=0, world_size=world, uneven=uneven)
        return
    for rank in range(world):
        sampler = DistributedSampler(Ids(n), num_replicas=world, rank=rank, shuffle=False,
                                     drop_last=uneven == "drop")
        assert _rank_ids(n, world, rank, uneven, shuffle=False, epoch=0) == list(sampler), (rank, n, world)
        assert _rank_ids(n, world, rank, uneven, shuffle=False, epoch=1) == list(sampler)


def _global_order(n: int, world: int, uneven: str, epoch: int, seed: int) -> np.ndarray:
    shards = [_rank_ids(n, world, r, uneven, shuffle=True, epoch=epoch, seed=seed) for r in range(world)]
    assert len({len(s) for s in shards}) == 1, "every rank must get as many samples"
    order = np.empty(len(shards[0]) * world, dtype=np.int64)
    for r, shard in enumerate(shards):
        order[r::world] = shard
    return order


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), world=st.integers(1, 6), uneven=st.sampled_from(["pad", "drop"]),
       seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 1000))
def test_shuffled_shards_cover_a_permutation(n, world, uneven, seed, epoch):
    assume(uneven == "pad" or n >= world)
    order = _global_order(n, world, uneven, epoch, seed)
    if uneven == "pad":
        assert len(order) == math.ceil(n / world) * world
        assert sorted(order[:n].tolist()) == list(range(n))
        assert np.array_equal(order, np.resize(order[:n], len(order))), "padding repeats the head"
    else:
        assert len(order) == n // world * world
        assert len(set(order.tolist())) == len(order) and all(0 <= i < n for i in order.tolist())


@pytest.mark.parametrize("uneven", ["pad", "drop"])
@pytest.mark.parametrize("n,world", [(10, 3), (33, 4), (17, 1)])
def test_shuffled_order_differs_per_epoch(n, world, uneven):
    orders = [_global_order(n, world, uneven, epoch, seed=SEED).tolist() for epoch in range(4)]
    assert len({tuple(o) for o in orders}) == 4
    assert orders[0][:n // world * world] != list(range(n // world * world))
    assert orders == [_global_order(n, world, uneven, epoch, seed=SEED).tolist() for epoch in range(4)]


# 5. Worker-global RNG ------------------------------------------------------------------------------------------

SHORT = 12  # 2 epochs


def _split_run(tmp_path: Path, cfg: Config, k: int, resume_cfg: Config | None = None):
    run(tmp_path / "ref", tmp_path / "ref", cfg, total=SHORT)
    run(tmp_path / "run", tmp_path / "part1", cfg, total=SHORT, stop_at=k)
    run(tmp_path / "run", tmp_path / "part2", resume_cfg or cfg, total=SHORT, fresh_seed=999)
    ref, _ = load(tmp_path / "ref")
    part1, _ = load(tmp_path / "part1")
    part2, meta = load(tmp_path / "part2")
    return ref, {key: np.concatenate([part1[key], part2[key]]) for key in ("ids", "sizes", "x")}, part2, meta


def _same(a: dict, b: dict, keys) -> bool:
    return all(a[key].tobytes() == b[key].tobytes() for key in keys)


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_global_rng_mid_epoch_warns_once(tmp_path, persistent):
    ref, got, _, meta = _split_run(tmp_path, Config(2, persistent=persistent, prefetch=2, dataset="global"), 3)
    assert len(meta["warnings"]) == 1, meta["warnings"]
    assert "global RNG" in meta["warnings"][0]
    assert meta["restore_warnings"] == meta["warnings"]
    assert meta["identical_continuation"] is False
    assert_bitwise(got["ids"], ref["ids"], "ids")  # the order is still exact
    assert not _same(got, ref, ["x"]), "the worker-global draws should differ after a mid-epoch resume"


def test_sample_generator_with_workers_does_not_warn(tmp_path):
    ref, got, part2, meta = _split_run(tmp_path, Config(2, persistent=False, prefetch=2), 3)
    assert meta["warnings"] == [] and meta["restore_warnings"] == [] and meta["identical_continuation"] is True
    assert _same(got, ref, ["ids", "sizes", "x"]) and _same(part2, ref, [k for k in ref if k.startswith("w.")])


def test_main_process_global_rng_is_bitwise(tmp_path):
    """num_workers=0: the dataset's torch.rand draws come from the main process's RNG, which the checkpoint
    captures, so the resume is bitwise and nothing is warned."""
    ref, got, part2, meta = _split_run(tmp_path, Config(0, dataset="global"), 3)
    assert meta["warnings"] == [] and meta["restore_warnings"] == [] and meta["identical_continuation"] is True
    for key in ("ids", "sizes", "x"):
        assert_bitwise(got[key], ref[key], key)
    for key in (k for k in ref if k.startswith("w.")):
        assert_bitwise(part2[key], ref[key], key)


def test_worker_global_rng_at_epoch_boundary(tmp_path):
    """Fresh workers each epoch are seeded from (seed, epoch): a resume at an epoch boundary is bitwise and
    does not warn. Persistent workers carry their RNG across epochs, so there it warns."""
    ref, got, part2, meta = _split_run(tmp_path / "fresh", Config(2, prefetch=2, dataset="global"), 6)
    assert meta["warnings"] == [] and meta["identical_continuation"] is True
    assert _same(got, ref, ["ids", "x"]) and _same(part2, ref, [k for k in ref if k.startswith("w.")])
    ref, got, part2, meta = _split_run(tmp_path / "persistent", Config(2, True, 2, dataset="global"), 6)
    assert len(meta["warnings"]) == 1 and meta["identical_continuation"] is False
    assert not _same(got, ref, ["x"])


def test_worker_global_draws_found_after_restore_warn_once(tmp_path):
    """Saved by a run that drew nothing global, resumed with a dataset that does: the warning comes with the
    first batch, once, and restore_warnings() reports it from then on."""
    _, _, _, meta = _split_run(tmp_path, Config(2, prefetch=2), 3, resume_cfg=Config(2, prefetch=2, dataset="global"))
    assert meta["restore_warnings"] == []
    assert len(meta["warnings"]) == 1 and "global RNG" in meta["warnings"][0]


# 7. Iteration edge cases ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{}, {"num_workers": 2, "prefetch_factor": 2},
                                    {"num_workers": 2, "prefetch_factor": 2, "persistent_workers": True}],
                         ids=["workers0", "workers2", "workers2-persistent"])
def test_stale_iterator_raises_and_costs_no_batch(kwargs):
    """Advancing an iterator after the loader was iterated again raises, and the newest iterator still hands
    out the batch its position names, with nothing skipped."""
    loader = ts.ResumableLoader(Ids(22), 4, seed=SEED, **kwargs)
    batches = [b.tolist() for b in loader.epoch_batches(0)]
    old = iter(loader)
    assert next(old).tolist() == batches[0]
    new = iter(loader)
    with pytest.raises(RuntimeError, match="stale"):
        next(old)
    got = next(new).tolist()
    assert loader.last_ids.tolist() == batches[1], "the position must name the batch handed out"
    assert got == batches[1], "the stale iterator took a batch from the live one"
    assert [b.tolist() for b in new] == batches[2:]
    assert (loader.epoch, loader.cursor, loader.samples_seen) == (1, 0, 22)


def test_stale_iterator_after_restore():
    loader = ts.ResumableLoader(Ids(22), 4, seed=SEED)
    it = iter(loader)
    next(it)
    saved = loader.state_dict()
    next(it)
    loader.load_state_dict(saved)
    with pytest.raises(RuntimeError, match="stale"):
        next(it)
    assert next(iter(loader)).tolist() == loader.epoch_batches(0)[1].tolist()


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if Path(f"/proc/{p}").exists()]


@pytest.mark.parametrize("persistent", [False, True])
def test_a_dropped_or_closed_loader_stops_its_workers_at_once(persistent):
    """Workers end when the last reference to the loader goes (no reference cycle left for gc to find, which
    stops a cycle's workers only after a 5 s timeout each), and at close(); the control keeps a reference."""
    import gc
    gc.collect()
    gc.disable()
    try:
        loader = ts.ResumableLoader(Ids(22), 4, seed=SEED, num_workers=2, persistent_workers=persistent)
        it = iter(loader)
        next(it)
        pids = [w.pid for w in loader._live()._workers]
        kept = loader  # control: a live reference keeps the workers
        del loader
        assert len(_alive(pids)) == 2, "the control must see live workers"
        kept.close()
        assert _alive(pids) == [], "close() must stop the workers"
        with pytest.raises(RuntimeError, match="stale"):
            next(it)
        it = iter(kept)
        assert next(it).tolist() == kept.epoch_batches(0)[1].tolist()  # new workers, same position
        pids = [w.pid for w in kept._live()._workers]
        assert len(_alive(pids)) == 2
        del kept, it
        assert _alive(pids) == [], "the loader's last reference went but its workers live on (a reference cycle?)"
    finally:
        gc.enable()


class NoLen(Dataset):
    def __getitem__(self, index: int) -> int:
        return int(index)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(5))


@pytest.mark.parametrize("dataset", [NoLen(), Stream()], ids=["no-len", "iterable"])
def test_dataset_without_len_is_refused(dataset):
    with pytest.raises(TypeError, match="no __len__.*map-style"):
        ts.ResumableLoader(dataset, 2, seed=0)


@pytest.mark.parametrize("key", ["sampler", "batch_sampler", "generator"])
def test_sampler_kwargs_refused(key):
    value = {"sampler": SequentialSampler(Ids(8)), "batch_sampler": [[0, 1], [2, 3]],
             "generator": torch.Generator()}[key]
    with pytest.raises(TypeError, match=f"does not take {key}="):
        ts.ResumableLoader(Ids(8), 2, seed=0, **{key: value})


def test_in_order_false_refused():
    with pytest.raises(ValueError, match="in_order"):
        ts.ResumableLoader(Ids(8), 2, seed=0, num_workers=2, in_order=False)
    loader = ts.ResumableLoader(Ids(8), 2, seed=0, in_order=True)  # the default is accepted
    assert [b.tolist() for b in loader] == [b.tolist() for b in loader.epoch_batches(0)]


# Evaluation between updates ------------------------------------------------------------------------------------


def _train_with_eval(evaluate: str) -> tuple[Recorder, dict]:
    seed_globals(7)
    state, loader = build(Config(0))
    val = ts.ResumableLoader(GlobalRandDataset(), 5, seed=3, shuffle=False)
    rec, passes = Recorder(), []
    while state.next_update < SHORT:
        for batch in loader:
            rec.add(batch)
            train_step(state, batch)
            state.next_update += 1
            if state.next_update % 4 == 0 and evaluate != "none":
                position = (loader.epoch, loader.cursor, val.epoch, val.cursor)
                if evaluate == "evaluating":
                    with ts.evaluating(state):
                        passes.append(torch.cat([b["x"] for b in val.replay()]))
                else:
                    passes.append(torch.cat([b["x"] for b in val.replay()]))
                assert (loader.epoch, loader.cursor, val.epoch, val.cursor) == position
            if state.next_update == SHORT:
                break
    return rec, {"weights": {k: v.clone() for k, v in state["model"].state_dict().items()}, "passes": passes}


def test_replay_under_evaluating_leaves_training_untouched():
    """A validation pass through replay() under ts.evaluating moves no position and draws no training RNG
    (its dataset draws torch.rand in this process); without evaluating the trajectory changes."""
    plain, plain_out = _train_with_eval("none")
    evald, eval_out = _train_with_eval("evaluating")
    leaky, leaky_out = _train_with_eval("leaky")
    assert _same(plain.arrays(), evald.arrays(), ["ids", "x"])
    for name, tensor in plain_out["weights"].items():
        assert torch.equal(tensor, eval_out["weights"][name])
    assert len(eval_out["passes"]) == 3
    assert _same(plain.arrays(), leaky.arrays(), ["ids", "x"])  # per-sample generators: the data is unmoved
    assert any(not torch.equal(t, leaky_out["weights"][n]) for n, t in plain_out["weights"].items()), \
        "a validation pass that draws training RNG should change the trajectory (negative control)"
