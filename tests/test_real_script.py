"""Issue 22: what a real training script taught us. Hand-written updates and accumulation keep their
gradients; two saves at one update publish a superseding revision (also across a SIGKILL); ``ls`` names a
recovery point only as restore would pick it; ``inspect`` shows tied tensors and nested values; the docs'
plain-variables and extending examples run. Issue 17 (third bullet): the ``ls`` table and ``--timeline``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import real_script_run
import trainstate as ts
from trainstate import cli
from trainstate.format.manifest import generation_name, generation_order, newest_first, parse_generation_name
from trainstate.lifecycle.retention import Retention, plan, superseded_by
from trainstate.lifecycle.candidates import recovery_point
from trainstate.storage.local import LocalStore

HERE = Path(__file__).resolve().parent
G = generation_name


def cli_out(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli.main(list(argv))
    return rc, capsys.readouterr().out


# --- item 1: gradients with no optimizer to account for them ----------------------------------------------


def _hand_state(seed: int = 0) -> ts.TrainState:
    torch.manual_seed(seed)
    return ts.TrainState(model=torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)))


def _micro_batch(state: ts.TrainState, update: int, micro: int) -> None:
    g = torch.Generator().manual_seed(update * 100 + micro)
    x, y = torch.randn(6, 5, generator=g), torch.randn(6, 1, generator=g)
    (((state["model"](x) - y) ** 2).mean() / 4).backward()  # accumulates into .grad


def _accumulating_run(state: ts.TrainState, ckpt: ts.CheckpointManager | None, until: int,
                      stop_at: tuple[int, int] | None = None) -> bool:
    """Updates of 4 micro-batches each, by hand; saves after micro-batch 2 of every update. Returns False
    when it stopped at ``stop_at`` (update, micro) right after that save, as a killed process would."""
    while state.next_update < until:
        if state.counters.get("micro", 0) == 0:
            state["model"].zero_grad(set_to_none=True)
        for micro in range(state.counters.get("micro", 0), 4):
            _micro_batch(state, state.next_update, micro)
            state.counters["micro"] = micro + 1
            if micro == 1 and ckpt is not None:
                ckpt.save(state)  # mid-accumulation: half the update's gradient exists only in .grad
                if stop_at == (state.next_update, micro):
                    return False
        for p in state["model"].parameters():
            p.data.add_(p.grad, alpha=-0.1)
        state.counters["micro"] = 0
        state.next_update += 1
    return True


def _params(state: ts.TrainState) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state["model"].parameters()]


def test_hand_written_update_records_its_gradients_and_restores_them_bitwise(tmp_path, caplog):
    """Before: with no optimizer the save dropped the populated .grad silently."""
    caplog.set_level(logging.INFO, logger="trainstate")
    state = _hand_state()
    with ts.CheckpointManager(tmp_path) as ckpt:
        for update in range(3):
            state["model"].zero_grad()
            _micro_batch(state, update, 0)
            for p in state["model"].parameters():
                p.data.add_(p.grad, alpha=-0.1)  # the word-language-model update
            state.next_update += 1
            ckpt.save(state)
    assert caplog.text.count("recording the gradients of 4 parameters") == 1  # said once, naming them
    assert "0.weight" in caplog.text and "zero_grad(set_to_none=True)" in caplog.text
    fresh = _hand_state(seed=5)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(fresh)
    for live, restored in zip(state["model"].parameters(), fresh["model"].parameters()):
        assert torch.equal(live, restored) and torch.equal(live.grad, restored.grad)
    state["model"].zero_grad(set_to_none=True)  # the documented way to leave them out
    state.next_update += 1
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
        again = _hand_state(seed=6)
        ckpt.restore(again)
    assert all(p.grad is None for p in again["model"].parameters())


def test_hand_written_accumulation_resumes_mid_accumulation_bitwise(tmp_path):
    straight = _hand_state()
    _accumulating_run(straight, None, 5)
    interrupted = _hand_state()
    with ts.CheckpointManager(tmp_path) as ckpt:
        assert not _accumulating_run(interrupted, ckpt, 5, stop_at=(2, 1))
    resumed = _hand_state(seed=9)
    with ts.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(resumed).generation.name == G(2)
        assert resumed.counters["micro"] == 2 and all(p.grad is not None for p in resumed["model"].parameters())
        _accumulating_run(resumed, ckpt, 5)
    for a, b in zip(_params(straight), _params(resumed)):
        assert torch.equal(a, b)
    # negative control: the same resume with the partial gradients lost (the old behaviour) diverges
    lost = _hand_state(seed=9)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(lost, generation=G(2))
    lost["model"].zero_grad(set_to_none=True)
    _accumulating_run(lost, None, 5)
    assert not all(torch.equal(a, b) for a, b in zip(_params(straight), _params(lost)))


def test_parameters_an_optimizer_steps_keep_the_pending_gradients_rule(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    state = ts.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(2, 3)).sum().backward()
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.PendingGradients):
            ckpt.save(state)


# --- item 5: two saves at one update ------------------------------------------------------------------------


def test_identical_state_writes_nothing_changed_counters_or_facts_are_what_restore_sees(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainstate")
    state, model, carried = real_script_run.build()
    state.next_update = 8
    with ts.CheckpointManager(tmp_path) as ckpt:
        first = ckpt.save(state)
        listing = sorted(os.listdir(tmp_path))
        assert ckpt.save(state) == first and sorted(os.listdir(tmp_path)) == listing  # nothing written
        state.counters.update(epoch=2, batch=0)
        state.facts["lr"] = 0.5
        second = ckpt.save(state, metrics={"val_loss": 3.0})
        assert second.name == "gen-000000000008-r001" and ckpt.latest() == second.name
        assert ckpt.save(state) == second  # the same again: nothing
        assert {G(8), second.name} <= set(ckpt.generations())
    assert re.search(r"gen-000000000008-r001 supersedes gen-000000000008: .*\(counters, facts, metrics\)",
                     caplog.text)
    fresh, _, _ = real_script_run.build()
    with ts.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(fresh).generation.name == second.name
    assert fresh.counters == {"epoch": 2, "batch": 0} and fresh.facts["lr"] == 0.5
    older, _, _ = real_script_run.build()  # negative control: the superseded generation holds the old values
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(older, generation=G(8))
    assert older.counters == {} and older.facts["lr"] == 2.0
    from trainstate.tools.diffread import resolve

    assert resolve(f"{tmp_path}@8")[1] == second.name  # `trainstate diff RUN@8`: the state the run continued from


def test_two_saves_at_one_update_survive_a_sigkill_after_the_second(tmp_path):
    """The script's epoch-end save lands on a periodic save's update; it is SIGKILLed right after it."""
    straight = tmp_path / "straight.st"
    real_script_run.main(str(tmp_path / "straight"), str(straight), kill=False)
    run = tmp_path / "run"
    worker = subprocess.Popen([sys.executable, str(HERE / "real_script_run.py"), str(run), str(tmp_path / "x.st"),
                               "--kill-after-epoch-end-save"], stdout=subprocess.PIPE, text=True, cwd=HERE)
    try:
        lines = [worker.stdout.readline() for _ in range(2)]
        assert lines[1].split() == ["SAVED", "gen-000000000008-r001"], lines
        os.kill(worker.pid, signal.SIGKILL)
        assert worker.wait(timeout=60) == -signal.SIGKILL
    finally:
        if worker.poll() is None:
            worker.kill()
    names = sorted(p.name for p in run.iterdir() if p.name.startswith("gen-"))
    assert names == [G(4), G(8), "gen-000000000008-r001"]  # ls shows both; the pointer names the revision
    assert json.loads((run / "latest").read_text())["generation"] == "gen-000000000008-r001"
    resumed = tmp_path / "resumed.st"
    out = subprocess.run([sys.executable, str(HERE / "real_script_run.py"), str(run), str(resumed)], cwd=HERE,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "RESTORED gen-000000000008-r001" in out.stdout
    a, b = load_file(straight), load_file(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads(Path(str(straight) + ".json").read_text()) == json.loads(Path(str(resumed) + ".json").read_text())
    plan_now = ts.CheckpointManager(run).plan()
    assert not any(n.startswith(G(8)) and n != "gen-000000000008-r001" for n in plan_now.keep)


def test_revision_names_parse_and_sort_everywhere():
    names = [G(8), "gen-000000000008-r002", "gen-000000000008-r010", G(8, "weights"), G(9), G(7)]
    assert [parse_generation_name(n) for n in names] == [(8, "full")] * 3 + [(8, "weights"), (9, "full"),
                                                                             (7, "full")]
    assert newest_first(names) == [G(9), G(8, "weights"), "gen-000000000008-r010", "gen-000000000008-r002", G(8),
                                   G(7)]
    assert generation_order("gen-000000000008-r002") == (8, 2) and generation_order(G(8)) == (8, 0)
    assert parse_generation_name("gen-000000000008-r000") is None  # revision 0 has no suffix
    assert parse_generation_name("gen-000000000008-r01") is None
    with pytest.raises(ts.InvalidArgument):
        generation_name(8, "weights", 1)


def test_retention_keeps_the_superseded_with_its_revision_without_counting_it():
    names = [G(2), G(4), "gen-000000000004-r001", G(6), "gen-000000000006-r001", "gen-000000000006-r002"]
    top = "gen-000000000006-r001"  # r002 above the pointer: an interrupted save, left alone
    decided = plan(names, policy=Retention(keep_last=2, milestone_every=4), newest={"full": top},
                   pins={"keep-me": G(4)})
    reasons = {d.generation: (d.keep, d.reasons) for d in decided.decisions}
    assert reasons["gen-000000000006-r002"][0] and "newer than" in reasons["gen-000000000006-r002"][1][0]
    assert reasons[G(6)] == (True, ("superseded by gen-000000000006-r001, kept while that is",))
    assert reasons["gen-000000000004-r001"] == (True, ("last 2", "milestone (every 4 updates)"))
    assert reasons[G(4)] == (True, ("superseded by gen-000000000004-r001, kept while that is", "pinned: keep-me"))
    assert not reasons[G(2)][0]  # keep_last=2 counted 6-r001 and 4-r001 only: revisions take no slot
    later = plan(names + [G(8), G(10)], policy=Retention(keep_last=2), newest={"full": G(10)})
    gone = {d.generation: d.reasons for d in later.decisions if not d.keep}
    assert gone[G(6)] == ("superseded by gen-000000000006-r002 (a later save at the same update)",)
    assert "gen-000000000006-r001" in gone  # r002 is no longer above the newest: it supersedes both, all go
    assert superseded_by(names, top, None) == {G(4): "gen-000000000004-r001", G(6): top}
    assert superseded_by(names, top, None, forks={4}) == {G(6): top}  # at a fork, nothing is superseded


# --- item 4: ls and inspect say only what they know ----------------------------------------------------------


def _three(tmp_path: Path) -> Path:
    state = _hand_state()
    with ts.CheckpointManager(tmp_path, retention=Retention(keep_last=5)) as ckpt:
        for _ in range(3):
            state.next_update += 1
            ckpt.save(state)
    return tmp_path


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_ls_after_a_bit_flip_names_the_generation_restore_picks(tmp_path, capsys):
    run = _three(tmp_path)
    _flip(run / G(3) / "tensors.safetensors")
    assert recovery_point(LocalStore(run, create=False), None) == G(3)  # structure alone cannot see it
    rc, out = cli_out(capsys, "ls", str(run))
    assert rc == 0 and "structure ok" not in next(l for l in out.splitlines() if l.startswith(G(3)))
    assert re.search(rf"^{G(3)} .*INVALID: .*digest", out, re.M)
    assert f"recovery point: {G(2)} (a restart resumes here; latest names {G(3)}, which it passes over; " \
           "every digest checked)" in out
    rc, report = cli.main(["ls", "--json", str(run)]), json.loads(capsys.readouterr().out)
    assert report["recovery_point"] == G(2) and report["recovery_point_checked"] == "digests"
    assert [r["generation"] for r in report["rejected"]] == [G(3)]
    with ts.CheckpointManager(run) as ckpt:
        assert ckpt.restore(_hand_state(seed=3)).generation.name == report["recovery_point"]
    rc, out = cli_out(capsys, "ls", "--quick", str(run))  # the fast path says plainly what it did not check
    assert f"recovery point (by structure only, digests NOT checked): {G(3)}" in out
    assert "`trainstate ls` without --quick, or `trainstate verify" in out


def test_inspect_shows_tied_tensors_and_nested_values(tmp_path, capsys):
    state, model, carried = real_script_run.build()
    carried.hidden = (torch.zeros(1, 3, real_script_run.EMB), torch.ones(1, 3, real_script_run.EMB))
    state.facts["history"] = (1.5, float("inf"), [1, 2])
    with ts.CheckpointManager(tmp_path) as ckpt:
        name = ckpt.save(state).name
    rc, out = cli_out(capsys, "inspect", str(tmp_path / name))
    assert rc == 0
    assert "  encoder.weight: float32 [11, 8] (352 B); tied: also held as model.decoder.weight (stored once)" in out
    assert "  decoder.weight: the same tensor as model.encoder.weight (tied; stored once): float32 [11, 8]" in out
    assert "  hidden: tuple of 2\n    [0]: float32 [1, 3, 8] (96 B)\n    [1]: float32 [1, 3, 8] (96 B)" in out
    assert "  history: tuple of 3\n    [0]: 1.5\n    [1]: inf\n    [2]: [1, 2]" in out
    assert "architecture.model: 7 parameters and buffers; tied: decoder.weight -> encoder.weight" in out
    assert '"$tuple"' not in out and "..." not in out
    rc, report = cli.main(["inspect", "--json", str(tmp_path / name)]), json.loads(capsys.readouterr().out)
    model_state = report["components"]["model"]["state"]
    assert model_state["decoder.weight"]["shared_with"] == ["model.encoder.weight"]
    assert report["shared_tensors"] == [["model.encoder.weight", "model.decoder.weight"]]


# --- issue 17: the ls table and the timeline -------------------------------------------------------------------


def _lineage_run(tmp_path: Path) -> Path:
    """Updates 1-5 with a revision at 3, a pin and a best; the newest damaged, then a fallback forks."""
    state = _hand_state()
    policy = Retention(keep_last=4, milestone_every=2, best=("loss", "min"))
    with ts.CheckpointManager(tmp_path, retention=policy) as ckpt:
        for update in range(1, 6):
            state.next_update = update
            ckpt.save(state, metrics={"loss": 1.0 if update != 2 else 0.1})
            if update == 3:
                ckpt.pin("first-epoch", G(3))
                state.counters["epoch"] = 1
                ckpt.save(state, metrics={"loss": 0.9})
    _flip(tmp_path / G(5) / "tensors.safetensors")
    resumed = _hand_state(seed=1)
    with ts.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.restore(resumed).generation.name == G(4)  # the fallback forks a new timeline
        for update in (5, 6):
            resumed.next_update = update
            ckpt.save(resumed, metrics={"loss": 0.5})
    return tmp_path


def test_ls_table_is_aligned_with_human_sizes_and_marks(tmp_path, capsys):
    run = _lineage_run(tmp_path)
    rc, out = cli_out(capsys, "ls", str(run))
    lines = out.splitlines()
    header, rows = lines[0], {l.split()[0]: l for l in lines[1:] if l.startswith("gen-")}
    state_col = header.index("state")
    assert all(l[state_col - 2:state_col] == "  " and l[state_col] != " " for l in rows.values())  # aligned
    assert re.search(r" \d+\.\d KiB ", rows[G(6)])
    assert "latest, recovery point, milestone" in rows[G(6)]
    assert "best loss (min), milestone" in rows[G(2)]
    assert "pinned: first-epoch, superseded by gen-000000000003-r001" in rows[G(3)]
    assert "supersedes gen-000000000003" in rows["gen-000000000003-r001"]
    aside = next(l for l in lines if ".rejected-" in l)
    assert aside.startswith("gen-000000000005.rejected-") and "set aside: damaged, kept as evidence" in aside


def test_ls_timeline_draws_the_fork_and_what_each_rule_keeps(tmp_path, capsys):
    run = _lineage_run(tmp_path)
    rc, out = cli_out(capsys, "ls", "--timeline", str(run))
    assert rc == 0
    timelines = re.findall(r"^timeline ([0-9a-f]{16}) \((.*)\)$", out, re.M)
    assert [role for _, role in timelines] == ["current: the recovery point's", "an ancestor of the current timeline"]
    (current, _), (older, _) = timelines
    assert f"+-- forked from timeline {older} after update 4" in out
    assert f"|   continued by timeline {current} after update 4" in out
    current_part, older_part = out.split(f"timeline {older} (")
    assert re.search(r"\|\s+6  gen-000000000006\s+keep\s+newest: the recovery point", current_part)
    assert re.search(r"\|\s+2  gen-000000000002\s+keep\s+.*best loss \(min\)", older_part)
    assert re.search(r"\|\s+3  gen-000000000003\s+keep\s+superseded by gen-000000000003-r001, kept while that "
                     r"is; pinned: first-epoch", older_part)
    assert re.search(r"\|\s+3  gen-000000000003-r001\s+keep\s+last 4 .*\[supersedes gen-000000000003\]",
                     older_part)
    assert "+-- the first timeline of this run" in older_part
    assert "set aside (damaged, kept as evidence): gen-000000000005.rejected-" in out
    assert out.rstrip().endswith(f"recovery point: {G(6)} (a restart resumes here; every digest checked)")


# --- docs/guides/single-process.md: state in plain variables, and extending a finished run ---------------------


def _section_blocks() -> list[str]:
    from docsite import runnable

    return [runnable("plain-variables"), runnable("extend-schedule")]


class _Killed(Exception):
    pass


def _lm_namespace(directory: Path, epochs: int, die_at_batch_call: int | None = None) -> dict:
    torch.manual_seed(1111)
    model = real_script_run.TinyLM()
    data = torch.Generator().manual_seed(7)
    train_data = torch.randint(real_script_run.VOCAB, (8 * 4 + 1, 3), generator=data)
    calls = []

    def get_batch(source, i):
        calls.append(i)
        if die_at_batch_call is not None and len(calls) == die_at_batch_call:
            raise _Killed
        return real_script_run.get_batch(source, i)

    def evaluate():
        return float(sum(p.detach().double().sum() for p in model.parameters()))

    return {"model": model, "epochs": epochs, "bptt": 4, "train_data": train_data, "get_batch": get_batch,
            "criterion": torch.nn.CrossEntropyLoss(), "evaluate": evaluate, "calls": calls,
            "__name__": "readme_plain_variables"}


def _run_block(block: str, directory: Path, ns: dict) -> dict:
    exec(block.replace('"runs/lm"', repr(str(directory))), ns)
    return ns


def test_readme_plain_variables_example_resumes_bitwise(tmp_path):
    block = next(b for b in _section_blocks() if "class Carried" in b)
    straight = _run_block(block, tmp_path / "a", _lm_namespace(tmp_path / "a", epochs=2))
    with pytest.raises(_Killed):  # dies mid-epoch 2, 2 batches after the save at update 12
        _run_block(block, tmp_path / "b", _lm_namespace(tmp_path / "b", epochs=2, die_at_batch_call=15))
    resumed = _run_block(block, tmp_path / "b", _lm_namespace(tmp_path / "b", epochs=2))
    assert resumed["calls"][0] == 4 * 4  # straight to the saved batch (update 12 = epoch 2, batch 4)
    assert len(resumed["calls"]) == 4
    for a, b in zip(straight["model"].parameters(), resumed["model"].parameters()):
        assert torch.equal(a, b)
    assert straight["state"].facts == resumed["state"].facts and straight["state"].counters == resumed["state"].counters
    names = sorted(p.name for p in (tmp_path / "b").iterdir() if p.name.startswith("gen-"))
    assert "gen-000000000008-r001" in names and "gen-000000000016-r001" in names  # the epoch-end revisions


def test_readme_extending_example_resumes_with_more_epochs_and_refuses_another_seed(tmp_path, monkeypatch):
    import argparse

    block = next(b for b in _section_blocks() if "SCHEDULE" in b)
    monkeypatch.chdir(tmp_path)

    def run(**args):
        ns = {"ts": ts, "model": torch.nn.Linear(2, 2),
              "args": argparse.Namespace(**{"model": "LSTM", "seed": 1111, "batch_size": 20, "epochs": 3,
                                            "log_interval": 200, "save": "model.pt", "dry_run": False, **args})}
        exec(block, ns)
        return ns

    ns = run()
    with ts.CheckpointManager(tmp_path / "runs" / "lm-extend") as ckpt:
        ckpt.save(ns["state"])
    run(epochs=4, log_interval=50)  # schedule only: resumes
    with pytest.raises(ts.ContractMismatch, match="config.seed"):
        run(seed=7)
    whole = {"config": {"model": "LSTM", "seed": 1111, "epochs": 3}}
    state = ts.TrainState(model=torch.nn.Linear(2, 2), contract=whole)
    with ts.CheckpointManager(tmp_path / "whole") as ckpt:
        ckpt.save(state)
    state = ts.TrainState(model=torch.nn.Linear(2, 2), contract={"config": {**whole["config"], "epochs": 4}})
    with ts.CheckpointManager(tmp_path / "whole") as ckpt:
        with pytest.raises(ts.ContractMismatch, match="config.epochs"):
            ckpt.restore(state)
        info = ckpt.restore(state, allow_changes=["config.epochs"])
    assert not info.identical_continuation and state.history[-1]["changes"][0]["field"] == "config.epochs"


def test_background_saves_at_one_update_chain_their_parents_through_the_revision(tmp_path):
    """A save prepared while the earlier one is still in flight names it by its prepared name; the
    publisher maps that to the revision it became, so lineage and rollback detection stay exact."""
    state, _, _ = real_script_run.build()
    state.next_update = 8
    with ts.CheckpointManager(tmp_path, keep_last=5, max_in_flight=2) as ckpt:
        ckpt.save(state)
        state.counters["epoch"] = 2
        first = ckpt.save(state, blocking=False)
        state.next_update = 9
        second = ckpt.save(state, blocking=False)
        assert (first.wait().name, second.wait().name) == ("gen-000000000008-r001", G(9))
    manifest = json.loads((tmp_path / G(9) / "manifest.json").read_text())
    assert manifest["parent"] == "gen-000000000008-r001"
