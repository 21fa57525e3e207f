"""torchft's ``CheckpointTransport`` moving a rank's restart state as :mod:`.wire` frames it, over HTTP.

The sender serves ``GET /heal/<step>`` from a small threaded HTTP server
bound to ``bind`` (``127.0.0.1`` by default: say which address peers reach);
each response is one :mod:`.wire` stream, digested as it is sent, read from
the tensors of the snapshot taken at the step boundary
(:meth:`.Healing.boundary`). The receiver reads the stream into fresh memory
and verifies every byte (and with a key, the signature) before it returns
anything: a damaged or cut stream raises, torchft reports it, and that
step's ``should_commit`` fails on the healing group, which heals again at
the next quorum.

:meth:`TrainStateTransport.disallow_checkpoint` (torchft calls it from
``should_commit``, before the optimizer steps) waits until every replica
the quorum named has had its stream (or ``heal_wait_s`` passed), then
refuses new requests: the live tensors a stream reads never change under
it, and a healing replica does not lose the race to the survivor's next
optimizer step. That wait is the survivor's blocking cost of a heal.
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from torchft.checkpointing.transport import CheckpointTransport

from ...errors import CorruptGeneration, InvalidType, StorageUnavailable, TrainStateError
from ...format.signing import SigningKey
from . import wire

log = logging.getLogger("trainstate")


class TrainStateTransport(CheckpointTransport[dict]):
    """Serves this rank's snapshot to healing peers and fetches a peer's, verified; no pickle either way.

    ``key``: the run's signing key (every stream signed, and a peer's refused unless signed by it).
    ``bind``: the address to listen on and to advertise. ``heal_wait_s``: how long ``disallow_checkpoint`` waits
    for the replicas a quorum named to have their streams (default: ``timeout``)."""

    def __init__(self, *, key: SigningKey | None = None, bind: str = "127.0.0.1",
                 timeout: timedelta = timedelta(seconds=60), heal_wait_s: float | None = None):
        self.key, self.timeout = key, timeout
        self.heal_wait_s = timeout.total_seconds() if heal_wait_s is None else heal_wait_s
        self._lock = threading.Condition()
        self._outgoing: wire.Outgoing | None = None
        self._step = -1
        self._owed = 0  # streams the quorum named and not yet served (or failed)
        self._active = 0  # streams being served now
        self.served: list[dict] = []  # per stream: step, bytes, seconds, error (for tests and benchmarks)
        self.received: list[dict] = []
        self.refused: list[dict] = []  # per stream refused: step, error
        transport = self

        class Handler(BaseHTTPRequestHandler):
            timeout = self.timeout.total_seconds()

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                transport._serve(self)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
                log.debug("heal server: " + format, *args)

        self._server = ThreadingHTTPServer((bind, 0), Handler)
        self._server.daemon_threads = True
        self._host = bind
        self._thread = threading.Thread(target=self._server.serve_forever, name="trainstate-heal", daemon=True)
        self._thread.start()

    # sending -------------------------------------------------------------------------------------------------
    def metadata(self) -> str:
        return f"http://{self._host}:{self._server.server_address[1]}/heal/"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict, timeout: timedelta) -> None:
        """Offer the snapshot of step ``step`` (``state_dict["user"]``: :meth:`.Healing.state_dict`'s, framed
        here with torchft's own state) to the ``dst_ranks`` the quorum named."""
        user = state_dict["user"]
        (name, snapshot), = user.items() if len(user) == 1 else ((None, None),)
        if not isinstance(snapshot, dict) or "skeleton" not in snapshot:
            raise InvalidType("TrainStateTransport sends what trainstate.integrations.torchft.Healing.state_dict "
                              "returns: register it as the manager's only state_dict")
        outgoing = wire.frame(snapshot["skeleton"], snapshot["tensors"], step=step, user=name,
                              torchft=dict(state_dict["torchft"]), key=self.key, shards=snapshot.get("shards"))
        with self._lock:
            self._outgoing, self._step, self._owed = outgoing, step, len(dst_ranks)
            self._lock.notify_all()

    def disallow_checkpoint(self) -> None:
        """Wait (up to ``heal_wait_s``) until every stream the quorum named was served and none is being
        served, then refuse requests until the next :meth:`send_checkpoint`."""
        deadline = time.monotonic() + self.heal_wait_s
        with self._lock:
            while (self._owed > 0 or self._active > 0) and self._outgoing is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("heal: %d stream(s) of step %d not fetched within %.1f s; no longer offered",
                                self._owed, self._step, self.heal_wait_s)
                    break
                self._lock.wait(left)
            while self._active > 0:  # a stream being read from live tensors ends before they may change
                self._lock.wait()
            self._outgoing, self._owed = None, 0

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        parts = handler.path.strip("/").split("/")
        wanted = int(parts[1]) if len(parts) == 2 and parts[0] == "heal" and parts[1].isdigit() else None
        with self._lock:  # the healing peer may ask before this rank's quorum thread offers the step: wait for it
            self._lock.wait_for(lambda: wanted is None or (self._outgoing is not None and self._step == wanted)
                                or self._step > wanted, self.timeout.total_seconds())
            outgoing, step = self._outgoing, self._step
            if outgoing is None or wanted != step:
                handler.send_error(409, f"not offering step {wanted}: offering "
                                        f"{step if outgoing is not None else 'nothing'}")
                return
            self._active += 1
        started, sent, error = time.perf_counter(), 0, None
        try:
            handler.send_response(200)
            handler.send_header("Content-Type", "application/octet-stream")
            handler.end_headers()
            for piece in outgoing.pieces():
                handler.wfile.write(piece)
                sent += len(piece)
            handler.wfile.flush()
        except (OSError, ValueError) as exc:  # the peer went away mid-stream: its heal fails and is retried
            error = f"{type(exc).__name__}: {exc}"
            log.warning("heal: serving step %d stopped after %d bytes: %s", step, sent, error)
        finally:
            with self._lock:
                self._active -= 1
                self._owed = max(0, self._owed - 1)
                self.served.append({"step": step, "bytes": sent, "seconds": time.perf_counter() - started,
                                    "error": error})
                self._lock.notify_all()

    # receiving -----------------------------------------------------------------------------------------------
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict:
        """The peer's snapshot of step ``step``, every byte verified (:func:`.wire.receive`), as torchft expects
        it: ``{"user": {<key>: Incoming}, "torchft": {...}}``."""
        url, started = f"{metadata}{step}", time.perf_counter()
        where = f"heal stream {url}"
        try:
            try:
                with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as response:
                    incoming = wire.receive(response, step=step, key=self.key, where=where)
            except urllib.error.HTTPError as exc:
                raise StorageUnavailable(f"{where}: the peer answered {exc.code} ({exc.reason}); the heal is "
                                         "retried at the next quorum") from None
            except (OSError, http.client.HTTPException) as exc:  # reset, timed out, cut mid-response
                raise CorruptGeneration(where, f"failed mid-stream ({type(exc).__name__}: {exc}); refusing "
                                               "it") from None
        except TrainStateError as exc:
            self.refused.append({"step": step, "error": f"{type(exc).__name__}: {exc}"})
            log.error("heal: refused what the peer sent for step %d: %s", step, exc)
            raise
        self.received.append({"step": step, "seconds": time.perf_counter() - started,
                              "bytes": sum(t.nbytes for t in incoming.tensors.values())})
        return {"user": {incoming.user: incoming}, "torchft": incoming.torchft}

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()
