"""Node-local tiers with peer replicas, on real multi-node launches (several ``torchrun`` agents on this host).

Each agent is a node with its own directory; a node is lost by deleting its
directory between launches (it comes back as a fresh agent with an empty one).
Every resume is judged bitwise against the uninterrupted run (``tests/tier_worker.py``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import trainstate as ts
from multinode import launch_nodes
from trainstate.cli.main import main as cli_main
from trainstate.distributed.tiers import placement, single_domain_shards
from trainstate.tools.nodes import check_nodes

WORKER = Path(__file__).resolve().parent / "tier_worker.py"
GEN = "gen-000000000006"


# placement: a pure function ------------------------------------------------------------------------------
def test_placement_prefers_other_failure_domains_then_the_ring():
    assert placement(["a", "b", "c", "d"], 2) == [[1], [2], [3], [0]]  # no domains: every node its own
    assert placement(["r1", "r1", "r2", "r2"], 2) == [[2], [3], [0], [1]]  # the other rack, spread evenly
    assert placement(["r1", "r1", "r2", "r2"], 3) == [[2, 1], [3, 0], [0, 3], [1, 2]]
    for domains in (["a"] * 5, ["r1", "r2", "r3"] * 3):  # every node keeps replicas-1 nodes' files
        kept = [t for ts_ in placement(domains, 3) for t in ts_]
        assert sorted(kept.count(n) for n in range(len(domains))) == [2] * len(domains)
    assert placement(["a", "b"], 5) == [[1], [0]]  # never more copies than nodes
    assert placement(["a", "b", "c"], 1) == [[], [], []]


def test_no_node_keeps_every_copy_in_one_domain_when_two_exist():
    for domains in (["r1", "r1", "r2", "r2"], ["r1", "r1", "r1", "r2"], ["z1", "z2", "z1", "z2", "z1", "z2"]):
        for replicas in (2, 3):
            assert single_domain_shards(domains, replicas) == []
    # the control: a placement by ring distance alone puts node 0's only copy beside it, in rack r1
    ring = [[(n + 1) % 4] for n in range(4)]
    domains = ["r1", "r1", "r2", "r2"]
    assert any(len({domains[n], *(domains[t] for t in ts_)}) < 2 for n, ts_ in enumerate(ring))


def test_tier_options_are_refused_without_a_process_group(tmp_path):
    with pytest.raises(ts.InvalidArgument, match="torchrun"):
        ts.CheckpointManager(tmp_path / "run", replicas=2)
    with pytest.raises(ts.InvalidArgument, match="node"):
        ts.CheckpointManager(tmp_path / "run", failure_domain="rack1")


# real launches -----------------------------------------------------------------------------------------------
def _flip(path: Path) -> None:
    """One bit of the first weight's exponent (the first float of the data, after the safetensors header)."""
    data = bytearray(path.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + 3] ^= 0x01
    path.write_bytes(bytes(data))


def _holders(dirs: list[Path], file: str) -> list[int]:
    """The node directories that hold ``file`` of the newest generation, in either tier."""
    return [i for i, d in enumerate(dirs) if (d / GEN / file).exists() or (d / "replicas" / GEN / file).exists()]


def _resumed(launch, scenario: str, world: int) -> list[dict]:
    results = launch.ok(scenario, world)
    for rank, result in enumerate(results):
        assert "raised" not in result, f"rank {rank}: {result}"
        assert result["full_differs"] == [] and result["rank_differs"] == [], f"rank {rank} diverged: {result}"
    return results


