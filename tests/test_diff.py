"""``ts.diff`` and ``trainstate diff``: real generations saved by CheckpointManager, compared in causal order."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import trainstate as ts
from trainstate.cli.main import main
from trainer import CLASSES, CONFIG, build, step


def _state(contract: dict | None = None) -> ts.TrainState:
    random.seed(5)
    np.random.seed(5)
    state = build(0, contract)
    for _ in range(3):
        step(state)
    return state


def _save(state: ts.TrainState, directory) -> str:
    with ts.CheckpointManager(directory) as ckpt:
        ckpt.save(state)
    return str(directory)


@pytest.fixture
def state() -> ts.TrainState:
    return _state()


def test_two_saves_of_one_state_are_identical_in_every_form(tmp_path, state):
    a, b = _save(state, tmp_path / "a"), _save(state, tmp_path / "b")
    for left, right in ((a, b), (f"{a}/gen-000000000003", f"{b}@3"), (f"{a}@3", f"{b}/gen-000000000003")):
        report = ts.diff(left, right)
        assert report.identical and report.first is None, report
        assert [c.name for c in report.categories] == ["contract", "model", "optimizer", "scheduler", "clocks",
                                                       "rng", "data"]
        assert all(c.identical for c in report.categories)
        assert "9 tensors bitwise equal" in report.category("model").summary
    assert main(["diff", a, b]) == 0


def test_one_optimizer_moment_element_is_named_with_its_index(tmp_path, state):
    a = _save(state, tmp_path / "a")
    opt = state["optimizer"]
    first_param = opt.param_groups[0]["params"][0]
    opt.state[first_param]["exp_avg"][3, 2] += 1.0
    b = _save(state, tmp_path / "b")
    report = ts.diff(a, b)
    assert not report.identical and report.first == "optimizer"
    assert [c.name for c in report.categories if not c.identical] == ["optimizer"]
    (entry,) = report.category("optimizer").entries
    assert entry.path == "optimizer.state[0].exp_avg"
    assert entry.tensor.differing == 1 and entry.tensor.first_index == 3 * 6 + 2 and entry.tensor.elements == 96
    assert entry.tensor.max_abs == pytest.approx(1.0, rel=1e-6)
    assert "1 of 18 tensors differ" in report.category("optimizer").summary


def test_chunk_boundaries_do_not_change_counts_or_the_first_index(tmp_path, state):
    a = _save(state, tmp_path / "a")
    weight = state["model"][0].weight
    with torch.no_grad():
        weight.view(-1)[[37, 90]] += 0.5
    b = _save(state, tmp_path / "b")
    for chunk in (4, 12, 64, 1 << 24):  # 1, 3 and 16 float32 elements per read, and one read
        entry = ts.diff(a, b, chunk_bytes=chunk).category("model").entries[0]
        assert (entry.path, entry.tensor.differing, entry.tensor.first_index) == ("model.0.weight", 2, 37)


def test_contract_class_order_is_the_first_difference_before_any_tensor(tmp_path):
    a = _save(_state(), tmp_path / "a")
    b = _save(_state({"config": CONFIG, "class_names": CLASSES[::-1], "data_manifest": "manifest-v1"}),
              tmp_path / "b")
    report = ts.diff(a, b)
    assert report.first == "contract"
    paths = [e.path for e in report.category("contract").entries]
    assert "contract_fingerprint" in paths
    assert "contract.fields.class_names[0]" in paths and "contract.fields.class_names[1]" in paths
    # same seeds, same training: nothing downstream differs, so the contract alone explains the verdict
    assert [c.name for c in report.categories if not c.identical] == ["contract"]


def test_an_rng_stream_that_advanced_is_named(tmp_path, state):
    a = _save(state, tmp_path / "a")
    state.rngs["noise"].normal()
    b = _save(state, tmp_path / "b")
    report = ts.diff(a, b)
    assert report.first == "rng"
    assert [e.path for e in report.category("rng").entries] == ["rng.named.noise"]
    torch_stream = _state()
    a2 = _save(torch_stream, tmp_path / "a2")
    torch.randn(3, generator=torch_stream.rngs["data"])
    b2 = _save(torch_stream, tmp_path / "b2")
    entries = ts.diff(a2, b2).category("rng").entries
    assert [e.path for e in entries] == ["rng.named.data.state"] and entries[0].tensor.differing > 0


def test_negative_zero_is_caught_bitwise_though_equal_by_value(tmp_path, state):
    bias = state["model"][0].bias
    with torch.no_grad():
        bias[5] = 0.0
    a = _save(state, tmp_path / "a")
    before = bias.detach().clone()
    with torch.no_grad():
        bias[5] = -0.0
    assert torch.equal(before, bias)  # the control: by value the two tensors are equal
    b = _save(state, tmp_path / "b")
    report = ts.diff(a, b)
    assert report.first == "model"
    (entry,) = report.category("model").entries
    assert (entry.path, entry.tensor.differing, entry.tensor.first_index) == ("model.0.bias", 1, 5)
    assert entry.tensor.max_abs == 0.0  # the numbers agree; the bits do not


def test_scalar_values_and_clocks_compare_exactly(tmp_path, state):
    a = _save(state, tmp_path / "a")
    state["optimizer"].param_groups[0]["lr"] = 0.02
    state.counters["epoch"] = 7
    b = _save(state, tmp_path / "b")
    report = ts.diff(a, b)
    assert report.first == "optimizer"
    assert [e.path for e in report.category("optimizer").entries] == ["optimizer.param_groups[0].lr"]
    assert [e.path for e in report.category("clocks").entries] == ["counters.epoch"]


def test_shape_mismatch_is_reported_as_such(tmp_path):
    a = _save(ts.TrainState(model=torch.nn.Linear(2, 3)), tmp_path / "a")
    b = _save(ts.TrainState(model=torch.nn.Linear(2, 4)), tmp_path / "b")
    report = ts.diff(a, b)
    assert report.first == "contract"  # the architecture is part of the contract
    entries = {e.path: e for e in report.category("model").entries}
    assert "dtype/shape differ: float32[3, 2] vs float32[4, 2]" in entries["model.weight"].message


def test_cli_exit_codes_and_json(tmp_path, state, capsys):
    a = _save(state, tmp_path / "a")
    b = _save(state, tmp_path / "b")
    state["scaler"].update(1.0)  # a scale change: scheduler-and-scaler category
    c = _save(state, tmp_path / "c")
    capsys.readouterr()
    assert main(["diff", a, b, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["identical"] is True
    assert main(["diff", a, c, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["first"] == "scheduler" and out["categories"][3]["entries"][0]["path"] == "scaler.scale"
    assert main(["diff", a, c]) == 1
    assert "first difference: scheduler" in capsys.readouterr().out
    assert main(["diff", a, str(tmp_path / "missing")]) == 2
    assert main(["diff", f"{a}@x", b]) == 2
    assert main(["diff", f"{a}@4", b, "--json"]) == 2  # no such generation
    assert "error" in json.loads(capsys.readouterr().out)
    proc = subprocess.run([sys.executable, "-m", "trainstate", "diff", a, c], capture_output=True, text=True)
    assert proc.returncode == 1 and "scaler.scale" in proc.stdout


def test_a_damaged_generation_is_an_error_not_a_difference(tmp_path, state):
    a = _save(state, tmp_path / "a")
    b = _save(state, tmp_path / "b")
    tensors = tmp_path / "b" / "gen-000000000003" / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 1
    tensors.write_bytes(bytes(data))
    with pytest.raises(ts.CorruptGeneration):
        ts.diff(a, f"{b}@3")
    assert main(["diff", a, f"{b}@3"]) == 2


class _Ids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        return int(index)


def test_a_data_position_that_moved_is_the_data_category(tmp_path):
    torch.manual_seed(0)
    loader = ts.ResumableLoader(_Ids(), 3, seed=1, shuffle=True)
    state = ts.TrainState(model=torch.nn.Linear(2, 2), data=loader)
    a = _save(state, tmp_path / "a")
    batches = iter(loader)
    next(batches)
    b = _save(state, tmp_path / "b")
    report = ts.diff(a, b)
    assert report.first == "data", report
    assert [c.name for c in report.categories if not c.identical] == ["data"]
    assert any(e.path.startswith("position.data") for e in report.category("data").entries)
