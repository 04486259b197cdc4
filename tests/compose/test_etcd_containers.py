"""tests/etcd_containers.py: etcd in containers through testcontainers, cleaned up by us."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from coordinator.etcd_server import EtcdStartError
from tests.compose.stack import etcdctl_binary
from tests.etcd_containers import (
    EtcdContainers,
    container_engine_problem,
    etcd_mode,
    remove_orphaned_containers,
    start_etcd_container,
)

pytestmark = [pytest.mark.compose, pytest.mark.timeout(300)]


def _etcdctl(endpoints: str, *args: str) -> str:
    return subprocess.run(
        [etcdctl_binary(), f"--endpoints={endpoints}", "--command-timeout=10s", *args],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip


def _labelled_containers() -> list[str]:
    """This process's test etcd containers (CI runs the container pass beside this one)."""
    return subprocess.run(
        ["docker", "ps", "-a", "-q", "--filter", "label=org.etcd-elastic.kind",
         "--filter", f"label=org.etcd-elastic.owner-pid={os.getpid()}"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.split()  # fmt: skip


def _exists(container: str) -> bool:
    return subprocess.run(["docker", "inspect", container], capture_output=True, timeout=60,
                          check=False).returncode == 0  # fmt: skip


@pytest.mark.parametrize(
    ("value", "problem", "mode"),
    [
        (None, None, "container"),
        (None, "no docker engine answers", "binary"),
        ("binary", None, "binary"),
        ("container", None, "container"),
        ("auto", None, "container"),
        ("auto", "no docker engine answers", "binary"),
        (" Container ", None, "container"),
    ],
)
def test_etcd_mode_decides_from_the_variable_and_the_engine(
    value: str | None, problem: str | None, mode: str
) -> None:
    env = {} if value is None else {"ETCD_ELASTIC_ETCD": value}
    assert etcd_mode(env, problem) == mode


def test_etcd_mode_refuses_a_bad_value_and_a_missing_engine() -> None:
    with pytest.raises(ValueError) as bad:
        etcd_mode({"ETCD_ELASTIC_ETCD": "docker"}, None)
    assert str(bad.value) == (
        "ETCD_ELASTIC_ETCD='docker' is not one of auto, binary, container; "
        "use binary (local etcd), container (docker) or auto"
    )
    with pytest.raises(ValueError) as missing:
        etcd_mode({"ETCD_ELASTIC_ETCD": "container"}, "no docker engine answers")
    assert str(missing.value) == (
        "ETCD_ELASTIC_ETCD=container but no docker engine answers; "
        "run scripts/build_images or set ETCD_ELASTIC_ETCD=binary"
    )


@pytest.fixture
def engine() -> Iterator[None]:
    problem = container_engine_problem()
    if problem is not None:
        pytest.fail(f"etcd containers cannot run: {problem} (scripts/build_images)")
    yield
    assert _labelled_containers() == [], "a test left etcd containers behind"


def test_one_member_serves_clients_and_metrics(engine: None) -> None:
    with start_etcd_container(1, no_fsync=True) as cluster:
        assert cluster.members[0].endpoint.startswith("127.0.0.1:")
        _etcdctl(cluster.endpoint_list, "put", "/tc/k", "v")
        assert _etcdctl(cluster.endpoint_list, "get", "/tc/k", "--print-value-only") == "v\n"
        assert "etcd_server_has_leader 1" in cluster.members[0].metrics()
        assert len(_labelled_containers()) == 1


def test_three_members_survive_a_killed_member_and_take_it_back(engine: None) -> None:
    cluster = start_etcd_container(3, no_fsync=True)
    try:
        assert len(set(cluster.endpoints)) == 3
        cluster.kill(1)
        assert not cluster.members[1].running
        # If it was the leader, the other two elect a new one first.
        cluster.wait_healthy([cluster.members[0], cluster.members[2]], 30)
        _etcdctl(",".join(cluster.endpoints[i] for i in (0, 2)), "put", "/tc/k", "during")
        cluster.restart(1)
        assert cluster.members[1].healthy()
        # The restarted member caught up with what was written while it was down.
        value = _etcdctl(cluster.endpoints[1], "get", "/tc/k", "--print-value-only",
                         "--consistency=s")  # fmt: skip
        assert value == "during\n"
    finally:
        cluster.stop()
    assert _labelled_containers() == []


def test_containers_of_a_dead_test_process_are_removed(engine: None) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = subprocess.run(
        ["docker", "create", "--label", "org.etcd-elastic.kind=test-etcd",
         "--label", f"org.etcd-elastic.owner-pid={dead.pid}", "etcd-elastic/etcd:latest"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.strip()  # fmt: skip
    try:
        remove_orphaned_containers()
        # Gone, whether this call removed it or another test process cleaning up at the
        # same moment took it first (then this call skipped it: tests/unit/test_orphans.py).
        assert not _exists(orphan)
    finally:
        subprocess.run(["docker", "rm", "-f", orphan], capture_output=True, timeout=60,
                       check=False)  # fmt: skip


def test_a_member_that_cannot_start_is_reported_and_removed(engine: None) -> None:
    cluster = EtcdContainers(1, log_level="chatty")  # etcd exits on an unknown log level
    with pytest.raises(EtcdStartError, match=r"etcd container m0 on 127\.0\.0\.1:\d+ exited"):
        cluster.start(timeout=30)
    assert _labelled_containers() == []
