"""Shared pieces of the Store tests: the two backends (our EtcdStore on real etcd, torch's
TCPStore as the reference), their fixtures, and a timer that every test joins.

Every contract test takes ``backend``, which opens handles on a round's store; TCPStore
proves that each expectation is torch's behaviour, not just ours. A "round" of the TCP
reference is a TCPStore server of its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import etcd3
import pytest
from torch.distributed import Store, TCPStore

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import RunKeys
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.store import EtcdStore

__all__ = [
    "LONG",
    "ODD_KEYS",
    "PROMPT_S",
    "SHORT",
    "Backend",
    "Later",
    "backend_fixture",
    "compact_to_head",
    "etcd_backend",
    "etcd_fixture",
    "store_fixture",
]

LONG = timedelta(seconds=30)
SHORT = timedelta(seconds=0.5)
# A blocked get must return this much sooner than its timeout once the key is set.
PROMPT_S = 10.0
ODD_KEYS = ["a/b", "..", "../../state", "/", "", "é✓", "%2F", "with space", "x" * 300]


@dataclass
class Backend:
    """Opens handles on per-round stores of one implementation."""

    name: str
    open: Callable[[int, timedelta], Store]
    client: EtcdClient | None = None
    keys: RunKeys | None = None
    _cleanup: list[Callable[[], None]] = field(default_factory=list)


@contextlib.contextmanager
def etcd_backend(cluster: EtcdCluster, run_id: str) -> Iterator[Backend]:
    client = EtcdClient(EtcdConfig(endpoints=tuple(cluster.endpoints)))
    keys = RunKeys("/etcd-elastic-test", run_id)
    try:
        yield Backend(
            "etcd",
            lambda round_, timeout: EtcdStore(client, keys.store_prefix(round_), timeout),
            client=client,
            keys=keys,
        )
    finally:
        client.delete_prefix(keys.run_prefix)
        client.close()


def _tcp_backend() -> Iterator[Backend]:
    servers: dict[int, TCPStore] = {}
    handles: list[TCPStore] = []

    def open_(round_: int, timeout: timedelta) -> Store:
        if round_ not in servers:
            servers[round_] = TCPStore(
                "127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False
            )
        handle = TCPStore("127.0.0.1", servers[round_].port, None, False, timeout=timeout)
        handles.append(handle)
        return handle

    try:
        yield Backend("tcp", open_)
    finally:
        handles.clear()
        servers.clear()


# Fixtures are imported by the test modules under these names and used as ``backend``,
# ``store`` and ``etcd``.
@pytest.fixture(name="backend", params=["etcd", "tcp"])
def backend_fixture(
    request: pytest.FixtureRequest, run_id: str, no_leaked_threads: None
) -> Iterator[Backend]:
    if request.param == "etcd":
        cluster: EtcdCluster = request.getfixturevalue("etcd1")
        with etcd_backend(cluster, run_id) as opened:
            yield opened
    else:
        yield from _tcp_backend()


@pytest.fixture(name="store")
def store_fixture(backend: Backend) -> Store:
    return backend.open(0, LONG)


class Later:
    """Runs ``action`` on a thread after ``delay`` seconds; always joined by the test."""

    def __init__(self, delay: float, action: Callable[[], Any]) -> None:
        self._timer = threading.Timer(delay, action)
        self._timer.start()

    def __enter__(self) -> Later:
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        self._timer.join(timeout=30)


@pytest.fixture(name="etcd")
def etcd_fixture(etcd1: EtcdCluster, run_id: str) -> Iterator[Backend]:
    """The etcd backend alone, for tests that look at etcd itself."""
    with etcd_backend(etcd1, run_id) as opened:
        yield opened


def compact_to_head(endpoint: str, scratch: bytes) -> int:
    """Compact etcd's whole history (as an operator's or the chaos suite's compaction)."""
    host, port = endpoint.rsplit(":", 1)
    raw = etcd3.client(host=host, port=int(port))
    try:
        raw.put(scratch, b"x")
        revision = int(raw.put(scratch, b"y").header.revision)
        raw.compact(revision, physical=True)
        return revision
    finally:
        raw.close()
