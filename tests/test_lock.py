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


FORKING_HOLDER = """
import fcntl, os, sys, time, trainstate as ts
m = ts.CheckpointManager(sys.argv[1]).__enter__()
if sys.argv[2] == "raw":  # control: a lock trainstate does not manage, shared with the child by fork
    fd = os.open(os.path.join(sys.argv[1], "other.lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
pid = os.fork()
if pid == 0:  # a DataLoader worker, say: outlives its parent for a while
    # says so only once running: the at-fork handlers ran before fork returned here (the parent printing the
    # pid could race a child not yet scheduled, which would still share the lock's description)
    print(os.getpid(), flush=True)
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


@pytest.mark.parametrize("kind", ["trainstate", "raw"])
def test_forked_child_does_not_keep_the_directory_locked(tmp_path, kind):
    """A child forked while the manager holds the lock (DataLoader workers are) must not keep it after the
    parent is SIGKILLed. The raw control shows that an ordinary flock would stay held by the child."""
    import fcntl
    holder = subprocess.Popen([sys.executable, "-c", FORKING_HOLDER, str(tmp_path), kind], stdout=subprocess.PIPE,
                              text=True)
    grandchild = int(holder.stdout.readline())
    try:
        holder.kill()
        holder.wait()
        with ts.CheckpointManager(tmp_path):  # the parent is dead; its forked child still runs
            os.kill(grandchild, 0)
        fd = os.open(tmp_path / "other.lock", os.O_RDWR | os.O_CREAT)
        try:
            if kind == "raw":
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        os.kill(grandchild, signal.SIGKILL)


def test_close_releases_the_lock_even_while_a_forked_child_lives(tmp_path):
    manager = ts.CheckpointManager(tmp_path).__enter__()
    pid = os.fork()
    if pid == 0:
        import time
        time.sleep(30)
        os._exit(0)
    try:
        manager.close()
        out = subprocess.run([sys.executable, "-c", HOLDER.replace("time.sleep(60)", ""), str(tmp_path)],
                             capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == "locked", out.stderr
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
