import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


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
