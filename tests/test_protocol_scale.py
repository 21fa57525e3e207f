"""The multi-rank protocol at many ranks, at CI size (issue 50).

``benchmarks/bench_protocol_scale.py`` runs rank 0's part (and rank 1's) of a save and a restore of an FSDP2
Llama-2-7B + AdamW without a process group; ``--ranks 256,1024,8192`` is the full run (benchmarks/README.md).
Here it runs at 16 and 64 ranks, on both of the save's paths (the metadata by rule, when every rank follows one;
listed, for incremental saves), and what must hold at any N is checked by counts and sizes, never by time: what
rank 0 writes and handles grows at most linearly in N (by rule: its metadata not at all), what a non-zero rank
sends and receives does not grow.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_protocol_scale as bench  # noqa: E402

from trainstate.distributed.planner import SavePlanner  # noqa: E402

NS = (16, 64)


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> dict[str, dict[int, dict]]:
    workdir = tmp_path_factory.mktemp("scale")
    return {path: {n: bench.simulate(n, workdir / path, path=path) for n in NS} for path in ("rule", "listed")}


@pytest.fixture(params=["rule", "listed"])
def runs(request, both) -> dict[int, dict]:
    return both[request.param]


@pytest.fixture
def listed(both) -> dict[int, dict]:
    return both["listed"]


def values(runs: dict[int, dict], *path: str) -> list:
    return [bench._get(runs[n], path) for n in NS]


# the generated state is the real one -----------------------------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.attention = torch.nn.Module()
        for name in ("wq", "wk", "wv", "wo"):
            setattr(self.attention, name, torch.nn.Linear(dim, dim, bias=False))
        self.feed_forward = torch.nn.Module()
        self.feed_forward.w1 = torch.nn.Linear(dim, ffn, bias=False)
        self.feed_forward.w2 = torch.nn.Linear(ffn, dim, bias=False)
        self.feed_forward.w3 = torch.nn.Linear(dim, ffn, bias=False)
        self.attention_norm = torch.nn.RMSNorm(dim)
        self.ffn_norm = torch.nn.RMSNorm(dim)


class _Llama(torch.nn.Module):
    def __init__(self, layers: int, dim: int, ffn: int, vocab: int):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(_Block(dim, ffn) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(dim)
        self.output = torch.nn.Linear(dim, vocab, bias=False)


def test_keys_shapes_and_item_kinds_are_torchs():
    """The plan the benchmark generates has the keys, global shapes and item kinds that DCP's own planning makes
    of ``get_model_state_dict`` / ``get_optimizer_state_dict`` (AdamW stepped once) of a model named as torchtitan's
    Llama: only the sharding (DTensor, which needs a process group) is the benchmark's."""
    model = _Llama(*bench.MODELS["tiny"])
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optim.step()
    planner = SavePlanner()
    state = {bench.MODEL: get_model_state_dict(model), bench.OPTIM: get_optimizer_state_dict(model, optim)}
    planner.set_up_planner(state, None, True)
    real = planner.create_local_plan()
    spec = bench.Spec(1, "tiny")
    ours = spec.items(0)
    assert [i.index.fqn for i in ours] == [i.index.fqn for i in real.items]
    assert [i.type == WriteItemType.BYTE_IO for i in ours] == [i.type == WriteItemType.BYTE_IO for i in real.items]
    assert [i.tensor_data and tuple(i.tensor_data.size) for i in ours] == \
        [i.tensor_data and tuple(i.tensor_data.size) for i in real.items]
    assert spec.mapping == real.planner_data
    assert [p.shape for p in model.parameters()] == [torch.Size(s) for _, s in bench.llama_params("tiny")]


@pytest.mark.parametrize("n", [3, 64, 4100])
def test_shards_are_torch_chunks(n):
    """Each rank's box of a Shard(0) parameter is torch.chunk's piece (ceil(dim0 / N) rows, then fewer, then
    none), at the offset where it starts; ranks past the end hold an empty box at the end."""
    for dim0 in (4096, 11008, 32000):
        boxes = bench.shard_chunks((dim0, 8), n)
        pieces = [len(c) for c in torch.arange(dim0).chunk(n)]
        sizes = [b.sizes[0] for b in boxes]
        assert sizes == pieces + [0] * (n - len(pieces))
        starts = [b.offsets[0] for b in boxes]
        assert starts == [min(sum(sizes[:r]), dim0) for r in range(n)]
        assert all(b.sizes[1] == 8 and b.offsets[1] == 0 for b in boxes)


