"""Component identity survives moving code, and still refuses a different kind of component.

The rule (``snapshot.check_components``): a module is identified by its
architecture, so its class is recorded but not enforced; torch's own classes
must match exactly (SGD is not Adam); any other class must keep its
qualified name, wherever its module now lives (``__main__.Stats`` may become
``netdef.Stats``). A module never stands in for a non-module, or back.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import trainstate as ts
from trainstate.cli import main as cli_main
from trainer import assert_same

# The training code, as a user writes it in their script; moved into a module file later, unchanged.
NET_SOURCE = textwrap.dedent("""
    import torch
    import trainstate as ts


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(5, 8)
            self.head = torch.nn.Linear(8, 2)

        def forward(self, x):
            return self.head(torch.tanh(self.body(x)))


    class Stats:
        def __init__(self):
            self.seen = 0

        def state_dict(self):
            return {"seen": self.seen}

        def load_state_dict(self, state):
            self.seen = state["seen"]


    def make_state(seed=0):
        torch.manual_seed(seed)
        model = Net()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return ts.TrainState(model=model, optimizer=opt, scheduler=sched, stats=Stats(),
                             rngs={"data": torch.Generator().manual_seed(seed + 1)})


    def train_step(state):
        x = torch.randn(4, 5, generator=state.rngs["data"])
        state["optimizer"].zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(state["model"](x), torch.tensor([0, 1, 1, 0])).backward()
        state["optimizer"].step()
        state["scheduler"].step()
        state["stats"].seen += len(x)
        state.next_update += 1


    def factory():
        return make_state(seed=99)
""")

SCRIPT_MAIN = textwrap.dedent("""
    if __name__ == "__main__":
        import sys
        torch.set_num_threads(1)
        state = make_state()
        for _ in range(3):
            train_step(state)
        with ts.CheckpointManager(sys.argv[1]) as ckpt:
            ckpt.save(state)
        for _ in range(2):
            train_step(state)
        with ts.CheckpointManager(sys.argv[2]) as ckpt:  # the uninterrupted run, for comparison
            ckpt.save(state)
""")


def _components(state: ts.TrainState) -> dict:
    return {name: c.state_dict() for name, c in state.components.items()} | {"next_update": state.next_update}


def test_class_moved_from_main_into_a_module_restores_bitwise(tmp_path, monkeypatch):
    script = tmp_path / "train_script.py"
    script.write_text(NET_SOURCE + SCRIPT_MAIN)
    run, reference = tmp_path / "run", tmp_path / "reference"
    subprocess.run([sys.executable, str(script), str(run), str(reference)], check=True, timeout=120,
                   capture_output=True, text=True, cwd=tmp_path)
    saved = json.loads((run / "gen-000000000003" / "state.json").read_text())["components"]
    assert saved["model"]["type"] == "__main__.Net" and saved["stats"]["type"] == "__main__.Stats"  # recorded

    (tmp_path / "netdef_moved.py").write_text(NET_SOURCE)  # the same classes, now in a module
    monkeypatch.syspath_prepend(str(tmp_path))
    netdef = importlib.import_module("netdef_moved")
    state = netdef.make_state(seed=99)
    with ts.CheckpointManager(run) as ckpt:
        info = ckpt.restore(state)
    assert info.identical_continuation
    for _ in range(2):
        netdef.train_step(state)
    uninterrupted = netdef.make_state(seed=7)
    with ts.CheckpointManager(reference) as ckpt:
        ckpt.restore(uninterrupted)
    assert_same(_components(state), _components(uninterrupted))

    # the rehearsal a restarted job's factory would run, from the command line
    assert cli_main(["verify", str(run), "--rehearse", "netdef_moved:factory"]) == 0


def _linear_state(optimizer: type, seed: int = 0) -> ts.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    return ts.TrainState(model=model, optimizer=optimizer(model.parameters(), lr=0.1), capture_global_rngs=False)


def test_other_optimizer_class_is_refused_before_anything_loads(tmp_path):
    saved = _linear_state(torch.optim.SGD)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(saved)
        live = _linear_state(torch.optim.Adam, seed=4)
        before = live["model"].weight.detach().clone()
        refused = (r"component 'optimizer': gen-0+ saved a 'torch\.optim\.sgd\.SGD', "
                   r"this run has a 'torch\.optim\.adam\.Adam'")
        with pytest.raises(ts.StateMismatch, match=refused):
            ckpt.restore(live)
        assert torch.equal(live["model"].weight, before) and live.next_update == 0
        with pytest.raises(ts.StateMismatch, match="SGD"):
            ckpt.rehearse(lambda: _linear_state(torch.optim.Adam))
        ckpt.restore(_linear_state(torch.optim.SGD, seed=4))  # control: the same class restores


def test_module_saved_where_an_optimizer_is_live(tmp_path):
    model = torch.nn.Linear(3, 2)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(ts.TrainState(part=model, capture_global_rngs=False))
        live = ts.TrainState(part=torch.optim.SGD(model.parameters(), lr=0.1), capture_global_rngs=False)
        with pytest.raises(ts.ContractMismatch, match="architecture.part"):
            ckpt.restore(live)
        with pytest.raises(ts.StateMismatch, match="component 'part'.*Linear.*SGD"):
            ckpt.restore(live, allow_changes=["architecture"])


class Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


class Tally(Counter):
    pass


class NetA(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)


class NetB(NetA):
    pass


def test_other_user_class_is_refused_a_renamed_module_is_not(tmp_path):
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(ts.TrainState(model=NetA(), counter=Counter(), capture_global_rngs=False))
        with pytest.raises(ts.StateMismatch, match=r"component 'counter'.*Counter.*Tally"):
            ckpt.restore(ts.TrainState(model=NetA(), counter=Tally(), capture_global_rngs=False))
        # a module is its architecture: the same parameters under another class name restore
        info = ckpt.restore(ts.TrainState(model=NetB(), counter=Counter(), capture_global_rngs=False))
    assert info.identical_continuation
