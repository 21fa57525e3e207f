"""Issue 29 item 4: a save that only some ranks entered (`if rank == 0: ckpt.save(state)`, kept from torch.save
code) fails within seconds on the rank that entered, with a typed error saying that save is collective, instead
of hanging for the collective timeout and blaming a rank that did not die. Under a real ``torchrun`` (2 gloo
ranks on CPU); the scenario is ``rank0_only_save`` in ``tests/dist_worker.py``.
"""

from __future__ import annotations

import pytest

from distlaunch import launch

pytestmark = pytest.mark.slow

JOIN_S, COLLECTIVE_S = 2, 30


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    # A small collective timeout and a launch timeout bound a regression to a failure, not a hang.
    return launch(tmp_path_factory.mktemp("partial"), ["rank0_only_save"], timeout=120, monitor=5,
                  env={"TRAINSTATE_TEST_TIMEOUT": str(COLLECTIVE_S), "TRAINSTATE_SAVE_JOIN_TIMEOUT_S": str(JOIN_S)})


def test_a_rank0_only_save_fails_fast_saying_save_is_collective(partial):
    result = partial.result("rank0_only_save", 0)
    assert result["outcome"] == "SaveNotJoined" and result["checkpoint_failed"], result  # typed, a CheckpointFailed
    assert result["missing"] == [1], result  # the rank that did not join, by number
    message = result["message"]
    assert message.startswith("save is collective: every rank must call ckpt.save(state) at the same update"), message
    assert "rank 1 did not enter save" in message and "if rank == 0" in message, message
    assert "died" not in message and "stopped answering" not in message, message  # no crash to look for
    # the join timeout, not the collective timeout (before: 600 s, then "a rank died or stopped answering")
    assert JOIN_S <= result["seconds_to_raise"] < JOIN_S + 5 < COLLECTIVE_S, result


def test_nothing_was_written_and_the_job_ends(partial):
    result = partial.result("rank0_only_save", 0)
    assert result["generations"] == [] and result["leftovers"] == [], result
    assert partial.returncode != 0, partial.log[-3000:]  # torchrun reports the failed job; nothing hangs


@pytest.fixture(scope="module")
def missing(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("missing"), ["manager_missing"], timeout=120, monitor=5,
                  env={"TRAINSTATE_TEST_TIMEOUT": str(COLLECTIVE_S), "TRAINSTATE_SAVE_JOIN_TIMEOUT_S": str(JOIN_S)})


def test_a_manager_one_rank_never_made_fails_the_first_save_fast(missing):
    """The groups' connections are made in the background at set-up; the first save waits for them no longer
    than the join timeout, and says which mistake to look for."""
    result = missing.result("manager_missing", 0)
    assert result["outcome"] == "SaveNotJoined", result
    assert "never created its CheckpointManager" in result["message"], result["message"]
    assert JOIN_S <= result["seconds_to_raise"] < JOIN_S + 5 < COLLECTIVE_S, result
    assert result["generations"] == [], result
