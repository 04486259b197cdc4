"""What etcd itself counts, read from every member's ``/metrics`` (etcd 3.5; 3.4 names the
same series), and the change between two readings.

Where each figure is read, and why (checked against etcd 3.5.1 on a 3-member cluster):

- on the **leader** (a write is applied by every member: summing would count it three
  times; lease renewals are counted by the leader only):
  ``writes`` = raft proposals committed (every put, delete, write transaction whether
  its compare held or not, lease grant, revoke and expiry: what is fsynced);
  ``keys_put`` / ``keys_deleted`` (``etcd_mvcc_put_total`` / ``etcd_mvcc_delete_total``:
  keys, not requests; a lease's expiry deletes its keys); ``bytes_put`` (sum of the
  key and value sizes put: what the database grows by before compaction);
  ``keepalives`` (leases renewed); lease ``grants``, ``revokes`` (explicit and expired)
  and ``expired``; the ``revision``, the live ``keys`` and the database size (``db_size``,
  ``db_in_use``) are gauges whose change is given;
- **summed over members** (each member counts what its own clients asked of it): unary
  requests by method (``grpc_server_handled_total``: ``rpc_Range``, ``rpc_Txn``, ...),
  keep-alive and watch stream messages received, streams opened, watch events sent
  (``etcd_debugging_mvcc_events_total``), bytes received from clients, and CPU.

Pure except :func:`scrape`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from benchmarks.stats import samples
from coordinator.etcd_server import EtcdCluster

__all__ = [
    "LEADER_COUNTERS",
    "LEADER_GAUGES",
    "SUM_COUNTERS",
    "Reading",
    "change",
    "parse",
    "scrape",
]

_LABEL = re.compile(r'(\w+)="([^"]*)"')

# figure -> series, read on the leader.
LEADER_COUNTERS = {
    "writes": "etcd_server_proposals_committed_total",
    "keys_put": "etcd_mvcc_put_total",
    "keys_deleted": "etcd_mvcc_delete_total",
    "mvcc_txns": "etcd_mvcc_txn_total",
    "bytes_put": "etcd_debugging_mvcc_total_put_size_in_bytes",
    "keepalives": "etcd_debugging_lease_renewed_total",
    "lease_grants": "etcd_debugging_lease_granted_total",
    "lease_revokes": "etcd_debugging_lease_revoked_total",
    "lease_expired": "etcd_debugging_server_lease_expired_total",
    "leader_cpu_s": "process_cpu_seconds_total",
}
LEADER_GAUGES = {
    "revision": "etcd_debugging_mvcc_current_revision",
    "keys": "etcd_debugging_mvcc_keys_total",
    "db_size": "etcd_mvcc_db_total_size_in_bytes",
    "db_in_use": "etcd_mvcc_db_total_size_in_use_in_bytes",
}
# figure -> series, summed over members.
SUM_COUNTERS = {
    "watch_events": "etcd_debugging_mvcc_events_total",
    "client_bytes_in": "etcd_network_client_grpc_received_bytes_total",
    "etcd_cpu_s": "process_cpu_seconds_total",
}
_UNARY = ("Range", "Txn", "Put", "DeleteRange", "LeaseGrant", "LeaseRevoke", "LeaseTimeToLive")
_STREAMS = {"LeaseKeepAlive": "etcdserverpb.Lease", "Watch": "etcdserverpb.Watch"}
_SUM_GAUGES = {
    "watchers": "etcd_debugging_mvcc_watcher_total",
    "watch_streams": "etcd_debugging_mvcc_watch_stream_total",
}


def parse(text: str) -> dict[str, float]:
    """One member's page as figures: plain series summed over their labels under their
    name, and gRPC series by method as ``<series>:<service>/<method>``."""
    out: dict[str, float] = {}
    for name, labels, value in samples(text):
        out[name] = out.get(name, 0.0) + value
        if name.startswith("grpc_server_") and labels:
            found = dict(_LABEL.findall(labels))
            key = f"{name}:{found.get('grpc_service', '')}/{found.get('grpc_method', '')}"
            out[key] = out.get(key, 0.0) + value
    return out


@dataclass(frozen=True)
class Reading:
    """Every member's figures at one moment, and which member led."""

    members: tuple[Mapping[str, float], ...]
    leader: int

    def at_leader(self, series: str) -> float:
        return self.members[self.leader].get(series, 0.0)

    def summed(self, series: str) -> float:
        return sum(m.get(series, 0.0) for m in self.members)


def leader_of(members: Sequence[Mapping[str, float]]) -> int:
    """The index of the member reporting ``etcd_server_is_leader 1`` (0 if none does)."""
    for index, member in enumerate(members):
        if member.get("etcd_server_is_leader", 0.0) >= 1.0:
            return index
    return 0


def change(before: Reading, after: Reading) -> dict[str, float]:
    """What etcd did between two readings (see the module docstring), plus the gauges'
    values at the end (``*_end``) and ``leader_changed`` (1 if another member led)."""
    out: dict[str, float] = {}
    lead = after.leader
    for figure, series in LEADER_COUNTERS.items():
        out[figure] = after.members[lead].get(series, 0.0) - before.members[lead].get(series, 0.0)
    for figure, series in LEADER_GAUGES.items():
        end = after.members[lead].get(series, 0.0)
        out[figure] = end - before.members[lead].get(series, 0.0)
        out[f"{figure}_end"] = end
    for figure, series in SUM_COUNTERS.items():
        out[figure] = after.summed(series) - before.summed(series)
    for method in _UNARY:
        series = f"grpc_server_handled_total:{_service(method)}/{method}"
        out[f"rpc_{method}"] = after.summed(series) - before.summed(series)
    for method, service in _STREAMS.items():
        received = f"grpc_server_msg_received_total:{service}/{method}"
        started = f"grpc_server_started_total:{service}/{method}"
        out[f"msgs_{method}"] = after.summed(received) - before.summed(received)
        out[f"streams_{method}"] = after.summed(started) - before.summed(started)
    for figure, series in _SUM_GAUGES.items():
        out[f"{figure}_end"] = after.summed(series)
    out["leader_changed"] = 0.0 if before.leader == after.leader else 1.0
    return out


def _service(method: str) -> str:
    return "etcdserverpb.Lease" if method.startswith("Lease") else "etcdserverpb.KV"


def scrape(cluster: EtcdCluster, timeout: float = 5.0) -> Reading:
    """Read every running member's ``/metrics`` now (a member that does not answer
    counts as empty). HTTP, not gRPC: it adds nothing to what it reads."""
    members: list[Mapping[str, float]] = []
    for member in cluster.members:
        try:
            members.append(parse(member.metrics(timeout=timeout)) if member.running else {})
        except OSError:
            members.append({})
    return Reading(tuple(members), leader_of(members))
