"""Change detection for incremental saves: every way a tensor changes in practice is caught (issue 32).

Each scenario mutates a real model and optimizer the way training code does,
and names what changed. The detector (:mod:`trainstate.state.changes`) must
report every changed name and, on a state nobody touched, nothing. The
controls run the same scenarios through the two cheap signals a detector
might be tempted by, the storage pointer and the autograd version counter,
and show each misses some of them: a test of a detector built on either
would fail here.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from trainstate.state import changes


def _setup(optimizer: str = "adam") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
    make = {"adam": lambda p: torch.optim.Adam(p, lr=1e-2),
            "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
            "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
            "sgd_foreach": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=True)}[optimizer]
    opt = make(model.parameters())
    _step(model, opt)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, entry in opt.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v for k, v in entry.items() if isinstance(v, torch.Tensor)})
    return out


PARAMS = {"model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"}


def _optimizer_step(kind: str) -> Callable:
    def run(model, opt):
        _step(model, opt)
        return PARAMS | {n for n in _tensors(model, opt) if n.startswith("optim.")}  # moments, momenta, steps
    return run


def _no_grad_add(model, opt):
    with torch.no_grad():
        model[0].weight.add_(1e-3)
    return {"model.0.weight"}


def _through_data(model, opt):
    model[2].bias.data.mul_(2)
    return {"model.2.bias"}


def _numpy_view(model, opt):
    model[0].bias.detach().numpy()[3] += 1.0
    return {"model.0.bias"}


def _copy_from_another(model, opt):
    with torch.no_grad():
        model[2].weight.copy_(torch.randn_like(model[2].weight))
    return {"model.2.weight"}


def _load_state_dict(model, opt):
    other = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
    model.load_state_dict(other.state_dict())
    return PARAMS


def _round_trip_with_a_change(model, opt):
    model.double()
    with torch.no_grad():
        model[0].bias.mul_(3)
    model.float()
    return {"model.0.bias"}


def _reshaped_in_place(model, opt):
    w = model[0].weight
    w.data = w.data.view(24, 64)  # the same bytes, another shape: a restore would build another tensor
    return {"model.0.weight"}


def _storage_swapped(model, opt):
    with torch.no_grad():
        model[2].bias.set_(torch.randn(8))
    return {"model.2.bias"}


SCENARIOS: dict[str, tuple[str, Callable]] = {
    "in-place add under no_grad": ("adam", _no_grad_add),
    "write through .data": ("adam", _through_data),
    "write through a NumPy view": ("adam", _numpy_view),
    "copy_ from another tensor": ("adam", _copy_from_another),
    "load_state_dict": ("adam", _load_state_dict),
    "device round trip with a change": ("adam", _round_trip_with_a_change),
    "reshaped in place": ("adam", _reshaped_in_place),
    "storage swapped with set_": ("adam", _storage_swapped),
    "Adam step (default kernels)": ("adam", _optimizer_step("adam")),
    "Adam step (fused)": ("adam_fused", _optimizer_step("adam_fused")),
    "AdamW step (foreach)": ("adamw_foreach", _optimizer_step("adamw_foreach")),
    "SGD step (foreach, momentum)": ("sgd_foreach", _optimizer_step("sgd_foreach")),
}


# the cheap signals, for the controls -----------------------------------------------------------------------------
def _by_pointer(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {n: (t.data_ptr(), tuple(t.shape), t.dtype) for n, t in tensors.items()}


def _by_version(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {n: (t.data_ptr(), t._version, tuple(t.shape), t.dtype) for n, t in tensors.items()}


CHEAP = {"pointer": _by_pointer, "version": _by_version}
# What each cheap signal misses among the scenarios (the controls assert each miss happens).
MISSED = {"pointer": {"in-place add under no_grad", "write through .data", "write through a NumPy view",
                      "copy_ from another tensor", "load_state_dict", "Adam step (default kernels)",
                      "Adam step (fused)", "AdamW step (foreach)", "SGD step (foreach, momentum)"},
          # the fused CPU Adam writes parameters and moments without moving a version counter (torch 2.13)
          "version": {"write through .data", "write through a NumPy view", "Adam step (fused)"}}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_way_a_tensor_changes_is_caught(scenario):
    kind, mutate = SCENARIOS[scenario]
    model, opt = _setup(kind)
    before = changes.fingerprints(_tensors(model, opt))
    expected = mutate(model, opt)
    now = changes.fingerprints(_tensors(model, opt))
    found = changes.changed(now, before)
    assert expected <= found, (scenario, expected - found)  # never a wrong "unchanged"
    assert found == expected, (scenario, found - expected)  # and no false alarm: what did not change is shared


@pytest.mark.parametrize("signal", list(CHEAP))
def test_control_each_cheap_signal_misses_a_change_the_test_catches(signal):
    """A detector built on the storage pointer or the version counter fails the test above for these scenarios:
    the names changed, the signal stayed the same."""
    missed = set()
    for scenario, (kind, mutate) in SCENARIOS.items():
        model, opt = _setup(kind)
        before = CHEAP[signal](_tensors(model, opt))
        expected = mutate(model, opt)
        after = CHEAP[signal](_tensors(model, opt))
        if any(before.get(n) == after.get(n) for n in expected):
            missed.add(scenario)
    assert missed == MISSED[signal]


def test_nothing_touched_reports_nothing_and_a_value_preserving_move_is_unchanged():
    """The efficiency side: an untouched state, and one whose tensors moved to new storage with the same values
    (a device round trip, ``double().float()``, ``p.data = p.data.clone()``), have nothing to write."""
    model, opt = _setup()
    before = changes.fingerprints(_tensors(model, opt))
    assert changes.changed(changes.fingerprints(_tensors(model, opt)), before) == set()
    model.double().float()
    model[0].weight.data = model[0].weight.data.clone()
    assert changes.changed(changes.fingerprints(_tensors(model, opt)), before) == set()


def test_a_byte_in_the_last_piece_of_a_large_tensor(monkeypatch):
    """Large tensors are hashed piece by piece on several threads: a change in any piece, the last one (shorter
    than the rest) included, changes the fingerprint; the layout of the pieces does not."""
    monkeypatch.setattr(changes, "PIECE_BYTES", 1000)  # 1 MB below: a thousand pieces, the last one partial
    big = torch.randn(250_123)
    before = changes.fingerprints({"big": big}, threads=3)
    big.numpy()[-1] += 1.0
    assert changes.changed(changes.fingerprints({"big": big}, threads=3), before) == {"big"}
    big.numpy()[-1] -= 1.0
    assert changes.changed(changes.fingerprints({"big": big}, threads=1), before) == set()  # threads don't matter


def test_values_not_layout_decide():
    """A transposed view hashes as its row-major values; a same-bytes view of another dtype or shape differs."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert changes.fingerprints({"a": t.T})["a"] == changes.fingerprints({"a": t.T.contiguous()})["a"]
    assert changes.fingerprints({"a": t.T})["a"] != changes.fingerprints({"a": t})["a"]
    assert changes.fingerprints({"a": t.view(torch.int32)})["a"] != changes.fingerprints({"a": t})["a"]
    assert changes.fingerprints({"a": t.reshape(4, 3)})["a"] != changes.fingerprints({"a": t})["a"]
    c = torch.tensor([1 + 2j, 3 - 1j])
    assert changes.fingerprints({"c": c.conj()})["c"] == changes.fingerprints({"c": c.conj().resolve_conj()})["c"]
    empty = changes.fingerprints({"e": torch.empty(0, 3)})["e"]
    assert changes.Fingerprint.from_json(empty.to_json()) == empty


