"""``trainstate doctor`` judges each RNG stream by whether the update drew from it (issue 29, item 2).

Most scripts seed torch and leave Python's ``random`` and NumPy's global generator to OS entropy, so a replay
from update 0 reaches update k with other states in those two streams than the generation holds. When the
update never draws from them, that difference cannot explain a drift: it is set apart and decides nothing.
The negative controls are the same factory with a step that *does* draw from ``random``: there the stream
still decides the verdict. Real runs, real fresh processes; the factories and steps are a module written to
the test's directory (the doctor's processes import it from there).
"""

from __future__ import annotations

import importlib
import json
import random
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

import doctor_fixtures
import trainstate as ts
from trainstate.cli.main import main
from trainstate.tools.doctor import Record, stream_of, unused_streams

SOURCE = '''
import random
import weakref

import torch

import trainstate as ts

_SCHEDULERS = weakref.WeakKeyDictionary()  # where a script keeps a scheduler it does not register


def _build(*, register_scheduler=True, dropout=True, capture=True):
    torch.set_num_threads(1)
    torch.manual_seed(0)  # torch only, as most scripts: random and numpy.random are left to OS entropy
    layers = [torch.nn.Linear(4, 8), torch.nn.Tanh()] + ([torch.nn.Dropout(0.25)] if dropout else [])
    model = torch.nn.Sequential(*layers, torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 0.8 ** u)
    components = {"model": model, "optimizer": optimizer}
    if register_scheduler:
        components["scheduler"] = scheduler
    else:
        _SCHEDULERS[optimizer] = scheduler
    return ts.TrainState(capture_global_rngs=capture, **components)


def torch_seeded():
    return _build()


def unregistered_scheduler():
    return _build(register_scheduler=False)


def uncaptured():
    return _build(dropout=False, capture=False)


def _loss(state):
    g = torch.Generator().manual_seed(1000 + state.next_update)  # the batch of update u, from u alone
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
    return torch.nn.functional.mse_loss(state["model"](x), y)  # dropout draws from torch's global stream


def _finish(state, loss):
    optimizer = state["optimizer"]
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    (state.components.get("scheduler") or _SCHEDULERS[optimizer]).step()
    return loss.detach()


def step(state):
    return _finish(state, _loss(state))


def step_drawing_random(state):
    return _finish(state, _loss(state) * (1 + 0.01 * random.random()))
'''


@pytest.fixture
def fx(tmp_path, monkeypatch):
    """The factories and steps, importable here and (through sys.path) in the doctor's processes."""
    name = f"streams_fx_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module(name)
    sys.modules.pop(name, None)


def _spec(fx, function: str) -> str:
    return f"{fx.__name__}:{function}"


def write_run(directory, factory, step, updates: int, *, save_at: tuple[int, ...] = ()) -> None:
    doctor_fixtures.write_run(directory, factory, updates, save_at=save_at, step_fn=step)


def _other_process() -> None:
    """What a second training process would differ in: its unseeded global streams."""
    random.random()
    np.random.random_sample()


