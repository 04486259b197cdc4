"""The etcd harness survives the port races of a busy machine: members of one cluster never
share a port, and a port another process took before etcd bound it means new ports, not a
failed test (CI once saw ``initial cluster ... has duplicate url``)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from coordinator.etcd_server import EtcdCluster, EtcdStartError

pytestmark = pytest.mark.integration


def test_members_of_one_cluster_never_share_a_port(etcd_binary: Path) -> None:
    for _ in range(20):
        cluster = EtcdCluster(3, binary=etcd_binary)
        try:
            ports = [p for m in cluster.members for p in (m.client_port, m.peer_port)]
            assert len(set(ports)) == 6, ports
        finally:
            cluster.stop()


def test_a_peer_port_taken_before_etcd_binds_it_gets_new_ports(
    etcd_binary: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = EtcdCluster(3, binary=etcd_binary, no_fsync=True, stop_grace=1.0)
    taken = cluster.members[1].peer_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with caplog.at_level(logging.WARNING, "coordinator.etcd_server"), cluster:
            assert "address already in use" in caplog.text and "trying new ports" in caplog.text
            assert taken not in {m.peer_port for m in cluster.members}
            assert all(m.healthy(timeout=5) for m in cluster.members)


def test_a_start_failure_that_is_not_a_port_race_is_raised_at_once(etcd_binary: Path) -> None:
    cluster = EtcdCluster(1, binary=etcd_binary, extra_args=["--no-such-flag"], stop_grace=1.0)
    first_port = cluster.members[0].client_port
    with pytest.raises(EtcdStartError, match="exited with code 2"):
        cluster.start(timeout=20)
    assert cluster.members[0].client_port == first_port  # no retry on new ports
    assert not cluster.base_dir.exists()
