"""The checkpoint protocol's cost per rank, counted under a real ``torchrun`` (run by tests/test_protocol_cost.py).

Each scenario trains an FSDP2 model a few updates, saves once to warm up, then counts one steady save (with
what follows it on the writer thread: replicas, an upload) and one restore into fresh objects with
:class:`collective_count.Tally`, and writes the counts. The test launches it at 2 and at 4 ranks and compares.

- ``plain``: one directory every rank shares (the default ``full_every``: by rule too, each shard being one file);
- ``by_rule``: the same without ``full_every``: DCP's metadata written by rule;
- ``objects``: an ``s3://`` URL (``$TRAINSTATE_TEST_S3``) on a loopback server;
- ``tiered``: node-local tiers, each rank a node of its own (``node=rank``) with its own directory, two replicas
  (waited for) and no remote: the restore finds every disk intact;
- ``tiny_shards``: a layer with fewer rows than ranks (empty FSDP2 shards, which no rank writes), restored bitwise;
- ``control_gather``: the negative control: the plain save plus one round in which every rank receives every
  rank's record (``Ranks.all_gather``, the shape of the protocol before this count), which the test must catch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainstate as ts  # noqa: E402
from collective_count import Tally  # noqa: E402
import torch  # noqa: E402

from dist_worker import TIMEOUT_S, build, full_state, main, scenario, train  # noqa: E402


def _counted(make, extra=None) -> dict:
    """Train, warm up with one save, then count a steady save and a restore into fresh objects."""
    state = build("fsdp")
    with make() as ckpt:
        train(state, 2)
        ckpt.save(state)
        train(state, 1)
        with Tally() as save:
            ckpt.save(state)
            ckpt.wait()
            if extra is not None:
                extra(ckpt)
    fresh = build("fsdp", seed=1)
    with make() as ckpt:
        with Tally() as restore:
            info = ckpt.restore(fresh)
            ckpt.wait()  # what the restore left to the writer thread (a refill, its timing record), counted too
    return {"save": save.summary(), "restore": restore.summary(), "restored": info.generation.name,
            "sources": info.sources}


@scenario
def plain(out: Path) -> dict:
    return _counted(lambda: ts.CheckpointManager(out / "run", keep_last=2, collective_timeout_s=TIMEOUT_S))


@scenario
def by_rule(out: Path) -> dict:
    """The plain save without ``full_every``: DCP's metadata by rule (each rank sends its files, not its items)."""
    counted = _counted(lambda: ts.CheckpointManager(out / "run", keep_last=2, full_every=None,
                                                    collective_timeout_s=TIMEOUT_S))
    metadata = json.loads((out / "run" / counted["restored"] / "dcp-metadata.json").read_bytes())
    return {**counted, "by_rule": "rule" in metadata}


@scenario
def objects(out: Path) -> dict:
    remote = json.loads(os.environ["TRAINSTATE_TEST_S3"])
    url = f"{remote['url']}/{os.environ.get('TS_WORLD_TAG', 'w')}-{dist.get_world_size()}"
    return _counted(lambda: ts.CheckpointManager(url, storage_options=remote["storage_options"], keep_last=2,
                                                 collective_timeout_s=TIMEOUT_S))


@scenario
def tiered(out: Path) -> dict:
    rank = dist.get_rank()
    return _counted(lambda: ts.CheckpointManager(out / f"node{rank}", keep_last=2, replicas=2, node=rank,
                                                 wait_replicas=True, collective_timeout_s=TIMEOUT_S))


@scenario
def tiny_shards(out: Path) -> dict:
    """A layer with fewer rows than ranks: FSDP2 leaves the ranks past its rows an empty shard, which no rank
    writes; the restore into fresh objects is bitwise all the same."""
    from torch.distributed.fsdp import fully_shard

    def made(seed: int) -> ts.TrainState:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 3), torch.nn.Linear(3, 1))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return ts.TrainState(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 2))

    state = made(0)
    for _ in range(2):
        state["model"](torch.randn(4, 8)).pow(2).mean().backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()
        state["scheduler"].step()
        state.next_update += 1
    with ts.CheckpointManager(out / "run", collective_timeout_s=TIMEOUT_S) as ckpt:
        ckpt.save(state)
    fresh = made(1)
    before, other = full_state(state), full_state(fresh)
    with ts.CheckpointManager(out / "run", collective_timeout_s=TIMEOUT_S) as ckpt:
        ckpt.restore(fresh)
    after = full_state(fresh)
    return {"bitwise": sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before),
            "differed_before": any(not torch.equal(before[k], other[k]) for k in before if k.startswith("model.")),
            "tensors": len(before)}


@scenario
def control_gather(out: Path) -> dict:
    def every_record(ckpt: ts.CheckpointManager) -> None:
        ckpt._session.fg.all_gather({"record": "x" * 1000}, "control")
    return _counted(lambda: ts.CheckpointManager(out / "run", keep_last=2, collective_timeout_s=TIMEOUT_S),
                    every_record)


if __name__ == "__main__":
    main()
