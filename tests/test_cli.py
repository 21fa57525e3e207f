"""The command line: ``trainstate ls|verify|inspect`` and ``python -m trainstate``.

Exit status is part of the contract: 0 success, 1 a verification failure or
error (with a message, never a traceback), 2 bad usage. Every command has a
``--json`` form that parses. ``inspect`` describes tensors from the file
headers alone, without reading tensor data.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import trainer
import trainstate as ts
from trainstate import cli
from trainstate.format import tensorfile
from trainstate.storage.local import LocalStore

pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")

G1, G2, G3 = (f"gen-{u:012d}" for u in (1, 2, 3))
W2 = "gen-000000000002-weights"
LEFTOVER = ".trainstate-staging-gen-000000000009-0123456789abcdef"
TENSORS = "tensors.safetensors"
CONSOLE_SCRIPT = Path(sys.executable).with_name("trainstate")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, ts.TrainState]:
    """Full generations 1-3, a weights-only generation at 2, and a leftover staging directory."""
    root = tmp_path_factory.mktemp("cli") / "run"
    state = trainer.build(seed=0)
    state.facts["best_loss"] = 0.25
    with ts.CheckpointManager(root, keep_last=5) as ckpt:
        for update in (1, 2, 3):
            trainer.step(state)
            ckpt.save(state)
            if update == 2:
                ckpt.save(state, weights_only=True)
    (root / LEFTOVER).mkdir()
    (root / LEFTOVER / "state.json").write_bytes(b"{}")
    return root, state


@pytest.fixture
def run(built, tmp_path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(built[0], root, symlinks=True)
    return root


def cli_run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli.main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def cli_json(capsys, *argv: str) -> tuple[int, dict]:
    rc, out, _ = cli_run(capsys, *argv, "--json")
    return rc, json.loads(out)


def flip_tensor_data(generation: Path) -> None:
    path = generation / TENSORS
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


# --- ls ----------------------------------------------------------------------------------------


def test_ls_lists_generations_pointers_and_leftovers(run, capsys):
    """Issue 17: an aligned table, sizes in human units, marks; the recovery point's digests are checked."""
    rc, out, err = cli_run(capsys, "ls", str(run))
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["generation", "update", "kind", "size", "created", "(UTC)", "marks", "state"]
    rows = {line.split()[0]: line for line in lines[1:] if line.startswith("gen-")}
    assert list(rows) == [G3, W2, G2, G1], "newest first, weights-only generations included"
    columns = {lines[0].index(h) for h in ("marks", "state")}
    assert all(len(line) > max(columns) for line in rows.values())
    assert rows[G3].split()[1:3] == ["3", "full"] and re.search(r"latest, recovery point +verified$", rows[G3])
    assert rows[W2].split()[1:3] == ["2", "weights"] and re.search(r"latest-weights +structure ok$", rows[W2])
    for name in (G2, G1):
        assert rows[name].split()[2] == "full" and rows[name].endswith("structure ok") and "latest" not in rows[name]
    size = sum(p.stat().st_size for p in (run / G3).iterdir())
    assert f"{size / 1024:.1f} KiB" in rows[G3]
    assert f"leftover from an interrupted save (removed by the next save): {LEFTOVER}" in lines


def test_ls_json(run, capsys):
    rc, report = cli_json(capsys, "ls", str(run))
    assert rc == 0
    assert report["directory"] == str(run)
    assert [(r["generation"], r["update"], r["kind"], r["latest"]) for r in report["generations"]] == [
        (G3, 3, "full", "latest"), (W2, 2, "weights", "latest-weights"), (G2, 2, "full", None), (G1, 1, "full", None)]
    assert {r["generation"]: r["state"] for r in report["generations"]} == {
        G3: "verified", W2: "structure ok", G2: "structure ok", G1: "structure ok"}  # the recovery point's digests
    assert report["recovery_point"] == G3 and report["recovery_point_checked"] == "digests"
    assert all(type(r["size"]) is int and r["created"] for r in report["generations"])
    assert report["leftovers"] == [LEFTOVER]
    assert report["pointers"] == {"latest": {"generation": G3, "ok": True},
                                  "latest-weights": {"generation": W2, "ok": True}}