def test_two_nodes_resume_from_own_disk_from_a_replica_past_a_flipped_bit_and_after_losing_a_node(tmp_path):
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    out = tmp_path / "out"
    trained = launch_nodes(out, dirs, ["tier_train"], worker=WORKER, nproc=2)
    for result in trained.ok("tier_train", 4):
        assert result["tiers"]["local"]["generation"] == GEN and result["tiers"]["replicated"]["generation"] == GEN
    for directory in dirs:  # keep_last=2 in both tiers: gen-2 pruned with its replicas
        for store in (directory, directory / "replicas"):
            assert sorted(p.name for p in store.glob("gen-*")) == ["gen-000000000004", GEN], store
    # every process killed, nothing lost: each rank reads its own node's disk, nothing crosses nodes
    first = _resumed(launch_nodes(out, dirs, ["tier_resume"], worker=WORKER, nproc=2), "tier_resume", 4)
    assert first[0]["generation"] == GEN and first[0]["rejected"] == []
    assert first[0]["sources"]["peer"] == 0 and first[0]["sources"]["local"] > 0

    # one flipped bit in a node's own copy of its shard: detected, read from the replica on the other node
    node = 1
    shard = sorted(p for p in (dirs[node] / GEN).glob("shard-*.safetensors") if "small" not in p.name)[0]
    _flip(shard)
    launched = launch_nodes(out, dirs, ["tier_resume_unverified", "tier_resume"], worker=WORKER, nproc=2)
    control = launched.ok("tier_resume_unverified", 4)
    assert any(r["full_differs"] for r in control), "the control (chunks unchecked) should load the flipped bit"
    repaired = _resumed(launched, "tier_resume", 4)
    assert repaired[0]["generation"] == GEN and repaired[0]["sources"]["peer"] > 0
    # its node read it straight from disk as DCP loaded it, found the flipped bit there, and every rank ran the
    # generation again through the fetch rounds, which took the replica
    assert any("reading it again through the nodes' copies" in w for r in repaired for w in r["warnings"]), repaired
    assert any(p.name.startswith(f"{GEN}.rejected") for p in dirs[node].iterdir()), "the damaged copy is kept aside"
    # the same after restore(in_place=False): found in the fetch round, before anything loads (no second reading)
    _flip(sorted(p for p in (dirs[node] / GEN).glob("shard-*.safetensors") if "small" not in p.name)[0])
    checked = _resumed(launch_nodes(out, dirs, ["tier_resume_checked_first"], worker=WORKER, nproc=2),
                       "tier_resume_checked_first", 4)
    assert checked[0]["generation"] == GEN and checked[0]["sources"]["peer"] > 0
    assert not any("reading it again" in w for r in checked for w in r["warnings"]), checked

    # a node lost (its directory gone, back empty): its shards come from the replicas, then it is refilled
    shutil.rmtree(dirs[1])
    dirs[1].mkdir()
    launched = launch_nodes(out, dirs, ["tier_resume", "tier_resume_again", "tier_resume_refill_later",
                                        "tier_resume_refill_fails", "tier_resume_refilled"], worker=WORKER, nproc=2)
    after_loss = _resumed(launched, "tier_resume", 4)
    assert after_loss[0]["generation"] == GEN and after_loss[0]["sources"]["peer"] > 0
    # the replacement holds its part and the replicas it keeps, durably, with its pointers, when restore returns
    for result in after_loss:
        assert _refilled(result["at_return"]), result["at_return"]
    again = _resumed(launched, "tier_resume_again", 4)
    assert again[0]["sources"]["peer"] == 0, "the replacement node was refilled with its own holding"
    assert (dirs[1] / GEN).is_dir() and (dirs[1] / "replicas" / GEN).is_dir()
    # the control: node 1 lost again, its refill run after restore returns (as in c81b50e): the window is seen
    late = _resumed(launched, "tier_resume_refill_later", 4)
    assert all(_refilled(r["at_return"]) == (r["node_dir"] != str(dirs[1])) for r in late), late
    # node 1 lost again and its refill cannot write: restore raises on every rank, the state restored and usable
    failed = launched.ok("tier_resume_refill_fails", 4)
    assert all(r["raised"] == "CheckpointFailed" and r["phase"] == "refill" and not r["unusable"] for r in failed)
    assert "restored completely and is usable" in failed[0]["message"], failed[0]
    refilled = _resumed(launched, "tier_resume_refilled", 4)
    assert refilled[0]["sources"]["peer"] > 0 and all(_refilled(r["at_return"]) for r in refilled)

    # the nodes read together from their directories (`trainstate nodes`): sound, and then two controls
    report = check_nodes(dirs)
    assert report["failures"] == [] and report["recovery_point"] == GEN, report
    assert report["generations"][GEN]["survives_one_node"]
    assert cli_main(["ls", str(dirs[0])]) == 1  # one node's directory alone: refused, pointing to `nodes`
    _flip(sorted((dirs[0] / GEN).glob("shard-0000?.safetensors"))[0])
    report = check_nodes(dirs)
    assert any("digest mismatch" in f for f in report["failures"]), report["failures"]
    assert report["generations"][GEN]["servable"] and not report["generations"][GEN]["survives_one_node"]
    assert any("replicas/latest names" in f for f in report["failures"]), report["failures"]
    assert cli_main(["nodes", *map(str, dirs)]) == 1

    # a deliberate return to update 4, then a save at 5: a restart resumes the timeline saved to last (gen 5), not
    # the abandoned one's gen 6; the control (newest by update first, as before) resumes gen 6
    forked = launch_nodes(out, dirs, ["tier_fork", "tier_resume_after_fork", "tier_resume_after_fork_control"],
                          worker=WORKER, nproc=2)
    for result in forked.ok("tier_fork", 4):
        assert (result["restored"], result["saved"]) == ("gen-000000000004", "gen-000000000005"), result
    assert all(r["generation"] == "gen-000000000005" for r in _resumed(forked, "tier_resume_after_fork", 4))
    control = forked.ok("tier_resume_after_fork_control", 4)
    assert all(r.get("generation") == GEN for r in control), control


