"""State that must round-trip exactly, or be refused out loud.

Each case here once went wrong silently: gradients of parameters the
optimizer gained after the TrainState was built, NumPy ``spawn()`` children,
an LR scheduler left out of the TrainState, weight tying, the global-RNG
opt-out, lazy modules, and generators whose state cannot be captured.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

import trainstate as ts
from trainstate.state import contract as contract_mod
from trainstate.state import rng as rng_mod
from trainer import assert_same, build, full_state, step


def _restore(directory, state, **kwargs):
    with ts.CheckpointManager(directory) as ckpt:
        return ckpt.restore(state, **kwargs)


def _save(directory, state, **kwargs):
    with ts.CheckpointManager(directory) as ckpt:
        return ckpt.save(state, **kwargs)


# --- gradients of parameters the optimizer holds at save time ---------------------------------------------

def _late_group_state(seed: int = 0) -> ts.TrainState:
    """An optimizer that gains a parameter group after the TrainState was built (a head unfrozen for
    fine-tuning, a progressively grown model)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    state = ts.TrainState(model=model, optimizer=opt, rngs={"data": torch.Generator().manual_seed(seed + 1)},
                          capture_global_rngs=False)
    opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.05})
    return state


def _micro(state: ts.TrainState) -> None:
    x = torch.randn(3, 5, generator=state.rngs["data"])
    (state["model"](x).square().mean() / 2).backward()
    state.counters["micro"] = state.counters.get("micro", 0) + 1


def _finish(state: ts.TrainState) -> None:
    state["optimizer"].step()
    state["optimizer"].zero_grad(set_to_none=True)
    state.counters["micro"] = 0
    state.next_update += 1


def test_gradients_of_a_param_group_added_later_are_pending(tmp_path):
    state = _late_group_state()
    state["model"][0].requires_grad_(False)  # only the late group receives gradients
    _micro(state)
    assert state["model"][2].weight.grad is not None
    assert state.pending_gradients
    with pytest.raises(ts.PendingGradients):
        _save(tmp_path, state)
    state["optimizer"].step()
    assert not state.pending_gradients  # the step consumed them: the usual loop saves fine
    _save(tmp_path, state)


def test_late_param_group_accumulation_resumes_bitwise(tmp_path):
    reference = _late_group_state()
    for _ in range(2):
        _micro(reference)
    _finish(reference)

    state = _late_group_state()
    _micro(state)
    _save(tmp_path, state, include_grads=True)
    resumed = _late_group_state(seed=9)
    info = _restore(tmp_path, resumed)
    assert info.identical_continuation and resumed.pending_gradients
    _micro(resumed)
    _finish(resumed)
    assert_same(resumed["model"].state_dict(), reference["model"].state_dict())
    assert_same(resumed["optimizer"].state_dict(), reference["optimizer"].state_dict())


def test_gradients_of_a_param_unfrozen_later_are_pending(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].requires_grad_(False)  # frozen when the state is built, in the optimizer all the same
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = ts.TrainState(model=model, optimizer=opt, capture_global_rngs=False)
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert not state.pending_gradients
    model[0].requires_grad_(True)  # unfrozen: the next backward reaches it
    model[1].requires_grad_(False)
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    assert model[0].weight.grad is not None and state.pending_gradients
    with pytest.raises(ts.PendingGradients):
        _save(tmp_path, state)


def test_zeroed_in_place_and_skipped_steps_are_not_pending(tmp_path):
    """zero_grad(set_to_none=False) leaves zero tensors behind: nothing is lost by not saving them."""
    state = _late_group_state()
    _micro(state)
    state["optimizer"].step()
    state["optimizer"].zero_grad(set_to_none=False)
    assert state["model"][2].weight.grad is not None and not state.pending_gradients
    _micro(state)
    assert state.pending_gradients  # accumulated into the zeroed tensors in place
    state["optimizer"].zero_grad(set_to_none=True)
    assert not state.pending_gradients
    _save(tmp_path, state)


# --- NumPy Generator.spawn() ------------------------------------------------------------------------------

