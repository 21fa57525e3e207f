"""``trainstate cost``: a storage cost estimate per tier from a real run's measured figures and the user's prices.

Runs are real directories written by ``CheckpointManager``; the expected
figures are read from the manifests by hand here (plain ``json``), not
through the code under test, and the costs are worked out by hand.
"""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainstate as ts
from trainstate.cli import main
from trainstate.errors import InvalidArgument
from trainstate.lifecycle import costs

MONTH_S = 30 * 86400

RATES = {"date": datetime.date.today().isoformat(), "currency": "USD", "tiers": {
    "disk": {"gb_month": 0.02, "per_1000_writes": 0.005, "per_1000_reads": 0.0004, "per_gb_in": 0.01,
             "per_gb_out": 0.09, "per_gb_retrieved": 0.01, "read_mb_per_s": 200},
    "cold": {"gb_month": 0.004, "per_1000_writes": 0.02, "min_retention_days": 90},
}}

TOML = """\
date = {date}
currency = "USD"
[tiers.disk]
gb_month = 0.02
per_1000_writes = 0.005
per_1000_reads = 0.0004
per_gb_in = 0.01
per_gb_out = 0.09
per_gb_retrieved = 0.01
read_mb_per_s = 200
[tiers.cold]
gb_month = 0.004
per_1000_writes = 0.02
min_retention_days = 90
"""


def _run(root: Path, saves: int, *, every: int = 10, weights: bool = False, metrics: bool = False,
         retention: ts.Retention | None = None) -> Path:
    state = ts.TrainState(model=torch.nn.Linear(8, 8))
    with ts.CheckpointManager(root, retention=retention or ts.Retention(keep_last=10)) as ckpt:
        for i in range(1, saves + 1):
            state.next_update += every
            ckpt.save(state, metrics={"loss": 1.0 / i} if metrics else None)
            if weights:
                state.next_update += 1
                ckpt.save(state, weights_only=True)
    return root


def _rates(path: Path, rates: dict | None = None) -> str:
    path.write_text(json.dumps(RATES if rates is None else rates))
    return str(path)


