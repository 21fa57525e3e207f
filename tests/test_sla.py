"""The tiered SLA model (``trainstate cadence --run NODE_DIR``): intervals, lost work, recovery and overhead per
failure class, from a node directory's measured timings and manifests. Figures are worked out by hand here.

The scenario used throughout: a save every 100 updates of 1 s, a blocking save of 10 s (so saves are 110 s
apart), replication 4 s, an upload 20 s every 4th save; restores of 30 s (own disks), 50 s (peers), 300 s
(the object store); MTBFs of 4 h (process), 8 h (one domain), 30 days (every node); a restart of 60 s.
"""

from __future__ import annotations

import datetime
import json
import math
import re

import pytest

from trainstate.cli import main as cli_main
from trainstate.distributed import tiertimes
from trainstate.errors import InvalidArgument, TrainStateError
from trainstate.format.manifest import MANIFEST, FileRecord, Manifest, generation_name
from trainstate.lifecycle import cadence, sla
from trainstate.storage.local import LocalStore

REL = 1e-12
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
MTBF = {"process": 14400.0, "domain": 28800.0, "every_node": 2592000.0}
RATES = sla.Rates(MTBF["process"], MTBF["domain"], MTBF["every_node"], restart_s=60.0)
CADENCE = sla.Cadence(updates_per_save=100, step_s=1.0, mirror_every=4)


def fig(kind: str, seconds: float, n: int = 3, nbytes: int = 1000) -> sla.Figure:
    return sla.Figure(kind, seconds, nbytes, n)


FIGS = {"save_local": fig("save_local", 10), "replicate": fig("replicate", 4), "upload": fig("upload", 20, 2),
        "restore_local": fig("restore_local", 30, 1), "restore_peer": fig("restore_peer", 50, 1),
        "restore_remote": fig("restore_remote", 300, 1)}


# the pure model -----------------------------------------------------------------------------------------
def test_youngs_example_and_dalys_interval_for_the_local_tier():
    local = {i.tier: i for i in sla.intervals(FIGS, RATES, CADENCE)}["local"]
    assert math.isclose(local.young_s, math.sqrt(2 * 10 * 14400), rel_tol=REL) and round(local.young_s, 1) == 536.7
    assert local.daly_s == cadence.daly_interval(10, 14400) and round(local.daly_s, 1) == 530.0
    assert local.daly_every == 530 and local.unit == "updates"  # 530 s of 1 s updates
    assert (local.cost, local.cost_s, local.cost_samples, local.against) == ("save_local", 10, 3, ("process",))


def test_the_save_interval_weighs_the_blocking_save_against_process_and_domain_failures_together():
    by_tier = {i.tier: i for i in sla.intervals(FIGS, RATES, CADENCE)}
    assert by_tier["replicated"].mtbf_s == 28800 and by_tier["replicated"].young_s == math.sqrt(2 * 10 * 28800)
    saves = by_tier["saves"]
    assert saves.mtbf_s == pytest.approx(9600, rel=REL)  # 1 / (1/14400 + 1/28800): the rates add
    assert saves.young_s == pytest.approx(math.sqrt(2 * 10 * 9600), rel=REL)  # 438.2 s
    assert saves.daly_every == round(cadence.daly_interval(10, 9600))


def test_the_remote_interval_is_the_upload_against_every_node_lost_in_whole_saves():
    remote = {i.tier: i for i in sla.intervals(FIGS, RATES, CADENCE)}["remote"]
    assert remote.young_s == pytest.approx(math.sqrt(2 * 20 * 2592000), rel=REL)  # 10182 s
    assert remote.unit == "saves" and remote.daly_every == round(cadence.daly_interval(20, 2592000) / 110)


