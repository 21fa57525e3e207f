"""Evaluation between updates leaves the training trajectory bitwise unchanged.

A run with an evaluation pass every few updates must train exactly as the same
run without it when the pass runs inside ``ts.evaluating(state)`` and reads a
separate, unshuffled validation ``ResumableLoader`` through ``replay()``. The
pass is made dangerous on purpose: it draws from every global RNG (test-time
noise from torch, Python ``random``, NumPy's global state, a validation
dataset that draws from torch's global RNG) and runs the model forward. The
negative controls show that each protection is needed: leaking the RNG draws,
running the pass in train mode (BatchNorm running statistics), or leaving the
model in eval mode each change the trajectory.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from trainer import assert_same, differs

import trainstate as ts

TOTAL, EVERY = 14, 4
TRAIN_N, VAL_N = 48, 20


class TrainSet(torch.utils.data.Dataset):
    """Fixed features per index, augmented from the index-addressed generator."""

    def __init__(self, n: int = TRAIN_N):
        g = torch.Generator().manual_seed(100)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x[:, 0] + self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index):
        g = ts.sample_generator(index)
        x = self.x[index] + 0.1 * torch.randn(6, generator=g)
        return x, self.y[index], int(index)


class ValSet(TrainSet):
    """Validation data with per-sample noise and, dangerously, a draw from torch's global RNG."""

    def __init__(self):
        super().__init__(VAL_N)

    def __getitem__(self, index):
        x, y, i = super().__getitem__(index)
        return x + 0.01 * torch.rand(()), y, i


def _seed_globals(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))


def _setup(val_workers: int = 0):
    _seed_globals(3)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    train_loader = ts.ResumableLoader(TrainSet(), batch_size=8, seed=11, shuffle=True)
    val_loader = ts.ResumableLoader(ValSet(), batch_size=6, seed=99, shuffle=False, num_workers=val_workers)
    state = ts.TrainState(model=model, optimizer=opt, data=train_loader,
                          rngs={"mix": torch.Generator().manual_seed(5)})
    return state, train_loader, val_loader


def _train_step(state: ts.TrainState, x: torch.Tensor, y: torch.Tensor) -> None:
    """Draws from every global source (dropout: torch) and from the named generator."""
    model, opt = state["model"], state["optimizer"]
    x = x * (1.0 + 0.05 * random.random()) * (1.0 + 0.05 * float(np.random.rand()))
    x = x + 0.01 * torch.randn(x.shape, generator=state.rngs["mix"])
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _evaluate(model: torch.nn.Module, val_loader: ts.ResumableLoader) -> float:
    """A pass that draws from every global RNG and runs the model forward."""
    total = 0.0
    for x, y, _ in val_loader.replay():
        x = x + 0.05 * torch.randn_like(x)  # test-time noise: torch global RNG
        x = x * (1.0 + 0.05 * random.random()) * (1.0 + 0.05 * float(np.random.rand()))
        total += float(F.cross_entropy(model(x), y))
    return total


def _eval_isolated(state, val_loader):
    with ts.evaluating(state):
        return _evaluate(state["model"], val_loader)


def _eval_rng_leak(state, val_loader):
    """Modes handled by hand, RNG not protected."""
    model = state["model"]
    model.eval()
    with torch.no_grad():
        metric = _evaluate(model, val_loader)
    model.train()
    return metric


def _leak_one(source: str):
    restore = {"python": (random.getstate, random.setstate),
               "numpy": (np.random.get_state, np.random.set_state),
               "torch": (torch.get_rng_state, torch.set_rng_state)}

    def evaluate(state, val_loader):
        # RNG protected except for one source; modes handled by hand.
        saved = {k: get() for k, (get, _) in restore.items() if k != source}
        metric = _eval_rng_leak(state, val_loader)
        for k, value in saved.items():
            restore[k][1](value)
        return metric
    return evaluate


def _eval_train_mode(state, val_loader):
    """RNG protected (evaluating with no modules), but the model stays in train mode: BatchNorm updates."""
    with ts.evaluating([]):
        return _evaluate(state["model"], val_loader)


def _eval_mode_leak(state, val_loader):
    """RNG protected, model put in eval mode and never put back: training continues in eval mode."""
    with ts.evaluating([]):
        state["model"].eval()
        return _evaluate(state["model"], val_loader)


EVALUATIONS = {"isolated": _eval_isolated, "rng_leak": _eval_rng_leak, "train_mode": _eval_train_mode,
               "mode_leak": _eval_mode_leak, **{f"leak_{s}": _leak_one(s) for s in ("python", "numpy", "torch")}}


