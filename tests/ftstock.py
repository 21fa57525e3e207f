"""torchft's stock HTTPTransport kept on loopback, for the control in tests/test_torchft.py and benchmarks/bench_heal.py."""

from __future__ import annotations

from datetime import timedelta


def loopback_http(timeout: timedelta = timedelta(seconds=20)):
    """torchft's stock HTTPTransport, listening and advertised on 127.0.0.1 (it binds every interface and
    advertises the host name)."""
    from http.server import ThreadingHTTPServer

    import torchft.checkpointing.http_transport as http_transport

    class Loopback(ThreadingHTTPServer):
        daemon_threads = True

        def __init__(self, address, handler):
            super().__init__(("127.0.0.1", address[1]), handler)

    class LoopbackHTTP(http_transport.HTTPTransport):
        def address(self) -> str:
            return f"http://127.0.0.1:{self._server.socket.getsockname()[1]}/checkpoint/"

    real, http_transport._IPv6HTTPServer = http_transport._IPv6HTTPServer, Loopback
    try:
        return LoopbackHTTP(timeout=timeout, num_chunks=0)
    finally:
        http_transport._IPv6HTTPServer = real