def test_each_failure_class_loses_half_its_tiers_interval_plus_its_lag():
    table = sla.sla("as run", FIGS, RATES, CADENCE)
    assert table.period_s == 110 and table.save_overhead == 10 / 100
    process, domain, every = table.rows
    # process crash: the local tier, no lag; 110 s between saves, counted in updates of 1 s (an upper bound: the
    # compute to redo is 100 x (50 + 10) / 110 = 54.5 updates on average, 100 at worst)
    assert (process.tier, process.source, process.lag_s) == ("local", "restore_local", 0)
    assert (process.expected_lost_s, process.worst_lost_s) == (55, 110)
    assert (process.expected_lost_updates, process.worst_lost_updates) == (55, 110)
    assert (process.restore_s, process.back_s, process.worst_back_s) == (30, 55 + 30 + 60, 110 + 30 + 60)
    assert process.overhead == pytest.approx(145 / 14400) and process.missing == ()
    # one domain lost: peers serve it, 4 s behind the local commit
    assert (domain.tier, domain.lag_s, domain.expected_lost_s, domain.worst_lost_s) == ("replicated", 4, 59, 114)
    assert (domain.expected_lost_updates, domain.worst_lost_updates) == (59, 114)
    assert (domain.back_s, domain.overhead) == (59 + 50 + 60, pytest.approx(169 / 28800))
    # every node lost: the remote, every 4th save, replication + upload behind
    assert (every.period_s, every.lag_s, every.lag_samples) == (440, 24, 2)
    assert (every.expected_lost_s, every.worst_lost_s, every.back_s) == (244, 464, 244 + 300 + 60)
    assert table.overhead == pytest.approx(0.1 + 145 / 14400 + 169 / 28800 + 604 / 2592000, rel=REL)
    assert table.overhead_covers == ("process", "domain", "every_node") and table.overhead_leaves_out == ()


def test_the_recommended_cadence_saves_at_the_daly_interval_and_uploads_at_the_remotes():
    report = sla.report(FIGS, RATES, CADENCE)
    every = round(cadence.daly_interval(10, 9600))
    assert report.recommended.updates_per_save == every
    assert report.recommended.mirror_every == round(cadence.daly_interval(20, 2592000) / (every + 10))
    assert report.recommended.rows[0].expected_lost_s == pytest.approx((every + 10) / 2)
    assert report.as_run.updates_per_save == 100 and report.notes == ()


def test_a_missing_restore_is_said_in_its_row_and_left_out_of_the_total():
    figs = {**FIGS, "restore_peer": None}
    table = sla.sla("as run", figs, RATES, CADENCE)
    domain = table.rows[1]
    assert domain.expected_lost_s == 59  # the lag is measured: lost work still follows
    assert domain.restore_s is None and domain.back_s is None and domain.overhead is None
    assert domain.missing == ("restore_peer not measured: " + sla.HOW["restore_peer"],)
    assert table.overhead_covers == ("process", "every_node") and table.overhead_leaves_out == ("domain",)
    assert table.overhead == pytest.approx(0.1 + 145 / 14400 + 604 / 2592000, rel=REL)


def test_without_replication_or_upload_measured_no_lost_work_is_promised_for_those_classes():
    table = sla.sla("as run", {**FIGS, "replicate": None}, RATES, CADENCE)
    for row in table.rows[1:]:  # the remote's lag includes replication too
        assert row.lag_s is None and row.expected_lost_s is None and row.back_s is None
        assert any(m.startswith("replicate not measured") for m in row.missing)
    unknown = sla.sla("as run", FIGS, RATES, sla.Cadence(100, 1.0, None)).rows[2]
    assert unknown.expected_lost_s is None and "mirror_every not known" in unknown.missing[0]
    no_upload = {i.tier: i for i in sla.intervals({**FIGS, "upload": None}, RATES, CADENCE)}["remote"]
    assert no_upload.young_s is None and no_upload.missing.startswith("upload not measured")


def test_a_class_without_an_mtbf_has_lost_work_and_recovery_but_no_interval_or_overhead():
    rates = sla.Rates(process_mtbf_s=14400.0)
    report = sla.report(FIGS, rates, CADENCE)
    by_tier = {i.tier: i for i in report.intervals}
    assert by_tier["replicated"].daly_s is None and "--node-mtbf" in by_tier["replicated"].missing
    assert by_tier["saves"].mtbf_s == 14400 and by_tier["saves"].against == ("process",)
    domain = report.as_run.rows[1]
    assert domain.back_s == 59 + 50 and domain.overhead is None  # restart 0: not given
    assert report.as_run.overhead_covers == ("process",) and report.as_run.overhead_leaves_out == ()