def _run(evaluation: str | None, val_workers: int = 0) -> dict:
    state, train_loader, val_loader = _setup(val_workers)
    state["model"].train()  # once: the loop relies on the mode staying as it was
    weights, ids, metrics = [], [], []
    while state.next_update < TOTAL:
        for x, y, batch_ids in train_loader:
            _train_step(state, x, y)
            state.next_update += 1
            weights.append({k: v.clone() for k, v in state["model"].state_dict().items()})
            ids.append(batch_ids.clone())
            assert torch.equal(batch_ids, torch.from_numpy(train_loader.last_ids))
            if evaluation and state.next_update % EVERY == 0:
                metrics.append(EVALUATIONS[evaluation](state, val_loader))
            if state.next_update == TOTAL:
                break
    draws = (random.random(), float(np.random.rand()), torch.rand(3), torch.rand(3, generator=state.rngs["mix"]))
    return {"weights": weights, "ids": ids, "optimizer": state["optimizer"].state_dict(),
            "position": train_loader.state_dict(), "draws": draws, "metrics": metrics}


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)  # module fixtures run before conftest's per-test autouse fixture
    return _run(None)


def _trajectory(run: dict) -> dict:
    return {k: run[k] for k in ("weights", "ids", "optimizer", "position", "draws")}


def test_reference_is_deterministic(reference):
    assert_same(_trajectory(_run(None)), _trajectory(reference))
    assert len(reference["ids"]) == TOTAL
    # more than one epoch, so an evaluation lands both mid-epoch and across an epoch boundary
    assert reference["position"]["epoch"] == TOTAL * 8 // TRAIN_N


@pytest.mark.parametrize("val_workers", [0, 2])
def test_isolated_evaluation_leaves_trajectory_bitwise(reference, val_workers):
    run = _run("isolated", val_workers)
    assert len(run["metrics"]) == TOTAL // EVERY
    assert_same(_trajectory(run), _trajectory(reference))


@pytest.mark.parametrize("control", ["rng_leak", "leak_python", "leak_numpy", "leak_torch"])
def test_negative_control_rng_leak_diverges(reference, control):
    run = _run(control)
    assert differs(run["weights"], reference["weights"]), f"{control} left the weights identical"
    assert differs(run["draws"], reference["draws"])
    # the data order is a function of (seed, epoch), not of the RNG: only the trajectory moves
    assert_same(run["ids"], reference["ids"])


def test_negative_control_train_mode_evaluation_changes_batchnorm(reference):
    run = _run("train_mode")
    first = EVERY - 1  # the state after the first evaluation's update is recorded before it runs
    assert_same(run["weights"][first], reference["weights"][first])
    after = run["weights"][first + 1]
    ref_after = reference["weights"][first + 1]
    assert not torch.equal(after["1.running_mean"], ref_after["1.running_mean"])
    assert after["1.num_batches_tracked"] > ref_after["1.num_batches_tracked"]
    assert differs(run["weights"], reference["weights"])


def test_negative_control_mode_leak_diverges(reference):
    run = _run("mode_leak")
    assert differs(run["weights"], reference["weights"])
    assert differs(run["draws"], reference["draws"])  # no dropout draws in eval mode


def test_repeated_isolated_evaluations_agree():
    """Same weights, restored RNG, replayed batches: the metric repeats bitwise, noise included."""
    state, train_loader, val_loader = _setup()
    state["model"].train()
    for x, y, _ in train_loader:
        _train_step(state, x, y)
        break
    first = _eval_isolated(state, val_loader)
    assert _eval_isolated(state, val_loader) == first
    assert _eval_rng_leak(state, val_loader) == first  # from the same RNG state, once
    assert _eval_rng_leak(state, val_loader) != first  # the leak moved the RNG


# evaluating() ---------------------------------------------------------------

def _draw(named: dict | None = None) -> list:
    out = [random.random(), float(np.random.rand()), torch.rand(2)]
    for g in (named or {}).values():
        if isinstance(g, torch.Generator):
            out.append(torch.rand(2, generator=g))
        elif isinstance(g, np.random.Generator):
            out.append(g.random(2))
        elif isinstance(g, np.random.RandomState):
            out.append(g.rand(2))
        else:
            out.append(g.random())
    return out


def _same_draws(a: list, b: list) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else np.array_equal(x, y) for x, y in zip(a, b))


def _mixed_model() -> torch.nn.Module:
    model = _model()
    model.train()
    model[1].eval()  # a frozen BatchNorm inside a training model: must come back frozen
    return model


def _modes(model: torch.nn.Module) -> list[bool]:
    return [m.training for m in model.modules()]


def test_evaluating_sets_eval_and_no_grad_then_restores():
    model = _mixed_model()
    state = ts.TrainState(model=model)
    before = _modes(model)
    with ts.evaluating(state):
        assert not any(_modes(model))
        assert not torch.is_grad_enabled()
    assert _modes(model) == before == [True, True, False, True, True, True]
    assert torch.is_grad_enabled()
    with ts.evaluating(state, no_grad=False):
        assert torch.is_grad_enabled() and not any(_modes(model))


@pytest.mark.parametrize("target", ["state", "modules"])
def test_evaluating_restores_modes_and_rng_when_the_block_raises(target):
    model = _mixed_model()
    other = torch.nn.Dropout(0.5)  # a second module passed in the iterable form
    state = ts.TrainState(model=model)
    before_modes = _modes(model)
    _seed_globals(21)
    expected = _draw()
    _seed_globals(21)

    class Boom(Exception):
        pass

    with pytest.raises(Boom), ts.evaluating(state if target == "state" else [model, other]):
        _draw()
        model(torch.randn(4, 6))
        model.train()  # even a mode change inside the block is undone
        raise Boom
    assert _modes(model) == before_modes
    assert other.training  # put in eval mode by the "modules" form, and back
    assert torch.is_grad_enabled()
    assert _same_draws(_draw(), expected)


