import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


# The suite runs on two workers, whole files each (pyproject: -n 2 --dist loadfile), handed out in collection
# order as a worker frees up. The heaviest files go first, longest first (measured serially, 2026-12-07:
# seconds in the comments), then the other files with multi-rank or kill trials (marked slow), then the rest:
# otherwise the alphabetical tail (tiers, torchtitan) runs on one worker while the other has nothing left.
HEAVIEST_FIRST = ("test_torchtitan.py",  # 270
                  "test_tiers.py",  # 230
                  "test_tiers_remote.py",  # 135
                  "test_tiers_kill.py",  # 128
                  "test_kill_ranks.py",  # 86
                  "test_object_restore_traffic.py",  # 83
                  "test_distributed.py")  # 75


def pytest_collection_modifyitems(config, items):
    slow = {item.path for item in items if item.get_closest_marker("slow")}

    def order(item):
        name = item.path.name
        return (HEAVIEST_FIRST.index(name) if name in HEAVIEST_FIRST else len(HEAVIEST_FIRST),
                item.path not in slow)

    items.sort(key=order)  # stable: each file's tests keep their order and stay together


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def _collect_after_module():
    """Collect reference cycles when each module ends.

    A DataLoader iterator with persistent workers that sits in a cycle shuts its
    workers down (joining them, for seconds) whenever the cyclic GC finds it.
    Collecting here keeps that in the module that made it, not inside a later
    module's timed case (the fuzz tests bound each case's time).
    """
    yield
    gc.collect()


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(size, name="fs")`` -> a fresh tmpfs under tmp_path; ``remount_ro(path)`` makes it read-only.

    Root only (CI runs as root); skips with the reason elsewhere. Tests use it
    for what permission bits cannot show to root: a real ENOSPC, a real EROFS.
    """
    mounted: list[Path] = []

    class Mounts:
        @staticmethod
        def mount(size: str, name: str = "fs") -> Path:
            path = tmp_path / name
            path.mkdir()
            if os.geteuid() != 0:
                pytest.skip("needs root to mount a tmpfs (a real ENOSPC or read-only filesystem)")
            result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                    capture_output=True, text=True)
            if result.returncode:
                pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip() or result.returncode})")
            mounted.append(path)
            return path

        @staticmethod
        def remount_ro(path: Path) -> None:
            result = subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True, text=True)
            if result.returncode:
                pytest.skip(f"cannot remount read-only ({result.stderr.strip() or result.returncode})")

    yield Mounts
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)
