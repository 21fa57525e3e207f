"""Restart rehearsal: a generation restored into freshly built objects catches what digests cannot.

Each defect below verifies perfectly byte for byte; the rehearsal is what
finds it, with a specific error, before a real restart has to. The global RNG
of the rehearsing process is left exactly as it was.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import trainstate as ts
from trainstate.cli import main as cli_main
from trainstate.storage.local import LocalStore
from trainstate.lifecycle.rehearsal import load_factory, rehearse
from trainer import CLASSES, CONFIG, assert_same, build, full_state, step

HERE = Path(__file__).parent
FULL_CHECKS = ("digests", "contract", "components", "shapes and dtypes", "optimizer pairing", "rng schema",
               "load_state_dict")


def _save(directory: Path, state: ts.TrainState, **kwargs) -> str:
    with ts.CheckpointManager(directory, **kwargs) as ckpt:
        return ckpt.save(state).name


def _trained(steps: int = 2, seed: int = 0) -> ts.TrainState:
    state = build(seed=seed)
    for _ in range(steps):
        step(state)
    return state


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(v) for v in tree)
    return tree


def _global_states():
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _set_global_states(states) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


def _global_draws():
    return random.random(), np.random.rand(4).tolist(), torch.rand(4).tolist(), torch.randn(2).tolist()


# a valid generation -----------------------------------------------------------------------------------
def test_valid_generation_passes_reports_checks_and_restores_bitwise(tmp_path):
    state = _trained()
    name = _save(tmp_path, state)
    saved = _clone(full_state(state))
    built = []

    def factory():
        fresh = build(seed=1234)  # other initial values: everything must come from the generation
        built.append(fresh)
        return fresh

    result = rehearse(LocalStore(tmp_path), name, factory)
    assert isinstance(result, ts.Rehearsal)
    assert result.generation == name == "gen-000000000002"
    assert result.checks == FULL_CHECKS
    assert result.warnings == ()
    assert len(built) == 1
    assert_same(full_state(built[0]), saved)  # the rehearsal really restored, bitwise
    assert_same(full_state(state), saved)  # and left the live objects alone
    with ts.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.rehearse(lambda: build(seed=5)) == result  # latest by default


def test_rehearsal_leaves_global_rng_untouched(tmp_path):
    name = _save(tmp_path, _trained())

    def noisy_factory():
        random.seed(99)
        np.random.seed(99)
        torch.manual_seed(99)
        _global_draws()
        return build(seed=99)  # build() seeds torch again and draws for its weights

    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    before = _global_states()
    rehearse(LocalStore(tmp_path), name, noisy_factory)
    after_rehearsal = _global_draws()
    _set_global_states(before)
    control = _global_draws()
    assert after_rehearsal == control
    # negative control: the factory on its own does move every global source
    _set_global_states(before)
    noisy_factory()
    moved = _global_draws()
    assert moved[0] != control[0] and moved[1] != control[1] and moved[2] != control[2]


def test_failed_rehearsal_also_leaves_global_rng_untouched(tmp_path):
    name = _save(tmp_path, _trained())

    def bad():
        torch.manual_seed(1)
        random.seed(1)
        np.random.seed(1)
        s = build(seed=1)
        return ts.TrainState(model=s["model"], optimizer=s["optimizer"], scheduler=s["scheduler"],
                             scaler=s["scaler"], rngs={"data": s.rngs["data"]}, contract=s.contract)

    random.seed(4)
    before = _global_states()
    with pytest.raises(ts.StateMismatch):
        rehearse(LocalStore(tmp_path), name, bad)
    got = _global_draws()
    _set_global_states(before)
    assert got == _global_draws()


# (a) a shape change -----------------------------------------------------------------------------------
def build_width(width: int, seed: int = 0) -> ts.TrainState:
    """trainer.build with another hidden width that the config does not record (a code change)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU(),
        torch.nn.Dropout(0.3), torch.nn.Linear(width, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=CONFIG["lr"])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    return ts.TrainState(model=model, optimizer=opt, scheduler=sched, scaler=scaler,
                         rngs={"data": torch.Generator().manual_seed(seed + 1),
                               "noise": np.random.default_rng(seed + 2)},
                         contract={"config": CONFIG, "class_names": CLASSES, "data_manifest": "manifest-v1"})


