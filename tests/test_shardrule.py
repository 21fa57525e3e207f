"""DCP's metadata by rule (``trainstate/format/shardrule.py``): derived records equal to what DCP and the ranks write.

Pure checks (no process group): the rule's chunk at every coordinate equals DTensor's own
(``_compute_local_shape_and_global_offset``) over meshes of one and two dimensions, even and uneven splits,
nested shards; the pieces a box needs (``overlapping``) equal a brute-force filter of every piece; a damaged rule
is refused. Then real ``torchrun`` launches: FSDP2 and DDP saved by rule at 3 gloo ranks (uneven rows, an empty
chunk), restored there, and at 2 ranks and 1 (resharding) bitwise; the incremental default by rule while each
rank's shard is one file, listed once a frozen block is laid out in a part.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from distlaunch import launch
from trainstate.errors import CorruptGeneration
from trainstate.format import shardrule

CASES = [  # (size, mesh shape, placements)
    ([16, 8], [3], [["shard", 0]]),
    ([4, 16], [3], [["shard", 0]]),
    ([5], [8], [["shard", 0]]),
    ([12, 10], [2, 3], [["shard", 0], ["shard", 1]]),
    ([12, 10], [2, 3], [["replicate"], ["shard", 1]]),
    ([13, 7], [2, 3], [["shard", 0], ["shard", 0]]),  # nested: two mesh dims cut one tensor dim
    ([7, 3], [4, 2], [["shard", 1], ["replicate"]]),
    ([0, 4], [2], [["shard", 0]]),
]


def torch_placements(placements):
    return [Shard(p[1]) if p[0] == "shard" else Replicate() for p in placements]


def rule_for(size, shape, placements, dtype="float32", small_bytes=0):
    ranks = list(range(math.prod(shape)))
    raw = {"world_size": len(ranks), "small_bytes": small_bytes, "meshes": [{"shape": shape, "ranks": ranks}],
           "items": {"w": {"dtype": dtype, "requires_grad": True, "size": size, "mesh": 0, "placements": placements},
                     "step": {"dtype": "float32", "requires_grad": False, "size": [], "writer": 0, "small": True},
                     "group": {"bytes": True, "writer": 0, "small": True}}}
    return raw


@pytest.mark.parametrize("size,shape,placements", CASES)
def test_every_chunk_is_dtensors_own(size, shape, placements):
    for coordinate in itertools.product(*map(range, shape)):
        want_sizes, want_offsets = _compute_local_shape_and_global_offset(size, shape, list(coordinate),
                                                                          torch_placements(placements))
        offsets, sizes = shardrule.chunk(size, shape, list(coordinate), placements)
        assert sizes == list(want_sizes), (coordinate, sizes, want_sizes)
        if math.prod(sizes):  # (an empty chunk's offset is never written)
            assert offsets == list(want_offsets), (coordinate, offsets, want_offsets)


@pytest.mark.parametrize("size,shape,placements", CASES)
def test_the_pieces_cover_each_tensor_once_and_each_writer_writes_its_own(size, shape, placements):
    rule = shardrule.checked(rule_for(size, shape, placements), "test")
    pieces = [r for r in shardrule.records(rule, "w")]
    assert sum(math.prod(s) for _, s, _, _ in pieces) == math.prod(size)
    assert len({tuple(o) for o, _, _, _ in pieces}) == len(pieces)
    by_writer = [w for r in range(rule["world_size"]) for w in shardrule.written_by(rule, r) if w[0] == "w"]
    assert sorted((tuple(o), f, e) for _, o, _, f, e in by_writer) == sorted((tuple(o), f, e) for o, _, f, e in pieces)
    # a replicated mesh dimension: only coordinate 0 on it writes
    for rank in range(rule["world_size"]):
        coordinate = rule["meshes"][0]["index"][rank]
        mine = [w for w in shardrule.written_by(rule, rank) if w[0] == "w"]
        if any(c and p[0] == "replicate" for c, p in zip(coordinate, placements)):
            assert not mine


@pytest.mark.parametrize("size,shape,placements", CASES)
def test_overlapping_equals_a_filter_of_every_piece(size, shape, placements):
    rule = shardrule.checked(rule_for(size, shape, placements), "test")
    every = list(shardrule.records(rule, "w"))
    boxes = [([0] * len(size), list(size)), ([1] * len(size), [max(0, d - 2) for d in size]),
             ([d // 2 for d in size], [1 if d else 0 for d in size])]
    for box in boxes:
        want = sorted(tuple(r[0]) for r in every if shardrule._meets(r[0], r[1], *box))
        assert sorted(tuple(r[0]) for r in shardrule.overlapping(rule, "w", [box])) == want, box


def test_the_listed_form_matches_what_a_save_without_the_rule_writes():
    raw = {"format": "trainstate-dcp-metadata", "version": "1.0.0", "planner_data": {"w": ["model", "w"]},
           "rule": rule_for([5, 2], [2], [["shard", 0]], small_bytes=64 << 10)}
    listed = shardrule.explicit(raw, "test")
    assert listed["items"]["w"]["chunks"] == [[[0, 0], [3, 2]], [[3, 0], [2, 2]]]
    assert listed["items"]["group"] == {"bytes": True}
    assert listed["items"]["step"]["chunks"] == [[[], []]]
    assert ["w", [3, 0], "shard-00001.safetensors", "w@3,0"] in listed["storage"]
    assert ["step", [], "shard-00000-small.safetensors", "step@"] in listed["storage"]
    assert ["group", None, "shard-00000-small.safetensors", "group@"] in listed["storage"]
    # a chunk that is the whole tensor and small goes to the small file; a large one to the shard
    whole = shardrule.explicit({**raw, "rule": rule_for([3], [2], [["replicate"]], small_bytes=64)}, "test")
    assert ["w", [0], "shard-00000-small.safetensors", "w@0"] in whole["storage"]
    large = shardrule.explicit({**raw, "rule": rule_for([3], [2], [["replicate"]], small_bytes=8)}, "test")
    assert ["w", [0], "shard-00000.safetensors", "w@0"] in large["storage"]


@pytest.mark.parametrize("damage", [
    lambda r: r.update(world_size=0),
    lambda r: r["meshes"][0].update(ranks=[0, 0, 1]),
    lambda r: r["meshes"][0].update(ranks=[0, 1, 7]),
    lambda r: r["items"]["w"].update(placements=[["shard", 5]]),
    lambda r: r["items"]["w"].update(placements=[["partial"]]),
    lambda r: r["items"]["w"].update(mesh=3),
    lambda r: r["items"]["w"].update(dtype="pickle"),
    lambda r: r["items"]["step"].update(writer=9),
    lambda r: r["items"]["group"].update(small="yes"),
    lambda r: r.update(extra=1),
])
def test_a_damaged_rule_is_refused_as_corrupt(damage):
    rule = json.loads(json.dumps(rule_for([16, 8], [3], [["shard", 0]])))
    shardrule.checked(json.loads(json.dumps(rule)), "test")  # control: the undamaged rule passes
    damage(rule)
    with pytest.raises(CorruptGeneration, match="malformed rule"):
        shardrule.checked(rule, "test")


# real ranks -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rule")
    whole = {"TRAINSTATE_TEST_FULL_EVERY": "none"}
    three = launch(root / "three", ["roundtrip_save_fsdp", "roundtrip_save_ddp"], ranks=3, env=whole)
    two = launch(root / "two", ["roundtrip_load_fsdp", "roundtrip_load_ddp", "roundtrip_save_fsdp", "rule_incremental"],
                 ranks=2, env={**whole, "TRAINSTATE_TEST_SOURCE": str(root / "three")})
    one = launch(root / "one", ["roundtrip_load_fsdp"], ranks=1,
                 env={**whole, "TRAINSTATE_TEST_SOURCE": str(root / "three")})
    return {"three": three, "two": two, "one": one}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_saved_by_rule_at_three_ranks_restores_bitwise(runs, mode):
    for result in runs["three"].ok(f"roundtrip_save_{mode}", 3):
        assert result["by_rule"] and result["differs"] == [] and result["identical"], result


@pytest.mark.slow
@pytest.mark.parametrize("mode,ranks", [("fsdp", 2), ("ddp", 2), ("fsdp", 1)])
def test_saved_by_rule_reshards_bitwise(runs, mode, ranks):
    launched = runs["two"] if ranks == 2 else runs["one"]
    for result in launched.ok(f"roundtrip_load_{mode}", ranks):
        assert result["differs"] == [], result


@pytest.mark.slow
def test_incremental_saves_go_by_rule_while_each_shard_is_one_file(runs):
    """The default ``full_every``: a state whose every tensor changes is saved by rule at every save, its
    manifest without fingerprints (O(N), not O(items x N)), a restarted manager's first save too; bitwise."""
    for result in runs["two"].ok("rule_incremental", 2):
        assert result["changing_by_rule"] == [True] * 4, result
        assert result["changing_prints"] == [False] * 4, result
        assert result["changing_differs"] == [], result


