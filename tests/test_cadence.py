"""Checkpoint cadence: Young's and Daly's intervals, Daly's overhead model, advice, the CLI and the manager's due()."""

from __future__ import annotations

import json
import math
import time

import pytest

import trainstate as ts
from trainstate.lifecycle import cadence
from trainstate.cli import main as cli_main
from trainer import build, step

REL = 1e-12  # the formulas are a handful of float operations: agreement to rounding, not a tolerance on behaviour


def daly_reference(C: float, M: float) -> float:
    """Daly (2006), eq. (37), written out here independently of the library."""
    if C < 2 * M:
        x = C / (2 * M)
        return math.sqrt(2 * C * M) * (1 + (1 / 3) * x ** 0.5 + (1 / 9) * x) - C
    return M


def wall_time_reference(T: float, C: float, M: float, R: float = 0.0) -> float:
    """Daly's expected wall time per unit of solve time, minus one: M e^(R/M) (e^((T+C)/M) - 1) / T - 1."""
    return M * math.exp(R / M) * (math.exp((T + C) / M) - 1) / T - 1


# Young ------------------------------------------------------------------------------------------------
def test_young_interval_for_ten_second_saves_and_four_hour_mtbf():
    t = cadence.young_interval(10, 14400)
    assert t == pytest.approx(math.sqrt(288000), rel=1e-9)
    assert math.isclose(t, math.sqrt(2 * 10 * 14400), rel_tol=1e-9)
    assert round(t, 1) == 536.7
    assert f"{t:.1f}" == "536.7"


@pytest.mark.parametrize("C,M", [(1, 100), (0.25, 3600), (10, 14400), (120, 86400), (3, 7)])
def test_young_is_sqrt_2CM(C, M):
    assert math.isclose(cadence.young_interval(C, M), math.sqrt(2 * C * M), rel_tol=REL)


# Daly -------------------------------------------------------------------------------------------------
GRID = [(C, M) for C in (0.01, 0.5, 1, 10, 60, 600, 3000) for M in (30, 600, 3600, 14400, 86400, 10 ** 6)]


@pytest.mark.parametrize("C,M", GRID)
def test_daly_matches_the_published_formula(C, M):
    got = cadence.daly_interval(C, M)
    assert math.isclose(got, daly_reference(C, M), rel_tol=REL), (C, M, got, daly_reference(C, M))
    if C < 2 * M:
        assert got < M + C  # the higher-order terms never push past the branch value by much
        # Daly's correction: slightly below Young's for small C/M
        if C / M < 0.01:
            assert got < cadence.young_interval(C, M)


@pytest.mark.parametrize("C,M", [(20, 10), (10, 5), (7, 3.5), (1e6, 1)])
def test_daly_when_save_cost_reaches_twice_the_mtbf_is_the_mtbf(C, M):
    assert C >= 2 * M
    assert cadence.daly_interval(C, M) == M == daly_reference(C, M)


def test_daly_just_below_the_branch_point_uses_the_series():
    C, M = 19.999, 10.0
    assert math.isclose(cadence.daly_interval(C, M), daly_reference(C, M), rel_tol=REL)
    assert cadence.daly_interval(C, M) != M


def test_daly_for_the_readme_example():
    x = 10 / 28800
    expected = math.sqrt(288000) * (1 + math.sqrt(x) / 3 + x / 9) - 10
    assert math.isclose(cadence.daly_interval(10, 14400), expected, rel_tol=REL)
    assert round(cadence.daly_interval(10, 14400), 1) == 530.0


# expected overhead -------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [5.0, 100.0, 530.0, 2000.0, 20000.0])
@pytest.mark.parametrize("R", [0.0, 60.0])
def test_expected_overhead_is_dalys_wall_time_model(T, R):
    C, M = 10.0, 14400.0
    got = cadence.expected_overhead(T, C, M, R)
    assert math.isclose(got, wall_time_reference(T, C, M, R), rel_tol=1e-9)
    assert got > 0


@pytest.mark.parametrize("C,M", [(10, 14400), (1, 600), (60, 86400), (0.5, 3600), (30, 300)])
def test_overhead_is_minimised_near_dalys_interval(C, M):
    daly = cadence.daly_interval(C, M)
    at = cadence.expected_overhead(daly, C, M)
    assert at < cadence.expected_overhead(0.5 * daly, C, M)
    assert at < cadence.expected_overhead(2 * daly, C, M)
    assert at < cadence.expected_overhead(0.9 * daly, C, M)
    assert at < cadence.expected_overhead(1.1 * daly, C, M)
    # a fine numerical search for the minimum lands within a few percent of Daly's closed form
    grid = [daly * (0.5 + i / 1000) for i in range(1501)]
    best = min(grid, key=lambda t: cadence.expected_overhead(t, C, M))
    assert abs(best - daly) / daly < 0.05
    assert at <= cadence.expected_overhead(best, C, M) * (1 + 1e-4)