def _refilled(held: dict) -> bool:
    """A node's directory as restore returned: both pointers name the generation, its manifests are there."""
    return held["latest"] == held["replicas_latest"] == GEN and {f"{GEN}/manifest.json",
                                                                  f"replicas/{GEN}/manifest.json"} <= set(held["manifests"])


def test_four_nodes_in_two_racks_replicas_across_racks_and_a_shard_lost_with_every_copy(tmp_path):
    dirs = [tmp_path / f"node{i}" for i in range(4)]
    out = tmp_path / "out"
    racks = [{"TS_DOMAIN": r} for r in ("rackA", "rackA", "rackB", "rackB")]
    launch = launch_nodes(out, dirs, ["tier_train"], worker=WORKER, nproc=1, node_env=racks)
    launch.ok("tier_train", 4)
    manifest_files = sorted(p.name for p in (dirs[0] / GEN).iterdir())
    assert "manifest.json" in manifest_files
    for rank in range(4):  # placement: each rank's files live in two racks
        holders = _holders(dirs, f"rank-{rank:05d}.safetensors")
        assert len(holders) == 2 and len({racks[i]["TS_DOMAIN"] for i in holders}) == 2, (rank, holders)

    # each node's directory back under another GROUP_RANK (the disks of the two machines of a rack swapped, as a
    # scheduler may give them back): the nodes are numbered anew, each holding files of ranks it no longer runs;
    # the restore reads every file from whichever node holds it, bitwise
    swapped = [dirs[1], dirs[0], dirs[3], dirs[2]]
    moved = _resumed(launch_nodes(out, swapped, ["tier_resume"], worker=WORKER, nproc=1, node_env=racks),
                     "tier_resume", 4)
    trained = {r["node_dir"]: r["group_rank"] for r in launch.ok("tier_train", 4)}
    assert all(trained[r["node_dir"]] != r["group_rank"] for r in moved), (trained, moved)
    assert moved[0]["generation"] == GEN and moved[0]["sources"]["peer"] > 0 and moved[0]["sources"]["remote"] == 0

    # one node lost: its rank's files come from the replica in the other rack, bitwise
    lost = _holders(dirs, "rank-00001.safetensors")[0]
    shutil.rmtree(dirs[lost])
    dirs[lost].mkdir()
    resumed = _resumed(launch_nodes(out, dirs, ["tier_resume"], worker=WORKER, nproc=1, node_env=racks),
                       "tier_resume", 4)
    assert resumed[0]["generation"] == GEN and resumed[0]["sources"]["peer"] > 0

    # a node and every holder of its replica lost: no surviving node can serve any generation whole
    for i in _holders(dirs, "rank-00002.safetensors"):
        shutil.rmtree(dirs[i])
        dirs[i].mkdir()
    failed = launch_nodes(out, dirs, ["tier_resume"], worker=WORKER, nproc=1, node_env=racks)
    for result in failed.ok("tier_resume", 4):  # every rank raises the same typed error, nothing loads
        assert result["raised"] == "NoValidGeneration" and "no surviving node holds" in result["message"], result
        # it points to reading every node's directory together, naming each (one node's alone is refused)
        assert "trainstate nodes" in result["message"] and all(str(d) in result["message"] for d in dirs), result


def test_ddp_with_background_saves_then_a_reshard_onto_one_node(tmp_path):
    """DDP (the model replicated: rank 0 writes it once), every save in the background (replicas too), bitwise;
    then the node directories restored by one node (world size 2 -> 1): model and optimizer reshard exactly.

    Two ranks: with DDP at 3 or more ranks a restart is not bitwise in the last bits of the moments, with or without
    a checkpoint (a fresh DDP wrapper reduces its first gradients in another bucket order; README, not guaranteed).
    """
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    out = tmp_path / "out"
    env = {"TS_MODE": "ddp", "TS_BLOCKING": "0"}
    launched = launch_nodes(out, dirs, ["tier_train", "tier_resume"], worker=WORKER, nproc=1, env=env)
    for result in launched.ok("tier_train", 2):
        assert result["tiers"]["replicated"]["generation"] == GEN, result
    assert _resumed(launched, "tier_resume", 2)[0]["sources"]["peer"] == 0
    fewer = launch_nodes(out, dirs[:1], ["tier_reshard"], worker=WORKER, nproc=1, env=env)
    result = fewer.ok("tier_reshard", 1)[0]
    assert result["generation"] == GEN and result["full_differs"] == [], result
    assert not result["identical"]  # per-rank RNG continues statistically at another world size