@pytest.mark.slow
def test_a_shard_with_parts_is_listed_and_rank0_keeps_its_own_fingerprints(runs):
    """Control: a frozen block laid out in a part (second save, found by its fingerprints when the
    ``requires_grad`` hint is left out) and linked (third) names files no rule says: listed. Rank 0 lays its block
    out in a part like every rank, so it kept its own fingerprints from a generation by rule, whose manifest has
    none. With the hint (the default) the block is laid out at the first save, and each later one links each
    rank's part and spare."""
    for result in runs["two"].ok("rule_incremental", 2):
        assert result["frozen_by_rule"] == [True, False, False], result
        assert result["rank_parts"] == [[], [0, 1], [0, 1]], result
        assert result["frozen_shares"] == [0, 0, 4], result  # save 3 links each rank's part and spare
        assert result["frozen_differs"] == [], result
        assert result["hinted_frozen_by_rule"] == [False, False, False], result
        assert result["hinted_rank_parts"] == [[0, 1], [0, 1], [0, 1]], result
        assert result["hinted_frozen_shares"] == [0, 4, 4] and result["hinted_frozen_differs"] == [], result


def test_a_ranks_view_lists_only_the_chunks_its_own_box_meets():
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from trainstate.distributed.storage import RuleMetadata

    raw = {"format": "trainstate-dcp-metadata", "version": "1.0.0", "planner_data": {},
           "rule": rule_for([16, 8], [4], [["shard", 0]])}
    files = {f"shard-{r:05d}.safetensors" for r in range(4)} | {"shard-00000-small.safetensors"}

    def boxed(offsets, sizes):
        value = torch.empty(16, 8)
        value.__create_chunk_list__ = lambda: [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))]
        return value

    lazy = RuleMetadata(raw, "test", files)
    own = lazy.view({"w": boxed([4, 0], [4, 8]), "step": torch.zeros(()), "group": b""})
    assert [list(c.offsets) for c in own.state_dict_metadata["w"].chunks] == [[4, 0]]
    assert own.storage_data[next(i for i in own.storage_data if i.fqn == "w")] == {
        "file": "shard-00001.safetensors", "entry": "w@4,0"}
    wider = lazy.view({"w": boxed([3, 0], [6, 8])})  # another world size: rows 3..8 meet three ranks' chunks
    assert [list(c.offsets)[0] for c in wider.state_dict_metadata["w"].chunks] == [0, 4, 8]
    assert set(wider.state_dict_metadata) == {"w", "step", "group"}  # every stored key, listed or not
    with pytest.raises(CorruptGeneration, match="does not list"):  # a file the manifest lacks
        RuleMetadata(raw, "test", files - {"shard-00002.safetensors"}).view({"w": boxed([8, 0], [4, 8])})
    assert lazy.entries("shard-00003.safetensors") == {"w@12,0"}


