"""SIGKILL torture: a child saves in a loop and acknowledges each save; the parent kills it at random.

    python benchmarks/torture.py --kills 500 [--seed S] [--dir PATH] [--mb 4]

Each child is forked from this already-imported process (so a kill cycle costs
milliseconds, not an interpreter start), restores the run directory, and then
loops: change the state, ``save``, write ``ack <update>`` to a pipe. The parent
SIGKILLs it after a random delay, then checks, with the child dead:

- restore succeeds and returns a generation at or after the last acknowledged
  save (an acknowledged save is durable and published);
- the restored state is bitwise the state of that update (every update's state
  is a known function of its number);
- every visible generation fully verifies: nothing partial is ever visible.

It prints one summary line and exits non-zero on the first violation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

import trainstate as ts
from trainstate.storage.local import LocalStore
from trainstate.storage.verify import verify_generation


class Weights:
    """A component whose content is a pure function of the update number."""

    def __init__(self, numel: int):
        self.value = {"w": torch.zeros(numel), "u": torch.zeros((), dtype=torch.int64)}

    def set(self, update: int) -> None:
        gen = torch.Generator().manual_seed(update)
        self.value = {"w": torch.rand(self.value["w"].numel(), generator=gen), "u": torch.tensor(update)}

    def state_dict(self):
        return self.value

    def load_state_dict(self, value):
        self.value = value


def _state(numel: int) -> ts.TrainState:
    return ts.TrainState(weights=Weights(numel), capture_global_rngs=False)


def _child(directory: Path, numel: int, ack_fd: int, ack_early: bool) -> None:
    """Runs in the forked child: restore, then save forever, acknowledging each save.

    ``ack_early`` (the negative control) acknowledges before saving, as a buggy
    loop that reports progress it has not made durable would.
    """
    try:
        state = _state(numel)
        with ts.CheckpointManager(directory, keep_last=2) as ckpt:
            ckpt.restore(state)
            while True:
                state.next_update += 1
                state["weights"].set(state.next_update)
                if ack_early:
                    os.write(ack_fd, f"{state.next_update}\n".encode())
                ckpt.save(state)
                if not ack_early:
                    os.write(ack_fd, f"{state.next_update}\n".encode())
    finally:
        os._exit(3)  # never return into the parent's code


def _check(directory: Path, numel: int, acked: int) -> tuple[int, str | None]:
    store = LocalStore(directory, create=False)
    for name in store.generations():
        try:
            verify_generation(store, name)
        except ts.CorruptGeneration as exc:
            return -1, f"partial or corrupt generation visible: {exc}"
    state = _state(numel)
    try:
        with ts.CheckpointManager(directory) as ckpt:
            info = ckpt.restore(state)
    except ts.TrainStateError as exc:
        return -1, f"restore failed: {exc}"
    got = 0 if info is None else info.generation.next_update
    if got < acked:
        return got, f"restored update {got}, but update {acked} had been acknowledged"
    if info is not None:
        expected = Weights(numel)
        expected.set(got)
        if not (torch.equal(state["weights"].value["w"], expected.value["w"])
                and int(state["weights"].value["u"]) == got):
            return got, f"update {got} restored, but not bitwise the state saved at that update"
    return got, None


def torture(directory: Path, kills: int, seed: int, numel: int, ack_early: bool = False) -> dict:
    """Run ``kills`` kill/restart cycles; return counts, or raise AssertionError on a violation."""
    rng = random.Random(seed)
    torch.set_num_threads(1)  # no intra-op threads alive across fork
    acked = restored_max = 0
    max_delay = 1.0
    mid_save = 0
    start = time.perf_counter()
    for cycle in range(kills):
        staging_before = set(directory.glob(".trainstate-staging-*"))
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _child(directory, numel, write_fd, ack_early)
        os.close(write_fd)
        began = time.perf_counter()
        # The first child runs until its first acknowledgement: that start-to-ack time
        # scales the kill window to this machine, so kills land before, inside and after saves.
        delay = 60.0 if cycle == 0 else rng.uniform(0.0, max_delay)
        deadline = began + delay
        buffer = b""
        while (left := deadline - time.perf_counter()) > 0:
            ready, _, _ = select.select([read_fd], [], [], left)
            if ready:
                chunk = os.read(read_fd, 4096)
                if not chunk:
                    break
                buffer += chunk
                if cycle == 0 and b"\n" in buffer:
                    max_delay = max(3 * (time.perf_counter() - began), 0.05)
                    break
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        while chunk := os.read(read_fd, 4096):  # acks written just before the kill
            buffer += chunk
        os.close(read_fd)
        acks = [int(line) for line in buffer.split()]
        if acks:
            acked = max(acked, acks[-1])
        mid_save += bool(set(directory.glob(".trainstate-staging-*")) - staging_before)
        got, problem = _check(directory, numel, acked)
        if problem:
            raise AssertionError(f"kill {cycle + 1} (seed {seed}): {problem}")
        restored_max = max(restored_max, got)
    return {"kills": kills, "seed": seed, "acknowledged_saves": acked, "restored_at_end": restored_max,
            "kills_inside_a_save": mid_save, "seconds": round(time.perf_counter() - start, 1),
            "state_bytes": numel * 4, "kill_window_s": round(max_delay, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=500)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--mb", type=float, default=1.0, help="size of the saved state in MB")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="trainstate-torture-"))
    try:
        result = torture(directory / "run", args.kills, seed, int(args.mb * 1e6 / 4))
    except AssertionError as exc:
        print(f"FAILED: {exc}")
        return 1
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