def test_unused_unseeded_streams_are_set_apart_and_exit_0(fx, tmp_path, capsys):
    write_run(tmp_path / "run", fx.torch_seeded, fx.step, 4)
    code = main(["doctor", str(tmp_path / "run"), "--factory", _spec(fx, "torch_seeded"), "--step",
                 _spec(fx, "step"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out["diagnosis"]
    assert out["identical"] and out["first"] is None and out["reproducible"], out["diagnosis"]
    assert all(not c["entries"] for c in out["stages"] + out["repeat"])
    # the replay's python and numpy streams really differ from the generation's, measured, and set apart
    assert sorted(out["unused"]) == ["rng.numpy_global", "rng.python"]
    paths = {e["path"] for e in out["unused"]["rng.python"]}
    assert {"state/rng.python", "rng/python", "updated/rng.python"} <= paths
    assert "never drew from differ (rng.numpy_global, rng.python)" in out["diagnosis"]
    # not vacuous: the stream the update did draw from (dropout) was compared, and is identical
    assert out["drawn"] == {role: ["rng.torch_cpu"] for role in ("resumed", "repeat", "reference")}
    rng = next(c for c in out["stages"] if c["name"] == "rng")
    assert rng["tensors"] == 1 and "set apart" in rng["summary"]


def test_an_unregistered_scheduler_is_named_as_the_lr_despite_unseeded_streams(fx, tmp_path, capsys):
    write_run(tmp_path / "run", fx.unregistered_scheduler, fx.step, 4)
    code = main(["doctor", str(tmp_path / "run"), "--factory", _spec(fx, "unregistered_scheduler"), "--step",
                 _spec(fx, "step"), "--no-repeat"])
    text = capsys.readouterr().out
    assert code == 1
    assert "first difference: lr (optimizer/after" in text, text
    assert "  state before the update: identical" in text
    assert "unused streams differ (cannot explain drift): rng.numpy_global, rng.python" in text


def test_against_names_the_lr_the_restart_left_not_an_unused_stream(fx, tmp_path, capsys):
    """The resumed run restarts at update 4 and writes update 5: its optimizer carries the LR of a schedule
    restarted at step 0. Both doctor processes restart, so that LR is where the drift shows: in the state
    before update 5, named by its optimizer path, with no unused stream beside it."""
    write_run(tmp_path / "straight", fx.unregistered_scheduler, fx.step, 6, save_at=(5,))
    _other_process()
    write_run(tmp_path / "resumed", fx.unregistered_scheduler, fx.step, 4)
    state = fx.unregistered_scheduler()  # the restart: a fresh state, its scheduler at step 0
    with ts.CheckpointManager(tmp_path / "resumed") as ckpt:
        ckpt.restore(state)
        fx.step(state)
        state.next_update += 1
        ckpt.save(state)
    code = main(["doctor", str(tmp_path / "resumed"), "--factory", _spec(fx, "unregistered_scheduler"),
                 "--step", _spec(fx, "step"), "--against", str(tmp_path / "straight"), "--no-repeat", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["first"] == "state", out["diagnosis"]
    stages = {c["name"]: c for c in out["stages"]}
    (entry,) = stages["state"]["entries"]
    assert entry["path"] == "optimizer.param_groups[0].lr"
    assert f"{0.1 * 0.8 ** 1!r} vs {0.1 * 0.8 ** 5!r}" in entry["message"]
    assert out["diagnosis"].startswith("first difference: state (optimizer.param_groups[0].lr:")
    assert [e["path"] for e in stages["lr"]["entries"]] == ["optimizer/used"]
    assert not stages["rng"]["entries"] and not stages["batch"]["entries"]
    assert sorted(out["unused"]) == ["rng.numpy_global", "rng.python"]


def test_a_drawn_unseeded_stream_still_decides(fx, tmp_path, capsys):
    """Negative control: the factory of the first test, a step that draws from random. The replay's draws
    differ from the run's, so its weights do too; the python stream stays among the differences, not apart."""
    write_run(tmp_path / "run", fx.torch_seeded, fx.step_drawing_random, 4)
    code = main(["doctor", str(tmp_path / "run"), "--factory", _spec(fx, "torch_seeded"), "--step",
                 _spec(fx, "step_drawing_random"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and not out["identical"] and out["reproducible"], out["diagnosis"]
    assert out["drawn"]["resumed"] == out["drawn"]["reference"] == ["rng.python", "rng.torch_cpu"]
    assert list(out["unused"]) == ["rng.numpy_global"]  # only the stream no update drew from is set apart
    stages = {c["name"]: c for c in out["stages"]}
    assert out["first"] == "state" and "rng.python" in [e["path"] for e in stages["state"]["entries"]]
    assert [e["path"] for e in stages["rng"]["entries"]] == ["python"]


def test_a_drawn_stream_the_checkpoint_does_not_hold_is_named_as_the_rng(fx, tmp_path):
    """Negative control: capture_global_rngs=False, so a restore leaves random to OS entropy, and the update
    draws from it: two fresh restores of the same generation already differ, at the rng stage."""
    write_run(tmp_path / "run", fx.uncaptured, fx.step_drawing_random, 4)
    report = ts.doctor(tmp_path / "run", _spec(fx, "uncaptured"), _spec(fx, "step_drawing_random"))
    assert not report.identical and report.reproducible is False and report.first == "rng", report.diagnosis
    again = {c.name: c for c in report.repeat}
    assert [e.path for e in again["rng"].entries] == ["python"] and again["state"].identical
    assert not again["loss"].identical and "not reproducible" in report.diagnosis
    # numpy's global stream differs between the two restores too, but no update drew from it
    assert list(report.unused) == ["rng.numpy_global"]
    assert any(e.path == "repeat:rng/numpy_global" for e in report.unused["rng.numpy_global"])


def _record(streams: dict[str, bool]) -> Record:
    return Record("x", {}, {}, [], Path("before"), Path("after"), streams)


def test_streams_are_judged_by_either_update_and_matched_by_name():
    """Pure logic: a stream is unused only when both processes judged it and neither drew from it."""
    a = _record({"rng.python": False, "rng.torch_cpu": True, "rng.named.a": False, "rng.named.ab": False})
    b = _record({"rng.python": False, "rng.torch_cpu": False, "rng.named.a": True})
    assert unused_streams(a, b) == {"rng.python"}  # named.ab: judged by one process only
    names = {"rng.named.a", "rng.named.ab", "rng.torch_cuda"}
    assert stream_of("state", "rng.named.ab.state", names) == "rng.named.ab"
    assert stream_of("state", "rng.named.a[1]", names) == "rng.named.a"
    assert stream_of("rng", "named.ab", names) == "rng.named.ab"
    assert stream_of("rng", "torch_cuda.1", names) == "rng.torch_cuda"
    assert stream_of("state", "rng.named.abc", names) is None
