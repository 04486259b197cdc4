"""Fixtures of the integration tests of coordinator.core.etcd_client (test_etcd_client.py and
test_etcd_watch.py use them; the cluster fixtures are in ``tests/conftest.py``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest


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
