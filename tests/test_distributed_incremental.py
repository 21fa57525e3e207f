"""Multi-rank incremental generations (issues 32, 51): each rank's shard is incremental against its own previous shard.

Real ``torchrun`` launches with 2 gloo ranks on CPU (scenarios in ``tests/dist_increments_worker.py``): a
LoRA-shaped FSDP2 model whose frozen base is laid out in a part and its spare at the first save (its parameters
do not require gradients) and linked crosswise from save to save, no generation written whole again; a write
through ``.data`` to one rank's frozen shard is saved; a control detector that misses it loses it; a damaged copy
costs one generation; a multi-rank incremental run written before spares (a golden fixture) continues bitwise; a
resharding restore at world size 1 continues incrementally; node-local tiers link within each node, and a replica
carries only what its holder lacks.
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
    two = launch(root / "two", ["incremental", "incremental_damaged", "incremental_missed", "golden_incremental_read"],
                 worker=WORKER)
    one = launch(root / "one", ["incremental_reshard"], ranks=1, worker=WORKER,
                 env={"TRAINSTATE_TEST_SOURCE": str(root / "two")})
    return {"two": two, "one": one}


def crosswise(before: dict[str, int], after: dict[str, int]) -> bool:
    """Whether ``after`` (part and spare files by inode) links ``before``'s crosswise: each part is the spare before
    it, each spare the part before it (the same names, no copy read by both generations)."""
    def twin(name: str) -> str:
        return (name.removesuffix(".spare") + ".safetensors" if name.endswith(".spare")
                else name.removesuffix(".safetensors") + ".spare")

    return bool(after) and set(after) == set(before) and all(after[f] == before[twin(f)] for f in after)


def test_each_rank_keeps_its_base_in_two_copies_linked_crosswise_and_nothing_is_written_whole_again(runs):
    for rank, result in enumerate(runs["two"].ok("incremental")):
        assert result["names"] == GENS and result["format"] == 5, result
        parts = result["parts"]
        # save 1 lays the frozen base out in a part and its spare (two inodes); every later save links them crosswise
        assert len(parts[0]) == 2 and len(set(parts[0].values())) == 2, parts
        assert all(crosswise(parts[k - 1], parts[k]) for k in range(1, 6)), parts
        owned, total = zip(*result["sizes"])
        assert owned[0] == total[0], result["sizes"]
        for linked in range(1, 6):  # a steady save owns the adapter, its moments and the small files: ~3% here
            assert owned[linked] < 0.04 * total[linked], result["sizes"]
        if rank == 0:  # gen 7: rank 0's base unchanged, linked; rank 1's changed through .data, written
            assert crosswise(parts[5], parts[6]), parts
        else:
            assert parts[6] == {}, parts  # the changed weight went to the shard of what changed
        assert sorted(result["shares"]) == sorted(runs["two"].ok("incremental")[0]["parts"][6]), result
        assert result["restored"] == GENS[-1] and result["differs"] == [], result  # bitwise, model and optimizer


def test_a_detector_that_misses_a_data_write_loses_it(runs):
    """The control: stale fingerprints (what a version counter or a requires_grad flag would say) link rank 1's
    changed part, and the restored base differs from the live one: the real detector's test above can fail."""
    for result in runs["two"].ok("incremental_missed"):
        assert len(result["shares"]) == 4, result  # both ranks' parts and spares linked in gen 7
        assert result["differs"] == ["model.base.weight"], result


def test_a_damaged_copy_costs_one_generation(runs):
    for result in runs["two"].ok("incremental_damaged"):
        assert result["rejected"] == [GENS[6]], result
        assert result["restored"] == GENS[5] and result["differs"] == [], result  # gen 6 reads the other copy
    report = json.loads(runs["two"].ok("incremental_damaged")[0]["verify"])
    assert sorted(f["generation"] for f in report["failures"] if f["generation"] != "latest") == GENS, report
    assert report["verified"] == [], report  # every generation lists the damaged inode, as its part or its spare


def test_a_multi_rank_incremental_run_written_before_spares_continues_bitwise(runs):
    """``tests/golden/multirank-incremental-v4-82a1efe`` was written by the code at 82a1efe (2 gloo ranks, the
    LoRA-shaped FSDP2 model of ``tests/dist_increments_worker.py`` at width 768, the defaults of then: gen 2 laid
    each rank's base out in one part, gen 3 linked it, format 4 with no spares; gen 3 kept). Today's code restores
    it bitwise, continues (compared with the same run recomputed uninterrupted), and saves three times: the first
    writes each part afresh and keeps the old one (the same inode) as its spare, the next two link them crosswise.
    (Its scenario rides this file's first launch.)"""
    for r in runs["two"].ok("golden_incremental_read"):
        assert r["restored"] == "gen-000000000003" and r["restored_differs"] == [], r
        assert r["continued_differs"] == [] and r["newest"] == r["names"][-1] and r["newest_differs"] == [], r
        assert r["formats"] == [4, 5, 5, 5], r
        (old_part, inode), = r["before"].items()
        first, second, third = r["parts"]
        spare = old_part.removesuffix(".safetensors") + ".spare"
        assert first[spare] == inode and first[old_part] != inode, r  # written afresh; the old one is the spare
        assert crosswise(first, second) and crosswise(second, third), r


