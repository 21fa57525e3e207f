"""One rank of a replica group of the torchft tests (run by tests/test_torchft.py), under the group's own ``torchrun``.

``python -m torch.distributed.run ... torchft_worker.py OUT`` with ``REPLICA_GROUP_ID``, ``TORCHFT_LIGHTHOUSE``
and ``TRAINSTATE_TEST_FT`` (JSON: ``steps``, ``pace_s``, ``save_every``,
``run``: where each group keeps its generations, restored from at a restart, ``corrupt``: flip one bit in the
first heal stream(s) this group receives, ``truncate``: cut them, ``slow``: slow the first one down); every group
stops at the step ``OUT/stop.json`` names, once the test writes it. Each committed step appends a line to
``OUT/group<id>-r<rank>.jsonl``: the step, the rank's digest (its parameters and AdamW moments and steps, local
shards for the sharded ones, every generator, the loader's position, the clocks), and how many heals it applied.

With two ranks a group (``torchrun --nproc_per_node=2``) the first layer is sharded by FSDP2 across the group's
ranks and the last is replicated in it (its gradients averaged in the group by hand, as DDP would), so that a
heal moves local shards and plain tensors alike. Both groups train the same model on the same data from the same
seeds, gradients averaged over the participating groups (rank r of each group with rank r of the others), so a
healed rank equals the survivor's rank at every step after it joins only if it received the whole restart state.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

import torchft.manager
from torchft import Manager, ProcessGroupGloo

import trainstate as ts
from trainstate.integrations.torchft import Healing, ManagerState, wire

CFG = json.loads(os.environ.get("TRAINSTATE_TEST_FT", "{}"))
GROUP = int(os.environ["REPLICA_GROUP_ID"])
RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
ME = f"group{GROUP}-r{RANK}"

# torchft's manager server binds every interface; the tests keep every server on loopback
_server = torchft.manager.ManagerServer
torchft.manager.ManagerServer = lambda **kw: _server(**{**kw, "bind": kw["bind"].replace("[::]", "127.0.0.1")})


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index):  # (a SampleIndex: its int is the sample)
        g = torch.Generator().manual_seed(int(index))
        return torch.randn(16, generator=g), torch.randn(4, generator=g)


def build() -> ts.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 4))
    if WORLD > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])  # sharded across the group's ranks; model[3] stays replicated in the group
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    loader = ts.ResumableLoader(Samples(), batch_size=8, seed=11, rank=RANK, world_size=WORLD)
    torch.manual_seed(100 + RANK)  # each rank its own dropout stream
    return ts.TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader, torchft=ManagerState(),
                         rngs={"noise": torch.Generator().manual_seed(5 + RANK)}, contract={"config": {"width": 64}})


def local(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank


def digest(state: ts.TrainState) -> str:
    h = hashlib.sha256()
    for name, value in sorted(state["model"].state_dict().items()):
        h.update(name.encode() + local(value).numpy().tobytes())
    for index, entry in sorted(state["optimizer"].state_dict()["state"].items()):
        for name, value in sorted(entry.items()):
            h.update(f"{index}.{name}".encode() + local(value).numpy().tobytes())
    h.update(state.rngs["noise"].get_state().numpy().tobytes() + torch.get_rng_state().numpy().tobytes())
    h.update(json.dumps([state["loader"].state_dict(), state["scheduler"].state_dict(), state.next_update],
                        sort_keys=True, default=str).encode())
    return h.hexdigest()


def tamper(out: Path) -> None:
    """Damage the first heal streams this group receives, in transit (``corrupt``: one bit; ``truncate``: cut),
    or hold the first one (``slow``: a marker file written as it starts, so that the test can SIGKILL this
    group mid-transfer)."""
    left = {"n": int(CFG.get("corrupt", 0) or CFG.get("truncate", 0) or CFG.get("slow", 0))}
    real = wire.receive

    def damaged(stream, **kw):
        if left["n"] <= 0:
            return real(stream, **kw)
        left["n"] -= 1
        if CFG.get("slow"):
            (out / f"{ME}-receiving-{os.getpid()}").touch()
            time.sleep(3.0)  # (the test SIGKILLs this group now, mid-transfer)
            return real(stream, **kw)
        data = bytearray(stream.read())
        if CFG.get("corrupt"):
            data[len(data) // 2] ^= 0x01
        else:
            data = data[: len(data) // 2]
        return real(io.BytesIO(bytes(data)), **kw)

    wire.receive = damaged  # (the transport reads through the module: this damages what it reads)


def stop_step(out: Path) -> int:
    """The step the test asks every group to stop at (``OUT/stop.json``, written once the kills are done)."""
    try:
        return json.loads((out / "stop.json").read_text())["step"]
    except (FileNotFoundError, ValueError, KeyError):
        return 1 << 62


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if WORLD > 1:
        torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=30))
    state = build()
    heal = Healing(state, timeout=timedelta(seconds=20))
    if CFG.get("corrupt") or CFG.get("truncate") or CFG.get("slow"):
        tamper(out)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
                      load_state_dict=heal.load_state_dict, state_dict=heal.state_dict,
                      replica_id=f"group{GROUP}", hostname="127.0.0.1", use_async_quorum=False,
                      timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=30),
                      connect_timeout=timedelta(seconds=20), checkpoint_transport=heal.transport)
    state["torchft"].manager = manager
    ckpt = ts.CheckpointManager(CFG["run"] + f"/group{GROUP}", keep_last=2) if CFG.get("run") else None
    if ckpt is not None and ckpt.latest() is not None:  # a restart: its newest generation, the manager's step too
        restored = ckpt.restore(state)
        (out / f"{ME}-restored-{os.getpid()}.json").write_text(json.dumps(
            {"generation": restored.generation.name, "step": manager.current_step()}))
    model, opt = state["model"], state["optimizer"]
    batches = heal.batches(state["loader"])
    noise = state.rngs["noise"]
    log = open(out / f"{ME}.jsonl", "a")
    refused = 0
    try:
        while manager.current_step() < min(CFG.get("steps", 2000), stop_step(out)):
            heal.boundary()
            manager.start_quorum()
            if len(heal.transport.refused) != refused:  # kept now: a later SIGKILL must not lose it
                refused = len(heal.transport.refused)
                (out / f"{ME}-refused-{os.getpid()}.json").write_text(json.dumps(heal.transport.refused))
            x, y = next(batches)
            model.train()
            loss = ((model(x + 0.01 * torch.randn(x.shape, generator=noise)) - y) ** 2).mean()
            loss.backward()
            for p in model.parameters():
                grad = local(p.grad)
                if WORLD > 1 and grad is p.grad:  # a replicated parameter: averaged in the group, as DDP would
                    torch.distributed.all_reduce(grad)
                    grad /= WORLD
                manager.allreduce(grad).wait()  # and across the participating groups
            if manager.should_commit():
                opt.step()
                state["scheduler"].step()
                state.next_update += 1
                saved = None
                if ckpt is not None and state.next_update % CFG.get("save_every", 5) == 0:
                    saved = ckpt.save(state).name  # (with the group's other rank: one commit)
                log.write(json.dumps({"step": manager.current_step(), "update": state.next_update,
                                      "digest": digest(state), "healed": len(heal.healed), "pid": os.getpid(),
                                      "boundary_s": heal.boundaries[-1], "saved": saved}) + "\n")
                log.flush()
            opt.zero_grad()
            time.sleep(CFG.get("pace_s", 0.0))
        summary = {"pid": os.getpid(), "healed": heal.healed, "served": heal.transport.served, "received": heal.transport.received,
                   "refused": heal.transport.refused}
        (out / f"{ME}-{os.getpid()}.json").write_text(json.dumps(summary, default=str))
    finally:
        log.close()
        if ckpt is not None:
            ckpt.close()
        manager.shutdown(wait=False)
        heal.shutdown()
        if WORLD > 1:
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
