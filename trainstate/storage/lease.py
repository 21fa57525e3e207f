"""A writer lease on an object store: the lock a run directory's ``flock`` is on a local disk.

One object per lease (``lock`` for the run's writer, ``mutex-<name>`` for a
short critical section), created create-only, renewed in the background,
taken over by compare-and-swap once expired, or at once when its holder was
a process on this host that is gone (a SIGKILLed job restarted on the same
machine does not wait out the lease). Advisory: the pointer's
compare-and-swap, not this lease, is what keeps two writers from losing
each other's generations.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from typing import Any

from ..errors import DirectoryLocked, RunDirectoryGone
from .objectclient import Client, Missing, Precondition, Taken


def token() -> str:
    return secrets.token_hex(8)


class Lease:
    """An advisory lease object: created create-only, taken over by compare-and-swap once expired.

    A holder on this host whose process is gone is taken over at once (a
    SIGKILLed job restarted on the same machine does not wait out the lease).
    The pointer's compare-and-swap, not this lease, is what keeps two writers
    from losing each other's generations.
    """

    def __init__(self, client: Client, key: str, ttl_s: float, location: str, *, renew: bool, wait: bool = False):
        self.client, self.key, self.ttl_s, self.location = client, key, ttl_s, location
        self.owner = token()
        self.lost: str | None = None
        self._e_tag = self._take(wait)
        self._stop = threading.Event()
        if renew:
            threading.Thread(target=self._renew_loop, name=f"trainstate-lease-{key}", daemon=True).start()

    def _body(self) -> bytes:
        return json.dumps({"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                           "expires": time.time() + self.ttl_s}).encode()

    def _take(self, wait: bool) -> str:
        while True:
            current = self.client.get_versioned(self.key)
            try:
                if current is None:
                    return self.client.put(self.key, self._body(), create=True)
                holder = _holder(current[0])
                if holder["expired"] or holder["dead"]:
                    return self.client.put(self.key, self._body(), e_tag=current[1])
            except (Taken, Precondition):
                continue
            if not wait:
                raise DirectoryLocked(
                    f"{self.location} is being written by another process (pid {holder['pid']} on "
                    f"{holder['host']}, lease for {holder['left']:.0f} s more); only one manager may write a run. "
                    "Stop the other run, or give this one its own URL.")
            time.sleep(0.05)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self._e_tag = self.client.put(self.key, self._body(), e_tag=self._e_tag)
            except (Taken, Precondition, Missing):
                self.lost = "another process took the lease over"
                return
            except Exception:  # a transient outage: try again at the next tick, well before expiry
                continue

    def check(self) -> None:
        if self.lost:
            raise RunDirectoryGone(f"{self.location}: this manager lost its writer lease ({self.lost}); nothing "
                                   "more is written there. Open a new manager to continue.")

    def release(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            current = self.client.get_versioned(self.key)
            if current is not None and json.loads(current[0]).get("owner") == self.owner:
                self.client.delete(self.key)


def _holder(data: bytes) -> dict[str, Any]:
    try:
        raw = json.loads(data)
        left = float(raw["expires"]) - time.time()
        host, pid = str(raw["host"]), int(raw["pid"])
    except (ValueError, KeyError, TypeError):
        return {"expired": True, "dead": True, "pid": "?", "host": "?", "left": 0.0}
    dead = host == socket.gethostname() and not _alive(pid)
    return {"expired": left <= 0, "dead": dead, "pid": pid, "host": host, "left": left}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