def _cost(capsys, *argv: str) -> tuple[int, dict]:
    rc = main(["cost", *argv, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def _manifests(root: Path, kind: str = "full") -> list[dict]:
    names = sorted(p.name for p in root.glob("gen-*") if p.name.endswith("-weights") == (kind == "weights"))
    return [json.loads((root / n / "manifest.json").read_text()) for n in names]


def _size(root: Path, generation: str) -> int:
    manifest = root / generation / "manifest.json"
    return manifest.stat().st_size + sum(f["size"] for f in json.loads(manifest.read_text())["files"])


def _tier(report: dict, name: str) -> dict:
    return next(t for t in report["tiers"] if t["tier"] == name)


# measured inputs ----------------------------------------------------------------------------------------------


def test_sizes_are_the_manifests_files_plus_the_manifest(tmp_path, capsys):
    run = _run(tmp_path / "run", 3, weights=True)
    rc, report = _cost(capsys, str(run), "--rates", _rates(tmp_path / "r.json"))
    assert rc == 0
    newest_full, newest_weights = _manifests(run)[-1], _manifests(run, "weights")[-1]
    full, weights = report["measured"]["full"], report["measured"]["weights"]
    assert full["size_bytes"] == _size(run, newest_full["generation"])
    assert full["size_bytes"] == sum(f["size"] for f in newest_full["files"]) + len(
        (run / newest_full["generation"] / "manifest.json").read_bytes())
    assert full["files"] == len(newest_full["files"]) == 2
    assert weights["size_bytes"] == _size(run, newest_weights["generation"]) < full["size_bytes"]
    assert newest_full["generation"] in full["size_source"]


def test_the_interval_is_measured_from_the_manifests_created_times(tmp_path, capsys):
    run = _run(tmp_path / "run", 4)
    rc, report = _cost(capsys, str(run), "--rates", _rates(tmp_path / "r.json"))
    assert rc == 0
    created = [datetime.datetime.fromisoformat(m["created"]) for m in _manifests(run)]
    gaps = [(b - a).total_seconds() for a, b in zip(created, created[1:])]
    full = report["measured"]["full"]
    assert full["interval_s"] == statistics.median(gaps)
    assert full["updates_per_save"] == 10
    assert "created" in full["interval_source"] and "3 gaps" in full["interval_source"]
    assert report["per_month"]["saves_full"] == pytest.approx(MONTH_S / statistics.median(gaps), rel=1e-12)
    # negative control: the flag replaces the measurement, and the source says so
    rc, report = _cost(capsys, str(run), "--rates", _rates(tmp_path / "r.json"), "--interval-s", "60")
    assert report["measured"]["full"]["interval_s"] == 60 and report["measured"]["full"]["interval_source"] == \
        "--interval-s"
    assert report["measured"]["full"]["updates_per_save"] == 10  # still measured


def test_cadence_ignores_pruned_saves_and_restart_downtime():
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    at = [(100, 0), (1000, 900), (1100, 1000), (1200, 1100), (1300, 5000), (1400, 5100)]  # pruned 200..900; a restart
    cadence = costs.measure_cadence([(u, t0 + datetime.timedelta(seconds=s)) for u, s in at])
    assert cadence == costs.SaveCadence(interval_s=100.0, updates_per_save=100, pairs=4)
    assert costs.measure_cadence([(100, t0)]) is None


def test_policy_comes_from_the_run_and_flags_override_it(tmp_path, capsys):
    run = _run(tmp_path / "run", 3, retention=ts.Retention(keep_last=2, keep_last_weights=4))
    rates = _rates(tmp_path / "r.json")
    _, report = _cost(capsys, str(run), "--rates", rates)
    assert report["measured"]["policy"]["keep_last"] == 2 and report["measured"]["full"]["keep"] == 2
    assert "gen-000000000030's manifest" in report["measured"]["policy_source"]
    _, wider = _cost(capsys, str(run), "--rates", rates, "--keep-last", "4")
    assert wider["measured"]["full"]["keep"] == 4 and "flags" in wider["measured"]["policy_source"]
    assert wider["per_month"]["retained_bytes"] == 2 * report["per_month"]["retained_bytes"]


# the arithmetic, by hand ---------------------------------------------------------------------------------------


def test_costs_match_a_hand_computation(tmp_path, capsys):
    run = _run(tmp_path / "run", 4, retention=ts.Retention(keep_last=3))
    rc, r = _cost(capsys, str(run), "--rates", _rates(tmp_path / "r.json"), "--size-bytes", "2000000000",
                  "--interval-s", "3600", "--restores-per-month", "4")
    assert rc == 0 and r["measured"]["full"]["files"] == 2
    month = r["per_month"]
    assert month["saves_full"] == 720  # 30 days / 1 h
    assert month["gb_months"] == pytest.approx(3 * 2.0, rel=1e-12)  # keep_last 3 x 2 GB
    assert month["writes"] == pytest.approx(720 * (2 + 3), rel=1e-12)  # files + manifest, commit, pointer
    # a restore of 2 GB: 17 fixed requests, then the file's HEAD, the header's chunk, the preview's read of the
    # RNG chunk, and 239 ranged GETs of 8 MiB (2e9 / 2^23 = 238.4)
    assert month["reads"] == pytest.approx(720 * (2 + 4 + 2 * 3) + 4 * (17 + 1 + 1 + 1 + 239), rel=1e-12)
    assert month["gb_in"] == pytest.approx(720 * 2.0, rel=1e-12)
    assert month["gb_out"] == pytest.approx(4 * 2.0, rel=1e-12)
    disk = _tier(r, "disk")
    assert disk["storage"] == pytest.approx(6 * 0.02, rel=1e-12)
    assert disk["requests"] == pytest.approx(3600 / 1000 * 0.005 + 9676 / 1000 * 0.0004, rel=1e-12)
    assert disk["transfer"] == pytest.approx(1440 * 0.01 + 8 * (0.09 + 0.01), rel=1e-12)
    assert disk["total"] == pytest.approx(0.12 + 0.0218704 + 15.2, rel=1e-12)
    assert disk["restore_s"] == pytest.approx(2e9 / 200e6, rel=1e-12)
    assert disk["early_deletion_gb_months"] == 0
    cold = _tier(r, "cold")  # 90-day minimum; a generation lives 3 x 1 h, so each save is billed the rest
    early = 720 * 2.0 * (90 * 86400 - 3 * 3600) / MONTH_S
    assert cold["early_deletion_gb_months"] == pytest.approx(early, rel=1e-12) == pytest.approx(4314.0)
    assert cold["storage"] == pytest.approx((6 + early) * 0.004, rel=1e-12)
    assert cold["requests"] == pytest.approx(3.6 * 0.02, rel=1e-12) and cold["transfer"] == 0
    assert cold["restore_s"] is None


def test_a_price_change_moves_only_its_own_part(tmp_path, capsys):
    """Negative control: doubling the storage price doubles storage and nothing else; halving saves halves writes."""
    run = _run(tmp_path / "run", 3)
    args = [str(run), "--size-bytes", "1000000000", "--interval-s", "3600"]
    _, base = _cost(capsys, *args, "--rates", _rates(tmp_path / "a.json"))
    dearer = json.loads(json.dumps(RATES))
    dearer["tiers"]["disk"]["gb_month"] *= 2
    _, more = _cost(capsys, *args, "--rates", _rates(tmp_path / "b.json", dearer))
    a, b = _tier(base, "disk"), _tier(more, "disk")
    assert b["storage"] == pytest.approx(2 * a["storage"], rel=1e-12) and b["storage"] > 0
    assert (b["requests"], b["transfer"]) == (a["requests"], a["transfer"])
    _, slower = _cost(capsys, str(run), "--size-bytes", "1000000000", "--interval-s", "7200",
                      "--rates", _rates(tmp_path / "a.json"))
    assert slower["per_month"]["writes"] == pytest.approx(base["per_month"]["writes"] / 2, rel=1e-12)
    assert slower["per_month"]["gb_months"] == base["per_month"]["gb_months"]  # the retained set does not change


def test_a_minimum_retention_shorter_than_the_lifetime_costs_nothing_extra():
    full = costs.KindFigures("full", size_bytes=10**9, files=2, interval_s=3600, updates_per_save=10, keep=3)
    measured = costs.Measured(full, ts.Retention(keep_last=3))
    assert costs.early_deletion_gb_months(measured, 3 * 3600 / 86400) == 0  # lives exactly the minimum
    assert costs.early_deletion_gb_months(measured, 4 * 3600 / 86400) == pytest.approx(720 * 3600 / MONTH_S)


def test_best_pins_and_milestones_add_to_what_is_stored(tmp_path, capsys):
    run = _run(tmp_path / "run", 4, metrics=True,
               retention=ts.Retention(keep_last=2, milestone_every=20, best=("loss", "min")))
    assert main(["pin", str(run), "first", "gen-000000000020"]) == 0
    capsys.readouterr()
    rc, r = _cost(capsys, str(run), "--rates", _rates(tmp_path / "r.json"), "--size-bytes", "1000000000",
                  "--interval-s", "3600")
    assert rc == 0
    pinned = _size(run, "gen-000000000020")
    assert (r["measured"]["pinned"], r["measured"]["pinned_bytes"]) == (1, pinned)
    assert r["measured"]["best_bytes"] == 10**9
    # a milestone every lcm(10, 20) = 20 updates = every 2 saves = 7200 s: 360 in a month, each stored to its end
    n, step = 360, 7200
    milestones = (n * MONTH_S - step * n * (n + 1) / 2) / MONTH_S
    assert milestones == 179.5
    month = r["per_month"]
    assert month["milestones_at_end"] == n
    assert month["milestone_gb_months"] == pytest.approx(milestones, rel=1e-12)
    assert month["retained_bytes"] == 2 * 10**9 + 10**9 + pinned  # last 2 + best + the pin
    assert month["gb_months"] == pytest.approx(3 + pinned / 1e9 + milestones, rel=1e-12)
    # a restore of 1 GB: 17 + 1 HEAD + the header's chunk + the RNG chunk + 120 GETs of 8 MiB
    assert month["reads"] == pytest.approx(720 * (2 + 4 + 2 * (2 + 1 + 1)) + 4 * (17 + 1 + 1 + 1 + 120), rel=1e-12)
    # over three months the milestones keep piling up: the monthly average grows
    _, longer = _cost(capsys, str(run), "--rates", _rates(tmp_path / "r.json"), "--size-bytes", "1000000000",
                      "--interval-s", "3600", "--months", "3")
    assert longer["per_month"]["milestones_at_end"] == 3 * n
    assert longer["per_month"]["milestone_gb_months"] > 2.9 * milestones
    assert _tier(longer, "disk")["horizon_total"] == pytest.approx(3 * _tier(longer, "disk")["total"], rel=1e-12)


def test_weights_only_saves_are_priced_with_their_own_size_and_cadence(tmp_path, capsys):
    run = _run(tmp_path / "run", 3, weights=True)
    _, r = _cost(capsys, str(run), "--rates", _rates(tmp_path / "r.json"))
    full, weights = r["measured"]["full"], r["measured"]["weights"]
    month = r["per_month"]
    assert month["saves_weights"] == pytest.approx(MONTH_S / weights["interval_s"], rel=1e-12)
    assert month["writes"] == pytest.approx(month["saves_full"] * (full["files"] + 3)
                                            + month["saves_weights"] * (weights["files"] + 3), rel=1e-12)
    assert month["retained_bytes"] == 10 * full["size_bytes"] + 10 * weights["size_bytes"]


# the rates file ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_a_toml_rates_file_reads_like_its_json_twin(tmp_path):
    as_toml = costs.parse_rates(TOML.format(date=RATES["date"]).encode(), str(tmp_path / "r.toml"))
    as_json = costs.parse_rates(json.dumps(RATES).encode(), str(tmp_path / "r.json"))
    assert as_toml == as_json
    assert [t.name for t in as_toml.tiers] == ["disk", "cold"] and as_toml.tiers[1].per_gb_out == 0


def test_stale_rates_are_flagged_not_refused(tmp_path, capsys):
    run = _run(tmp_path / "run", 2)
    old = dict(RATES, date="2000-01-01")
    rc, r = _cost(capsys, str(run), "--rates", _rates(tmp_path / "old.json", old))
    assert rc == 0 and r["stale"] is True and "2000-01-01" in r["warnings"][0]
    assert _tier(r, "disk")["total"] > 0  # still estimated
    assert main(["cost", str(run), "--rates", str(tmp_path / "old.json")]) == 0
    assert "warning: these prices were read on 2000-01-01" in capsys.readouterr().out
    # negative control and the boundary: 10 days old is stale beyond 9 days, not beyond 10
    recent = dict(RATES, date=(datetime.date.today() - datetime.timedelta(days=10)).isoformat())
    path = _rates(tmp_path / "recent.json", recent)
    assert _cost(capsys, str(run), "--rates", path, "--max-age-days", "9")[1]["stale"] is True
    _, fresh = _cost(capsys, str(run), "--rates", path, "--max-age-days", "10")
    assert fresh["stale"] is False and fresh["warnings"] == []


BAD_RATES = [
    ({"date": "2026-11-01", "tiers": {"disk": {"gb_mnth": 0.1}}}, r"tiers\.disk\.gb_mnth"),
    ({"date": "2026-11-01", "tiers": {"disk": {"gb_month": -0.1}}}, r"tiers\.disk\.gb_month must be zero or more"),
    ({"date": "2026-11-01", "tiers": {"disk": {"gb_month": 0.1, "per_gb_out": "0.09"}}}, r"tiers\.disk\.per_gb_out"),
    ({"date": "2026-11-01", "tiers": {"disk": {"gb_month": True}}}, r"tiers\.disk\.gb_month must be a number"),
    ({"date": "2026-11-01", "tiers": {"disk": {"per_1000_reads": 0.1}}}, r"tiers\.disk\.gb_month is required"),
    ({"date": "2026-11-01", "tiers": {"disk": {"gb_month": 0.1, "read_mb_per_s": 0}}}, r"read_mb_per_s must be positive"),
    ({"date": "2026-11-01", "tiers": {"disk": 0.08}}, r"tiers\.disk must be a table"),
    ({"date": "2026-11-01", "tiers": {}}, r"'tiers' must be a table"),
    ({"tiers": {"disk": {"gb_month": 0.1}}}, r"'date' is required"),
    ({"date": "last week", "tiers": {"disk": {"gb_month": 0.1}}}, r"'date' must be a date"),
    ({"date": "2026-11-01", "price": 1, "tiers": {"disk": {"gb_month": 0.1}}}, r"unknown key 'price'"),
]


@pytest.mark.parametrize("rates,match", BAD_RATES)
def test_invalid_rates_raise_a_typed_error_naming_the_key(tmp_path, rates, match):
    with pytest.raises(InvalidArgument, match=match) as caught:
        costs.parse_rates(json.dumps(rates).encode(), str(tmp_path / "r.json"))
    assert isinstance(caught.value, ValueError) and str(tmp_path / "r.json") in str(caught.value)


def test_invalid_rates_files_by_syntax_and_extension(tmp_path):
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        costs.parse_rates(b'{"date": ', "r.json")
    with pytest.raises(InvalidArgument, match="appears twice"):
        costs.parse_rates(b'{"date": "2026-11-01", "date": "2026-11-02", "tiers": {}}', "r.json")
    with pytest.raises(InvalidArgument, match="NaN is not a price"):
        costs.parse_rates(b'{"date": "2026-11-01", "tiers": {"d": {"gb_month": NaN}}}', "r.json")
    with pytest.raises(InvalidArgument, match=r"\.toml or \.json"):
        costs.parse_rates(b"date: 2026-11-01", "r.yaml")
    if sys.version_info >= (3, 11):
        with pytest.raises(InvalidArgument, match="not valid TOML"):
            costs.parse_rates(b"date = \n", "r.toml")
        with pytest.raises(InvalidArgument, match=r"unknown key tiers\.s3\.gb_mnth"):
            costs.parse_rates(b"date = 2026-11-01\n[tiers.s3]\ngb_mnth = 1\n", "r.toml")
        with pytest.raises(InvalidArgument, match=r"tiers\.s3 must be a table"):
            costs.parse_rates(b"date = 2026-11-01\ntiers.s3 = 0.02\n", "r.toml")


def test_the_cli_reports_a_bad_rates_file_in_one_line(tmp_path, capsys):
    run = _run(tmp_path / "run", 2)
    bad = _rates(tmp_path / "bad.json", {"date": "2026-11-01", "tiers": {"disk": {"gb_mnth": 0.1}}})
    rc, out = _cost(capsys, str(run), "--rates", bad)
    assert rc == 1 and out["type"] == "InvalidArgument" and "tiers.disk.gb_mnth" in out["error"]
    assert main(["cost", str(run), "--rates", bad]) == 1
    err = capsys.readouterr().err
    assert err.startswith("trainstate cost: ") and "gb_mnth" in err and "Traceback" not in err
    assert main(["cost", str(run), "--rates", str(tmp_path / "missing.toml")]) == 1
    assert "missing.toml" in capsys.readouterr().err


# directories that cannot be measured ---------------------------------------------------------------------------


def test_one_generation_asks_for_an_interval(tmp_path, capsys):
    run = _run(tmp_path / "run", 1)
    rates = _rates(tmp_path / "r.json")
    assert main(["cost", str(run), "--rates", rates]) == 1
    err = capsys.readouterr().err
    assert "1 full generation" in err and "--interval-s" in err and err.count("\n") == 1
    rc, r = _cost(capsys, str(run), "--rates", rates, "--interval-s", "1800")
    assert rc == 0 and r["measured"]["full"]["interval_s"] == 1800
    assert r["measured"]["full"]["size_bytes"] == _size(run, "gen-000000000010")


def test_empty_missing_and_generation_directories_are_one_line_errors(tmp_path, capsys):
    rates = _rates(tmp_path / "r.json")
    (tmp_path / "empty").mkdir()
    assert main(["cost", str(tmp_path / "empty"), "--rates", rates]) == 1
    assert "holds no generations" in capsys.readouterr().err
    assert main(["cost", str(tmp_path / "nowhere"), "--rates", rates]) == 1
    assert "is not a directory" in capsys.readouterr().err
    run = _run(tmp_path / "run", 2)
    assert main(["cost", str(run / "gen-000000000010"), "--rates", rates]) == 1
    assert "pass the run directory" in capsys.readouterr().err
    assert main(["cost", str(run), "--rates", rates, "--interval-s", "0"]) == 1
    assert "--interval-s must be positive" in capsys.readouterr().err


# the readable output -------------------------------------------------------------------------------------------


def test_text_output_shows_inputs_table_and_assumptions(tmp_path, capsys):
    run = _run(tmp_path / "run", 3)
    assert main(["cost", str(run), "--rates", _rates(tmp_path / "r.json"), "--interval-s", "3600",
                 "--size-bytes", "2000000000"]) == 0
    out = capsys.readouterr().out
    inputs, _, rest = out.partition("rates: ")
    assert "full generation        2,000,000,000 B  [--size-bytes]" in inputs
    assert "[--interval-s]" in inputs and "keep_last=10" in inputs
    header = next(line for line in rest.splitlines() if line.startswith("tier"))
    for column in ("GB-months", "writes", "reads", "GB in", "GB out", "storage", "requests", "transfer", "restore"):
        assert column in header
    assert any(line.startswith("disk") and line.rstrip().endswith("10 s") for line in rest.splitlines())
    assert "cold: GB-months include" in rest  # early deletion is shown, not hidden in the total
    assert "assumptions:" in rest and "commit record" in rest and "costs in USD" in rest


def test_python_m_trainstate_cost_json_parses(tmp_path):
    run = _run(tmp_path / "run", 2)
    done = subprocess.run([sys.executable, "-m", "trainstate", "cost", str(run), "--rates",
                           _rates(tmp_path / "r.json"), "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert {t["tier"] for t in report["tiers"]} == {"disk", "cold"} and report["stale"] is False
    assert report["assumptions"] == list(costs.ASSUMPTIONS)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_the_docs_rates_example_is_a_valid_rates_file():
    from docsite import runnable

    block = runnable("rates-toml")  # docs/cli.md, `trainstate cost`
    rates = costs.parse_rates(block.encode(), "rates.toml")
    assert rates.date == datetime.date(2026, 11, 1) and rates.tiers[1].min_retention_days == 90
