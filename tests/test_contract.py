"""The experiment contract: mismatches name each field and load nothing; allowed changes are recorded."""

from __future__ import annotations

import copy

import pytest
import torch

import trainstate as ts
from trainer import CLASSES, CONFIG, assert_same, build, full_state, step


def _saved(tmp_path, **contract_overrides):
    state = build()
    for _ in range(3):
        step(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    return state


def _contract(**changes):
    contract = {"config": copy.deepcopy(CONFIG), "class_names": list(CLASSES), "data_manifest": "manifest-v1"}
    contract.update(changes)
    return contract


@pytest.mark.parametrize("changes, field, old, new", [
    ({"class_names": ["dog", "cat"]}, "class_names", ["cat", "dog"], ["dog", "cat"]),
    ({"config": {**CONFIG, "lr": 0.5}}, "config.lr", 0.01, 0.5),
    ({"config": {**CONFIG, "optim": {"betas": [0.8, 0.999]}}}, "config.optim.betas", [0.9, 0.999], [0.8, 0.999]),
    ({"data_manifest": "manifest-v2"}, "data_manifest", "manifest-v1", "manifest-v2"),
    ({"tokenizer": "sha256:abc"}, "tokenizer", "<absent>", "sha256:abc"),
])
def test_mismatch_names_field_and_loads_nothing(tmp_path, changes, field, old, new):
    _saved(tmp_path)
    live = build(seed=5, contract=_contract(**changes))
    before = copy.deepcopy(full_state(live))
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.ContractMismatch) as err:
            ckpt.restore(live)
    assert [(c.field, c.old, c.new) for c in err.value.changes] == [(field, old, new)]
    assert field in str(err.value) and "allow_changes" in str(err.value)
    assert_same(full_state(live), before)


def test_architecture_change_is_a_contract_mismatch(tmp_path):
    _saved(tmp_path)
    live = build(seed=5)
    live.components["model"][4] = torch.nn.Linear(16, 3)
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.ContractMismatch) as err:
            ckpt.restore(live)
    fields = {c.field for c in err.value.changes}
    assert "architecture.model.4.weight" in fields and "architecture.model.4.bias" in fields


def test_allowed_change_restores_and_is_recorded(tmp_path):
    saved = _saved(tmp_path)
    live = build(seed=5, contract=_contract(config={**CONFIG, "lr": 0.002}))
    with ts.CheckpointManager(tmp_path) as ckpt:
        info = ckpt.restore(live, allow_changes=["config.lr"])
        assert not info.identical_continuation
        assert [(c.field, c.old, c.new) for c in info.contract_changes] == [("config.lr", 0.01, 0.002)]
        assert_same(full_state(live)["model"], full_state(saved)["model"])
        step(live)
        ckpt.save(live)
    # the change travels in the next generation's history, and its contract is the new one
    later = build(seed=6, contract=_contract(config={**CONFIG, "lr": 0.002}))
    with ts.CheckpointManager(tmp_path) as ckpt:
        info = ckpt.restore(later)
    assert info.identical_continuation  # same contract as the generation it restored
    (event,) = later.history
    assert event["event"] == "contract_change" and event["changes"][0]["field"] == "config.lr"
    assert event["restored_from"] == "gen-000000000003"


def test_allowing_a_parent_field_covers_its_children(tmp_path):
    _saved(tmp_path)
    live = build(seed=5, contract=_contract(config={**CONFIG, "lr": 0.3, "width": 16}, data_manifest="v9"))
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.ContractMismatch) as err:
            ckpt.restore(live, allow_changes=["config"])
        assert [c.field for c in err.value.changes] == ["data_manifest"]
        info = ckpt.restore(live, allow_changes=["config", "data_manifest"])
    assert {c.field for c in info.contract_changes} == {"config.lr", "data_manifest"}


def test_versions_recorded_not_enforced(tmp_path):
    _saved(tmp_path)
    import json
    payload = json.loads((tmp_path / "gen-000000000003" / "state.json").read_text())
    assert set(payload["contract"]["versions"]) == {"trainstate", "torch", "numpy", "python"}
    payload["contract"]["versions"]["torch"] = "0.0.1"  # would need re-digesting; check compare ignores versions
    from trainstate.state.contract import compare
    assert compare(payload["contract"]["fields"], build().contract_fields()) == []