def test_restart_cost_scales_the_expected_time_not_the_optimum():
    C, M = 10.0, 14400.0
    daly = cadence.daly_interval(C, M)
    for R in (0.0, 300.0):
        at = cadence.expected_overhead(daly, C, M, R)
        assert at < cadence.expected_overhead(0.5 * daly, C, M, R)
        assert at < cadence.expected_overhead(2 * daly, C, M, R)
    assert cadence.expected_overhead(daly, C, M, 300.0) > cadence.expected_overhead(daly, C, M, 0.0)


# advise ------------------------------------------------------------------------------------------------
def test_advise_converts_seconds_to_updates():
    a = cadence.advise(10, 14400, 0.5)
    assert (a.save_cost_s, a.mtbf_s, a.step_time_s) == (10, 14400, 0.5)
    assert a.young_s == cadence.young_interval(10, 14400)
    assert a.daly_s == cadence.daly_interval(10, 14400)
    assert a.young_updates == round(math.sqrt(288000) / 0.5) == 1073
    assert a.daly_updates == round(daly_reference(10, 14400) / 0.5) == 1060
    assert a.overhead_young == cadence.expected_overhead(1073 * 0.5, 10, 14400)
    assert a.overhead_daly == cadence.expected_overhead(1060 * 0.5, 10, 14400)
    assert a.overhead_daly <= a.overhead_young
    text = a.describe()
    assert "536.7" in text and "1073 updates" in text and "1060 updates" in text and "not a guarantee" in text


def test_advise_never_recommends_fewer_than_one_update():
    a = cadence.advise(0.001, 1.0, 100.0)  # an update far longer than the optimum interval
    assert a.young_updates == a.daly_updates == 1
    assert a.overhead_daly == cadence.expected_overhead(100.0, 0.001, 1.0)


def test_advise_with_restart_cost():
    a = cadence.advise(10, 14400, 0.5, restart=120)
    assert a.overhead_daly == cadence.expected_overhead(1060 * 0.5, 10, 14400, 120)
    assert a.daly_updates == 1060  # the restart cost does not move the interval


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), -float("inf")])
def test_invalid_inputs_raise_value_error(bad):
    with pytest.raises(ValueError, match="save cost"):
        cadence.young_interval(bad, 100)
    with pytest.raises(ValueError, match="save cost"):
        cadence.daly_interval(bad, 100)
    with pytest.raises(ValueError, match="MTBF"):
        cadence.young_interval(1, bad)
    with pytest.raises(ValueError, match="MTBF"):
        cadence.daly_interval(1, bad)
    with pytest.raises(ValueError, match="step time"):
        cadence.advise(1, 100, bad)
    with pytest.raises(ValueError):
        cadence.expected_overhead(bad, 1, 100)
    with pytest.raises(ValueError):
        cadence.expected_overhead(10, bad, 100)
    with pytest.raises(ValueError):
        ts.Cadence(mtbf_s=bad)


def test_invalid_overhead_restart_and_cadence_options():
    with pytest.raises(ValueError, match="restart"):
        cadence.expected_overhead(10, 1, 100, restart=-1)
    with pytest.raises(ValueError, match="model"):
        ts.Cadence(mtbf_s=100, model="weibull")
    for kwargs in ({"first_after": 0}, {"min_updates": 0}, {"min_updates": 5, "max_updates": 4}):
        with pytest.raises(ValueError):
            ts.Cadence(mtbf_s=100, **kwargs)


