"""Worker threads that every read and write in the process shares, started once.

A restore reads each file through several threads (chunks mapped and
verified side by side, ranged GETs in flight together). Starting a pool per
file cost a restore about 2 ms a thread on a loaded machine, some 30 ms for a
two-rank restore of 64 MB: more than reading the bytes. The pool here is
started lazily, grows to :data:`LIMIT` threads as calls need them, keeps idle
threads for the next call, and is forgotten in a child process after
``fork`` (its threads did not survive it).

:func:`in_order` is the one way to use it. The calling thread works too, so a
call never waits for a pool thread to become free: when every pool thread is
busy (or itself inside :func:`in_order`), the caller does all the work alone,
and a call nested inside another cannot deadlock.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

LIMIT = 32  # pool threads at most (each call still asks for no more than it was given)

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _shared() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=LIMIT, thread_name_prefix="trainstate-worker")
        return _pool


def _forget_after_fork() -> None:  # the child has the pool object but none of its threads
    global _pool, _lock
    _pool = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def in_order(count: int, threads: int, one: Callable[[int], None]) -> None:
    """``one(0)``, ``one(1)``, ... on up to ``threads`` threads (this one included), each taking the next index.

    After a failure no thread takes another index; once those under way end, the failure of the lowest index is
    raised. Returns only when no ``one`` call of this batch is running.
    """
    order = itertools.count()
    done = threading.Condition()
    running = 0
    failures: list[tuple[int, BaseException]] = []

    def work() -> None:
        nonlocal running
        while True:
            with done:
                if failures:
                    return
                at = next(order)
                if at >= count:
                    return
                running += 1
            try:
                one(at)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the caller, lowest index first
                with done:
                    failures.append((at, exc))
            finally:
                with done:
                    running -= 1
                    done.notify_all()

    helpers = max(0, min(threads, count) - 1)
    if helpers:
        pool = _shared()
        for _ in range(helpers):
            pool.submit(work)  # one queued after the work is gone takes no index and returns at once
    work()
    with done:  # every index is taken (or a failure stops the taking): wait for those still running elsewhere
        done.wait_for(lambda: running == 0)
    if failures:
        raise min(failures, key=lambda f: f[0])[1]
