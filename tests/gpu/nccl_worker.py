"""Two ranks on two GPUs over NCCL (run by tests/gpu/test_nccl.py under torchrun): ``nccl_worker.py SCENARIO OUT``.

Scenarios: ``ddp`` and ``fsdp2`` (train, background and blocking saves, restore, go on: bitwise against the
uninterrupted run; each save's stall, the peak host RSS and the pinned bytes against the state's size),
``tp_dropout`` (tensor-parallel dropout resumes bitwise), ``one_rank_fails`` (rank 1 refuses a save under FSDP1:
every rank raises within seconds) and ``preempted`` (SIGTERM on rank 1 one step before rank 0's boundary:
``agreed()`` saves on both). Each rank writes OUT/<scenario>-<rank>.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import trainstate as ts


def digest(module: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    h = hashlib.sha256()
    for k, v in sorted(get_model_state_dict(module).items()):
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        h.update(k.encode() + v.float().cpu().numpy().tobytes())
    for k, entry in sorted(get_optimizer_state_dict(module, opt)["state"].items()):
        for name, v in sorted(entry.items()):
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            h.update(f"{k}.{name}".encode() + torch.as_tensor(v).float().cpu().numpy().tobytes())
    return h.hexdigest()


def build(kind: str) -> ts.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(4096, 1024)).cuda()
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[3]):
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    torch.manual_seed(100 + dist.get_rank())
    return ts.TrainState(model=model, optimizer=opt)


def step(state: ts.TrainState) -> None:
    x = torch.randn(64, 1024, device="cuda")
    state["model"](x).square().mean().backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad(set_to_none=True)
    state.next_update += 1


def trained(out: Path, kind: str) -> dict:
    run = out / kind
    state = build(kind)
    stalls = []
    with ts.CheckpointManager(run, keep_last=3) as ckpt:
        for i in range(12):
            step(state)
            if state.next_update in (4, 8):
                started = time.perf_counter()
                ckpt.save(state, blocking=state.next_update == 8)
                torch.cuda.synchronize()
                stalls.append(time.perf_counter() - started)
        status = ckpt.status()
    whole = digest(state["model"], state["optimizer"])
    resumed = build(kind)
    with ts.CheckpointManager(run) as ckpt:
        ckpt.restore(resumed, generation="gen-000000000008")
    while resumed.next_update < 12:
        step(resumed)
    state_bytes = sum(p.numel() * p.element_size() * 3 for p in state["model"].parameters())
    return {"bitwise": digest(resumed["model"], resumed["optimizer"]) == whole, "stall_s": stalls,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "state_bytes": state_bytes,
            "pinned_bytes": status.staging_pinned_bytes, "staging_bytes": status.staging_bytes}


def tp_dropout(out: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))

    def build_tp() -> ts.TrainState:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Dropout(0.3), torch.nn.Linear(1024, 256)).cuda()
        parallelize_module(model, mesh, {"0": ColwiseParallel(use_local_output=False),
                                         "2": RowwiseParallel(input_layouts=None)})
        return ts.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))

    def tp_step(state: ts.TrainState) -> float:
        x = torch.randn(32, 256, device="cuda")
        y = state["model"](x)
        loss = (y.full_tensor() if hasattr(y, "full_tensor") else y).square().mean()
        loss.backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad(set_to_none=True)
        state.next_update += 1
        return float(loss)

    state = build_tp()
    losses = {}
    with ts.CheckpointManager(out / "tp", keep_last=2) as ckpt:
        for _ in range(6):
            losses[state.next_update] = tp_step(state)
            if state.next_update == 3:
                ckpt.save(state)
    resumed = build_tp()
    with ts.CheckpointManager(out / "tp") as ckpt:
        ckpt.restore(resumed)
    again = {}
    while resumed.next_update < 6:
        again[resumed.next_update] = tp_step(resumed)
    return {"bitwise": all(losses[k] == v for k, v in again.items()), "losses": losses, "again": again}


def one_rank_fails(out: Path) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    model = FullyShardedDataParallel(torch.nn.Linear(256, 256).cuda())
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
    state = ts.TrainState(model=model, optimizer=opt)
    if dist.get_rank() == 1:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
    started = time.monotonic()
    try:
        with ts.CheckpointManager(out / "fails") as ckpt:
            ckpt.save(state)
        raised = None
    except Exception as exc:  # noqa: BLE001
        raised = type(exc).__name__
    return {"raised": raised, "seconds": time.monotonic() - started}


def preempted(out: Path) -> dict:
    state = build("ddp")
    saved = None
    with ts.PreemptionHandler() as preempt, ts.CheckpointManager(out / "preempted") as ckpt:
        for i in range(10):
            step(state)
            if dist.get_rank() == 1 and i == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            if preempt.agreed():
                ckpt.save(state)
                saved = state.next_update
                break
    return {"saved": saved}


def main() -> int:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", timeout=timedelta(seconds=60), device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        result = trained(out, scenario) if scenario in ("ddp", "fsdp2") else globals()[scenario](out)
    finally:
        (out / f"{scenario}-{dist.get_rank()}.json").write_text(json.dumps(locals().get("result", {"ok": False})))
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
