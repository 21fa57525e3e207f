import gc
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
