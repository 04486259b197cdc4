"""What the tests of coordinator.core.etcd_client share: a client factory, a client behind
a TCP fault proxy, a bounded poll, a watch-callback recorder, a lease-callback recorder,
and a lease-owning child program to freeze with SIGSTOP (their fixtures are in
``conftest.py``).

Run as ``python -m tests.integration.etcd_client_support ENDPOINTS TTL KEY`` it is that
child: it takes a lease, puts KEY on it, keeps it alive and prints one JSON line per
event (``ready``, ``unreachable``, ``reachable``, ``lost``) until the lease is lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from coordinator.core.etcd_client import EtcdClient, EtcdConfig, Outage, WatchEvent
from coordinator.etcd_server import EtcdCluster
from tests.chaos.proxy import TcpFaultProxy

__all__ = [
    "LeaseEvents",
    "Recorder",
    "_FirstEndpoint",
    "_behind_a_proxy",
    "_client",
    "_eventually",
]


def _client(endpoints: list[str], **kwargs: Any) -> EtcdClient:
    options: dict[str, Any] = {"request_timeout": 2.0, "retry_budget": 10.0, **kwargs}
    rng = options.pop("rng", None)
    return EtcdClient(EtcdConfig(endpoints=tuple(endpoints), **options), rng=rng)


def _eventually(predicate: Any, timeout: float = 10.0) -> None:
    """Poll a condition nothing signals (a thread's progress), with a bound."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not predicate():
        assert time.monotonic() < deadline, f"condition not met within {timeout} s"
        pause.wait(0.02)


class _FirstEndpoint:
    """An rng whose first pick is endpoint 0, so the dead endpoint is tried first."""

    def randrange(self, n: int) -> int:
        return 0

    def random(self) -> float:
        return 0.5


@contextlib.contextmanager
def _behind_a_proxy(
    etcd: EtcdCluster, name: str, **options: Any
) -> Iterator[tuple[TcpFaultProxy, EtcdClient]]:
    """A client whose first endpoint is a fault proxy of member 0, the second member 0."""
    host, port = etcd.endpoints[0].rsplit(":", 1)
    with TcpFaultProxy((host, int(port)), name=name) as proxy:
        endpoints = [proxy.endpoint, etcd.endpoints[0]]
        with _client(endpoints, rng=_FirstEndpoint(), **options) as client:
            yield proxy, client


class Recorder:
    """Collects watch callbacks; tests wait on it with a bound, never a bare sleep."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.events: list[WatchEvent] = []
        self.compacted: list[int] = []
        self.errors: list[Exception] = []

    def on_events(self, events: list[WatchEvent], revision: int) -> None:
        with self.cond:
            self.events.extend(events)
            self.cond.notify_all()

    def on_compacted(self, revision: int) -> None:
        with self.cond:
            self.compacted.append(revision)
            self.cond.notify_all()

    def on_error(self, error: Exception) -> None:
        with self.cond:
            self.errors.append(error)
            self.cond.notify_all()

    def wait(self, predicate: Any, timeout: float = 10.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: predicate(self), timeout), (
                f"watch did not deliver in {timeout} s: {len(self.events)} events, "
                f"compacted={self.compacted}, errors={self.errors}"
            )


class LeaseEvents:
    """Collects a keep-alive's callbacks (on_lost, on_unreachable, on_reachable)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.lost: list[float] = []
        self.unreachable: list[Outage] = []
        self.reachable: list[float] = []
        self.unreachable_at: list[float] = []  # monotonic time of each on_unreachable

    def on_lost(self) -> None:
        with self.cond:
            self.lost.append(time.monotonic())
            self.cond.notify_all()

    def on_unreachable(self, outage: Outage) -> None:
        with self.cond:
            self.unreachable.append(outage)
            self.unreachable_at.append(time.monotonic())
            self.cond.notify_all()

    def on_reachable(self, silence: float) -> None:
        with self.cond:
            self.reachable.append(silence)
            self.cond.notify_all()

    def wait(self, predicate: Any, timeout: float) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: predicate(self), timeout), (
                f"lease callbacks not seen in {timeout} s: lost={self.lost}, "
                f"unreachable={self.unreachable}, reachable={self.reachable}"
            )


def _lease_owner(endpoints: str, ttl: int, key: str) -> None:
    def say(event: str, **fields: Any) -> None:
        print(json.dumps({"event": event, **fields}), flush=True)

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    with _client(endpoints.split(",")) as client:
        lease = client.lease_grant(ttl)
        client.put(key.encode(), b"owned", lease=lease)
        keepalive = client.keep_alive(
            lease,
            ttl,
            on_unreachable=lambda outage: say("unreachable", since=outage.since),
            on_reachable=lambda silence: say("reachable", silence=silence),
        )
        say("ready", lease=lease)
        keepalive.wait_lost(120)
        say("lost", state=keepalive.state.value, reason=keepalive.lost_reason)
        keepalive.close(revoke=False)


if __name__ == "__main__":
    _lease_owner(sys.argv[1], int(sys.argv[2]), sys.argv[3])
