"""The remote tier behind node-local tiers: every ``mirror_every``-th generation on an object store (moto on
loopback, counted by a proxy), written from the nodes' disks; a restore reads it only when the nodes cannot serve.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

from multinode import launch_nodes
from objectservers import FaultProxy, moto_server  # noqa: F401  (fixture)
from test_tiers import GEN, _flip, _resumed
from trainstate.storage.locate import open_store
from trainstate.storage.verify import verify_generation

pytestmark = pytest.mark.slow
pytest.importorskip("obstore")
WORKER = Path(__file__).resolve().parent / "tier_worker.py"


def _lose(directory: Path) -> None:
    shutil.rmtree(directory)
    directory.mkdir()


def test_remote_tier_uploads_every_second_generation_and_serves_only_what_the_nodes_lost(moto_server, tmp_path,
                                                                                         capsys):
    bucket = moto_server.make_bucket()
    url = moto_server.url(bucket, f"run-{uuid.uuid4().hex[:8]}")
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    out = tmp_path / "out"
    with FaultProxy(moto_server.endpoint) as proxy:
        options = moto_server.storage_options(endpoint=proxy.endpoint)
        env = {"TRAINSTATE_TEST_S3": json.dumps({"url": url, "storage_options": options}), "TS_MIRROR_EVERY": "2"}
        trained = launch_nodes(out, dirs, ["tier_train"], worker=WORKER, nproc=2, env=env)
        status = trained.ok("tier_train", 4)[0]["tiers"]  # after wait(): every tier names the newest
        assert status["remote"]["generation"] == GEN and status["remote"]["lag_updates"] == 0, status
        timings = {}
        for directory in dirs:
            record = directory / "tier-timings.json"
            timings.update({k: v for k, v in json.loads(record.read_text()).items() if v} if record.exists() else {})
        assert {"save_local", "replicate", "upload"} <= set(timings), timings  # measured, for `cadence --run`
        _check_cost(dirs[0], tmp_path, capsys)
        remote = open_store(url, storage_options=options)
        assert remote.generations() == [GEN, "gen-000000000002"]  # the first save, then every second one
        verify_generation(remote, GEN, content=True)  # an ordinary multi-rank generation: every byte verifies

        # every process killed, nothing lost: the nodes serve it, not one request reaches the object store
        proxy.clear()
        first = _resumed(launch_nodes(out, dirs, ["tier_resume"], worker=WORKER, nproc=2, env=env), "tier_resume", 4)
        assert first[0]["sources"]["remote"] == 0 and proxy.count() == 0, [t.path for t in proxy.traffic][:5]

        # one node lost: its shards come from the replicas on the other node, still not one request remotely
        _lose(dirs[1])
        proxy.clear()
        one = _resumed(launch_nodes(out, dirs, ["tier_resume"], worker=WORKER, nproc=2, env=env), "tier_resume", 4)
        assert one[0]["sources"]["peer"] > 0 and one[0]["sources"]["remote"] == 0 and proxy.count() == 0

        # one node lost and one bit flipped in the other node's replica of its shard: the surviving node hands the
        # replica over unchecked, the receiver's check rejects it, and that file comes from the remote, bitwise
        _lose(dirs[1])
        replica = sorted(p for p in (dirs[0] / "replicas" / GEN).glob("shard-*.safetensors") if "small" not in p.name)
        _flip(replica[0])
        proxy.clear()
        launched = launch_nodes(out, dirs, ["tier_resume_unverified"], worker=WORKER, nproc=2, env=env)
        control = launched.ok("tier_resume_unverified", 4)
        assert any(r["full_differs"] for r in control), "the control (chunks unchecked) should load the flipped bit"
        _lose(dirs[1])  # what the control's refill wrote is not evidence here
        healed = _resumed(launch_nodes(out, dirs, ["tier_resume"], worker=WORKER, nproc=2, env=env), "tier_resume", 4)
        assert healed[0]["generation"] == GEN and healed[0]["rejected"] == []
        assert healed[0]["sources"]["remote"] > 0 and proxy.count("GET") > 0, healed[0]["sources"]
        assert any(p.name.startswith(f"{GEN}.rejected") for p in (dirs[0] / "replicas").iterdir()), \
            "the damaged replica is kept aside"

        # every node's directory lost: from the remote alone, then every node refilled
        for directory in dirs:
            _lose(directory)
        proxy.clear()
        launched = launch_nodes(out, dirs, ["tier_resume", "tier_resume_again"], worker=WORKER, nproc=2, env=env)
        alone = _resumed(launched, "tier_resume", 4)
        assert alone[0]["generation"] == GEN and alone[0]["sources"]["local"] == 0  # no disk held any of it
        assert alone[0]["sources"]["remote"] > 0 and proxy.count("GET") > 0
        again = _resumed(launched, "tier_resume_again", 4)
        assert again[0]["sources"]["remote"] == 0 and again[0]["sources"]["local"] > 0, "the nodes were refilled"


def test_a_lost_node_without_replicas_takes_only_its_own_shards_from_the_remote(moto_server, tmp_path):
    """One replica each: the node that lost its disk reads its own shards from the remote, the other its own disk.
    While the remote does not answer those reads, the restore raises StorageUnavailable on every rank (the
    control, which counts the unanswered reads as damage, finds no generation: NoValidGeneration, permanent)."""
    bucket = moto_server.make_bucket()
    url = moto_server.url(bucket, f"run-{uuid.uuid4().hex[:8]}")
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    out = tmp_path / "out"
    env = {"TRAINSTATE_TEST_S3": json.dumps({"url": url, "storage_options": moto_server.storage_options()}),
           "TS_MIRROR_EVERY": "1", "TS_REPLICAS": "1"}
    launch_nodes(out, dirs, ["tier_train"], worker=WORKER, nproc=1, env=env).ok("tier_train", 2)
    lost = next(i for i, d in enumerate(dirs) if (d / GEN / "rank-00001.json").exists())
    _lose(dirs[lost])
    with FaultProxy(moto_server.endpoint) as proxy:  # the remote stops answering the lost rank's shard reads
        options = moto_server.storage_options(endpoint=proxy.endpoint, retry_config={"max_retries": 1})
        down = {**env, "TRAINSTATE_TEST_S3": json.dumps({"url": url, "storage_options": options})}
        proxy.fail(1, "503", method="GET", path_contains="shard-00001", times=100_000)
        launched = launch_nodes(out, dirs, ["tier_resume", "tier_resume_unavailable_as_damage"], worker=WORKER,
                                nproc=1, env=down)
    for r in launched.ok("tier_resume", 2):  # not damage: the restore stops, for a restart, passing over nothing
        assert r.get("raised") == "StorageUnavailable" and "loaded nothing" in r["message"], r
    for r in launched.ok("tier_resume_unavailable_as_damage", 2):  # the control: no generation left, for good
        assert r.get("raised") == "NoValidGeneration", r
    mixed = _resumed(launch_nodes(out, dirs, ["tier_resume"], worker=WORKER, nproc=1, env=env), "tier_resume", 2)
    sources = mixed[0]["sources"]  # the surviving node reads its own disk; the replacement its shards remotely
    assert sources["local"] > 0 and sources["remote"] > 0, sources
    remote_files = open_store(url, storage_options=moto_server.storage_options()).files(GEN)
    lost_rank = sum(size for name, size in remote_files.items() if name.startswith(("rank-00001", "shard-00001")))
    assert sources["remote"] <= lost_rank, (sources, lost_rank)  # the global files came from the surviving node


def _check_cost(node: Path, tmp_path: Path, capsys) -> None:
    """``trainstate cost NODE_DIR``: the node's capacity, the replicas' traffic priced on the replication tier, and
    the object store priced at one upload every mirror_every saves (2 here), from what the run recorded."""
    from trainstate.cli.main import main

    rates = tmp_path / "rates.toml"
    rates.write_text('date = 2026-12-01\n[tiers.zone]\ngb_month = 0\nper_gb_in = 0.01\nper_gb_out = 0.01\n'
                     '[tiers.s3]\ngb_month = 0.023\nper_1000_writes = 0.005\n')
    capsys.readouterr()
    assert main(["cost", str(node), "--rates", str(rates), "--replication-tier", "zone", "--json",
                 "--interval-s", "60"]) == 0
    report = json.loads(capsys.readouterr().out)
    local = report["node_tiers"]
    assert local["tiering"] == {"nodes": 2, "ranks": 4, "domains": 2, "replicas": 2, "keep_last": 2,
                                "mirror_every": 2, "remote_keep": 2}, local
    held = local["per_month"]
    assert held["own_bytes"] > 0 and held["replica_bytes"] > 0, held
    assert held["node_capacity_bytes"] == 3 * (held["own_bytes"] + held["replica_bytes"])
    size = report["measured"]["full"]["size_bytes"]
    assert held["replicated_gb"] == pytest.approx(30 * 24 * 60 * size / 1e9)  # a save a minute, one more copy
    assert held["cross_domain_gb"] == held["replicated_gb"]  # two domains: the copy crosses
    assert local["replication"]["transfer"] == pytest.approx(held["cross_domain_gb"] * 0.02)
    assert [t["tier"] for t in report["tiers"]] == ["s3"]  # the replication tier prices the replicas only
    assert report["measured"]["full"]["interval_s"] == 120 and report["measured"]["full"]["keep"] == 2
    assert report["per_month"]["saves_full"] == pytest.approx(30 * 24 * 30)  # every second save uploaded
    assert main(["cost", str(node), "--rates", str(rates), "--interval-s", "60"]) == 0
    text = capsys.readouterr().out
    assert "node-local tiers: 2 nodes in 2 failure domain(s), 4 ranks, replicas=2" in text, text
    assert "between failure domains" in text and "not priced" in text, text
