"""An etcd member's addresses and HTTP probes, wherever it runs, and waiting for members
to be healthy.

Shared by the member processes started here (:mod:`coordinator.etcd_server.cluster`),
etcd's gRPC proxy (:mod:`coordinator.etcd_proxy`) and the tests' member containers:
each says where its client and peer ports are, and these give it its URLs, its
``/health`` and ``/metrics``, and a cluster's endpoint list.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

__all__ = [
    "ClusterAddresses",
    "EtcdStartError",
    "MemberHttp",
    "wait_members_healthy",
]


class EtcdStartError(RuntimeError):
    """An etcd member did not become healthy in time."""


class MemberHttp:
    """Addresses and HTTP probes of an etcd member, wherever it runs (process, container).

    Needs ``host``, ``client_port`` and ``peer_port`` attributes; ``client_scheme`` and
    ``probe_url`` may be overridden (a TLS member is probed on its plain metrics port).
    """

    host: str
    client_port: int
    peer_port: int
    client_scheme: str = "http"

    @property
    def probe_url(self) -> str:
        """Where ``/health`` and ``/metrics`` are read, over plain http."""
        return self.client_url

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL, as ``--rdzv-endpoint`` takes it."""
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{self.client_scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def healthy(self, timeout: float = 1.0) -> bool:
        """Whether the member answers ``/health`` with ``true`` (it has a leader)."""
        try:
            with urllib.request.urlopen(f"{self.probe_url}/health", timeout=timeout) as rsp:
                return b'"true"' in rsp.read()
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def metrics(self, timeout: float = 5.0) -> str:
        """The Prometheus text of the member's ``/metrics``."""
        with urllib.request.urlopen(f"{self.probe_url}/metrics", timeout=timeout) as rsp:
            text: str = rsp.read().decode()
            return text


class _Member(Protocol):
    name: str

    @property
    def endpoint(self) -> str: ...

    def healthy(self, timeout: float = 1.0) -> bool: ...


M = TypeVar("M", bound=_Member)


def wait_members_healthy(
    members: Sequence[M], timeout: float, exited: Callable[[M], str | None], poll: float
) -> None:
    """Wait until every member answers ``/health``; raise EtcdStartError if one exits
    (``exited`` returns why) or the timeout passes. Shared by processes and containers."""
    deadline = time.monotonic() + timeout
    pending = list(members)
    while pending:
        for member in list(pending):
            why = exited(member)
            if why is not None:
                raise EtcdStartError(why)
            if member.healthy():
                pending.remove(member)
        if pending and time.monotonic() > deadline:
            names = ", ".join(f"{m.name} ({m.endpoint})" for m in pending)
            raise EtcdStartError(f"etcd member(s) {names} not healthy after {timeout:.0f} s")
        if pending:
            # Server start-up is not a condition we could watch for: a short back-off.
            time.sleep(poll)


class ClusterAddresses(Generic[M]):
    """``endpoints`` and ``endpoint_list`` of any set of members (processes, containers)."""

    members: list[M]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def endpoint_list(self) -> str:
        """Comma-separated ``host:port`` list for ``--rdzv-endpoint``."""
        return ",".join(self.endpoints)