def test_component_set_must_match(tmp_path):
    _saved(tmp_path)
    live = build(seed=5)
    del live.components["scaler"]
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.StateMismatch, match="scaler"):
            ckpt.restore(live)


def test_a_long_list_difference_names_the_positions_that_differ():
    """A class-name list of 1,000 differing at index 500: the message shows that position, not a truncated prefix."""
    from trainstate.errors import ContractMismatch, FieldChange

    old = [f"class_{i:04d}" for i in range(1000)]
    new = list(old)
    new[500] = "renamed"
    text = str(ContractMismatch("gen-000000000001", [FieldChange("class_names", old, new)]))
    assert "position 500: checkpoint has 'class_0500', this run has 'renamed'" in text
    assert "class_0499" not in text  # no wall of unchanged names
    longer = str(ContractMismatch("g", [FieldChange("class_names", old, old + ["extra"])]))
    assert "length 1000 in the checkpoint, 1001 in this run" in longer


def test_a_fixed_loader_plan_change_is_never_suggested_as_an_allowed_change():
    from trainstate.errors import ContractMismatch, FieldChange

    exc = ContractMismatch("g", [FieldChange("loader.data.seed", 3, 4), FieldChange("config.lr", 1, 2)],
                           fixed=["loader.data.seed"])
    assert "allow_changes=['config.lr']" in str(exc)
    assert "'loader.data.seed'" not in str(exc).split("allow_changes=")[1].split("]")[0]
    assert "loader.data.seed cannot change within a run" in str(exc)


# The architecture is remembered per module between saves (a large model's state_dict() runs every
# submodule's hooks at every save); each change below alters the answer and must be seen.

def _tie(m):
    m[1].weight = m[0].weight


def _retie_data(m):  # same Parameter objects, the second now a view of the first's bytes
    m[1].weight.data = m[0].weight.data


def _reshape_data(m):
    m[0].weight.data = torch.zeros(3, 4)


def _new_buffer(m):
    m[0].register_buffer("shift", torch.zeros(4))


def _non_persistent(m):  # the same tensor, no longer in the state dict
    m[0].register_buffer("scale", m[0].scale, persistent=False)


def _rename_hook(m):
    def hook(module, sd, prefix, local):
        sd[prefix + "renamed"] = sd.pop(prefix + "bias")
    m[0]._register_state_dict_hook(hook)


def _new_child(m):
    m.append(torch.nn.Linear(4, 2))


def _cast(m):
    m[0].to(torch.float64)


def _materialize(m):
    m[2].weight.materialize((4, 4))


MUTATIONS = [_tie, _retie_data, _reshape_data, _new_buffer, _non_persistent, _rename_hook, _new_child, _cast,
             _materialize]


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.LazyLinear(4))
    m[0].register_buffer("scale", torch.ones(4))
    return m


@pytest.mark.parametrize("mutate", MUTATIONS, ids=lambda f: f.__name__)
def test_remembered_architecture_follows_every_change(mutate):
    from trainstate.state import contract
    m = _model()
    before = contract.architecture(m)
    assert contract.architecture(m) == before  # remembered
    mutate(m)
    fresh = contract._architecture(m)
    assert fresh != before, "the mutation must change the answer for this test to mean anything"
    assert contract.architecture(m) == fresh


def test_remembered_architecture_control_a_cache_on_the_module_alone_misses_changes(monkeypatch):
    """Negative control: with the layout reduced to the module's identity, the mutations go unseen."""
    from trainstate.state import contract
    monkeypatch.setattr(contract, "_layout", lambda module: (id(module),))
    missed = []
    for mutate in MUTATIONS:
        m = _model()
        before = contract.architecture(m)
        mutate(m)
        if contract.architecture(m) == before:
            missed.append(mutate.__name__)
    assert missed == [f.__name__ for f in MUTATIONS]


def test_remembered_architecture_is_a_copy_and_skips_custom_state_dicts():
    from trainstate.state import contract

    class Custom(torch.nn.Linear):
        def get_extra_state(self):
            return {"k": 1}

    m = _model()
    contract.architecture(m)[0][0] = "scribbled"
    assert contract.architecture(m)[0][0] == "0.weight"
    assert contract._layout(torch.nn.Sequential(Custom(2, 2))) is None