def _spawn_draws(gen: np.random.Generator) -> list[list[float]]:
    return [child.random(3).tolist() for child in gen.spawn(2)]


@pytest.mark.parametrize("live_seed", [3, 99], ids=["same-entropy", "other-entropy"])
def test_numpy_spawn_continues_after_restore(tmp_path, live_seed):
    gen = np.random.default_rng(3)
    gen.spawn(2)  # two children handed out before the save (data workers, say)
    gen.random(4)
    _save(tmp_path, ts.TrainState(rngs={"noise": gen}, capture_global_rngs=False))
    expected_draws, expected_children = gen.random(3).tolist(), _spawn_draws(gen)

    live = np.random.default_rng(live_seed)
    info = _restore(tmp_path, ts.TrainState(rngs={"noise": live}, capture_global_rngs=False))
    assert info.identical_continuation
    assert live.random(3).tolist() == expected_draws
    assert _spawn_draws(live) == expected_children


def test_rng_record_without_seed_sequence_restores_draws_and_warns():
    """A record written before the SeedSequence was captured: draws continue, spawn() may not, and it says so.

    Also the negative control: comparing draws alone would miss the difference.
    """
    gen = np.random.default_rng(3)
    gen.spawn(2)
    saved = rng_mod.capture({"noise": gen}, include_globals=False)
    old = {"named": {"noise": {k: v for k, v in saved["named"]["noise"].items() if k != "seed_seq"}}}
    expected_draws, expected_children = gen.random(3).tolist(), _spawn_draws(gen)
    live = np.random.default_rng(3)
    warned = rng_mod.restore(old, {"noise": live}, restore_globals=False)
    assert live.random(3).tolist() == expected_draws  # the draws alone look exact ...
    assert _spawn_draws(live) != expected_children  # ... but the children are not
    assert len(warned) == 1 and "rngs['noise']" in warned[0] and "spawn()" in warned[0]


def test_malformed_seed_sequence_is_refused_before_anything_changes():
    gen = np.random.default_rng(3)
    saved = rng_mod.capture({"noise": gen}, include_globals=False)
    saved["named"]["noise"]["seed_seq"]["pool_size"] = "four"
    live = np.random.default_rng(8)
    before = live.bit_generator.state
    with pytest.raises(ts.StateMismatch, match="malformed"):
        rng_mod.restore(saved, {"noise": live})
    assert live.bit_generator.state == before


