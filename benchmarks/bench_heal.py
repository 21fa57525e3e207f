"""Live recovery (issue 52): one heal's transfer through trainstate's transport against torchft's own.

Two gloo ranks under ``torchrun`` on this host: rank 0 holds a trained state (``Linear(1024, 1024)`` layers and
their AdamW moments, ``--size`` in all) and offers it, rank 1 fetches it, as a survivor and a healing replica group
do. Each repetition, the transports in rotated order, timed on the receiver from a barrier to a state it can load:

- ``trainstate``: :class:`trainstate.integrations.torchft.TrainStateTransport`, the whole restart state
  (:meth:`Healing.boundary`'s snapshot: model, optimizer, RNG), every byte digested (``xxh3-chunked``) on both
  sides and verified before it is decoded;
- ``http``: torchft's ``HTTPTransport`` (``num_chunks=0``) with the model's and optimizer's state dicts
  (``torch.load(weights_only=False)`` on the receiver, nothing verified);
- ``pg``: torchft's ``PGTransport`` over the gloo process group (pickled metadata, then each tensor sent).

Each is timed twice: the transfer (``recv_checkpoint`` returns), and the heal, until the received state is
applied to the live one (``Healing.load_state_dict``; for the stock transports the model's and the
optimizer's ``load_state_dict``), which is when the replica can train again.

Reported: medians, each against ``http``, the bytes of tensors moved, and the load average. Every server
listens on 127.0.0.1.

    python benchmarks/bench_heal.py --size 64M --reps 5
    python benchmarks/bench_heal.py --size 1G --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import trainstate as ts  # noqa: E402
from bench_amortized import size_arg  # noqa: E402
from ftstock import loopback_http  # noqa: E402

TIMEOUT = timedelta(seconds=600)


def build(size: int) -> ts.TrainState:
    torch.manual_seed(0)
    layers = max(1, size // (3 * 1024 * 1024 * 4))
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1024)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return ts.TrainState(model=model, optimizer=opt, rngs={"data": torch.Generator().manual_seed(1)})


def run(args: argparse.Namespace) -> None:
    from torchft.checkpointing.pg_transport import PGTransport

    from trainstate.integrations.torchft import Healing

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    state = build(size_arg(args.size))
    heal = Healing(state, timeout=TIMEOUT)
    http, pg = loopback_http(TIMEOUT), PGTransport(dist.group.WORLD, TIMEOUT, torch.device("cpu"))
    transports = {"trainstate": heal.transport, "http": http, "pg": pg}
    addresses = [t.metadata() for t in transports.values()]
    dist.broadcast_object_list(addresses, 0)
    metadata = dict(zip(transports, addresses))
    nbytes = sum(t.nbytes for t in state["model"].state_dict().values()) + sum(
        v.nbytes for entry in state["optimizer"].state_dict()["state"].values() for v in entry.values())
    times: dict[str, list[float]] = {k: [] for k in (*transports, *(f"{t} heal" for t in transports))}
    loads = []
    names = list(transports)
    for rep in range(args.reps):
        loads.append(os.getloadavg()[0])
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            step = rep * 10 + names.index(name)
            transport = transports[name]
            if rank == 0:
                if name == "trainstate":
                    heal.boundary()
                    user = heal.state_dict()
                else:
                    user = {"model": state["model"].state_dict(), "optim": state["optimizer"].state_dict()}
                if name != "pg":
                    transport.send_checkpoint([1], step, {"user": {"default": user}, "torchft": {"step": step}},
                                              TIMEOUT)
                dist.barrier()
                if name == "pg":
                    transport.send_checkpoint([1], step, {"user": {"default": user}, "torchft": {"step": step}},
                                              TIMEOUT)
                dist.barrier()
                transport.disallow_checkpoint()
            else:
                dist.barrier()
                started = time.perf_counter()
                got = transport.recv_checkpoint(0, metadata[name], step, TIMEOUT)
                times[name].append(time.perf_counter() - started)
                if name == "trainstate":
                    heal.load_state_dict(got["user"]["default"])
                else:
                    state["model"].load_state_dict(got["user"]["default"]["model"])
                    state["optimizer"].load_state_dict(got["user"]["default"]["optim"])
                times[f"{name} heal"].append(time.perf_counter() - started)
                del got
                dist.barrier()
                transport.disallow_checkpoint()
        if rank == 1:
            print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items() if v), flush=True)
    if rank == 1:
        med = {k: statistics.median(v) for k, v in times.items() if v}
        print(f"\n{args.size}: {nbytes / 2**20:.0f} MiB of tensors (model and AdamW moments); load average "
              f"{min(loads):.1f}-{max(loads):.1f}; {args.reps} repetitions, rotated")
        print("| transport | median s | vs http |\n|---|---:|---:|")
        for k, v in med.items():
            print(f"| {k} | {v:.3f} | {v / med['http heal' if 'heal' in k else 'http']:.2f}x |")
        print(f"http time / trainstate time: transfer {med['http'] / med['trainstate']:.2f}, heal "
              f"{med['http heal'] / med['trainstate heal']:.2f} (>= 1.0: trainstate as fast or faster, verifying "
              "every byte)")
    heal.shutdown()
    http.shutdown(wait=False)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="64M", help="tensor bytes of the state (binary units)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:
        run(args)
        return
    raise SystemExit(subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                      "--nproc_per_node=2", __file__, *sys.argv[1:]],
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}))


if __name__ == "__main__":
    main()
