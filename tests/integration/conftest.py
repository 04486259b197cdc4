"""Fixtures shared by the integration tests (the etcd cluster fixtures are in
``tests/conftest.py``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.integration.orphans_support import Tracked
from tests.integration.warm_support import Harness
from tests.rdzv_helpers import shutdown_all


@pytest.fixture
def handlers() -> Iterator[list[EtcdRendezvousHandler]]:
    """Handlers a test creates; all leave at the end, even on failure."""
    made: list[EtcdRendezvousHandler] = []
    yield made
    shutdown_all(made)


@pytest.fixture
def client(etcd1: EtcdCluster) -> Iterator[EtcdClient]:
    """A client of the session's single-member etcd, closed after the test."""
    with EtcdClient(EtcdConfig(tuple(etcd1.endpoints))) as c:
        yield c


@pytest.fixture
def threads_reaped() -> Iterator[None]:
    """Every thread a test's clients started is gone once they are closed."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    leaked = [t for t in threading.enumerate() if t not in before]
    for thread in leaked:
        thread.join(max(0.0, deadline - time.monotonic()))
    still = [t.name for t in leaked if t.is_alive()]
    assert not still, f"threads left running after the clients closed: {still}"


@pytest.fixture
def prefix(run_id: str) -> bytes:
    return f"/etcd-client-test/{run_id}/".encode()


@pytest.fixture
def tracked() -> Iterator[Tracked]:
    """Processes a test must not leave running: SIGKILLed at the end if still alive."""
    t = Tracked()
    try:
        yield t
    finally:
        t.cleanup()


@pytest.fixture
def harness() -> Iterator[Harness]:
    """Worker groups and warm pools a test starts: stopped, reaped and closed at the end."""
    h = Harness()
    try:
        yield h
    finally:
        h.close()
