"""Accelerate with trainstate: a CPU Accelerate loop SIGKILLed and resumed bitwise, data position included.

The loop saves through ``train_state(accelerator, data=ResumableLoader)`` and
a ``CheckpointManager``; one run goes straight through, another is SIGKILLed
twice at seeded moments (between updates, and inside a save before its
commit). The resumed run's model, optimizer moments and the sample ids of
every update equal the straight run's. Negative control: the same loop saved
with Accelerate's own ``save_state``/``load_state`` resumes at the start of
the epoch (``load_state`` does not restore the data position) and ends
elsewhere. Every job is its own forked process (accelerate_child.py); set
TRAINSTATE_KILL_SEED to replay a schedule.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import trainstate as ts
from forkjobs import launch

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
TOTAL, EVERY = 12, 3
SEED = int(os.environ.get("TRAINSTATE_KILL_SEED") or random.SystemRandom().randrange(2**31))


def kill_plan(seed: int) -> list[list]:
    """A kill between updates and one inside a save, in a seeded order: the first in updates 1-6, the second 7-11."""
    rng = random.Random(seed)
    kinds = ["step", "save"]
    rng.shuffle(kinds)
    windows = [(1, 6), (7, 11)]
    return [[kind, rng.choice([s for s in range(lo, hi + 1) if s % EVERY == 0]) if kind == "save"
             else rng.randint(lo, hi)] for kind, (lo, hi) in zip(kinds, windows)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("accelerate")
    plan = kill_plan(SEED)

    def spec(name, directory, mode, **kw):
        return {"name": name, "dir": str(root / directory), "mode": mode, "log": str(root / f"{name}.log"),
                "ids": str(root / f"{directory}.ids"), "final": str(root / f"{directory}.safetensors"), **kw}

    jobs = [spec("reference", "reference", "trainstate"),
            *[spec(f"kill-{i}", "killed", "trainstate", kill=kill) for i, kill in enumerate(plan)],
            spec("finish", "killed", "trainstate"),
            spec("accelerate-reference", "accelerate-reference", "accelerate"),
            spec("accelerate-kill", "accelerate-killed", "accelerate", kill=["step", 7]),
            spec("accelerate-resume", "accelerate-killed", "accelerate")]
    exits = launch(HERE / "accelerate_child.py", jobs, root, timeout=300)
    where = f"kill plan {plan} (TRAINSTATE_KILL_SEED={SEED})" + "".join(
        f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(root.glob("*.log")))
    return root, plan, exits, where


def ids_by_update(path: Path) -> dict[int, list[int]]:
    """The sample ids of each update; a repeated update (run again after a kill) keeps its last record."""
    out = {}
    for line in path.read_text().splitlines():
        update, *ids = map(int, line.split())
        out[update] = ids
    return out


def test_killed_accelerate_loop_resumes_bitwise_with_its_data_position(runs):
    root, plan, exits, where = runs
    assert [exits[f"kill-{i}"] for i in range(len(plan))] == [-9] * len(plan), where  # really SIGKILLed
    assert exits["reference"] == 0 and exits["finish"] == 0, where
    reference, killed = load_file(root / "reference.safetensors"), load_file(root / "killed.safetensors")
    assert sorted(reference) == sorted(killed) and any(k.startswith("opt.") for k in reference)
    differing = [k for k in reference if not torch.equal(reference[k], killed[k])]
    assert not differing, f"{differing} differ; {where}"
    expected = ids_by_update(root / "reference.ids")
    assert sorted(expected) == list(range(1, TOTAL + 1))
    assert ids_by_update(root / "killed.ids") == expected, where
    report = ts.diff(root / "reference", root / "killed")  # the final generations, every category
    assert report.identical, report.to_dict()


def test_negative_control_accelerate_load_state_loses_the_data_position(runs):
    root, plan, exits, where = runs
    assert exits["accelerate-kill"] == -9 and exits["accelerate-resume"] == 0, where
    expected, resumed = ids_by_update(root / "accelerate-reference.ids"), ids_by_update(root / "accelerate-killed.ids")
    assert [resumed[u] for u in range(1, 7)] == [expected[u] for u in range(1, 7)]  # the same run until the kill
    # resumed from update 6 (one batch into the second epoch): the epoch starts again from its first batch
    assert resumed[7] != expected[7], where
    reference = load_file(root / "accelerate-reference.safetensors")
    final = load_file(root / "accelerate-killed.safetensors")
    assert not all(torch.equal(reference[k], final[k]) for k in reference)


def test_train_state_holds_what_save_state_would_save_unwrapped(caplog):
    from accelerate import Accelerator

    from trainstate.integrations.accelerate import train_state

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    plain = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    model, opt, sched, plain = accelerator.prepare(model, opt, sched, plain)
    counter = torch.nn.Module()  # anything with state_dict/load_state_dict
    accelerator.register_for_checkpointing(counter)
    loader = ts.ResumableLoader(list(range(8)), batch_size=2, seed=0)
    assert accelerator.prepare(loader) is loader  # Accelerate passes it through unchanged
    with caplog.at_level(logging.WARNING, logger="trainstate"):
        state = train_state(accelerator, data=loader)
    assert sorted(state.components) == ["accelerator", "custom_checkpoint_0", "data", "model", "optimizer",
                                        "scheduler"]
    assert type(state["optimizer"]) is torch.optim.SGD and type(state["scheduler"]) is torch.optim.lr_scheduler.StepLR
    assert type(state["model"]) is torch.nn.Linear and state["custom_checkpoint_0"] is counter
    assert any("keep no position" in r.getMessage() for r in caplog.records)  # the prepared plain loader
    with pytest.raises(ts.InvalidType, match="use_stateful_dataloader"):
        train_state(accelerator, data=plain)
    renamed = train_state(accelerator, net=model)  # the caller's name wins; saved once
    assert "net" in renamed.components and "model" not in renamed.components


def test_docs_example_runs_and_resumes_bitwise(tmp_path):
    from docsite import runnable

    example = runnable("accelerate-loop")  # docs/guides/frameworks.md

    def run(directory: str, total: int) -> dict:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        xs, ys = torch.randn(96, 4, generator=g), torch.randn(96, 1, generator=g)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 50)
        namespace = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                     "dataset": list(zip(xs, ys)), "loss_fn": torch.nn.functional.mse_loss, "total_updates": total,
                     "__name__": "readme_example"}
        exec(example.replace('"runs/exp1"', repr(str(tmp_path / directory))), namespace)
        return namespace

    straight = run("straight", 300)
    run("resumed", 250)  # saved at 200, then stopped
    resumed = run("resumed", 300)
    assert resumed["state"].next_update == 300
    for a, b in zip(straight["model"].parameters(), resumed["model"].parameters()):
        assert torch.equal(a, b)
