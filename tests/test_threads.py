"""The shared worker threads: every index once, the lowest failure raised, nested calls that cannot deadlock."""

from __future__ import annotations

import os
import threading
import time

import pytest

from trainstate.storage import threads


def test_every_index_runs_once_and_the_pool_is_reused():
    seen: list[int] = []
    lock = threading.Lock()

    def one(at: int) -> None:
        with lock:
            seen.append(at)

    threads.in_order(100, 4, one)
    assert sorted(seen) == list(range(100))
    pool = threads._shared()
    threads.in_order(10, 4, one)
    assert threads._shared() is pool  # no pool per call


def test_the_lowest_failing_index_is_raised_and_nothing_runs_after_it():
    ran: list[int] = []
    gate = threading.Event()

    def one(at: int) -> None:
        ran.append(at)
        if at == 3:
            gate.set()
            raise ValueError("three")
        if at == 5:
            raise KeyError("five")
        if at > 5:
            gate.wait(5)

    with pytest.raises(ValueError, match="three"):
        threads.in_order(50, 3, one)
    assert len(ran) < 50  # the taking stopped


def test_returns_only_when_no_call_is_running():
    finished = []

    def one(at: int) -> None:
        time.sleep(0.05 if at == 1 else 0)
        finished.append(at)

    threads.in_order(2, 2, one)
    assert sorted(finished) == [0, 1]


def test_nested_calls_on_a_saturated_pool_finish(monkeypatch):
    # every pool thread busy inside an outer call that itself calls in_order: the callers do the work themselves
    monkeypatch.setattr(threads, "LIMIT", 2)
    monkeypatch.setattr(threads, "_pool", None)
    total = []
    lock = threading.Lock()

    def inner(at: int) -> None:
        with lock:
            total.append(at)

    inside = [0, 0]  # outer calls running now, most at once

    def outer(at: int) -> None:
        with lock:
            inside[0] += 1
            inside[1] = max(inside)
        time.sleep(0.05)
        threads.in_order(8, 8, inner)
        with lock:
            inside[0] -= 1

    done = threading.Event()
    worker = threading.Thread(target=lambda: (threads.in_order(6, 6, outer), done.set()), daemon=True)
    worker.start()
    assert done.wait(30), "nested in_order deadlocked"
    assert len(total) == 48
    assert inside[1] >= 2  # the pool's threads were busy in outer calls while their inner calls ran
    threads._shared().shutdown(wait=True)


def test_a_forked_child_starts_its_own_pool():
    threads.in_order(4, 4, lambda at: None)
    pid = os.fork()
    if pid == 0:  # the child: the parent's threads are gone; a call must still finish
        try:
            threads.in_order(8, 4, lambda at: None)
            os._exit(0 if threads._pool is not None else 2)
        except BaseException:  # noqa: BLE001
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