def test_shape_change_is_caught(tmp_path):
    name = _save(tmp_path, _trained())
    store = LocalStore(tmp_path)
    assert rehearse(store, name, lambda: build_width(CONFIG["width"])).checks == FULL_CHECKS  # control
    # The contract records the architecture, so it is the first check to see the change ...
    with pytest.raises(ts.ContractMismatch) as caught:
        rehearse(store, name, lambda: build_width(32))
    fields = {c.field for c in caught.value.changes}
    assert "architecture.model.0.weight" in fields and "architecture.model.4.weight" in fields
    # ... and with the architecture change allowed, the shape check names the tensor and both shapes.
    with pytest.raises(ts.StateMismatch, match=r"model\.0\.weight: gen-000000000002 has \(16, 6\) torch\.float32, "
                                               r"this run has \(32, 6\) torch\.float32"):
        rehearse(store, name, lambda: build_width(32), allow_changes=("architecture.model",))


# (b) a swapped optimizer param group ------------------------------------------------------------------
def build_grouped(swapped: bool = False, seed: int = 0) -> ts.TrainState:
    """Two parameter groups of two tensors each (equal sizes), in the saved order or swapped."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    first, second = list(model[0].parameters()), list(model[2].parameters())
    groups = [{"params": second}, {"params": first}] if swapped else [{"params": first}, {"params": second}]
    return ts.TrainState(model=model, optimizer=torch.optim.AdamW(groups, lr=0.01),
                         rngs={"data": torch.Generator().manual_seed(seed)}, contract={"groups": "body, head"})


def _grouped_step(state: ts.TrainState) -> None:
    model, opt = state["model"], state["optimizer"]
    opt.zero_grad(set_to_none=True)
    x = torch.randn(8, 6, generator=state.rngs["data"])
    torch.nn.functional.cross_entropy(model(x), torch.arange(8) % 2).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state.next_update += 1


def test_swapped_param_groups_load_silently_in_torch_but_fail_rehearsal(tmp_path):
    state = build_grouped()
    _grouped_step(state)
    name = _save(tmp_path, state)
    saved_opt = copy.deepcopy(state["optimizer"].state_dict())

    # Negative control: torch's own load_state_dict accepts the swapped groups without a word, and each
    # moment lands on a parameter of another shape.
    swapped = build_grouped(swapped=True, seed=1)
    swapped["optimizer"].load_state_dict(copy.deepcopy(saved_opt))
    body_weight = swapped["model"][0].weight
    assert swapped["optimizer"].state[body_weight]["exp_avg"].shape == (2, 16) != body_weight.shape

    store = LocalStore(tmp_path)
    assert rehearse(store, name, lambda: build_grouped(seed=2)).checks == FULL_CHECKS  # control: same order
    with pytest.raises(ts.StateMismatch, match=r"optimizer 'optimizer': group 0 parameter 0 has exp_avg of shape "
                                               r"\(16, 6\) in gen-000000000001, but the live parameter is \(2, 16\): parameter groups are in "
                                               r"another order"):
        rehearse(store, name, lambda: build_grouped(swapped=True, seed=2))


def test_param_groups_of_other_sizes_fail_rehearsal(tmp_path):
    state = build_grouped()
    _grouped_step(state)
    name = _save(tmp_path, state)

    def one_group():
        s = build_grouped(seed=3)
        return ts.TrainState(model=s["model"], optimizer=torch.optim.AdamW(s["model"].parameters(), lr=0.01),
                             rngs=s.rngs, contract=s.contract)

    with pytest.raises(ts.StateMismatch, match=r"parameter groups of sizes \[2, 2\], this run has \[4\]"):
        rehearse(LocalStore(tmp_path), name, one_group)


# (c) a missing RNG source -----------------------------------------------------------------------------
def _with_rngs(rngs_of):
    def factory():
        s = build(seed=11)
        return ts.TrainState(model=s["model"], optimizer=s["optimizer"], scheduler=s["scheduler"],
                             scaler=s["scaler"], rngs=rngs_of(s), contract=s.contract)
    return factory


@pytest.mark.parametrize("rngs_of,message", [
    (lambda s: {"data": s.rngs["data"]},
     r"RNG sources \['data', 'noise'\] but this run passes rngs=\['data'\]"),
    (lambda s: {**s.rngs, "extra": random.Random(0)},
     r"RNG sources \['data', 'noise'\] but this run passes rngs=\['data', 'extra', 'noise'\]"),
    (lambda s: {"data": s.rngs["data"], "noise": torch.Generator()},
     r"rngs\['noise'\]: the checkpoint holds a 'numpy.Generator', this run passes a torch.Generator"),
], ids=["missing", "extra", "other-kind"])
def test_rng_sources_that_differ_fail_rehearsal(tmp_path, rngs_of, message):
    name = _save(tmp_path, _trained())
    with pytest.raises(ts.StateMismatch, match=message):
        rehearse(LocalStore(tmp_path), name, _with_rngs(rngs_of))


# (d) a changed CUDA device count ----------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host would take the saved device's stream by role")
def test_changed_cuda_device_count_is_a_topology_mismatch(tmp_path, monkeypatch):
    state = _trained()
    live = torch.cuda.device_count() if torch.cuda.is_available() else 0
    fake_streams = [torch.get_rng_state() for _ in range(live + 1)]  # uint8 tensors, as CUDA states are
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "is_initialized", lambda: True)
        m.setattr(torch.cuda, "current_device", lambda: 0)
        m.setattr(torch.cuda, "get_rng_state_all", lambda: list(fake_streams))
        name = _save(tmp_path, state)
    recorded = json.loads((tmp_path / name / "state.json").read_text())["rng"]["torch_cuda"]
    assert len(recorded) == live + 1
    with pytest.raises(ts.TopologyMismatch, match=rf"RNG streams for {live + 1} CUDA device\(s\) but this "
                                                  rf"process sees none"):
        rehearse(LocalStore(tmp_path), name, lambda: build(seed=8))
    # a restart would hit the same wall
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.TopologyMismatch):
            ckpt.restore(build(seed=8))


# (e) an empty model dict ------------------------------------------------------------------------------
def _sequential_state(empty: bool) -> ts.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential() if empty else torch.nn.Sequential(torch.nn.Linear(6, 4))
    return ts.TrainState(model=model, contract={"run": "empty-dict"})


@pytest.mark.parametrize("saved_empty", [True, False], ids=["saved-empty", "live-empty"])
def test_empty_model_dict_fails_rehearsal(tmp_path, saved_empty):
    saved = _sequential_state(empty=saved_empty)
    name = _save(tmp_path, saved)
    record = json.loads((tmp_path / name / "state.json").read_text())["components"]["model"]["state"]
    assert (record == {"$odict": {}}) == saved_empty  # a module's state_dict() is an OrderedDict
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.rehearse(lambda: _sequential_state(empty=saved_empty))  # control: the same (empty or not) model
    factory = lambda: _sequential_state(empty=not saved_empty)  # noqa: E731
    store = LocalStore(tmp_path)
    with pytest.raises(ts.ContractMismatch, match="architecture.model.0.weight"):
        rehearse(store, name, factory)
    missing, unexpected = (r"\['0.bias', '0.weight'\]", r"\[\]") if saved_empty else (r"\[\]", r"\['0.bias', '0.weight'\]")
    with pytest.raises(ts.StateMismatch, match=rf"keys missing from {name}: {missing}, unexpected: {unexpected}"):
        rehearse(store, name, factory, allow_changes=("architecture.model",))


class ModelHolder:
    """Not an nn.Module (so no architecture in the contract): holds a model built lazily, as some wrappers do."""

    def __init__(self, built: bool):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(6, 4) if built else None

    def state_dict(self):
        return {} if self.model is None else self.model.state_dict()

    def load_state_dict(self, state):
        if self.model is None:
            if state:
                raise KeyError(f"unexpected keys {sorted(state)}: the model is not built")
            return
        self.model.load_state_dict(state)


@pytest.mark.parametrize("saved_built", [False, True], ids=["saved-empty", "live-empty"])
def test_empty_model_dict_in_a_holder_fails_at_load_state_dict(tmp_path, saved_built):
    name = _save(tmp_path, ts.TrainState(model=ModelHolder(saved_built)))
    store = LocalStore(tmp_path)
    assert rehearse(store, name, lambda: ts.TrainState(model=ModelHolder(saved_built))).checks == FULL_CHECKS
    with pytest.raises(ts.StateMismatch, match=r"component 'model' rejected the saved state \((RuntimeError|KeyError)"):
        rehearse(store, name, lambda: ts.TrainState(model=ModelHolder(not saved_built)))


def test_a_plain_object_saved_where_the_factory_builds_a_module(tmp_path):
    name = _save(tmp_path, ts.TrainState(model=ModelHolder(False)))
    factory = lambda: ts.TrainState(model=torch.nn.Linear(6, 4))  # noqa: E731
    with pytest.raises(ts.ContractMismatch, match="architecture.model"):
        rehearse(LocalStore(tmp_path), name, factory)
    with pytest.raises(ts.StateMismatch, match=r"component 'model': gen-000000000000 saved a '.*ModelHolder', "
                                               r"this run has a 'torch.nn.modules.linear.Linear'"):
        rehearse(LocalStore(tmp_path), name, factory, allow_changes=("architecture",))


def test_factory_that_returns_no_trainstate(tmp_path):
    name = _save(tmp_path, _trained())
    with pytest.raises(TypeError, match="not a TrainState"):
        rehearse(LocalStore(tmp_path), name, lambda: build(seed=2)["model"])


# the manager refuses to publish a generation that fails its rehearsal ----------------------------------
def _no_noise():
    s = build(seed=21)
    return ts.TrainState(model=s["model"], optimizer=s["optimizer"], scheduler=s["scheduler"], scaler=s["scaler"],
                         rngs={"data": s.rngs["data"]}, contract=s.contract)


def test_manager_sets_aside_a_generation_that_fails_rehearsal(tmp_path):
    state = _trained(steps=1)
    with ts.CheckpointManager(tmp_path, rehearse=lambda: build(seed=20)) as ckpt:
        ckpt.save(state)
    at_gen1 = _clone(full_state(state))
    step(state)
    pointer = (tmp_path / "latest").read_bytes()
    with ts.CheckpointManager(tmp_path, rehearse=_no_noise) as ckpt:
        with pytest.raises(ts.StateMismatch, match="rngs="):
            ckpt.save(state)
        assert ckpt.latest() == "gen-000000000001"
        assert ckpt.generations() == ["gen-000000000001"]
        assert ckpt.status().recovery_point == "gen-000000000001"
        ckpt.save(state, weights_only=True)  # weights-only generations are not rehearsed
    assert (tmp_path / "latest").read_bytes() == pointer
    names = sorted(p.name for p in tmp_path.iterdir())
    aside = [n for n in names if n.startswith("gen-000000000002.")]
    assert len(aside) == 1 and re.fullmatch(r"gen-000000000002\.rejected-[0-9a-f]+", aside[0]), names
    assert [n for n in names if re.fullmatch(r"gen-\d{12}", n)] == ["gen-000000000001"]
    assert (tmp_path / aside[0] / "manifest.json").is_file()  # kept whole, as evidence
    resumed = build(seed=22)
    with ts.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(resumed).generation.name == "gen-000000000001"
    assert_same(full_state(resumed), at_gen1)
    # the same update can then be published by a run whose restart works; the evidence stays
    with ts.CheckpointManager(tmp_path, rehearse=lambda: build(seed=23)) as ckpt:
        ckpt.save(state)
        assert ckpt.latest() == "gen-000000000002"
    assert (tmp_path / aside[0]).is_dir()


# the CLI ----------------------------------------------------------------------------------------------
FACTORIES = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(HERE)!r})
    import trainstate as ts
    from trainer import build

    def good():
        return build(seed=77)

    def no_noise():
        s = build(seed=77)
        return ts.TrainState(model=s["model"], optimizer=s["optimizer"], scheduler=s["scheduler"],
                             scaler=s["scaler"], rngs={{"data": s.rngs["data"]}}, contract=s.contract)
""")


