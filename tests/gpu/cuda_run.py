"""One training process of the GPU tests (tests/gpu/test_cuda.py): trains on CUDA, saves, or restores and goes on.

``python cuda_run.py RUN MODE UPDATES SAVE_AT OUT`` with MODE ``train`` (train UPDATES updates from the start,
saving at SAVE_AT) or ``resume`` (restore the newest generation, train to UPDATES). OUT receives JSON: every
update's loss bits, the final parameters' and moments' digest, the CUDA generators' states, what CUDA was
initialised with. The model draws from dropout (the device's default generator) and from a registered
``torch.Generator(device="cuda")``; AdamW fused; bf16 autocast; a GradScaler.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

import trainstate as ts


def build() -> ts.TrainState:
    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(256, 8)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    noise = torch.Generator(device=device).manual_seed(5)
    return ts.TrainState(model=model, optimizer=opt, scaler=scaler, rngs={"noise": noise})


def step(state: ts.TrainState) -> float:
    model, opt, scaler = state["model"], state["optimizer"], state["scaler"]
    device = next(model.parameters()).device
    x = torch.randn(32, 64, device=device, generator=state.rngs["noise"])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    state.next_update += 1
    return loss.item()


def digest(state: ts.TrainState) -> str:
    h = hashlib.sha256()
    for name, value in sorted(state["model"].state_dict().items()):
        h.update(name.encode() + value.float().cpu().numpy().tobytes())
    for index, entry in sorted(state["optimizer"].state_dict()["state"].items()):
        for name, value in sorted(entry.items()):
            h.update(f"{index}.{name}".encode() + value.float().cpu().numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    run, mode, updates, save_at, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    torch.cuda.set_device(int(os.environ.get("TS_DEVICE", "0")))  # the device this process draws on
    state = build()
    losses = {}
    with ts.CheckpointManager(run, keep_last=3) as ckpt:
        if mode == "resume":
            info = ckpt.restore(state)
            assert info is not None and info.identical_continuation, info
        while state.next_update < updates:
            losses[state.next_update] = step(state).hex()
            if mode == "train" and state.next_update == save_at:
                ckpt.save(state)
    result = {"losses": losses, "digest": digest(state), "device": torch.cuda.current_device(),
              "cuda_state": torch.cuda.get_rng_state().tolist(), "noise": state.rngs["noise"].get_state().tolist()}
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
