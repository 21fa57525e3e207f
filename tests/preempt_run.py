"""Child half of tests/test_preemption.py: a training loop that saves every N updates and on preemption.

``python preempt_run.py run --dir D --total T ...`` runs one training process.
``python preempt_run.py zygote`` imports torch once, then forks one such
process per request (one JSON line on stdin: ``{"op": "start", "args": [...],
"log": path}`` -> ``{"pid": n}``; ``{"op": "wait", "pid": n, "timeout": s}``
-> ``{"code": c, "timed_out": bool}``). Each worker is its own process: it
builds fresh objects and restores from disk after the fork, as a fresh
interpreter would; only the imports are shared. Workers print progress lines
(flushed) that the test waits on before signalling.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainstate as ts  # noqa: E402
from trainstate.storage.local import LocalStore  # noqa: E402
from trainstate.format.manifest import generation_name  # noqa: E402
from trainer import build  # noqa: E402

WAIT_LIMIT_S = 30.0


def seed_globals(seed: int = 7) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def fresh_state() -> ts.TrainState:
    """What a fresh run starts from (the test's reference does exactly the same)."""
    seed_globals()
    return build()


def step(state: ts.TrainState, mid_update=None) -> None:
    """trainer.step, with a hook between backward and the optimizer step: the middle of an update."""
    model, opt, scaler = state["model"], state["optimizer"], state["scaler"]
    x = torch.randn(8, 6, generator=state.rngs["data"])
    x = x + torch.from_numpy(state.rngs["noise"].normal(size=(8, 6)).astype(np.float32)) * 0.1
    y = (torch.arange(8) + random.randrange(2)) % 2
    x = x * float(1.0 + 0.1 * np.random.rand())
    model.train()
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    if mid_update is not None:
        mid_update()  # gradients are pending here: no consistent state to save
    scaler.step(opt)
    scaler.update()
    state["scheduler"].step()
    state.next_update += 1
    state.tokens_seen += x.numel()
    state.counters["epoch"] = state.next_update // 5


class SlowSaveStore(LocalStore):
    """The real store; once ``slow`` is set, a save stalls before writing its tensors (state.json is staged)."""

    slow = False

    def begin(self, generation):
        staging = super().begin(generation)
        real_write = staging.write

        def write(file, chunks, **kwargs):
            if self.slow and file == "tensors.safetensors":
                print(f"saving {generation}: writing {file}", flush=True)
                deadline = time.monotonic() + WAIT_LIMIT_S
                while time.monotonic() < deadline:
                    time.sleep(0.01)
            return real_write(file, chunks, **kwargs)

        staging.write = write
        return staging


def run(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--total", type=int, required=True)
    p.add_argument("--every", type=int, required=True)
    p.add_argument("--handler", choices=["yes", "no"], default="yes")
    p.add_argument("--wait-at", type=int, default=None, help="the update that waits, mid-update, for a signal")
    p.add_argument("--stuck", action="store_true", help="the waiting update never reaches its boundary in time")
    p.add_argument("--slow-save", action="store_true", help="the preemption save stalls mid-write")
    p.add_argument("--grace", type=float, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    state = fresh_state()
    store = SlowSaveStore(args.dir) if args.slow_save else None
    with ts.CheckpointManager(args.dir, keep_last=3, store=store) as ckpt:
        info = ckpt.restore(state)
        print(f"resumed {info.generation.name if info else None} at {state.next_update}", flush=True)
        handler = ts.PreemptionHandler(grace_s=args.grace) if args.handler == "yes" else contextlib.nullcontext()
        with handler as preempt:
            print(f"handlers {signal.getsignal(signal.SIGTERM)!r} {signal.getsignal(signal.SIGUSR1)!r}", flush=True)

            def wait_for_signal() -> None:
                print(f"update {state.next_update} waiting", flush=True)
                deadline = time.monotonic() + (5.0 if args.stuck else WAIT_LIMIT_S)
                while time.monotonic() < deadline and (args.stuck or preempt is None or not preempt.requested):
                    time.sleep(0.005)
                print(f"update {state.next_update} resumed", flush=True)

            while state.next_update < args.total:
                k = state.next_update
                print(f"update {k} started", flush=True)
                step(state, wait_for_signal if k == args.wait_at else None)
                saved = False
                if state.next_update % args.every == 0 or state.next_update == args.total:
                    ckpt.save(state)
                    saved = True
                    print(f"saved {generation_name(state.next_update)}", flush=True)
                if preempt is not None and preempt.requested:
                    if not saved:
                        if store is not None:
                            store.slow = True
                        print(f"saving {generation_name(state.next_update)} on preemption", flush=True)
                        ckpt.save(state)
                    print(f"preempted by {signal.Signals(preempt.received).name} at {state.next_update}", flush=True)
                    preempt.exit()
        print(f"done at {state.next_update}", flush=True)
    return 0


def zygote() -> int:
    torch.set_num_threads(1)
    warm = fresh_state()
    step(warm)  # AdamW's first step imports more of torch: once, here, before any fork
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads != 1:
        raise RuntimeError(f"the zygote runs {threads} threads; forking it would be unsafe")
    devnull = os.open(os.devnull, os.O_RDONLY)
    reply = sys.stdout
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "start":
            reply.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(devnull, 0)
                    os.dup2(log, 1)
                    os.dup2(log, 2)
                    os.close(log)
                    code = run(request["args"])
                except SystemExit as exc:
                    code = exc.code if type(exc.code) is int else 2
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            answer = {"pid": pid}
        else:
            pid, deadline, timed_out = request["pid"], time.monotonic() + request["timeout"], False
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    os.kill(pid, signal.SIGKILL)
                    _, status = os.waitpid(pid, 0)
                    break
                time.sleep(0.01)
            answer = {"code": os.waitstatus_to_exitcode(status), "timed_out": timed_out}
        reply.write(json.dumps(answer) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["zygote"]:
        sys.exit(zygote())
    if sys.argv[1:2] == ["run"]:
        sys.exit(run(sys.argv[2:]))
    sys.exit(f"usage: {sys.argv[0]} zygote | run --dir D --total T --every N [...]")