def _cli_setup(tmp_path, module: str) -> Path:
    run = tmp_path / "run"
    _save(run, _trained())
    (tmp_path / f"{module}.py").write_text(FACTORIES)
    return run


def test_cli_verify_rehearse_in_process(tmp_path, monkeypatch, capsys):
    module = "rehearse_factories_inproc"
    _cli_setup(tmp_path, module)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli_main(["verify", "run", "--rehearse", f"{module}:good"]) == 0
    out = capsys.readouterr().out
    assert "ok      gen-000000000002" in out
    assert f"rehearsed gen-000000000002 into fresh objects: {', '.join(FULL_CHECKS)}" in out

    assert cli_main(["verify", "run", "--rehearse", f"{module}:no_noise"]) == 1
    out = capsys.readouterr().out
    assert "ok      gen-000000000002" in out  # the bytes are fine ...
    assert "FAILED  gen-000000000002: rehearsal failed: StateMismatch: " in out  # ... the restart is not
    assert "rngs=['data']" in out

    assert cli_main(["verify", "run", "--rehearse", f"{module}:good", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["failures"] == [] and report["rehearsal"] == {
        "generation": "gen-000000000002", "checks": list(FULL_CHECKS), "warnings": []}

    for spec, why in ((f"{module}:missing", "cannot load factory"), ("no_colon", "must look like 'module:function'"),
                      ("no_such_module_xyz:f", "cannot load factory")):
        assert cli_main(["verify", "run", "--rehearse", spec]) == 1
        assert why in capsys.readouterr().out


def test_cli_verify_rehearse_exit_status_in_a_subprocess(tmp_path):
    module = "rehearse_factories_subproc"
    _cli_setup(tmp_path, module)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH"))
                                                      if p), OMP_NUM_THREADS="1")
    bad = subprocess.run([sys.executable, "-m", "trainstate", "verify", "run", "--rehearse", f"{module}:no_noise"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAILED  gen-000000000002: rehearsal failed: StateMismatch" in bad.stdout


def test_load_factory(tmp_path, monkeypatch):
    (tmp_path / "factory_spec_mod.py").write_text("x = 3\ndef f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_factory("factory_spec_mod:f")() == 1
    with pytest.raises(ValueError, match="not callable"):
        load_factory("factory_spec_mod:x")
    with pytest.raises(ValueError, match="cannot load factory"):
        load_factory("factory_spec_mod:g")
    for spec in ("factory_spec_mod", ":f", "factory_spec_mod:"):
        with pytest.raises(ValueError, match="module:function"):
            load_factory(spec)


# data positions --------------------------------------------------------------------------------------
class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, index):
        return torch.tensor([float(index)])


def build_with_loader(seed: int = 5, init: int = 0) -> ts.TrainState:
    torch.manual_seed(init)
    model = torch.nn.Linear(1, 1)
    loader = ts.ResumableLoader(Numbers(), batch_size=4, seed=seed, shuffle=True)
    return ts.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=loader)


def _train_on_loader(state: ts.TrainState, batches: int) -> None:
    it = iter(state["data"])
    for _ in range(batches):
        x = next(it)
        opt = state["optimizer"]
        opt.zero_grad(set_to_none=True)
        state["model"](x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state.next_update += 1


def test_data_position_is_rehearsed(tmp_path):
    state = build_with_loader()
    _train_on_loader(state, 3)
    name = _save(tmp_path, state)
    store = LocalStore(tmp_path)
    built = []
    result = rehearse(store, name, lambda: built.append(build_with_loader(init=9)) or built[-1])
    assert result.checks == FULL_CHECKS + ("next-batch fingerprint",)
    assert built[0]["data"].data_position() == state["data"].data_position()
    assert built[0]["data"].data_position()["cursor"] == 3

    # another loader seed: other samples at the same position
    with pytest.raises(ts.ContractMismatch) as caught:
        rehearse(store, name, lambda: build_with_loader(seed=6))
    assert [(c.field, c.old, c.new) for c in caught.value.changes] == [("loader.data.seed", 5, 6)]
    with pytest.raises(ts.DataMismatch, match="data plan differs"):
        rehearse(store, name, lambda: build_with_loader(seed=6), allow_changes=("loader.data.seed",))


def test_changed_batch_order_fails_the_next_batch_fingerprint(tmp_path):
    state = build_with_loader()
    _train_on_loader(state, 3)
    name = _save(tmp_path, state)

    def reordered():
        fresh = build_with_loader()
        loader = fresh["data"]
        original = loader.epoch_batches
        loader.epoch_batches = lambda epoch: list(reversed(original(epoch)))  # an order algorithm changed
        return fresh

    with pytest.raises(ts.DataMismatch, match=r"the next batch of 'data' after restore .* the data pipeline changed"):
        rehearse(LocalStore(tmp_path), name, reordered)


def test_factory_without_the_data_component(tmp_path):
    state = build_with_loader()
    _train_on_loader(state, 2)
    name = _save(tmp_path, state)

    def without():
        s = build_with_loader()
        return ts.TrainState(model=s["model"], optimizer=s["optimizer"])

    with pytest.raises(ts.ContractMismatch) as caught:
        rehearse(LocalStore(tmp_path), name, without)
    assert [c.field for c in caught.value.changes] == ["loader.data"]
    with pytest.raises(ts.StateMismatch, match=r"holds components \['data', 'model', 'optimizer'\] but this "
                                               r"TrainState has \['model', 'optimizer'\]"):
        rehearse(LocalStore(tmp_path), name, without, allow_changes=("loader.data",))


def test_tampered_manifest_data_record_fails_at_digests(tmp_path):
    state = build_with_loader()
    _train_on_loader(state, 3)
    name = _save(tmp_path, state)
    path = tmp_path / name / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["data"]["data"]["cursor"] = 4
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    with pytest.raises(ts.CorruptGeneration):
        rehearse(LocalStore(tmp_path), name, build_with_loader)


def test_weights_only_generation_is_not_a_restart(tmp_path):
    """restore() refuses a weights-only generation (WeightsOnlyGeneration); a rehearsal, which claims to do what
    a restart does, must refuse it too rather than report a passing restart into a model-only factory."""
    state = _trained(steps=1)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
        step(state)
        name = ckpt.save(state, weights_only=True).name
        with pytest.raises(ts.WeightsOnlyGeneration):
            ckpt.restore(build(seed=3), generation=name)
    model_only = lambda: ts.TrainState(model=build(seed=3)["model"], contract=state.contract)  # noqa: E731
    with pytest.raises(ts.WeightsOnlyGeneration):
        rehearse(LocalStore(tmp_path), name, model_only)


def test_rejected_generation_is_not_the_parent_of_the_next(tmp_path):
    """A generation set aside by its rehearsal was never published: the next one descends from the latest."""
    state = _trained(steps=1)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    step(state)
    with ts.CheckpointManager(tmp_path, rehearse=_no_noise) as ckpt:
        with pytest.raises(ts.StateMismatch):
            ckpt.save(state)
    assert state.parent == "gen-000000000001"
    step(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    manifest = json.loads((tmp_path / "gen-000000000003" / "manifest.json").read_text())
    assert manifest["parent"] == "gen-000000000001"


def test_rehearse_option_refuses_background_saves(tmp_path):
    state = _trained(steps=1)
    with ts.CheckpointManager(tmp_path, rehearse=lambda: build(seed=1)) as ckpt:
        with pytest.raises(ValueError, match="rehearse"):
            ckpt.save(state, blocking=False)
        assert ckpt.generations() == []
        ckpt.save(state)
        assert ckpt.latest() == "gen-000000000001"
