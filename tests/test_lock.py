"""Single writer: a second manager is refused; a SIGKILLed holder leaves no stale lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import trainstate as ts
from trainer import build, step

HOLDER = """
import sys, time, trainstate as ts
m = ts.CheckpointManager(sys.argv[1]).__enter__()
print("locked", flush=True)
time.sleep(60)
"""


def test_second_writer_gets_clear_error(tmp_path):
    with ts.CheckpointManager(tmp_path):
        with pytest.raises(ts.DirectoryLocked, match=str(os.getpid())) as err:
            ts.CheckpointManager(tmp_path).__enter__()
        assert isinstance(err.value, BlockingIOError)


def test_lock_released_on_close(tmp_path):
    with ts.CheckpointManager(tmp_path):
        pass
    with ts.CheckpointManager(tmp_path):
        pass


def test_other_process_holding_lock_blocks_then_sigkill_frees_it(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        state = build()
        step(state)
        with pytest.raises(ts.DirectoryLocked, match=str(child.pid)):
            with ts.CheckpointManager(tmp_path) as ckpt:
                ckpt.save(state)
        assert not any(p.name.startswith("gen-") for p in tmp_path.iterdir())
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert (tmp_path / ".trainstate.lock").exists()  # the file stays; the kernel dropped the lock
        with ts.CheckpointManager(tmp_path) as ckpt:
            ckpt.save(state)
    finally:
        child.kill()
        child.wait()