def test_ls_full_checks_content(run, capsys):
    """Plain ls checks structure only (fast); --full re-reads every byte."""
    flip_tensor_data(run / G2)
    _, report = cli_json(capsys, "ls", str(run))
    assert {r["generation"]: r["state"] for r in report["generations"]}[G2] == "structure ok"
    rc, report = cli_json(capsys, "ls", "--full", str(run))
    states = {r["generation"]: r["state"] for r in report["generations"]}
    assert rc == 0
    assert states[G2].startswith("INVALID") and "digest" in states[G2]
    assert states[G3] == states[G1] == states[W2] == "verified"
    rc, out, _ = cli_run(capsys, "ls", "--full", str(run))
    assert re.search(rf"^{G2} .*INVALID: .*digest", out, re.M)


def test_ls_shows_invalid_pointer(run, capsys):
    (run / "latest").write_bytes(b"not json")
    rc, out, _ = cli_run(capsys, "ls", str(run))
    assert rc == 0 and "pointer latest: INVALID" in out
    _, report = cli_json(capsys, "ls", str(run))
    assert report["pointers"]["latest"]["ok"] is False and "JSON" in report["pointers"]["latest"]["error"]
    assert {r["latest"] for r in report["generations"]} == {None, "latest-weights"}


def test_ls_of_a_single_generation(run, capsys):
    rc, report = cli_json(capsys, "ls", str(run / G2))
    assert rc == 0 and [r["generation"] for r in report["generations"]] == [G2]


# --- verify ------------------------------------------------------------------------------------


def test_verify_exit_codes(run, capsys):
    rc, out, _ = cli_run(capsys, "verify", str(run))
    assert rc == 0
    assert out.splitlines() == [f"ok      {n}" for n in (G3, W2, G2, G1)] + [
        f"ok: 4 generation(s) of {run} verified (digests checked, and every pointer); unsigned: nothing was "
        "authenticated"]
    for name in (G3, W2, G2, G1):
        assert cli_run(capsys, "verify", str(run / name))[0] == 0
    flip_tensor_data(run / G2)
    rc, out, _ = cli_run(capsys, "verify", str(run))
    assert rc == 1 and f"FAILED  {G2}: {G2}/{TENSORS}: xxh3-chunked digest mismatch in chunk" in out
    assert cli_run(capsys, "verify", str(run / G2))[0] == 1
    assert cli_run(capsys, "verify", str(run / G3))[0] == 0


def test_verify_json(run, capsys):
    rc, report = cli_json(capsys, "verify", str(run))
    assert rc == 0 and report == {"verified": [G3, W2, G2, G1], "failures": [], "signature": "absent",
                                  "authenticated": False}
    (run / G1 / "state.json").unlink()
    rc, report = cli_json(capsys, "verify", str(run))
    assert rc == 1 and report["verified"] == [G3, W2, G2]
    assert report["failures"] == [{"generation": G1, "error": f"{G1}/state.json: missing"}]


@pytest.mark.parametrize("json_flag", [False, True])
def test_verify_missing_target_is_an_error_not_a_traceback(tmp_path, capsys, json_flag):
    argv = ["verify", str(tmp_path / "nowhere")] + (["--json"] if json_flag else [])
    rc, out, err = cli_run(capsys, *argv)
    assert rc == 1
    if json_flag:
        assert json.loads(out) == {"error": f"{tmp_path / 'nowhere'} is not a directory", "type": "FileNotFoundError"}
    else:
        assert "not a directory" in err and "Traceback" not in err