def _named() -> dict:
    return {"torch": torch.Generator().manual_seed(1), "numpy": np.random.default_rng(2),
            "legacy": np.random.RandomState(3), "python": random.Random(4)}


def test_evaluating_restores_named_generators_in_state():
    _seed_globals(5)
    expected = _draw(_named())
    named = _named()
    state = ts.TrainState(model=_model(), rngs=named)
    _seed_globals(5)
    with ts.evaluating(state):
        _draw(named)
        _draw(named)
    assert _same_draws(_draw(named), expected)


def test_evaluating_extra_rngs_keyword_and_negative_control():
    """A generator that is neither in state.rngs nor in rngs= is not restored (proof the check can fail)."""
    covered, uncovered = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
    expected = torch.rand(3, generator=torch.Generator().manual_seed(8))
    with ts.evaluating(ts.TrainState(model=_model()), rngs={"extra": covered}):
        torch.rand(3, generator=covered)
        torch.rand(3, generator=uncovered)
    assert torch.equal(torch.rand(3, generator=covered), expected)
    assert not torch.equal(torch.rand(3, generator=uncovered), expected)


def test_nested_evaluating_restores_each_level():
    model = _mixed_model()
    state = ts.TrainState(model=model)
    before = _modes(model)
    _seed_globals(9)
    expected = _draw()
    _seed_globals(9)
    with ts.evaluating(state):
        _draw()
        inner_expected = _draw()
        _seed_globals(9)
        _draw()
        with ts.evaluating(state):
            model.train()
            _draw()
        assert not any(_modes(model))
        assert _same_draws(_draw(), inner_expected)
    assert _modes(model) == before
    assert _same_draws(_draw(), expected)


def test_evaluating_rejects_a_non_generator():
    with pytest.raises(TypeError, match="rngs\\['bad'\\]"), ts.evaluating([], rngs={"bad": 42}):
        pass


# replay() -------------------------------------------------------------------

def _collect(iterable) -> list:
    return [[t.clone() if isinstance(t, torch.Tensor) else t for t in batch] for batch in iterable]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_replay_repeats_and_does_not_move_the_position(num_workers):
    loader = ts.ResumableLoader(TrainSet(), batch_size=8, seed=11, shuffle=True, num_workers=num_workers)
    epoch0 = [ids.copy() for ids in loader.epoch_batches(0)]
    iterator = iter(loader)
    consumed = [next(iterator) for _ in range(2)]
    position = loader.state_dict()

    first = _collect(loader.replay())
    second = _collect(loader.replay())
    assert_same(second, first)
    # replay(0) of a shuffled loader is epoch 0 in full, in its order, with its augmentation
    assert torch.equal(torch.cat([b[2] for b in first]), torch.from_numpy(np.concatenate(epoch0)))
    assert_same(_collect(consumed), first[:2])
    assert loader.state_dict() == position

    # another epoch replays another order
    other = _collect(loader.replay(1))
    assert not torch.equal(torch.cat([b[2] for b in other]), torch.cat([b[2] for b in first]))
    assert loader.state_dict() == position

    # the interrupted training iterator refuses to continue; a new one continues from the cursor
    with pytest.raises(RuntimeError, match="stale"):
        next(iterator)
    rest = _collect(iter(loader))
    assert_same([b[2] for b in rest], [b[2] for b in first[2:]])
    assert loader.epoch == 1 and loader.cursor == 0


class TwoDraws(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index):
        return torch.rand((), generator=ts.sample_generator(index)), torch.rand(()), int(index)


@pytest.mark.parametrize("persistent", [False, True])
def test_replay_with_workers_repeats_per_sample_draws(persistent):
    """Per-sample generators repeat on every replay. Draws from the workers' global RNG repeat
    only when each replay starts fresh workers: persistent workers continue their streams."""
    loader = ts.ResumableLoader(TwoDraws(), batch_size=4, seed=3, shuffle=False, num_workers=2,
                                persistent_workers=persistent)
    first, second = _collect(loader.replay()), _collect(loader.replay())
    for column in (0, 2):
        assert_same([b[column] for b in second], [b[column] for b in first])
    same_global = all(torch.equal(a[1], b[1]) for a, b in zip(first, second))
    assert same_global is not persistent


def test_replay_of_validation_loader_leaves_training_loader_alone():
    _, train_loader, val_loader = _setup()
    iterator = iter(train_loader)
    next(iterator)
    position = train_loader.state_dict()
    for _ in val_loader.replay():
        pass
    assert train_loader.state_dict() == position
    assert val_loader.state_dict()["cursor"] == 0 and val_loader.state_dict()["epoch"] == 0
    next(iterator)  # the training iterator is untouched by another loader's replay
    assert train_loader.cursor == 2