# what rank 0 writes and handles grows at most linearly --------------------------------------------------------
def test_growth_check_can_fail():
    """The negative control: a quadratic series (and one a little worse than linear) fails the check that the
    other tests rely on; linear and constant ones pass."""
    ns = [16, 64, 256]
    assert not bench.at_most_linear(ns, [n * n for n in ns])
    assert not bench.at_most_linear([16, 64], [100, 100 * 4 * 1.2])
    assert not bench.at_most_linear(ns, [1000 + n * n for n in ns])  # quadratic beyond a constant part
    assert bench.at_most_linear(ns, [7 * n for n in ns])
    assert bench.at_most_linear(ns, [1000 + n for n in ns])
    assert bench.at_most_linear(ns, [5, 5, 5])
    assert bench.exponent(16, 256, 64, 4096) == 2.0


def test_rank0_writes_at_most_linear(runs):
    manifest = values(runs, "sizes", "manifest_bytes")
    assert bench.at_most_linear(list(NS), manifest), manifest
    assert manifest[1] / manifest[0] <= 4.5
    metadata = values(runs, "sizes", "dcp_metadata_bytes")
    assert bench.at_most_linear(list(NS), metadata), metadata
    if runs[NS[0]].get("path") == "rule":  # the rule: the same for any N but the mesh's list of ranks
        assert metadata[1] - metadata[0] <= 6 * (NS[1] - NS[0]), metadata
    files = values(runs, "sizes", "manifest_files")  # 2 records and a shard a rank; rank 0's global and small files
    assert files == [3 * n + 4 for n in NS], files
    # the per-rank records do not grow with N (a rank's RNG streams, its number)
    for key in ("rank_json_bytes", "rank_tensors_bytes"):
        small, large = values(runs, "sizes", key)
        assert abs(large - small) <= 64, (key, small, large)


def test_rank0_work_counts_linear(listed):
    """Rank 0's work measured by what it handles, not by time: every item written passes through its metadata once
    (each rank's own chunk of 3 x 291 tensors; the 291 steps and 12 param-group values once), every chunk is one
    record of DCP's metadata, and what it gathers is N pieces of one size."""
    runs = listed
    assert values(runs, "inputs", "items_per_rank") == [4 * 291 + 12] * 2  # params, moments, steps, 12 group values
    for n, r in runs.items():
        counts = r["counts"]
        assert counts["items_written_total"] == counts["storage_records"] == n * 3 * 291 + 291 + 12
        assert counts["metadata_chunks"] == n * 3 * 291 + 291
        assert counts["metadata_keys"] == 4 * 291 + 12
        assert r["inputs"]["items_written_other"] == 3 * 291
    for path in (("counts", "items_written_total"), ("counts", "metadata_chunks"),
                 ("traffic", "gathered_bytes_rank0")):
        assert bench.at_most_linear(list(NS), values(runs, *path), slack=1.0), path


# what a non-zero rank sends and receives does not grow with N ------------------------------------------------
def test_each_rank_sends_and_receives_the_same_at_any_n(runs):
    """A rank's piece (its items described, its files' records), the frame it sends (padded to the largest piece,
    rank 0's) and what it receives in the write round (the all-reduce of sizes and stamp, the outcome) do not grow
    from 16 to 64 ranks: the pieces shrink (a shard's record lists a digest per 4 MiB of it, and the shards
    shrink)."""
    for path in (("traffic", "piece_bytes_other"), ("traffic", "sent_bytes_per_rank")):
        small, large = values(runs, *path)
        assert large <= small, (path, small, large)
    assert values(runs, "traffic", "received_bytes_per_rank") == [5 * 8 + bench.group_mod.ROOM + 8] * 2


def test_by_rule_a_rank_sends_its_files_not_its_items(both):
    """The control of the rule's saving: a piece by rule lacks the listed one's record per item (over 100 bytes
    each; what both carry is the files' records, a digest per 4 MiB of shard), and what rank 0 gathers by rule is
    smaller at 64 ranks than the listed path's at 16."""
    for n in NS:
        saved = both["listed"][n]["traffic"]["piece_bytes_other"] - both["rule"][n]["traffic"]["piece_bytes_other"]
        assert saved >= 100 * both["rule"][n]["inputs"]["items_per_rank"], saved
    assert both["rule"][NS[1]]["traffic"]["gathered_bytes_rank0"] < \
        both["listed"][NS[0]]["traffic"]["gathered_bytes_rank0"]


def test_restore_parses_and_plans(runs):
    """Every rank parses the manifest and dcp-metadata.json and plans its reads: at 64 ranks nothing is refused and
    rank 1 reads exactly its own items."""
    for n, r in runs.items():
        assert r["restore_refused"] is None
        assert r["phases"]["load_plan"]["read_items"] == r["inputs"]["items_per_rank"]
        assert r["files_each_rank_opens"] == r["sizes"]["manifest_files"]
        if r.get("path") == "rule":  # this rank's records alone listed from the rule, not every rank's
            assert r["phases"]["load_plan"]["listed_records"] == r["inputs"]["items_per_rank"]