def test_the_pure_model_refuses_what_it_cannot_compute():
    with pytest.raises(InvalidArgument, match="save_local.*replicas=2"):
        sla.sla("as run", {**FIGS, "save_local": None}, RATES, CADENCE)
    with pytest.raises(InvalidArgument, match="--process-mtbf, --node-mtbf, --all-mtbf"):
        sla.report(FIGS, sla.Rates(), CADENCE)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(InvalidArgument, match="--node-mtbf"):
            sla.Rates(domain_mtbf_s=bad)
    with pytest.raises(InvalidArgument, match="--restart"):
        sla.Rates(process_mtbf_s=1.0, restart_s=-1.0)
    for kwargs in ({"updates_per_save": 0}, {"step_s": 0.0}, {"mirror_every": 0}, {"updates_per_save": 1.5}):
        with pytest.raises(InvalidArgument):
            sla.Cadence(**{"updates_per_save": 1, "step_s": 1.0, "mirror_every": None, **kwargs})


def test_medians_and_counts_of_the_samples():
    figs = sla.figures({"save_local": [[4.0, 10, 0], [1.0, 30, 1], [2.0, 20, 2], [3.0, 40, 3]], "upload": []})
    assert figs["save_local"] == sla.Figure("save_local", 2.5, 25, 4)
    assert figs["upload"] is None and figs["restore_remote"] is None


def test_mirror_every_is_the_most_common_count_of_saves_between_uploads():
    saves = list(range(1, 13))
    # uploads after saves 1, 5, 9 (every 4th), then a restart uploads its first save (10): gaps 4, 4, 1
    assert sla.mirror_every(saves, [1.5, 5.5, 9.5, 10.5]) == (4, 3)
    assert sla.mirror_every(saves, [0.5, 1.5, 3.5]) == (2, 1)  # the upload before the first save sample: no gap
    assert sla.mirror_every(saves, [1.5]) is None and sla.mirror_every([], [1.0, 2.0]) is None
    assert sla.mirror_every(saves, [1.5, 2.5, 4.5]) == (2, 2)  # a tie between 1 and 2: the larger


def test_seconds_per_update_leave_the_blocking_save_out():
    assert sla.step_time(110, 100, 10) == 1.0
    assert sla.step_time(5, 10, 8) == 0.5  # a save longer than the measured gap: the gap alone


# the command on a synthetic node directory --------------------------------------------------------------
def write_manifests(node, updates_and_offsets):
    """Full generations through the library's Manifest (each holding only its manifest, like a node's
    holding's manifest without its files: the cadence is read from the manifest alone)."""
    for update, offset in updates_and_offsets:
        name = generation_name(update)
        manifest = Manifest(name, "full", update, "sha256", (FileRecord("state.json", 1, "ab" * 32),),
                            (T0 + datetime.timedelta(seconds=offset)).isoformat(), "cd" * 32)
        (node / name).mkdir(parents=True)
        (node / name / MANIFEST).write_bytes(manifest.to_bytes())


def write_timings(node, samples):
    LocalStore(node).write_pointer(tiertimes.TIMINGS, json.dumps({"format": "trainstate-tier-timings",
                                                                  **samples}).encode())


SAMPLES = {  # [seconds, bytes, unix time]: saves at t = 1..8, uploads after saves 1 and 5
    "save_local": [[10.0, 1000, t] for t in range(1, 9)], "replicate": [[4.0, 1000, t + 0.2] for t in range(1, 9)],
    "upload": [[20.0, 1000, 1.5], [20.0, 1000, 5.5]], "restore_local": [[30.0, 1500, 20]],
    "restore_peer": [[50.0, 1500, 30]], "restore_remote": [[300.0, 1500, 40]]}
FLAGS = ["--process-mtbf", "14400", "--node-mtbf", "28800", "--all-mtbf", "2592000", "--restart", "60"]


@pytest.fixture
def node(tmp_path):
    node = tmp_path / "node0"
    write_manifests(node, [(100, 0), (200, 110), (300, 220), (400, 330)])
    write_timings(node, SAMPLES)
    return node


