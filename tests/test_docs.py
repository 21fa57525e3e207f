"""The README is the front door and the site holds the rest: their examples run as written, CI runs the
README's test command, and the README keeps its two set-up commands and its loop (the same as the site's)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from docsite import page, runnable

ROOT = Path(__file__).resolve().parent.parent


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_ci_runs_the_readme_test_command():
    test_command = next(line for block in _blocks("sh") for line in block.splitlines() if "pytest" in line)
    assert test_command in (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0" in test_command.split("&&")[0]


def test_readme_keeps_the_two_set_up_commands_and_the_sites_loop():
    commands = [line for block in _blocks("sh") for line in block.splitlines()]
    assert commands[:2] == [
        "pip install torch==2.13.0 && pip install . && trainstate demo",
        'pip install torch==2.13.0 && pip install -e ".[test,torchtitan]" && pip install --no-deps torchtitan==0.3.0 && python -m pytest -q -p no:cacheprovider']
    assert next(b for b in _blocks("python") if "CheckpointManager" in b) == runnable("ten-line-loop")
    site = re.findall(r"```sh\n(.*?)```", page("getting-started.md"), re.S)
    assert site[:2] == _blocks("sh")[:2]  # the site's set-up is the README's
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):  # every link into the site names a page
        assert (ROOT / target).is_file(), target


def test_usage_example_runs_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    example = runnable("ten-line-loop")  # docs/getting-started.md, and the README's loop (above)

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


def test_data_position_example_resumes_bitwise(tmp_path, monkeypatch):
    """The site's loader example, run straight to 300 updates and as 250 + resume: the same weights."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "data" / "train" / "shard-0.bin").write_bytes(b"x" * 10)
    example = runnable("resumable-loader")  # docs/guides/data-position.md
    assert "ResumableLoader" in example and example in page("guides/data-position.md")

    def namespace(directory: str, total: int) -> dict:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)

        def train_step(x, y):
            opt.zero_grad()
            ((model(x).squeeze(1) - y) ** 2).mean().backward()
            opt.step()

        gen = torch.Generator().manual_seed(1)
        return {"xs": torch.randn(96, 4, generator=gen), "ys": torch.randn(96, generator=gen), "model": model,
                "opt": opt, "train_step": train_step, "total_updates": total,
                "__name__": "readme_example", "_dir": directory}

    def run(directory: str, total: int) -> dict:
        ns = namespace(directory, total)
        exec(example.replace('"runs/exp2"', repr(directory)), ns)
        ns["loader"].close()  # ns is a reference cycle (its functions' globals): stop the workers now, not in gc
        return ns

    straight = run("straight", 300)
    run("resumed", 250)
    resumed = run("resumed", 300)  # restores gen 200, replays 200..300
    assert resumed["state"].next_update == straight["state"].next_update == 300
    for a, b in zip(straight["model"].parameters(), resumed["model"].parameters()):
        assert torch.equal(a, b)
    assert (resumed["loader"].epoch, resumed["loader"].cursor) == (straight["loader"].epoch, straight["loader"].cursor)
    assert resumed["loader"].samples_seen == straight["loader"].samples_seen == 300 * 32
