"""ts.Mixture: set proportions over every window, per-source epochs, index-addressable, resumable, in the contract.

The window bound is the documented one (strictly below ``mix.bound(k)``
samples of ``w_k m`` over any ``m`` consecutive samples), checked over every
window of 10**4 samples in a stretch of 3·10**5; an i.i.d. random choice of
source (what most pipelines do) fails the same check (negative control). The
kill test SIGKILLs a real training process mid-mixture and compares the ids
and weights of the resumed run with an uninterrupted one, bitwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import trainstate as ts
from trainstate.data.mixture import MixtureOrder, quantise

HERE = Path(__file__).parent
WINDOW = 10 ** 4


class Ids(torch.utils.data.Dataset):
    def __init__(self, n: int, base: int = 0):
        self.n, self.base = n, base

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return self.base + int(index)


def _window_excess(sources: np.ndarray, weights, window: int = WINDOW) -> list[float]:
    """Per source, the largest |count - w m| over all windows of m consecutive positions."""
    out = []
    for k, w in enumerate(weights):
        c = np.concatenate([[0], np.cumsum(sources == k)])
        counts = c[window:] - c[:-window]
        out.append(float(np.max(np.abs(counts - w * window))))
    return out


CASES = [([0.7, 0.3], [1000, 30]), ([0.5, 0.25, 0.25], [50, 7000, 3]), ([0.1, 0.2, 0.3, 0.15, 0.25], [9, 99, 999, 5, 77]),
         ([1 / 3, 2 / 3], [10 ** 6, 10]), ([0.999, 0.001], [100, 100])]


@pytest.mark.parametrize("weights, lengths", CASES)
def test_realised_proportions_within_the_stated_bound_over_every_window(weights, lengths):
    order = MixtureOrder(tuple(lengths), tuple(weights), sum(lengths), seed=11, shuffle=True)
    sources, _ = order.locate(np.arange(3 * 10 ** 5) + 10 ** 9)  # far into the stream, too
    excess = _window_excess(sources, weights)
    bounds = [order.bound(k) for k in range(len(weights))]
    assert all(e < b for e, b in zip(excess, bounds)), (excess, bounds)
    assert max(bounds) <= max(1, int(np.ceil(np.log2(len(weights)))))


def test_negative_control_iid_source_choice_fails_the_window_bound():
    rng = np.random.default_rng(0)
    sources = rng.choice(2, size=3 * 10 ** 5, p=[0.7, 0.3])
    assert max(_window_excess(sources, [0.7, 0.3])) >= 1  # ~sqrt(m w (1 - w)) = 46 samples, not < 1


def test_each_source_keeps_its_own_epochs_reshuffled():
    small, large = 7, 10 ** 5
    order = MixtureOrder((large, small), (0.5, 0.5), large + small, seed=3, shuffle=True)
    ids, epochs = order.ids_at(0, np.arange(700))
    mine = ids >= large
    small_ids, small_epochs = ids[mine] - large, epochs[mine]
    assert len(small_ids) == 350 and set(small_epochs.tolist()) == set(range(50))
    passes = [small_ids[small_epochs == e] for e in range(50)]
    assert all(sorted(p.tolist()) == list(range(small)) for p in passes)  # every pass a permutation of the source
    assert len({tuple(p.tolist()) for p in passes}) > 40  # reshuffled per pass
    big = ids[~mine]
    assert set(epochs[~mine].tolist()) == {0} and len(set(big.tolist())) == len(big)  # first pass, no repeats


def test_index_addressable_any_position_any_epoch():
    order = MixtureOrder((100, 37, 5), (0.6, 0.3, 0.1), 142, seed=9, shuffle=True)
    ids, epochs = order.ids_at(0, np.arange(142 * 6))
    for epoch in range(6):
        at = np.array([0, 5, 77, 141])
        got, got_epochs = order.ids_at(epoch, at)
        assert np.array_equal(got, ids[epoch * 142 + at]) and np.array_equal(got_epochs, epochs[epoch * 142 + at])
    sources, local = order.locate(np.arange(2 ** 40, 2 ** 40 + 8))
    assert sources.min() >= 0 and local.max() < 2 ** 40


def test_weights_are_quantised_exactly():
    assert sum(quantise([0.7, 0.3])) == 2 ** 30 and sum(quantise([1, 1, 1])) == 2 ** 30
    assert min(quantise([1e-12, 1.0])) >= 1


@pytest.mark.parametrize("sources, message", [
    ([], "at least one"), ([(Ids(3), 0.0)], "positive finite"), ([(Ids(3), float("nan"))], "positive finite"),
    ([(Ids(0), 1.0)], "at least one sample"), ([Ids(3)], r"\(dataset, weight\) pair"),
])
def test_bad_mixtures_refused(sources, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ts.Mixture(sources)


def _mix_loader(weights=(0.7, 0.3), **kwargs) -> ts.ResumableLoader:
    mix = ts.Mixture([(Ids(40), weights[0]), (Ids(9, base=1000), weights[1])])
    return ts.ResumableLoader(mix, batch_size=4, seed=21, **kwargs)


def test_loader_over_a_mixture_reads_source_samples_with_source_epochs():
    loader = _mix_loader()
    seen = [b.tolist() for b in loader]
    flat = [i for b in seen for i in b]
    assert len(flat) == 49 and sum(i >= 1000 for i in flat) in (14, 15)
    assert loader.data_contract()["mixture"]["weights"] == [0.7, 0.3]
    first = loader.epoch_batches(0).keyed(0)
    assert first[1] is not None  # the source's epoch keys each sample's randomness


def test_resume_mid_mixture_in_a_new_loader_is_bitwise(tmp_path):
    reference = _mix_loader()
    expected = [b.tolist() for epoch in range(3) for b in reference]
    loader = _mix_loader()
    state = ts.TrainState(data=loader)
    got = []
    it = (batch for _ in range(3) for batch in loader)
    for _ in range(17):  # into the second epoch (13 batches each)
        got.append(next(it).tolist())
    state.next_update = 17
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    fresh = _mix_loader()
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(ts.TrainState(data=fresh))
    while len(got) < len(expected):
        got += [b.tolist() for b in fresh]
    assert got == expected


def test_changed_weight_refused_then_allowed_continues_each_source(tmp_path):
    loader = _mix_loader()
    it = iter(loader)
    consumed = [next(it).tolist() for _ in range(5)]
    state = ts.TrainState(data=loader)
    state.next_update = 5
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    changed = _mix_loader(weights=(0.5, 0.5))
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.ContractMismatch, match=r"loader\.data\.mixture\.weights"):
            ckpt.restore(ts.TrainState(data=changed))
        info = ckpt.restore(ts.TrainState(data=changed), allow_changes=["loader.data.mixture.weights"])
    assert [c.field for c in info.contract_changes] == ["loader.data.mixture.weights"]
    assert not info.identical_continuation
    rest = [b.tolist() for b in changed]
    flat_before = [i for b in consumed for i in b]
    flat_after = [i for b in rest for i in b]
    # each source continues its own stream: no sample of a source's current pass repeats, none is skipped
    for lo, n in ((0, 40), (1000, 9)):
        mine = [i - lo for i in flat_before + flat_after if lo <= i < lo + n]
        passes = [mine[i:i + n] for i in range(0, len(mine), n)]
        assert all(sorted(p) == list(range(n)) for p in passes[:-1]) and len(set(passes[-1])) == len(passes[-1])
    after_small = sum(i >= 1000 for i in flat_after)
    assert abs(after_small - 0.5 * len(flat_after)) <= 1  # the new weights from the resume on
    # and the reweighted run saves and resumes like any other
    state = ts.TrainState(data=changed)
    state.next_update = 6
    with ts.CheckpointManager(tmp_path / "again") as ckpt:
        ckpt.save(state)
        again = _mix_loader(weights=(0.5, 0.5))
        ckpt.restore(ts.TrainState(data=again))
    assert again.plan == changed.plan


def test_changed_weight_refused_by_load_state_dict_without_the_contract():
    loader = _mix_loader()
    next(iter(loader))
    with pytest.raises(ts.DataMismatch, match="mixture"):
        _mix_loader(weights=(0.6, 0.4)).load_state_dict(loader.state_dict())


def test_changed_source_length_refused():
    loader = _mix_loader()
    other = ts.ResumableLoader(ts.Mixture([(Ids(41), 0.7), (Ids(9, base=1000), 0.3)]), batch_size=4, seed=21)
    with pytest.raises(ts.DataMismatch, match="mixture"):
        other.load_state_dict(loader.state_dict())


# SIGKILL --------------------------------------------------------------------------------------------------------

def _run(directory: Path, out: Path, total: int, every: int = 2) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "mixture_run.py"), str(directory), str(out), str(total),
                             str(every)], stdout=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_sigkill_mid_mixture_resumes_bitwise(tmp_path):
    total = 14  # loader epochs of 10 batches
    ref = _run(tmp_path / "ref", tmp_path / "ref.json", total, every=0)
    assert ref.wait(timeout=120) == 0
    ref.stdout.close()
    run, out = tmp_path / "run", tmp_path / "run.json"
    killed = 0
    for kill_at in (5, 13):  # after update 5 (saved at 4: mid-epoch), after 13 (saved at 12: second epoch)
        proc = _run(run, out, total)
        for line in proc.stdout:
            if int(line.split()[1]) >= kill_at:
                os.kill(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=60)
        proc.stdout.close()
        killed += proc.returncode == -signal.SIGKILL
    assert killed == 2
    proc = _run(run, out, total)
    assert proc.wait(timeout=120) == 0
    proc.stdout.close()
    reference, resumed = json.loads((tmp_path / "ref.json").read_text()), json.loads(out.read_text())
    assert resumed["restored"] and resumed["ids"] == reference["ids"] and resumed["weights"] == reference["weights"]
    assert len(reference["ids"]) == total


def test_docs_mixture_example_runs_as_written():
    from docsite import runnable

    block = runnable("mixture")  # docs/guides/data-position.md
    assert "ts.Mixture(" in block
    namespace: dict = {}
    exec(block, namespace)
    first = namespace["first"]
    assert len(first) == 32 and int((first >= 10_000).sum()) in (9, 10)
