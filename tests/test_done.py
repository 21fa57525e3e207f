"""Issue 16: the DONE record binds a finished run; a record that no longer holds is stale, never done.

Each stale case has its negative control in the valid record it starts from (``test_finish_...``): the
same directory, reported done, until exactly one thing is changed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import trainstate as ts
from trainstate.asyncsave import AsyncSaveFailed
from trainstate.cli.main import main
from trainstate.lifecycle import done as done_mod

CONFIG = {"lr": 0.1, "total": 4}
KEY = "a-signing-key-of-enough-bytes"


def build(config: dict = CONFIG) -> ts.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return ts.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=config["lr"]),
                         contract={"config": config})


def step(state: ts.TrainState) -> None:
    state["optimizer"].zero_grad()
    state["model"](torch.ones(2, 3)).sum().backward()
    state["optimizer"].step()
    state.next_update += 1
    state.tokens_seen += 6


def train(run: Path, *, until: int = 4, save_last: bool = True, metrics=None, key=None) -> ts.DoneRecord:
    state = build()
    with ts.CheckpointManager(run, signing_key=key) as ckpt:
        ckpt.restore(state)
        while state.next_update < until:
            step(state)
            if state.next_update % 2 == 0 and (save_last or state.next_update < until):
                ckpt.save(state)
        return ckpt.finish(state, metrics=metrics)


def gen(update: int) -> str:
    return f"gen-{update:012d}"


@pytest.fixture
def run(tmp_path) -> Path:
    path = tmp_path / "run"
    train(path)
    return path


def test_finish_writes_a_record_that_binds_the_final_generation(tmp_path):
    path = tmp_path / "run"
    record = train(path, metrics={"val_loss": 0.25})
    manifest = json.loads((path / gen(4) / "manifest.json").read_text())
    assert record.generation == gen(4) and record.next_update == 4 and record.tokens_seen == 24
    assert record.contract_fingerprint == manifest["contract_fingerprint"]
    assert record.run == manifest["run"] == json.loads((path / "run-identity").read_text())["run"]
    pointer = json.loads((path / "latest").read_text())
    assert (record.manifest_digest, record.manifest_size) == (pointer["manifest_digest"], pointer["manifest_size"])
    assert record.metrics == {"val_loss": 0.25}
    assert done_mod.parse((path / "DONE").read_bytes()) == record
    assert not [p.name for p in path.iterdir() if p.name.startswith(".trainstate-tmp")]  # written by replace
    status = ts.done(str(path), config=CONFIG, state=build())
    assert status and status.status == "done" and status.record == record


def test_finish_reuses_the_generation_at_the_same_update_and_keeps_the_metrics(tmp_path):
    path = tmp_path / "run"
    record = train(path, metrics={"val_loss": 0.5})  # the save at update 4 came first, without metrics
    assert sorted(p.name for p in path.glob("gen-*")) == [gen(2), gen(4)]
    assert "metrics" not in json.loads((path / gen(4) / "manifest.json").read_text())
    assert record.metrics == {"val_loss": 0.5}
    again = train(path, metrics={"val_loss": 0.5})  # a finished run, run again: the same generation
    assert (again.generation, again.manifest_digest) == (record.generation, record.manifest_digest)


def test_finish_publishes_the_final_generation_when_none_is_at_this_update(tmp_path):
    path = tmp_path / "run"
    record = train(path, until=5, metrics={"val_loss": 0.5})
    assert record.generation == gen(5)
    assert json.loads((path / gen(5) / "manifest.json").read_text())["metrics"] == {"val_loss": 0.5}
    with pytest.raises(ts.InvalidArgument):
        train(tmp_path / "other", metrics={"val_loss": float("nan")})


def test_restore_tells_the_script_it_is_done(run):
    state = build()
    with ts.CheckpointManager(run) as ckpt:
        info = ckpt.restore(state)
    assert info.done is not None and info.done.generation == gen(4) and info.done == ts.done(str(run)).record


def test_restore_under_a_changed_contract_is_not_done(run):
    state = build({"lr": 0.2, "total": 8})
    with ts.CheckpointManager(run) as ckpt:
        info = ckpt.restore(state, allow_changes=["config"])
    assert info.done is None  # the run goes on under the new config
    assert not ts.done(str(run), state=state) and not ts.done(str(run), config={"lr": 0.2, "total": 8})


def test_restore_of_an_unfinished_run_is_not_done(tmp_path):
    path = tmp_path / "run"
    state = build()
    with ts.CheckpointManager(path) as ckpt:
        step(state)
        ckpt.save(state)
    with ts.CheckpointManager(path) as ckpt:
        assert ckpt.restore(build()).done is None
    assert ts.done(str(path)).status == "missing"


def _edit(path: Path, **fields) -> None:
    record = json.loads(path.read_text())
    record.update(fields)
    path.write_text(json.dumps(record))


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def _train_on(run: Path) -> None:
    state = build()
    with ts.CheckpointManager(run) as ckpt:
        ckpt.restore(state)
        step(state)
        ckpt.save(state)


def _transplant(run: Path) -> None:
    other = run.parent / "other"
    train(other)
    shutil.copy(other / "DONE", run / "DONE")


STALE = {
    "tampered digest": (lambda run: _edit(run / "DONE", manifest_digest="0" * 64), "manifest digest differs"),
    "tampered tokens": (lambda run: _edit(run / "DONE", tokens_seen=25), "tokens_seen"),
    "generation damaged": (lambda run: _flip_a_byte(run / gen(4) / "tensors.safetensors"), "no longer verifies"),
    "generation removed": (lambda run: shutil.rmtree(run / gen(4)), "no longer exists"),
    "trained past it": (_train_on, "latest names gen-000000000005"),
    "another run's record": (_transplant, "another run"),
    "garbage": (lambda run: (run / "DONE").write_bytes(b"\x00{"), "unusable"),
    "empty": (lambda run: (run / "DONE").write_bytes(b""), "unusable"),
}


@pytest.mark.parametrize("case", list(STALE))
def test_a_record_that_no_longer_holds_is_stale(run, case):
    damage, reason = STALE[case]
    assert ts.done(str(run))  # the control: done until the damage
    damage(run)
    status = ts.done(str(run))
    assert not status and status.status == "stale" and reason in status.reason, status.reason
    with ts.CheckpointManager(run) as ckpt:
        try:
            info = ckpt.restore(build())
        except ts.NoValidGeneration:
            return  # nothing restorable at all
    assert info.done is None


def test_the_full_check_reads_every_byte(run):
    _flip_a_byte(run / gen(4) / "tensors.safetensors")
    assert ts.done(str(run), content=False)  # sizes and structure alone cannot see it
    assert not ts.done(str(run))


def test_another_config_is_stale(run):
    status = ts.done(str(run), config={"lr": 0.2, "total": 4})
    assert status.status == "stale" and "config.lr" in status.reason
    assert ts.done(str(run), config=CONFIG)


def test_signed_records(tmp_path, monkeypatch):
    path = tmp_path / "run"
    train(path, key=KEY)
    assert "signature" in json.loads((path / "DONE").read_text())
    assert ts.done(str(path), signing_key=KEY)
    monkeypatch.setenv("TRAINSTATE_SIGNING_KEY", KEY)
    assert ts.done(str(path))
    _edit(path / "DONE", tokens_seen=24)  # unchanged value, but the record was rewritten: signature still holds
    assert ts.done(str(path))
    _edit(path / "DONE", metrics={"val_loss": 0.0})
    assert "signature" in ts.done(str(path)).reason
    record = json.loads((path / "DONE").read_text())
    del record["signature"]
    (path / "DONE").write_text(json.dumps(record))
    assert "not signed" in ts.done(str(path)).reason


def test_missing_directory_or_record(tmp_path):
    assert ts.done(str(tmp_path / "nowhere")).status == "missing"
    assert not ts.done(str(tmp_path / "nowhere"))


def test_cli_done_valid_stale_missing(run, tmp_path, capsys):
    assert main(["done", str(run)]) == 0
    assert capsys.readouterr().out.startswith(f"done: {gen(4)} (update 4, 24 tokens)")
    (tmp_path / "cfg.json").write_text(json.dumps({"lr": 0.2, "total": 4}))
    assert main(["done", str(run), "--config", str(tmp_path / "cfg.json")]) == 1
    assert "another config" in capsys.readouterr().out
    (tmp_path / "cfg.toml").write_text("lr = 0.1\ntotal = 4\n")
    assert main(["done", str(run), "--config", str(tmp_path / "cfg.toml"), "--fast"]) == 0
    capsys.readouterr()
    _edit(run / "DONE", manifest_digest="0" * 64)
    assert main(["done", str(run), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["status"] == "stale"
    (run / "DONE").unlink()
    assert main(["done", str(run)]) == 3
    assert "no DONE record" in capsys.readouterr().out
    assert main(["done", str(run), "--config", str(tmp_path / "absent.json")]) == 2


def test_exit_code_for():
    permanent = [ts.ContractMismatch("gen-000000000001", []), ts.DataMismatch("x"), ts.InvalidArgument("x"),
                 ts.StorageAccessDenied("x"), ts.InsufficientSpace("/r", "g", 10, 1), ts.ExistingRun("x")]
    for exc in permanent:
        assert ts.exit_code_for(exc) == ts.EXIT_PERMANENT == 78, exc
    for exc in (RuntimeError("x"), ts.StorageUnavailable("x"), ts.DirectoryLocked("x"), OSError("x")):
        assert ts.exit_code_for(exc) == 1, exc  # worth a bounded retry
    try:
        try:
            raise ts.InsufficientSpace("/r", "g", 10, 1)
        except ts.InsufficientSpace as cause:
            raise AsyncSaveFailed("background save failed") from cause
    except AsyncSaveFailed as wrapped:
        assert ts.exit_code_for(wrapped) == 78  # judged by what it was raised from
    assert ts.exit_code_for(SystemExit(ts.EXIT_PREEMPTED)) == 75
    assert ts.exit_code_for(SystemExit(None)) == 0 and ts.exit_code_for(KeyboardInterrupt()) == 130


def test_the_docs_finishing_example_runs_and_a_second_start_exits_at_once(tmp_path, monkeypatch):
    from docsite import runnable

    block = runnable("finish-and-exit")  # docs/guides/supervisor.md
    monkeypatch.chdir(tmp_path)
    calls = []

    def namespace() -> dict:
        def train_one_update(state):
            calls.append(state.next_update)
            step(state)
            state.next_update -= 1  # the example advances the clock itself

        return {"__name__": "__main__", "cfg": CONFIG, "total_updates": 250, "build_state": build,
                "train_one_update": train_one_update, "evaluate": lambda state: 0.5}

    exec(block, namespace())
    assert len(calls) == 250 and ts.done("runs/exp1", config=CONFIG).record.metrics == {"val_loss": 0.5}
    exec(block, namespace())  # restored, told it is done, and returned before training
    assert len(calls) == 250
    with pytest.raises(SystemExit) as stopped:  # another config: the restore refuses, permanently
        exec(block, {**namespace(), "cfg": {"lr": 0.2, "total": 4}})
    assert stopped.value.code == ts.EXIT_PERMANENT