def test_retention_with_tiers_keeps_milestones_the_best_and_a_pin_made_on_one_node_whole_on_every_node(tmp_path):
    """Retention(keep_last=2, milestone_every=4, best=("loss", "min")), update 5 pinned on rank 0 only: both
    nodes keep 3 (best), 4 and 8 (milestones), 5 (pinned), 8 and 9 (the last two) in both tiers, and the best
    restores from them. Control: each node pruning with its own pins drops the pinned generation on node 1."""
    want = [f"gen-{u:012d}" for u in (3, 4, 5, 8, 9)]
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for result in launch_nodes(tmp_path / "out", dirs, ["tier_retention"], worker=WORKER, nproc=1).ok(
            "tier_retention", 2):
        assert result["own"] == want and result["replica"] == want, result
        assert result["restored"] == "gen-000000000003" and result["sources"]["remote"] == 0, result
    dirs = [tmp_path / "control0", tmp_path / "control1"]
    control = launch_nodes(tmp_path / "control", dirs, ["tier_retention"], worker=WORKER, nproc=1,
                           env={"TS_PINS_LOCAL": "1"}).ok("tier_retention", 2)
    assert control[0]["own"] == want, control[0]
    assert "gen-000000000005" not in control[1]["own"] + control[1]["replica"], control[1]


def test_prune_by_hand_with_tiers_prunes_every_node_and_both_its_stores_by_every_nodes_pins(tmp_path):
    """Before, ``ckpt.prune()`` in a tiered run pruned each caller's own store only, left the replicas, and
    dropped on node 1 the generation rank 0 had pinned."""
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    gens = [f"gen-{u:012d}" for u in range(1, 5)]
    for result in launch_nodes(tmp_path / "out", dirs, ["tier_prune_by_hand"], worker=WORKER, nproc=1).ok(
            "tier_prune_by_hand", 2):
        assert result["dry_prune"] == [gens[1]] and result["after_dry"] == {"own": gens, "replica": gens}, result
        kept = [gens[0], gens[2], gens[3]]
        assert result["prune"] == [gens[1]] and sorted(result["keep"]) == kept, result
        assert result["after"] == {"own": kept, "replica": kept}, result
        assert any("pin" in r for r in result["reasons"][gens[0]]), result


def test_a_second_save_at_one_update_with_tiers_is_a_no_op_when_nothing_changed_and_a_revision_otherwise(tmp_path):
    """Before, every such save was a new revision, and finish() raised (it verified the generation as if node 0
    held every file)."""
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for result in launch_nodes(tmp_path / "out", dirs, ["tier_same_update"], worker=WORKER, nproc=1).ok(
            "tier_same_update", 2):
        first, revision = "gen-000000000002", "gen-000000000002-r001"
        changed = [f"gen-000000000002-r00{r}" for r in (2, 3, 4)]
        last = changed[-1]
        assert result["names"] == [first, first, revision, revision, *changed], result
        kept = [first, revision, *changed]
        assert result["own"] == kept and result["replica"] == kept, result
        assert result["latest"] == last and result["leftovers"] == [], result  # every staging discarded
        assert result["done"], result  # finish reused the revision and wrote DONE on every node


def test_a_node_without_room_refuses_the_save_everywhere_before_anything_is_written(tmp_path, tmpfs):
    dirs = [tmp_path / "node0", tmpfs.mount("48k", "node1")]  # node 1: too small for its share (a real ENOSPC check)
    launched = launch_nodes(tmp_path / "out", dirs, ["tier_no_space"], worker=WORKER, nproc=1)
    results = launched.ok("tier_no_space", 2)
    assert {r["raised"] for r in results} <= {"InsufficientSpace", "CheckpointFailed"}, results
    assert any(r["raised"] == "InsufficientSpace" for r in results), results
    assert all("InsufficientSpace" in r["message"] or "not enough space" in r["message"] for r in results), results
    for result in results:  # no generation and no staging left on either node
        assert not [n for n in result["held"] if n.startswith(("gen-", ".trainstate-staging"))], result


def test_a_replication_failure_is_raised_once_and_never_reported_as_protection(tmp_path, tmpfs):
    (tmp_path / "node1").mkdir()
    full = tmpfs.mount("16k", "node1/replicas")  # node 1's replicated tier cannot hold node 0's files
    dirs = [tmp_path / "node0", full.parent]
    results = launch_nodes(tmp_path / "out", dirs, ["tier_replica_fails"], worker=WORKER, nproc=1).ok(
        "tier_replica_fails", 2)
    for result in results:
        assert result["saved"] == "gen-000000000002", result  # save returned: the local tier committed
        first, second = result["raised"]
        assert first is not None and second is None, result  # raised by wait(), exactly once
        assert result["tiers"]["local"]["generation"] == "gen-000000000002", result
        assert result["tiers"]["replicated"] is None, result  # never named while it is not replicated
    # the full disk holds no replica (its staging aborted); the other node's committed replica is real, verified data
    assert sum(not [n for n in r["replica_entries"] if n.startswith(("gen-", ".trainstate-staging"))]
               for r in results) == 1, results