# CLI ---------------------------------------------------------------------------------------------------
def test_cli_cadence_json(capsys):
    assert cli_main(["cadence", "--save-cost", "10", "--mtbf", "14400", "--step-time", "0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = cadence.advise(10, 14400, 0.5)
    assert out == json.loads(json.dumps(expected.__dict__))
    assert out["young_updates"] == 1073 and out["daly_updates"] == 1060
    assert math.isclose(out["young_s"], math.sqrt(288000), rel_tol=1e-9)
    assert round(out["young_s"], 1) == 536.7


def test_cli_cadence_text_and_restart(capsys):
    assert cli_main(["cadence", "--save-cost", "10", "--mtbf", "14400", "--step-time", "0.5",
                     "--restart", "120"]) == 0
    out = capsys.readouterr().out
    assert "Young: every 536.7 s = 1073 updates" in out
    assert "Daly:  every 530.0 s = 1060 updates" in out
    assert f"{cadence.expected_overhead(530.0, 10, 14400, 120):.2%}" in out


def test_cli_cadence_rejects_a_zero_save_cost(capsys):
    assert cli_main(["cadence", "--save-cost", "0", "--mtbf", "14400", "--step-time", "0.5"]) == 1
    assert "save cost must be a positive number" in capsys.readouterr().err


# the manager's cadence ---------------------------------------------------------------------------------
def _slow_step(state, seconds=0.01):
    time.sleep(seconds)  # a measurable update time; nothing below asserts on its value
    step(state)


def test_first_save_is_due_at_first_after(tmp_path):
    """Cadence docs: "The first save is due after first_after updates". A fresh run calling due() once per
    update boundary (after each update, as the README's loop does) has done 3 updates at next_update == 3.
    (A resumed run counts from its restored generation: see the test below, which gets 5 -> 8.)"""
    state = build()
    with ts.CheckpointManager(tmp_path, cadence=ts.Cadence(mtbf_s=3600, first_after=3)) as ckpt:
        decisions = []
        for _ in range(3):
            _slow_step(state)
            decisions.append((state.next_update, ckpt.due(state)))
        assert decisions == [(1, False), (2, False), (3, True)]


def test_due_without_a_cadence_is_an_error(tmp_path):
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ValueError, match="cadence"):
            ckpt.due(build())
        assert ckpt.advice() is None
        assert ckpt.status().interval_updates is None


@pytest.mark.parametrize("model", ["daly", "young"])
def test_interval_in_force_is_the_advice_for_measured_costs(tmp_path, model):
    mtbf = 0.2  # tiny, so that the optimum is a handful of updates and several saves happen
    cad = ts.Cadence(mtbf_s=mtbf, first_after=3, model=model)
    state = build()
    with ts.CheckpointManager(tmp_path, cadence=cad, keep_last=2) as ckpt:
        assert ckpt.status().interval_updates is None  # nothing measured yet
        saved_at, last_save, checked = [], 0, 0
        for _ in range(40):
            _slow_step(state)
            due = ckpt.due(state)
            s = ckpt.status()  # the same measurements due() just used
            if s.mean_save_s is not None:
                advice = cadence.advise(s.mean_save_s, mtbf, s.mean_update_s)
                expected = advice.daly_updates if model == "daly" else advice.young_updates
                assert s.interval_updates == max(expected, cad.min_updates)
                assert ckpt.advice() == advice
                assert due == (state.next_update - last_save >= s.interval_updates)
                checked += 1
            if due:
                ckpt.save(state)
                saved_at.append(state.next_update)
                last_save = state.next_update
        s = ckpt.status()
        # where the first save lands is test_first_save_is_due_at_first_after's business; every later one was
        # decided by the measured interval, checked above at each boundary
        assert len(saved_at) >= 2 and checked >= 20
        assert s.last_save_s is not None and s.mean_save_s > 0 and s.mean_update_s > 0
        assert s.recovery_point == f"gen-{saved_at[-1]:012d}"


def test_interval_is_clamped(tmp_path):
    cad = ts.Cadence(mtbf_s=10 ** 9, first_after=2, max_updates=4)  # unclamped: millions of updates
    state = build()
    with ts.CheckpointManager(tmp_path, cadence=cad) as ckpt:
        saved_at = []
        for _ in range(16):
            _slow_step(state, 0.002)
            if ckpt.due(state):
                ckpt.save(state)
                saved_at.append(state.next_update)
        s = ckpt.status()
        assert cadence.advise(s.mean_save_s, cad.mtbf_s, s.mean_update_s).daly_updates > 4
        assert s.interval_updates == 4
        assert len(saved_at) >= 3
        assert [b - a for a, b in zip(saved_at, saved_at[1:])] == [4] * (len(saved_at) - 1)


def test_resumed_run_counts_from_the_restored_generation(tmp_path):
    state = build()
    for _ in range(5):
        step(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    resumed = build(seed=3)
    with ts.CheckpointManager(tmp_path, cadence=ts.Cadence(mtbf_s=3600, first_after=3)) as ckpt:
        ckpt.restore(resumed)
        decisions = []
        for _ in range(3):
            _slow_step(resumed)
            decisions.append((resumed.next_update, ckpt.due(resumed)))
        assert decisions == [(6, False), (7, False), (8, True)]


def test_a_refused_save_does_not_count_as_a_save(tmp_path, monkeypatch):
    """A save that raised (here: the disk preflight) published nothing: the cadence must still want one."""
    state = build()
    with ts.CheckpointManager(tmp_path, cadence=ts.Cadence(mtbf_s=3600, first_after=2)) as ckpt:
        for _ in range(5):
            _slow_step(state)
            if ckpt.due(state):
                break
        else:
            pytest.fail("no save became due")
        monkeypatch.setattr(ckpt.store, "free_bytes", lambda: 0)
        with pytest.raises(ts.InsufficientSpace):
            ckpt.save(state)
        monkeypatch.undo()
        assert ckpt.status().recovery_point is None
        _slow_step(state)
        assert ckpt.due(state), "the refused save reset the interval: no save is due although none exists"
