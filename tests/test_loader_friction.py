"""Issue 29 item 4, the loader parts: friction met porting the pytorch/examples DDP tutorial.

A peek (``len(next(iter(loader))[0])``) consumes a batch: the next iterator warns, naming how many, and
``peek()`` looks without consuming (position, epoch and every RNG unchanged). DataLoader's ``batch_size``,
``dataset``, ``drop_last`` and ``sampler.set_epoch`` are there, with the loader's epoch as the one clock.
"""

from __future__ import annotations

import copy
import random
import warnings

import numpy as np
import pytest
import torch

import trainstate as ts
from trainstate.errors import AbandonedIteratorWarning

N, BATCH = 20, 4  # 5 batches per epoch


class Augmented(torch.utils.data.Dataset):
    """Per-sample noise from sample_generator, and a draw from each global RNG (which a peek must undo)."""

    def __len__(self):
        return N

    def __getitem__(self, index):
        random.random(), np.random.rand(), torch.rand(1)  # global draws, as careless datasets do
        noise = torch.randn(3, generator=ts.sample_generator(index))
        return torch.full((3,), float(index)) + noise, torch.tensor(int(index))


def loader(**kwargs) -> ts.ResumableLoader:
    return ts.ResumableLoader(Augmented(), batch_size=BATCH, seed=5, **kwargs)


def abandoned(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, AbandonedIteratorWarning)]


def globals_state() -> tuple:
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()


# 1. a peek by next(iter(loader)) is named -----------------------------------------------------------------------
def test_an_abandoned_iterator_then_a_new_one_warns_naming_the_consumed_batches():
    data = loader()
    size = len(next(iter(data))[0])  # the DDP tutorial's batch-size print
    assert size == BATCH and data.cursor == 1
    with pytest.warns(AbandonedIteratorWarning) as caught:
        rest = list(data)
    message = str(caught[0].message)
    assert "handed out 1 batch of this epoch" in message and "counts as consumed" in message, message
    assert "loader.peek()" in message and "resume exact" in message, message
    assert len(rest) == 4 and data.epoch == 1  # the peeked batch is gone from epoch 0: the rule the warning names
    assert issubclass(AbandonedIteratorWarning, ts.ContinuationWarning)


def test_the_count_is_of_every_batch_the_abandoned_iterator_handed_out():
    data = loader()
    it = iter(data)
    next(it), next(it), next(it)
    del it
    with pytest.warns(AbandonedIteratorWarning, match="handed out 3 batches of this epoch"):
        iter(data)


def test_full_epochs_a_resume_and_a_save_between_give_no_warning():
    data = loader()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert len(list(data)) == 5  # whole epochs, one iterator each
        for batch in data:
            break  # one batch trained on, then a save records it as used ...
        saved = copy.deepcopy(data.state_dict())
        assert len(list(data)) == 4  # ... so continuing warns of nothing
        resumed = loader()
        resumed.load_state_dict(saved)
        assert len(list(resumed)) == 4  # a resume mid-epoch
    assert abandoned(caught) == [], abandoned(caught)


def test_negative_control_without_the_check_the_loss_is_silent(monkeypatch):
    """The warning comes from ResumableLoader._warn_abandoned; with it disabled the same peek loses its batch
    silently (what issue 29 reported), so the first test fails without the warning code."""
    monkeypatch.setattr(ts.ResumableLoader, "_warn_abandoned", lambda self: setattr(self, "_taken", 0))
    data = loader()
    next(iter(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest = list(data)
    assert abandoned(caught) == [] and len(rest) == 4


# 2. peek() does not consume ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mid_epoch", [False, True])
def test_peek_is_the_next_batch_and_changes_no_position_epoch_or_rng(mid_epoch):
    peeked, plain = loader(), loader()
    if mid_epoch:
        for data in (peeked, plain):
            it = iter(data)
            next(it), next(it)
            data.state_dict()  # as a save does: these two were used
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    before, position = globals_state(), copy.deepcopy(peeked.state_dict())
    x, y = peeked.peek()
    after = globals_state()
    assert before[0] == after[0] and np.array_equal(before[1], after[1]) and torch.equal(before[2], after[2])
    assert peeked.state_dict() == position and (peeked.epoch, peeked.cursor) == (plain.epoch, plain.cursor)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(3), np.random.seed(3), random.seed(3)
        got = list(peeked) + list(peeked)  # the rest of this epoch, then a whole one
        torch.manual_seed(3), np.random.seed(3), random.seed(3)
        want = list(plain) + list(plain)
    assert abandoned(caught) == []
    assert torch.equal(got[0][0], x) and torch.equal(got[0][1], y)  # what the next iteration yields first
    assert len(got) == len(want) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                         for a, b in zip(got, want))
    assert peeked.state_dict() == plain.state_dict()


def test_peek_with_workers_matches_what_the_workers_produce():
    data = ts.ResumableLoader(Augmented(), batch_size=BATCH, seed=5, num_workers=1)
    x, y = data.peek()
    first = next(iter(data))
    assert torch.equal(first[0], x) and torch.equal(first[1], y)


# 3. DataLoader's attributes ---------------------------------------------------------------------------------------
def test_batch_size_dataset_drop_last_and_the_sampler_length():
    dataset = Augmented()
    data = ts.ResumableLoader(dataset, batch_size=3, seed=5, drop_last=True, rank=1, world_size=2, num_workers=1)
    assert data.batch_size == 3 and data.dataset is dataset and data.drop_last and data.num_workers == 1
    assert len(data.sampler) == 10 and len(data) == 3  # 10 samples on this rank; 3 full batches of 3
    assert list(data.sampler) == [i for ids in data.epoch_batches(0) for i in ids.tolist()]


def test_set_epoch_is_a_no_op_on_the_loaders_epoch_and_refuses_another():
    data = loader()
    for epoch in range(2):  # the DDP tutorial's loop
        data.sampler.set_epoch(epoch)
        assert len(list(data)) == 5 and data.sampler.epoch == data.epoch == epoch + 1
    data.sampler.set_epoch(np.int64(2))
    with pytest.raises(ts.InvalidArgument, match=r"set_epoch\(0\) but the ResumableLoader is at epoch 2.*advances "
                                                 r"its epoch itself.*restores it on resume.*not needed"):
        data.sampler.set_epoch(0)  # a loop restarted at 0 after a resume
    with pytest.raises(ts.InvalidType):
        data.sampler.set_epoch("2")
    assert (data.epoch, data.cursor) == (2, 0)
