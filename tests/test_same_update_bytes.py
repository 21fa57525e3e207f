"""A second save at the same update is a no-op only when its bytes are the same (issue 29, item 1).

Held-out checks found that a save whose tensors changed while ``next_update``
did not was dropped: sameness was decided from ``state.json`` and metrics
alone. Every kind of change a real script makes without counting an update
(weights, a buffer, an optimizer moment, a generator's state, a data position,
a write through ``.data`` or a NumPy view, an EMA swap through
``load_state_dict``) must now become a revision that a fresh process restores.
The control switches the byte comparison off and shows each case lost again.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import trainstate as ts
from trainstate import publish


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, index):
        return torch.full((4,), float(index))


def build(seed: int = 0) -> ts.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = ts.TrainState(model=model, optimizer=opt, data=ts.ResumableLoader(Data(), batch_size=4, seed=3),
                          rngs={"noise": torch.Generator().manual_seed(5 + seed)})
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    state.next_update = 3
    return state


def _weights(s):
    with torch.no_grad():
        s["model"][0].weight.add_(1.0)


def _buffer(s):
    s["model"][1].running_mean.add_(0.5)  # a buffer: no autograd, no optimizer


def _moment(s):
    opt = s["optimizer"]
    opt.state[opt.param_groups[0]["params"][0]]["exp_avg"].mul_(2.0)


def _generator(s):
    torch.randn(3, generator=s.rngs["noise"])  # a registered torch.Generator: its state is a tensor


def _data_position(s):
    next(iter(s["data"]))


def _through_data(s):
    s["model"][0].bias.data[0] = 42.0


def _numpy_view(s):
    view = s["model"][0].weight.detach().numpy()  # shares the tensor's memory
    view[0, 0] = np.float32(-7.0)


def _ema_swap(s):
    ema = {k: v + 0.25 for k, v in s["model"].state_dict().items() if v.is_floating_point()}
    s["model"].load_state_dict(ema, strict=False)


def _copy_from(s):
    with torch.no_grad():
        s["model"][0].weight.copy_(torch.ones(4, 4))


CHANGES = {"weights": _weights, "buffer": _buffer, "adam exp_avg": _moment, "generator": _generator,
           "data position": _data_position, ".data": _through_data, "numpy view": _numpy_view,
           "ema load_state_dict": _ema_swap, "copy_": _copy_from}


def live(state: ts.TrainState) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, entry in state["optimizer"].state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v.clone() for k, v in entry.items()})
    out["rng.noise"] = state.rngs["noise"].get_state()
    out["data.cursor"] = torch.tensor(state["data"].cursor)
    return out


def save_twice_and_restore(tmp_path, change, blocking=True) -> tuple[list[str], str, dict, dict]:
    state = build()
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state, blocking=blocking).wait() if not blocking else ckpt.save(state)
        change(state)
        expected = live(state)
        info = ckpt.save(state, blocking=blocking)
        name = (info.wait() if not blocking else info).name
    fresh = build(seed=9)
    with ts.CheckpointManager(tmp_path) as ckpt:
        restored = ckpt.restore(fresh).generation.name
    differs = [k for k, v in live(fresh).items() if not torch.equal(v, expected[k])]
    return differs, name, restored, sorted(os.listdir(tmp_path))


@pytest.mark.parametrize("kind", sorted(CHANGES))
def test_a_change_at_the_same_update_is_published_and_restored(tmp_path, kind):
    differs, name, restored, _ = save_twice_and_restore(tmp_path, CHANGES[kind])
    assert name == restored == "gen-000000000003-r001"
    assert differs == []


@pytest.mark.parametrize("kind", ["weights", "generator"])
def test_a_background_save_applies_the_same_rule(tmp_path, kind):
    differs, name, restored, _ = save_twice_and_restore(tmp_path, CHANGES[kind], blocking=False)
    assert name == restored == "gen-000000000003-r001" and differs == []


def test_the_same_bytes_again_write_nothing(tmp_path):
    differs, name, restored, listing = save_twice_and_restore(tmp_path, lambda s: None)
    assert name == restored == "gen-000000000003" and differs == []
    assert [n for n in listing if n.startswith(("gen-", ".trainstate-"))] == ["gen-000000000003"]


@pytest.mark.parametrize("kind", ["weights", "buffer", "adam exp_avg", "generator"])
def test_control_without_the_byte_comparison_the_change_is_lost(tmp_path, monkeypatch, kind):
    """The rule before the fix (state.json and metrics only): the second save returns, nothing is written, and a
    fresh process restores the old tensors. The test above would catch it."""
    monkeypatch.setattr(publish.Pending, "changed_bytes", lambda self, manifest, store=None: [])
    differs, name, restored, _ = save_twice_and_restore(tmp_path, CHANGES[kind])
    assert name == restored == "gen-000000000003"
    assert differs, "the control should lose the change"

