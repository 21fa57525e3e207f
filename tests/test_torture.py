"""SIGKILL torture at CI size; `python benchmarks/torture.py --kills 500` is the full run (RELIABILITY.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from torture import torture  # noqa: E402

KILLS = int(os.environ.get("TRAINSTATE_TORTURE_KILLS", "25"))


def test_acknowledged_saves_survive_sigkill(tmp_path):
    result = torture(tmp_path / "run", KILLS, seed=int(os.environ.get("TRAINSTATE_TORTURE_SEED", "7")),
                     numel=100_000)
    print(f"\n{result}")
    assert result["kills"] == KILLS and result["acknowledged_saves"] > 0
    assert result["restored_at_end"] >= result["acknowledged_saves"]


def test_torture_catches_an_acknowledgement_before_durability(tmp_path):
    """Negative control: a loop that acknowledges before its save is durable is caught."""
    import pytest

    with pytest.raises(AssertionError, match="had been acknowledged"):
        torture(tmp_path / "run", 60, seed=3, numel=100_000, ack_early=True)


def test_hashing_works_in_a_child_forked_after_hashing(tmp_path):
    """A process that forks after trainstate hashed a large file must be able to hash in the child."""
    import os
    import signal
    import time

    from trainstate.format.digest import digest_bytes

    data = os.urandom(8 << 20)
    digest_bytes("blake3", data)  # the parent hashes a large input first
    pid = os.fork()
    if pid == 0:
        digest_bytes("blake3", data)
        os._exit(0)
    deadline = time.time() + 30
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("hashing in a forked child hung")
