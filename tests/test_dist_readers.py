"""Every command that reads a run works on a multi-rank run, with no process group (issue 29, item 3).

``trainstate ls`` picked the recovery point through the single-process restore,
which refuses a multi-rank manifest, so it failed on every multi-rank run; and
``trainstate diff`` compared only the global files, calling two multi-rank
generations whose weights differ "identical". The run here is written by a
real ``torchrun`` of 2 gloo ranks (FSDP2): one generation, then one revision
per kind of change at the same update (weights, an Adam moment, rank 1's RNG
stream, rank 1's loader position, the learning rate).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distlaunch import launch
from test_cost import RATES

pytestmark = pytest.mark.slow
GENS = ["gen-000000000002", "gen-000000000002-r001", "gen-000000000002-r002", "gen-000000000002-r003",
        "gen-000000000002-r004", "gen-000000000002-r005"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("readers")
    launch(root / "two", ["existing_generation"]).ok("existing_generation")
    return root / "two" / "existing_generation" / "run"


def cli(*argv: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "trainstate", *argv], capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def test_ls_names_a_verified_recovery_point_and_falls_back_past_a_damaged_shard(run, tmp_path):
    rc, out = cli("ls", str(run))
    assert rc == 0 and "recovery point: gen-000000000002-r005 (a restart resumes here; every digest checked)" in out, out
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shard = copy / GENS[-1] / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10  # one bit of rank 1's shard (the tail: tensor data, not the header)
    shard.write_bytes(bytes(data))
    rc, out = cli("ls", str(copy))
    assert rc == 0 and "recovery point: gen-000000000002-r004" in out, out
    assert "shard-00001.safetensors" in out, out  # the rejection names the damaged file
    rc, out = cli("verify", str(copy))
    assert rc != 0 and GENS[-1] in out, out


@pytest.mark.parametrize("a, b, first, path", [
    (GENS[0], GENS[1], "model", "model.0.weight"),
    (GENS[1], GENS[2], "optimizer", "optimizer.state.0.weight.exp_avg"),
    (GENS[2], GENS[3], "rng", "rank-00001.safetensors/rng.named.noise.state"),
    (GENS[3], GENS[4], "data", "rank1.data.cursor"),
    (GENS[4], GENS[5], "optimizer", "optimizer.param_groups.0.lr"),
    (GENS[5], GENS[5], None, None)])
def test_diff_finds_each_change_in_the_shards_and_the_rank_records(run, a, b, first, path):
    """Before, each of these pairs was reported identical: only state.json and tensors.safetensors were read."""
    rc, out = cli("diff", str(run / a), str(run / b), "--json")
    assert rc == (0 if first is None else 1), out  # exit 1: different
    report = json.loads(out)
    assert report["first"] == first, out
    if path is not None:
        entries = [e["path"] for c in report["categories"] for e in c["entries"]]
        assert entries[0] == path and all(e.startswith(path.rsplit(".", 1)[0]) for e in entries), entries
    else:
        model = next(c for c in report["categories"] if c["name"] == "model")
        assert model["tensors"] == 6 and report["identical"], model


@pytest.mark.parametrize("argv", [["inspect"], ["verify"], ["plan", "--total-updates", "10"],
                                  ["ls", "--timeline"], ["ls", "--quick"]])
def test_the_other_readers_work_on_a_multi_rank_run(run, argv):
    rc, out = cli(*argv, str(run))
    assert rc == 0 and "torchrun" not in out, out


def test_cost_works_on_a_multi_rank_run(run, tmp_path):
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps(RATES))
    rc, out = cli("cost", str(run), "--rates", str(rates), "--interval-s", "60")
    assert rc == 0, out