def test_a_resharding_restore_continues_incrementally_at_another_world_size(runs):
    (result,) = runs["one"].ok("incremental_reshard", 1)
    assert result["restored"] == GENS[-1] and result["differs"] == [], result  # bitwise after resharding 2 -> 1
    first, second, third = result["parts"]
    assert first == {} and len(second) == 2 and crosswise(second, third) and result["shares"], result


def test_node_local_tiers_link_within_each_node_and_a_lost_node_is_refilled_from_its_peer(tmp_path):
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    out = tmp_path / "out"
    for rank, result in enumerate(launch_nodes(out, dirs, ["tier_incremental"], worker=WORKER, nproc=1).ok(
            "tier_incremental", 2)):
        own = f"{dirs[rank].name}/shard-{rank:05d}-part-"
        inodes = [{f: i for f, i in p.items() if f.startswith(own)} for p in result["parts"]]
        assert len(inodes[0]) == 2 and all(crosswise(inodes[k - 1], inodes[k]) for k in range(1, 5)), result
        peer = [{f: i for f, i in p.items() if not f.startswith(own)} for p in result["parts"]]
        assert [len(p) for p in peer] == [2] * 5 and all(crosswise(peer[k - 1], peer[k]) for k in (1, 2, 4)), result
        (part, spare), (was_part, was_spare) = sorted(peer[3].items()), sorted(peer[2].items())  # .safetensors first
        assert spare[1] == was_part[1] and part[1] not in (was_part[1], was_spare[1]), result  # the damaged one sent
        base = 2 << 20  # the peer's half of the frozen 1024x1024 fp32 weight, which its first replica receives twice
        received = result["received"]  # the bytes this node's replicas received, per save
        assert received[0] > 2 * base and base < received[3] < 1.2 * base, received
        assert all(received[k] < base / 5 for k in (1, 2, 4)), received
        assert result["restored"] == GENS[4] and result["sources"]["remote"] == 0, result
        assert result["differs"] == [], result
    shutil.rmtree(dirs[1])
    refilled = launch_nodes(out, dirs, ["tier_incremental_refilled"], worker=WORKER, nproc=1).ok(
        "tier_incremental_refilled", 2)
    for rank, result in enumerate(refilled):
        assert result["restored"] == GENS[4] and result["differs"] == [], result
        own = f"{dirs[rank].name}/shard-{rank:05d}-part-"
        first, second = ({f: i for f, i in p.items() if f.startswith(own)} for p in result["parts"])
        assert len(first) == 2 and crosswise(first, second), result  # gens 6 and 7 link what it was refilled with
    assert refilled[1]["sources"]["peer"] > 0 and refilled[1]["sources"]["remote"] == 0, refilled[1]


def test_on_an_object_store_a_steady_save_uploads_only_what_changed(moto_server, tmp_path):
    pytest.importorskip("obstore")
    url = moto_server.url(moto_server.make_bucket(), "run")
    remote = {"url": url, "storage_options": moto_server.storage_options()}
    for result in launch(tmp_path / "objects", ["incremental_objects"], worker=WORKER,
                         env={"TRAINSTATE_TEST_S3": json.dumps(remote)}).ok("incremental_objects"):
        uploaded = result["uploaded"]  # this rank's bytes put, per save
        base = 2 << 20  # this rank's half of the frozen 1024x1024 fp32 weight
        assert uploaded[0] > 2 * base and all(u < base / 5 for u in uploaded[1:]), uploaded  # then referenced
        assert result["held"] < 2 * 2 * base + 2 * 4 * base / 5, result["held"]  # 2 ranks x 2 copies, 4 saves
        assert result["restored"] == GENS[3] and result["differs"] == [], result


def test_with_tiers_the_upload_to_the_remote_references_unchanged_parts(moto_server, tmp_path):
    pytest.importorskip("obstore")
    url = moto_server.url(moto_server.make_bucket(), "run")
    remote = {"url": url, "storage_options": moto_server.storage_options()}
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for result in launch_nodes(tmp_path / "out", dirs, ["tier_incremental_remote"], worker=WORKER, nproc=1,
                               env={"TRAINSTATE_TEST_S3": json.dumps(remote)}).ok("tier_incremental_remote", 2):
        uploaded = result["uploaded"]  # this rank's bytes sent to the remote, per save
        base = 2 << 20  # this rank's half of the frozen weight
        assert uploaded[0] > 2 * base and all(u < base / 5 for u in uploaded[1:]), uploaded  # then referenced
        assert result["held"] < 2 * 2 * base + 2 * 4 * base / 5, result["held"]  # 2 ranks x 2 copies, 4 saves
        assert result["restored"] == GENS[3] and result["sources"]["remote"] > 0, result
        assert result["differs"] == [], result  # bitwise from the remote alone