def test_export_reads_a_rule_as_the_listed_form():
    from trainstate.tools.exportread import dcp_items

    raw = {"format": "trainstate-dcp-metadata", "version": "1.0.0",
           "planner_data": {"w": ["model", "w"], "step": ["optim", "step"], "group": ["optim", "group"]},
           "rule": rule_for([5, 2], [2], [["shard", 0]], small_bytes=64 << 10)}
    files = {"shard-00000.safetensors", "shard-00001.safetensors", "shard-00000-small.safetensors"}
    assert dcp_items(raw, "test", files) == dcp_items(shardrule.explicit(raw, "test"), "test", files)
    assert dcp_items(raw, "test", files)["w"].chunks == (((0, 0), (3, 2), "shard-00000.safetensors", "w@0,0"),
                                                         ((3, 0), (2, 2), "shard-00001.safetensors", "w@3,0"))


@pytest.mark.slow
def test_the_commands_that_read_a_run_read_a_generation_by_rule(runs, tmp_path):
    """``ls``, ``verify``, ``diff`` (the ranks' pieces compared) and ``export`` (full tensors from the shards) on the
    3-rank FSDP2 run whose metadata is the rule (``diff`` of a generation with itself: every piece compared)."""
    import subprocess
    import sys

    def cli(*argv):
        done = subprocess.run([sys.executable, "-m", "trainstate", *argv], capture_output=True, text=True, timeout=120)
        return done.returncode, done.stdout + done.stderr

    three = runs["three"].out / "roundtrip_save_fsdp" / "run-fsdp"
    assert "rule" in json.loads(next(three.glob("gen-*/dcp-metadata.json")).read_bytes())
    for argv in (("ls", str(three)), ("verify", str(three))):
        rc, out = cli(*argv)
        assert rc == 0, out
    gen = sorted(three.glob("gen-*"))[-1]
    rc, out = cli("diff", str(gen), str(gen), "--json")
    assert rc == 0 and json.loads(out)["first"] is None, out
    rc, out = cli("export", str(three), str(tmp_path / "out"), "--json")
    assert rc == 0, out
    exported = sorted(p.name for p in (tmp_path / "out").rglob("*.safetensors"))
    assert exported, out
