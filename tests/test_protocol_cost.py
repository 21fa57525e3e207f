"""The protocol's cost model, counted: rounds constant in N, bytes per rank O(1), rank 0 alone O(N) (issue 50).

A steady save and a restore, under a real ``torchrun`` at 2 and at 4 gloo ranks, counted by
``tests/collective_count.py`` where the real calls happen (every ``torch.distributed`` collective, every
mutating filesystem call): a plain directory, an object store on loopback, and node-local tiers (each rank a
node). What a test pins:

- **rounds**: the same at 2 and 4 ranks, and the number itself (``ROUNDS``), so that a change that adds one
  fails here and says where;
- **bytes each rank other than 0 receives and sends**: the same at 2 and 4 ranks, save a small slack for
  what DCP's own rounds move per rank (each of its object gathers first all-gathers every rank's 8-byte size);
- **rank 0**: what it receives grows by a constant per rank (a small record from each);
- **files and fsyncs**: each rank's the same at 2 and 4 ranks.

The control adds one round in which every rank receives every rank's record (``Ranks.all_gather``, how the
save's rounds ran before): the per-rank check must catch it.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from distlaunch import launch
from objectservers import moto_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parent / "protocol_worker.py"
SCENARIOS = ["plain", "by_rule", "objects", "tiered", "tiny_shards", "control_gather"]
DCP_SLACK = 64  # bytes per rank added to a non-zero rank's receipts by DCP's size all-gathers (8 per rank per round)

# rounds of one steady save and one restore, by scenario, on every rank: (trainstate's own, DCP's)
ROUNDS = {
    "plain": {"save": (7, 0), "restore": (6, 0)},
    "by_rule": {"save": (7, 0), "restore": (6, 0)},
}


@pytest.fixture(scope="module")
def counts(tmp_path_factory, moto_server):  # noqa: F811
    root = tmp_path_factory.mktemp("protocol")
    bucket = moto_server.make_bucket()
    remote = {"url": moto_server.url(bucket, f"run-{uuid.uuid4().hex[:8]}"),
              "storage_options": moto_server.storage_options()}
    out = {}
    for n in (2, 4):
        launched = launch(root / f"n{n}", SCENARIOS, ranks=n, worker=WORKER, timeout=300,
                          env={"TRAINSTATE_TEST_S3": json.dumps(remote)})
        out[n] = {s: launched.ok(s, n) for s in SCENARIOS}
    return out


def ours(tally: dict) -> dict:
    return {k: v for k, v in tally["phases"].items() if "dcp." not in k}


def dcp(tally: dict) -> dict:
    return {k: v for k, v in tally["phases"].items() if "dcp." in k}


def rounds(phases: dict) -> int:
    return sum(p["rounds"] for p in phases.values())


def received(phases: dict) -> int:
    return sum(p["received"] for p in phases.values())


def growth(small: dict, large: dict, n_small: int, n_large: int) -> list[str]:
    """What of one rank's counts (a non-zero rank's) grows from ``n_small`` to ``n_large`` ranks: each phase's
    rounds, its own rounds' bytes, DCP's beyond the slack, and the files and fsyncs."""
    found = []
    for name, tally in (("own", ours), ("dcp", dcp)):
        a, b = tally(small), tally(large)
        if {k: v["rounds"] for k, v in a.items() if v["rounds"]} != {k: v["rounds"] for k, v in b.items() if v["rounds"]}:
            found.append(f"{name} rounds by phase: {_by(a, 'rounds')} at {n_small} ranks, {_by(b, 'rounds')} at "
                         f"{n_large}")
        slack = 0 if name == "own" else DCP_SLACK * (n_large - n_small) * max(1, rounds(b))
        for what in ("received", "sent"):
            if sum(v[what] for v in b.values()) > sum(v[what] for v in a.values()) + slack:
                found.append(f"{name} bytes {what}: {_by(a, what)} at {n_small} ranks, {_by(b, what)} at {n_large}")
    if small["files"] != large["files"]:
        found.append(f"files and fsyncs: {small['files']} at {n_small} ranks, {large['files']} at {n_large}")
    return found


def _moving_round(small: dict, large: dict) -> tuple[dict, dict]:
    """A tiered restore with every disk intact, each rank a node with two replicas: at 2 nodes each holds the
    other's files, at 4 a node lacks rank 0's small file (the optimizer's step counters and param groups, which
    every rank loads), so one fetch round moves chunks between peers and ends in a gather and a broadcast of its
    outcome (2 rounds, one frame each way): the cost of moving shards, not of the world size. Taken out of the
    larger count once, exactly; anything beyond it still counts as growth."""
    phase = "tierfetch.together"
    a, b = small["phases"].get(phase), large["phases"].get(phase)
    if a is None or b is None or b["rounds"] != a["rounds"] + 2:
        return small, large
    frame = 8 + 2048  # one ROOM frame with its length
    trimmed = {**b, "rounds": a["rounds"], "received": b["received"] - frame, "sent": b["sent"] - frame}
    return small, {**large, "phases": {**large["phases"], phase: trimmed}}


def _by(phases: dict, what: str) -> dict:
    return {k: v[what] for k, v in phases.items()}


@pytest.mark.parametrize("scenario, op", [("plain", "save"), ("plain", "restore"), ("objects", "save"),
                                          ("objects", "restore"), ("tiered", "save"), ("tiered", "restore"), ("by_rule", "save"),
                                          ("by_rule", "restore")])
def test_every_rank_but_0_pays_the_same_at_2_and_4_ranks(counts, scenario, op):
    for rank in (1,):
        small, large = counts[2][scenario][rank][op], counts[4][scenario][rank][op]
        if (scenario, op) == ("tiered", "restore"):
            small, large = _moving_round(small, large)
        found = growth(small, large, 2, 4)
        assert not found, f"{scenario} {op} on rank {rank} grows with the world size: {found}"
    assert counts[4][scenario][1][op] == counts[4][scenario][3][op] or scenario != "plain"


@pytest.mark.parametrize("scenario", ["plain", "by_rule"])
@pytest.mark.parametrize("op", ["save", "restore"])
def test_the_rounds_are_pinned(counts, scenario, op):
    for n in (2, 4):
        for rank, result in enumerate(counts[n][scenario]):
            got = (rounds(ours(result[op])), rounds(dcp(result[op])))
            assert got == ROUNDS[scenario][op], (f"{scenario} {op} at {n} ranks, rank {rank}: {got} rounds (own, DCP)"
                                                 f" where {ROUNDS[scenario][op]} are pinned: {_by(result[op]['phases'], 'rounds')}")


def test_the_rule_is_what_was_written(counts):
    assert all(r["by_rule"] for n in (2, 4) for r in counts[n]["by_rule"])


@pytest.mark.parametrize("scenario", ["plain", "by_rule", "objects"])
def test_rank_0_receives_a_constant_record_per_rank(counts, scenario):
    for op in ("save", "restore"):
        at = {n: received(ours(counts[n][scenario][0][op])) for n in (2, 4)}
        per_rank = (at[4] - at[2]) / 2
        assert per_rank <= 16 << 10, f"{scenario} {op}: rank 0 receives {per_rank:.0f} more bytes per rank ({at})"


def test_a_layer_with_fewer_rows_than_ranks_restores_bitwise(counts):
    """At 4 ranks FSDP2 leaves the ranks past a layer's rows empty shards, which no rank writes (DCP kept one of
    them; writing each would be half the items of a 7B model at 8,192 ranks)."""
    for n in (2, 4):
        for result in counts[n]["tiny_shards"]:
            assert result["bitwise"] and result["differed_before"], result


def test_control_a_round_that_hands_every_rank_every_record_is_caught(counts):
    found = growth(counts[2]["control_gather"][1]["save"], counts[4]["control_gather"][1]["save"], 2, 4)
    assert found and "own bytes received" in found[0], found