def run_json(capsys, argv):
    code = cli_main(["cadence", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_cli_measures_the_node_directory_and_computes_the_hand_worked_figures(node, capsys):
    code, out = run_json(capsys, ["--run", str(node), *FLAGS])
    assert code == 0, out
    assert out["model"].startswith("a model computed from the measurements") and out["directory"] == str(node)
    assert out["figures"]["save_local"] == {"kind": "save_local", "seconds": 10.0, "bytes": 1000, "samples": 8}
    assert out["cadence"]["updates_per_save"] == 100 and out["cadence"]["step_s"] == 1.0  # (110 - 10) / 100
    assert out["cadence"]["mirror_every"] == 4  # saves 2..5 between the uploads at 1.5 and 5.5
    assert "median of 3 gap(s)" in " ".join(out["cadence"]["sources"])
    local = next(i for i in out["intervals"] if i["tier"] == "local")
    assert round(local["young_s"], 1) == 536.7 and round(local["daly_s"], 1) == 530.0
    rows = {r["failure"]: r for r in out["as_run"]["rows"]}
    assert rows["process"]["back_s"] == 145 and rows["domain"]["back_s"] == 169 and rows["every_node"]["back_s"] == 604
    assert rows["every_node"]["worst_lost_s"] == 464 and rows["every_node"]["restore_samples"] == 1
    assert out["as_run"]["overhead"] == pytest.approx(0.1 + 145 / 14400 + 169 / 28800 + 604 / 2592000)
    assert out["recommended"]["updates_per_save"] == round(cadence.daly_interval(10, 9600))


def test_cli_text_labels_the_model_the_samples_and_what_is_not_measured(node, capsys):
    samples = {**SAMPLES, "restore_remote": []}
    write_timings(node, samples)
    assert cli_main(["cadence", "--run", str(node), *FLAGS]) == 0
    out = capsys.readouterr().out
    assert "a model computed from the measurements" in out and "not a guarantee" in out
    assert re.search(r"save_local +10 s +1,000 B +n=8 +blocking save", out)
    assert "restore_remote not measured: " + sla.HOW["restore_remote"] in out
    assert "Young 8.94 min, Daly 8.83 min = every 530 updates" in out  # 536.7 s and 530.0 s
    assert "process crash    local      55 s = 55 upd          110 s = 110 upd" in out
    assert "given, not measured: --process-mtbf 4 h, --node-mtbf 8 h, --all-mtbf 30 d; restart 60 s" in out
    assert "leaves out every node lost (not measured)" in out
    # the negative control: with the sample back, the row is computed and the total covers it
    write_timings(node, SAMPLES)
    assert cli_main(["cadence", "--run", str(node), *FLAGS]) == 0
    again = capsys.readouterr().out
    assert "restore_remote not measured" not in again and "leaves out" not in again


def test_cli_flags_override_the_measured_cadence(node, capsys):
    code, out = run_json(capsys, ["--run", str(node), *FLAGS, "--every", "50", "--step-time", "2",
                                  "--mirror-every", "1"])
    assert code == 0
    assert (out["cadence"]["updates_per_save"], out["cadence"]["step_s"], out["cadence"]["mirror_every"]) == (50, 2, 1)
    assert out["as_run"]["period_s"] == 110 and out["as_run"]["rows"][2]["period_s"] == 110  # 50 x 2 s + 10 s
    assert "--every]" in " ".join(out["cadence"]["sources"]) and "--step-time" in " ".join(out["cadence"]["sources"])


def test_cli_a_damaged_manifest_does_not_count_and_one_manifest_needs_the_flags(node, capsys):
    (node / generation_name(200) / MANIFEST).write_bytes(b"{}")
    code, out = run_json(capsys, ["--run", str(node), *FLAGS])
    assert code == 0 and "median of 1 gap(s)" in " ".join(out["cadence"]["sources"])  # 300 -> 400: 100 updates, 110 s
    for n in (100, 300):
        (node / generation_name(n) / MANIFEST).unlink()
    code, out = run_json(capsys, ["--run", str(node), *FLAGS])
    assert code == 1 and out["type"] == "InvalidArgument" and "--every UPDATES and --step-time" in out["error"]
    code, out = run_json(capsys, ["--run", str(node), *FLAGS, "--every", "100", "--step-time", "1"])
    assert code == 0 and out["as_run"]["rows"][0]["back_s"] == 145


@pytest.mark.parametrize("damage", [b"", b"not json", b'{"format": "other", "save_local": [[1, 2, 3]]}',
                                    b'{"format": "trainstate-tier-timings", "save_local": [[-1, 2, 3], [1, 2]]}',
                                    b"[1, 2, 3]"])
def test_cli_a_damaged_timings_file_is_no_measurement(node, capsys, damage):
    LocalStore(node).write_pointer(tiertimes.TIMINGS, damage)
    code, out = run_json(capsys, ["--run", str(node), *FLAGS])
    assert code == 1 and out["type"] == "InvalidArgument"
    assert "holds no save_local sample" in out["error"] and "replicas=2" in out["error"]


def test_cli_without_a_timings_file_says_what_writes_it(tmp_path, capsys):
    write_manifests(tmp_path / "run", [(1, 0), (2, 1)])
    assert cli_main(["cadence", "--run", str(tmp_path / "run"), *FLAGS]) == 1
    err = capsys.readouterr().err
    assert "tier-timings.json is missing" in err and "node-local tiers" in err and "--save-cost" in err


def test_cli_a_bad_sample_is_dropped_and_the_count_says_so(node, capsys):
    write_timings(node, {**SAMPLES, "save_local": SAMPLES["save_local"] + [[-5.0, 1000, 9], ["x", 1, 2]]})
    code, out = run_json(capsys, ["--run", str(node), *FLAGS])
    assert code == 0 and out["figures"]["save_local"]["samples"] == 8


@pytest.mark.parametrize("argv, message", [
    (["--every", "0"], "--every must be a positive"),
    (["--mirror-every", "0"], "--mirror-every must be a positive"),
    (["--step-time", "-1"], "--step-time must be a positive"),
    (["--step-time", "nan"], "--step-time must be a positive"),
    (["--save-cost", "10"], "--save-cost and --mtbf are the explicit mode's"),
    (["--restart", "-1"], "--restart must be zero or more"),
])
def test_cli_bad_flags_in_the_measured_mode(node, capsys, argv, message):
    code, out = run_json(capsys, ["--run", str(node), *FLAGS, *argv])
    assert code == 1 and message in out["error"] and out["type"] == "InvalidArgument"


def test_cli_bad_flags_and_places(node, capsys):
    code, out = run_json(capsys, ["--run", str(node)])
    assert code == 1 and "no failure rate given" in out["error"]
    code, out = run_json(capsys, ["--run", str(node), "--process-mtbf", "0"])
    assert code == 1 and "--process-mtbf must be a positive number" in out["error"]
    code, out = run_json(capsys, ["--process-mtbf", "100"])
    assert code == 1 and "--process-mtbf needs --run NODE_DIR" in out["error"]
    code, out = run_json(capsys, ["--save-cost", "10", "--step-time", "1"])
    assert code == 1 and "--mtbf required" in out["error"]
    code, out = run_json(capsys, ["--run", str(node / "missing"), *FLAGS])
    assert code == 1 and "is not a directory" in out["error"]
    code, out = run_json(capsys, ["--run", str(node / generation_name(100)), *FLAGS])
    assert code == 1 and "is one generation" in out["error"]


def test_cli_explicit_mode_is_unchanged(capsys):
    assert cli_main(["cadence", "--save-cost", "10", "--mtbf", "14400", "--step-time", "0.5"]) == 0
    assert "Young: every 536.7 s = 1073 updates" in capsys.readouterr().out


def test_errors_are_typed():
    assert issubclass(InvalidArgument, TrainStateError) and issubclass(InvalidArgument, ValueError)


def test_a_gap_between_saves_longer_than_compute_and_save_local_is_noted():
    def notes(step_s):
        return sla.report(FIGS, RATES, sla.Cadence(100, step_s, 4, gap_s=110.0, gap_updates=100)).notes

    assert notes(1.0) == ()  # 110 s = 100 x 1 s + save_local's 10 s: nothing unaccounted
    assert "each save blocked about 30 s, more than save_local's 10 s" in notes(0.8)[0]
    assert "is the seconds per update right?" in notes(1.2)[0]


def test_background_work_longer_than_the_compute_between_saves_is_noted():
    def notes(replicate, upload):
        figs = {**FIGS, "replicate": fig("replicate", replicate), "upload": fig("upload", upload)}
        return sla.report(figs, RATES, CADENCE).notes  # 100 s of compute between saves

    assert notes(4, 20) == ()
    assert "after each save that uploads (replicate + upload, 110 s)" in notes(10, 100)[0]
    assert "after every save (replicate, 101 s)" in notes(101, 1)[0]
