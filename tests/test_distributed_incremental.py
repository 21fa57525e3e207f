"""Multi-rank incremental generations (issue 32): each rank's shard is incremental against its own previous shard.

Real ``torchrun`` launches with 2 gloo ranks on CPU (scenarios in ``tests/dist_increments_worker.py``): a
LoRA-shaped FSDP2 model whose frozen base is linked from save to save, every third generation self-contained;
a write through ``.data`` to one rank's frozen shard is saved; a control detector that misses it loses it; a
damaged shared part is fallen back past; a resharding restore at world size 1 continues incrementally.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from distlaunch import launch
from multinode import launch_nodes
from objectservers import moto_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow
WORKER = Path(__file__).resolve().parent / "dist_increments_worker.py"
GENS = [f"gen-{u:012d}" for u in range(1, 8)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("incremental")
    two = launch(root / "two", ["incremental", "incremental_damaged", "incremental_missed"], worker=WORKER)
    one = launch(root / "one", ["incremental_reshard"], ranks=1, worker=WORKER,
                 env={"TRAINSTATE_TEST_SOURCE": str(root / "two")})
    return {"two": two, "one": one}


def test_each_rank_links_its_unchanged_part_and_every_third_generation_is_whole(runs):
    for rank, result in enumerate(runs["two"].ok("incremental")):
        assert result["names"] == GENS and result["format"] == 4, result
        parts = [list(p.items()) for p in result["parts"]]
        assert parts[0] == [] and len(parts[1]) == 1, parts  # the first save knows no parent; the second splits
        # gens 3 and 4 link gen 2's part (one inode); gen 5 writes a fresh copy (full_every=3); gen 6 links it
        assert parts[1] == parts[2] == parts[3] and parts[4] == parts[5] and parts[4][0][1] != parts[1][0][1], parts
        owned, total = zip(*result["sizes"])
        assert owned[0] == total[0] and owned[1] == total[1] and owned[4] == total[4], result["sizes"]
        for linked in (2, 3, 5):  # a steady save owns the adapter, its moments and the small files: ~6% here
            assert owned[linked] < 0.08 * total[linked], result["sizes"]
        if rank == 0:  # gen 7: rank 0's base unchanged, linked; rank 1's changed through .data, written
            assert parts[6] == parts[5], parts
        else:
            assert parts[6] == [], parts  # the changed weight went to the shard of what changed
        assert list(result["shares"]) == [next(iter(runs["two"].ok("incremental")[0]["parts"][6]))], result
        assert result["restored"] == GENS[-1] and result["differs"] == [], result  # bitwise, model and optimizer


def test_a_detector_that_misses_a_data_write_loses_it(runs):
    """The control: stale fingerprints (what a version counter or a requires_grad flag would say) link rank 1's
    changed part, and the restored base differs from the live one: the real detector's test above can fail."""
    for result in runs["two"].ok("incremental_missed"):
        assert len(result["shares"]) == 2, result  # both ranks' parts linked in gen 7
        assert result["differs"] == ["model.base.weight"], result


def test_a_damaged_shared_part_fails_every_generation_naming_it(runs):
    for result in runs["two"].ok("incremental_damaged"):
        assert result["rejected"] == [GENS[6], GENS[5], GENS[4]], result
        assert result["restored"] == GENS[3] and result["differs"] == [], result  # gen 4: gen 2's own copy
    report = json.loads(runs["two"].ok("incremental_damaged")[0]["verify"])
    assert sorted(f["generation"] for f in report["failures"] if f["generation"] != "latest") == GENS[4:], report
    assert report["verified"] == GENS[3::-1], report


def test_a_resharding_restore_continues_incrementally_at_another_world_size(runs):
    (result,) = runs["one"].ok("incremental_reshard", 1)
    assert result["restored"] == GENS[-1] and result["differs"] == [], result  # bitwise after resharding 2 -> 1
    first, second, third = (list(p.items()) for p in result["parts"])
    assert first == [] and second and third == second and result["shares"], result  # split at world size 1, linked


def test_node_local_tiers_link_within_each_node_and_a_lost_node_is_refilled_from_its_peer(tmp_path):
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    out = tmp_path / "out"
    for rank, result in enumerate(launch_nodes(out, dirs, ["tier_incremental"], worker=WORKER, nproc=1).ok(
            "tier_incremental", 2)):
        own = f"{dirs[rank].name}/shard-{rank:05d}-part-"
        inodes = [{f: i for f, i in p.items() if f.startswith(own)} for p in result["parts"]]
        assert inodes[0] == {} and len(inodes[1]) == 1 and inodes[1] == inodes[2] == inodes[3], result
        assert inodes[4] != inodes[3], result  # the third generation after a whole one is whole again
        peer = [{f: i for f, i in p.items() if not f.startswith(own)} for p in result["parts"]]
        assert [len(p) for p in peer] == [0, 1, 1, 1, 1] and peer[2] != peer[1], result  # a replica: its own bytes
        assert result["restored"] == GENS[4] and result["sources"]["remote"] == 0, result
        assert result["differs"] == [], result
    shutil.rmtree(dirs[1])
    refilled = launch_nodes(out, dirs, ["tier_incremental_refilled"], worker=WORKER, nproc=1).ok(
        "tier_incremental_refilled", 2)
    for rank, result in enumerate(refilled):
        assert result["restored"] == GENS[4] and result["differs"] == [], result
        own = f"{dirs[rank].name}/shard-{rank:05d}-part-"
        first, second = ({f: i for f, i in p.items() if f.startswith(own)} for p in result["parts"])
        assert first and first == second, result  # gen 6 and gen 7 link the same own part on each node
    assert refilled[1]["sources"]["peer"] > 0 and refilled[1]["sources"]["remote"] == 0, refilled[1]


def test_on_an_object_store_a_steady_save_uploads_only_what_changed(moto_server, tmp_path):
    pytest.importorskip("obstore")
    url = moto_server.url(moto_server.make_bucket(), "run")
    remote = {"url": url, "storage_options": moto_server.storage_options()}
    for result in launch(tmp_path / "objects", ["incremental_objects"], worker=WORKER,
                         env={"TRAINSTATE_TEST_S3": json.dumps(remote)}).ok("incremental_objects"):
        uploaded = result["uploaded"]  # this rank's bytes put, per save
        base = 2 << 20  # this rank's half of the frozen 1024x1024 fp32 weight
        assert uploaded[1] > base > 10 * uploaded[2] and uploaded[3] < base / 10, uploaded  # gens 3, 4: copied
        assert result["restored"] == GENS[3] and result["differs"] == [], result


def test_with_tiers_the_upload_to_the_remote_copies_unchanged_parts_on_the_server(moto_server, tmp_path):
    pytest.importorskip("obstore")
    url = moto_server.url(moto_server.make_bucket(), "run")
    remote = {"url": url, "storage_options": moto_server.storage_options()}
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for result in launch_nodes(tmp_path / "out", dirs, ["tier_incremental_remote"], worker=WORKER, nproc=1,
                               env={"TRAINSTATE_TEST_S3": json.dumps(remote)}).ok("tier_incremental_remote", 2):
        uploaded = result["uploaded"]  # this rank's bytes sent to the remote, per save
        base = 2 << 20  # this rank's half of the frozen weight
        assert uploaded[1] > base > 10 * uploaded[2] and uploaded[3] < base / 10, uploaded  # gens 3, 4: copied
        assert result["restored"] == GENS[3] and result["sources"]["remote"] > 0, result
        assert result["differs"] == [], result  # bitwise from the remote alone
