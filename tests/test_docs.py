"""The README is the front door: its example runs as written and CI runs its test command."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_ci_runs_the_readme_test_command():
    test_command = next(line for block in _blocks("sh") for line in block.splitlines() if "pytest" in line)
    assert test_command in (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0" in test_command.split("&&")[0]


def test_usage_example_runs_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    example = next(b for b in _blocks("python") if "CheckpointManager" in b)

    def namespace():
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters())
        calls = []

        def train_one_update(*_):
            opt.zero_grad()
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
            calls.append(1)

        return {"model": model, "opt": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 10),
                "scaler": torch.amp.GradScaler("cpu"), "data_generator": torch.Generator().manual_seed(0),
                "np_rng": np.random.default_rng(0), "cfg": {"lr": 1e-3}, "classes": ["a", "b"],
                "manifest_id": "m", "total_updates": 250, "train_one_update": train_one_update, "calls": calls}

    first = namespace()
    exec(example.replace("...", ""), first)
    assert first["state"].next_update == 250 and len(first["calls"]) == 250
    second = namespace()
    second["total_updates"] = 300
    exec(example.replace("...", ""), second)
    assert len(second["calls"]) == 100  # resumed at 200, the last save, and ran the rest
    assert sorted(p.name for p in (tmp_path / "runs" / "exp1").glob("gen-*")) == [
        "gen-000000000100", "gen-000000000200", "gen-000000000300"]