def test_verify_of_empty_directory(tmp_path, capsys):
    rc, out, _ = cli_run(capsys, "verify", str(tmp_path))
    assert rc == 1 and "holds no generations" in out  # a wrong or empty directory is not "verified"


# --- inspect -----------------------------------------------------------------------------------


def _walk_tensors(node, path=""):
    if isinstance(node, dict):
        if "tensor" in node and "dtype" in node:
            yield path, node
            return
        for key, value in node.items():
            yield from _walk_tensors(value, f"{path}.{key}" if path else key)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk_tensors(value, f"{path}[{i}]")


def test_inspect_json_describes_components_counters_and_contract(run, built, capsys):
    state = built[1]
    rc, report = cli_json(capsys, "inspect", str(run / G3))
    assert rc == 0
    assert (report["generation"], report["kind"], report["next_update"]) == (G3, "full", 3)
    assert report["clocks"] == {"next_update": 3, "tokens_seen": state.tokens_seen}
    assert report["counters"] == state.counters and report["facts"] == {"best_loss": 0.25}
    assert report["contract"]["fields"] == state.contract_fields()
    assert set(report["contract"]["versions"]) >= {"trainstate", "torch"}
    assert set(report["components"]) == {"model", "optimizer", "scheduler", "scaler"}
    assert report["components"]["model"]["type"] == "torch.nn.modules.container.Sequential"
    model = dict(_walk_tensors(report["components"]["model"]["state"]))
    for key, tensor in state["model"].state_dict().items():
        entry = model[key]
        assert entry["dtype"] == str(tensor.dtype).removeprefix("torch.")
        assert entry["shape"] == list(tensor.shape) and entry["bytes"] == tensor.numel() * tensor.element_size()
    optim = report["components"]["optimizer"]["state"]
    first = next(iter(state["model"].parameters()))
    assert optim["state"]["0"]["exp_avg"]["shape"] == list(first.shape)
    assert optim["param_groups"][0]["betas"] == list(state["optimizer"].param_groups[0]["betas"])
    every = list(_walk_tensors(report["components"]))
    assert report["tensor_bytes"] >= sum(e["bytes"] for _, e in every) > 0
    assert {f["name"] for f in report["files"]} == {"state.json", TENSORS}


def test_inspect_text(run, built, capsys):
    state = built[1]
    rc, out, _ = cli_run(capsys, "inspect", str(run / G3))
    assert rc == 0
    assert out.startswith(f"{G3}  kind=full  next_update=3  created=")
    assert f"counters: {state.counters}" in out
    assert "model  (torch.nn.modules.container.Sequential)" in out
    assert "optimizer  (torch.optim.adamw.AdamW)" in out
    weight = state["model"].state_dict()["0.weight"]
    assert f"  0.weight: float32 {list(weight.shape)} ({weight.numel() * 4:,} B)" in out
    assert "  1.num_batches_tracked: int64 [] (8 B)" in out
    contract = out.split("\ncontract:\n", 1)[1]
    assert "  class_names: [\"cat\", \"dog\"]" in contract and "  architecture.model: " in contract
    assert "  data_manifest: \"manifest-v1\"" in contract


def test_inspect_run_directory_means_newest(run, capsys):
    _, of_dir = cli_json(capsys, "inspect", str(run))
    _, of_gen = cli_json(capsys, "inspect", str(run / G3))
    assert of_dir == of_gen


def test_inspect_weights_only_generation(run, capsys):
    rc, report = cli_json(capsys, "inspect", str(run / W2))
    assert rc == 0 and report["kind"] == "weights" and set(report["components"]) == {"model"}


class _CountingStream:
    def __init__(self, stream, counts: dict, name: str):
        self._stream, self._counts, self._name = stream, counts, name

    def read(self, n=-1):
        data = self._stream.read(n)
        self._counts[self._name] = self._counts.get(self._name, 0) + len(data)
        return data

    def readinto(self, buffer):
        n = self._stream.readinto(buffer)
        self._counts[self._name] = self._counts.get(self._name, 0) + (n or 0)
        return n

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stream.close()