def test_tensors_that_need_a_copy_are_fingerprinted_in_bounded_batches(monkeypatch):
    """Views (as a GPU state would be) are copied a batch at a time, never the whole state at once, and the
    fingerprints are those of the unbatched pass. Control: the batch bound raised, one pass holds every copy."""
    torch.manual_seed(0)
    bases = [torch.randn(256, 256) for _ in range(8)]  # 256 KiB each
    tensors = {f"t{i}": b.t() for i, b in enumerate(bases)}  # non-contiguous: each needs a copy
    tensors["plain"] = torch.randn(1000)
    held: list[int] = []
    real = changes._fingerprints

    def counting(values, threads):
        held.append(sum(v.nbytes for n, v in values.items() if n != "plain"))
        return real(values, threads)

    monkeypatch.setattr(changes, "_fingerprints", counting)
    monkeypatch.setattr(changes, "COPY_BATCH_BYTES", 600 << 10)
    batched = changes.fingerprints(tensors)
    assert max(held) <= 600 << 10 and len(held) >= 4, held
    held.clear()
    monkeypatch.setattr(changes, "COPY_BATCH_BYTES", 1 << 40)
    whole = changes.fingerprints(tensors)
    assert held == [8 * (256 << 10)]  # the control: every copy at once
    assert batched == whole and list(batched) == list(tensors)
    assert whole == {n: changes.fingerprints({n: t.contiguous()})[n] for n, t in tensors.items()}
