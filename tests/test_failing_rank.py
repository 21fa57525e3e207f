"""One rank's exception inside ``with CheckpointManager(...)`` stops the job as it would without trainstate.

Real ``torchrun`` launches, two gloo ranks (``tests/failing_rank_worker.py``):
rank 1 fails while rank 0 waits in a training ``all_reduce``. Without the
manager, torchrun stops the job a second or two after the failure. A close
that waits on a collective while the exception propagates (a barrier, a
background save's drain) holds rank 1 until the collective timeout, and with
it the whole job. The control puts that close back and shows the wait.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import pytest

from distlaunch import launch
from failing_rank_worker import COLLECTIVE_TIMEOUT_S
from trainstate import cli

pytestmark = pytest.mark.slow
WORKER = Path(__file__).resolve().parent / "failing_rank_worker.py"
STOPS_WITHIN_S = 10.0  # after the failure; the plain job takes 1-2 s, the control at least the collective timeout
CASES = ["plain", "value_error", "background", "interrupt", "system_exit", "control"]
SAID = {"value_error": "ValueError: a bug in rank 1's training step", "background": "ValueError: a bug in rank 1",
        "interrupt": "KeyboardInterrupt", "system_exit": "exitcode  : 3", "plain": "ValueError: a bug in rank 1"}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """Each case's launch: how long it ran on after rank 1 failed, its exit status and log."""
    root = tmp_path_factory.mktemp("failing")
    out = {}

    def run(case: str) -> None:
        launched = launch(root / case, [case], worker=WORKER, timeout=120)
        ended = time.time()
        assert (root / case / "raised").exists(), f"{case}: rank 1 never reached its failure\n{launched.log[-4000:]}"
        raised = float((root / case / "raised").read_text())
        out[case] = (ended - raised, launched)

    # the control mostly waits out its collective timeout, idle: it runs beside the others
    with concurrent.futures.ThreadPoolExecutor(1) as beside:
        control = beside.submit(run, "control")
        for case in CASES:
            if case != "control":
                run(case)
        control.result()
    return out


@pytest.mark.parametrize("case", ["value_error", "background", "interrupt", "system_exit"])
def test_a_failing_rank_stops_the_job_as_plain_torch_does(stopped, case):
    seconds, launched = stopped[case]
    plain_s = stopped["plain"][0]
    assert launched.returncode != 0 and SAID[case] in launched.log, launched.log[-3000:]
    assert seconds < STOPS_WITHIN_S, (case, seconds, plain_s, launched.log[-3000:])


def test_the_control_close_holds_the_job_until_the_collective_timeout(stopped):
    seconds, launched = stopped["control"]
    assert launched.returncode != 0
    assert seconds >= COLLECTIVE_TIMEOUT_S * 0.9 > STOPS_WITHIN_S, (seconds, launched.log[-3000:])


def test_a_background_save_left_in_flight_publishes_nothing_partial(stopped, capsys):
    """The save at update 2 was in flight when rank 1 failed: the run still has exactly update 1's generation,
    whole and latest."""
    run = stopped["background"][1].out / "run"
    assert json.loads((run / "latest").read_text())["generation"] == "gen-000000000001"
    assert cli.main(["verify", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verified"] == ["gen-000000000001"] and report["failures"] == [], report