def test_inspect_reads_no_tensor_data(run, capsys, monkeypatch):
    counts: dict[str, int] = {}
    real_open = LocalStore.open
    monkeypatch.setattr(LocalStore, "open",
                        lambda self, gen, file: _CountingStream(real_open(self, gen, file), counts, file))
    monkeypatch.setattr(tensorfile, "read_tensor", lambda *a, **k: pytest.fail("inspect read tensor data"))
    for argv in (["inspect", str(run / G3)], ["inspect", "--json", str(run / G3)]):
        counts.clear()
        rc, _, _ = cli_run(capsys, *argv)
        assert rc == 0
        raw = (run / G3 / TENSORS).read_bytes()
        header_end = 8 + int.from_bytes(raw[:8], "little")
        assert 0 < counts[TENSORS] <= header_end < len(raw)


def test_inspect_output_ignores_tensor_bytes(run, capsys):
    """Inspect describes the data from headers only: changing every data byte changes nothing it shows."""
    _, clean = cli_json(capsys, "inspect", str(run / G3))
    path = run / G3 / TENSORS
    raw = path.read_bytes()
    start = 8 + int.from_bytes(raw[:8], "little")
    path.write_bytes(raw[:start] + bytes(b ^ 0xFF for b in raw[start:]))
    _, damaged = cli_json(capsys, "inspect", str(run / G3))
    assert damaged == clean


def test_inspect_of_damaged_generation_is_an_error(run, capsys):
    (run / G3 / "manifest.json").write_bytes(b"{")
    rc, out, err = cli_run(capsys, "inspect", str(run / G3))
    assert rc == 1 and out == "" and f"{G3}/manifest.json" in err and "Traceback" not in err
    rc, report = cli_json(capsys, "inspect", str(run / G3))
    assert rc == 1 and report["type"] == "CorruptGeneration"


def test_inspect_of_empty_directory(tmp_path, capsys):
    rc, _, err = cli_run(capsys, "inspect", str(tmp_path))
    assert rc == 1 and "no generations" in err


# --- usage errors and the two entry points -----------------------------------------------------


@pytest.mark.parametrize("argv", [[], ["bogus"], ["ls"], ["verify"], ["inspect"], ["ls", "DIR", "--bogus"],
                                  ["verify", "a", "b"], ["--json"], ["ls", "--full=yes", "DIR"]],
                         ids=lambda a: " ".join(a) or "(none)")
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert "usage: trainstate" in capsys.readouterr().err


def _spawn(argv: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)


@pytest.mark.skipif(not CONSOLE_SCRIPT.exists(), reason="the trainstate console script is not installed")
def test_module_and_console_script_agree(run):
    """``python -m trainstate`` and ``trainstate`` give the same output and exit status."""
    flip_tensor_data(run / G1)
    # a failing verify (exit 1, JSON on stdout) and no command (exit 2, usage): the other commands share their path
    commands = [["verify", "--json", "run"], []]
    procs = [(argv, _spawn([str(CONSOLE_SCRIPT)] + argv, run.parent),
              _spawn([sys.executable, "-m", "trainstate"] + argv, run.parent)) for argv in commands]
    for argv, script, module in procs:
        s_out, s_err = script.communicate(timeout=120)
        m_out, m_err = module.communicate(timeout=120)
        assert (script.returncode, s_out) == (module.returncode, m_out), argv
        assert "Traceback" not in s_err + m_err, argv
        expected = {"ls": 0, "verify": 1, "inspect": 0}.get(argv[0] if argv else "", 2)
        assert script.returncode == expected, (argv, s_err)
        if expected == 2:
            assert s_err.startswith("usage: trainstate") and m_err.startswith("usage: trainstate")
        else:
            json.loads(s_out)