# --- an LR scheduler left out of the TrainState -----------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2),
    lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10),
    lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9 ** e),
], ids=["StepLR", "OneCycleLR", "LambdaLR"])
def test_unregistered_scheduler_warns_once_at_the_first_save(tmp_path, make):
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = make(opt)
    state = ts.TrainState(model=model, optimizer=opt, capture_global_rngs=False)
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.warns(ts.ContinuationWarning, match=r"optimizer 'optimizer'.*TrainState\(scheduler=\.\.\.\)"):
            ckpt.save(state)
        state.next_update += 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ckpt.save(state)  # once, not at every save
    # control: registered, no warning
    registered = ts.TrainState(model=model, optimizer=opt, sched=sched, capture_global_rngs=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _save(tmp_path / "registered", registered)


def test_optimizer_without_scheduler_does_not_warn(tmp_path):
    model = torch.nn.Linear(3, 1)
    state = ts.TrainState(model=model, optimizer=torch.optim.Adam(model.parameters()), capture_global_rngs=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _save(tmp_path, state)


# --- weight tying -----------------------------------------------------------------------------------------

class LM(torch.nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = torch.nn.Embedding(7, 4)
        self.head = torch.nn.Linear(4, 7, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def _lm_state(tied: bool, seed: int = 0, optimizer: bool = True) -> ts.TrainState:
    """A tied model's optimizer holds one parameter fewer: ``optimizer=False`` isolates the tie itself."""
    torch.manual_seed(seed)
    model = LM(tied)
    if not optimizer:
        return ts.TrainState(model=model, capture_global_rngs=False)
    return ts.TrainState(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                         capture_global_rngs=False)


def _lm_step(state: ts.TrainState) -> None:
    model, opt = state["model"], state["optimizer"]
    opt.zero_grad(set_to_none=True)
    tokens = torch.arange(6) % 7
    torch.nn.functional.cross_entropy(model.head(model.embed(tokens)), (tokens + 1) % 7).backward()
    opt.step()
    state.next_update += 1


def test_ties_are_part_of_the_architecture():
    assert contract_mod.architecture(LM(tied=True)) == [
        ["embed.weight", [7, 4], "float32", None], ["head.weight", [7, 4], "float32", "embed.weight"]]
    assert contract_mod.architecture(LM(tied=False))[1] == ["head.weight", [7, 4], "float32", None]


def test_untied_checkpoint_into_tied_model_is_a_contract_mismatch(tmp_path):
    """Model only (an EMA copy, say): no optimizer's parameter count gives the difference away."""
    saved = _lm_state(tied=False, optimizer=False)
    saved["model"].embed.weight.data.mul_(2)
    _save(tmp_path, saved)
    live = _lm_state(tied=True, seed=5, optimizer=False)
    before = live["model"].embed.weight.detach().clone()
    with pytest.raises(ts.ContractMismatch) as err:
        _restore(tmp_path, live)
    assert [c.field for c in err.value.changes] == ["architecture.model.head.weight"]
    assert (err.value.changes[0].old, err.value.changes[0].new) == ([[7, 4], "float32", None],
                                                                     [[7, 4], "float32", "embed.weight"])
    assert torch.equal(live["model"].embed.weight, before)  # nothing loaded
    # a deliberate tie is accepted as a recorded contract change
    info = _restore(tmp_path, live, allow_changes=["architecture.model.head.weight"])
    assert not info.identical_continuation
    # with an optimizer, and in the reverse direction, the tie is the difference named too
    _save(tmp_path / "untied", _lm_state(tied=False))
    with pytest.raises(ts.ContractMismatch, match="architecture.model.head.weight"):
        _restore(tmp_path / "untied", _lm_state(tied=True))
    _save(tmp_path / "tied", _lm_state(tied=True))
    with pytest.raises(ts.ContractMismatch, match="architecture.model.head.weight"):
        _restore(tmp_path / "tied", _lm_state(tied=False))


def test_tied_model_resumes_bitwise(tmp_path):
    reference = _lm_state(tied=True)
    for _ in range(3):
        _lm_step(reference)
    state = _lm_state(tied=True)
    _lm_step(state)
    _save(tmp_path, state)
    resumed = _lm_state(tied=True, seed=8)
    assert _restore(tmp_path, resumed).identical_continuation
    assert resumed["model"].head.weight is resumed["model"].embed.weight
    for _ in range(2):
        _lm_step(resumed)
    assert_same(resumed["model"].state_dict(), reference["model"].state_dict())
    assert_same(resumed["optimizer"].state_dict(), reference["optimizer"].state_dict())


@pytest.fixture
def old_format(monkeypatch):
    """Save as trainstate did before ties (and the SeedSequence) were recorded."""
    architecture = contract_mod.architecture
    monkeypatch.setattr(contract_mod, "architecture", lambda m: [e[:3] for e in architecture(m)])


@pytest.mark.parametrize("saved_tied, live_tied, outcome", [
    (False, False, "restores"), (True, True, "restores"), (True, False, "restores"), (False, True, "refused")])
def test_generation_without_tie_record(tmp_path, monkeypatch, old_format, saved_tied, live_tied, outcome):
    saved = _lm_state(saved_tied, optimizer=False)
    saved["model"].embed.weight.data.mul_(2)  # untied, the two tensors now differ
    _save(tmp_path, saved)
    monkeypatch.undo()
    live = _lm_state(live_tied, seed=3, optimizer=False)
    before = live["model"].embed.weight.detach().clone()
    if outcome == "refused":  # the checkpoint's two tensors differ: one of them would be lost
        with pytest.raises(ts.StateMismatch, match="architecture.model.head.weight"):
            _restore(tmp_path, live)
        assert torch.equal(live["model"].embed.weight, before)
        return
    info = _restore(tmp_path, live)
    assert info.identical_continuation and not info.contract_changes
    assert_same(live["model"].state_dict(), saved["model"].state_dict())


# --- capture_global_rngs differing between save and restore -----------------------------------------------

def test_saved_without_globals_restored_with_them_warns(tmp_path):
    state = build()
    state.capture_global_rngs = False
    step(state)
    _save(tmp_path, state)
    info = _restore(tmp_path, build(seed=3))
    assert not info.identical_continuation
    assert any("capture_global_rngs=False" in w and "not restored" in w for w in info.warnings)


def test_saved_with_globals_restored_without_leaves_them_alone(tmp_path):
    state = build()
    step(state)
    _save(tmp_path, state)
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    before = random.getstate(), np.random.get_state(legacy=False), torch.get_rng_state()
    live = build(seed=3)
    live.capture_global_rngs = False
    random.setstate(before[0]), np.random.set_state(before[1]), torch.set_rng_state(before[2])
    info = _restore(tmp_path, live)
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state(legacy=False)["state"]["key"], before[1]["state"]["key"])
    assert np.random.get_state(legacy=False)["state"]["pos"] == before[1]["state"]["pos"]
    assert torch.equal(torch.get_rng_state(), before[2])
    assert not info.identical_continuation
    assert any("capture_global_rngs=False" in w and "left" in w for w in info.warnings)
    assert_same(full_state(live)["model"], full_state(state)["model"])
    # control: the same restore with the globals wanted does set them
    _restore(tmp_path, build(seed=3))
    assert random.getstate() != before[0]


# --- lazy modules -----------------------------------------------------------------------------------------

def test_lazy_module_and_its_optimizer_restore_like_load_state_dict(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = ts.TrainState(model=model, optimizer=opt, capture_global_rngs=False)
    x = torch.randn(5, 4)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    _save(tmp_path, state)
    expected = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()

    lazy = torch.nn.LazyLinear(3)
    lazy_opt = torch.optim.Adam(lazy.parameters(), lr=0.01)  # torch allows this: the parameters stay the same objects
    live = ts.TrainState(model=lazy, optimizer=lazy_opt, capture_global_rngs=False)
    info = _restore(tmp_path, live)
    assert info.identical_continuation
    assert_same(dict(lazy.state_dict()), expected["model"])
    lazy_opt.zero_grad()
    lazy(x).square().sum().backward()
    lazy_opt.step()
    assert_same(dict(lazy.state_dict()), dict(model.state_dict()))
    assert_same(lazy_opt.state_dict(), opt.state_dict())


# --- construction refuses what could never be saved -------------------------------------------------------

def test_system_random_is_refused_at_construction():
    with pytest.raises(ts.InvalidType, match=r"rngs\['sys'\].*SystemRandom.*no state"):
        ts.TrainState(rngs={"sys": random.SystemRandom()})


@pytest.mark.parametrize("kwargs, error, match", [
    ({"next_update": torch.nn.Linear(1, 1)}, ts.InvalidType, "next_update"),
    ({"_private": torch.nn.Linear(1, 1)}, ts.InvalidType, "_private"),
    ({"thing": object()}, ts.InvalidType, "state_dict"),
    ({"rngs": [np.random.default_rng(1)]}, ts.InvalidType, "rngs"),
    ({"rngs": {1: np.random.default_rng(1)}}, ts.InvalidType, "rngs"),
    ({"rngs": {"x": 42}}, ts.InvalidType, r"rngs\['x'\]"),
    ({"contract": ["config"]}, ts.InvalidType, "contract"),
    ({"capture_global_rngs": "no"}, ts.InvalidType, "capture_global_rngs"),
])
def test_constructor_misuse_is_typed(kwargs, error, match):
    with pytest.raises(error, match=match):
        ts.TrainState(**kwargs)
