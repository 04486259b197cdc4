"""The HTTP endpoint of ``--metrics-port``: Prometheus' text format at ``/metrics``.

Started by :func:`agent.cli.etcdrun` before anything else (no etcd, no worker), so a port
in use ends the program at once with one line naming the flag; stopped when the agent
exits. ``prometheus_client``'s own WSGI server serves it on a daemon thread (one more
per request), on the address of ``--metrics-addr`` (default 127.0.0.1: nothing is
reachable from other hosts unless asked for).
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from types import TracebackType
from typing import Any

from prometheus_client import start_http_server

from agent.observe.metrics import PrometheusMetrics

__all__ = ["MetricsServer", "MetricsServerError", "listen_error", "metrics_url"]

log = logging.getLogger(__name__)


class MetricsServerError(RuntimeError):
    """The metrics endpoint cannot listen; the message starts with the flag to change."""


def metrics_url(host: str, port: int) -> str:
    """``http://host:port/metrics``, with an IPv6 address in brackets."""
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/metrics"


def listen_error(addr: str, port: int, exc: OSError) -> MetricsServerError:
    """One line for a failed listen on ``addr:port``, naming the flag to change."""
    why = exc.strerror or str(exc) or type(exc).__name__
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return MetricsServerError(
            f"--metrics-addr: cannot listen on {addr!r} ({why}); give an address of this "
            "host: 127.0.0.1 (the default), 0.0.0.0 for every interface, or one of its own"
        )
    if exc.errno == errno.EADDRINUSE:
        return MetricsServerError(
            f"--metrics-port: port {port} on {addr} is in use ({why}); choose another port, "
            "or 0 for any free one"
        )
    if exc.errno == errno.EACCES:
        return MetricsServerError(
            f"--metrics-port: no permission to listen on port {port} ({why}); ports below "
            "1024 need root: choose one from 1024 up, or 0 for any free one"
        )
    return MetricsServerError(f"--metrics-port: cannot listen on {addr}:{port} ({why})")


class MetricsServer:
    """Serves one agent's metrics over HTTP until closed (a context manager).

    Args:
        metrics: what to serve.
        addr: the address to listen on.
        port: the port; 0 for any free one (read :attr:`port` or :attr:`url`).

    Raises:
        MetricsServerError: the address or port cannot be listened on.
    """

    def __init__(self, metrics: PrometheusMetrics, addr: str, port: int) -> None:
        try:
            server, thread = start_http_server(port, addr, registry=metrics.registry)
        except OSError as exc:  # socket.gaierror is one
            raise listen_error(addr, port, exc) from exc
        self._server: Any = server
        self._thread: threading.Thread = thread
        self._thread.name = "metrics-http"
        self.port = int(server.server_address[1])
        self.url = metrics_url(addr, self.port)
        self._closed = False
        log.info("serving metrics at %s", self.url)

    def close(self) -> None:
        """Stop listening and join the serving thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
