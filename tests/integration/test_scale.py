"""Scale sanity: formation cost grows linearly with the nodes, in writes and watch events.

Counted from etcd's own /metrics around one formation: keys written (puts + deletes,
including those inside transactions) and watch events etcd delivered to watchers.
"""

from __future__ import annotations

import uuid

import pytest

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.rdzv_helpers import Joins, make_handler, metric, shutdown_all

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _counters(cluster: EtcdCluster) -> dict[str, float]:
    text = cluster.members[0].metrics()
    return {
        "writes": metric(text, "etcd_mvcc_put_total") + metric(text, "etcd_mvcc_delete_total"),
        "events": metric(text, "etcd_debugging_mvcc_events_total"),
    }


def _formation_cost(cluster: EtcdCluster, n: int) -> dict[str, float]:
    run_id = f"scale-{n}-{uuid.uuid4().hex[:8]}"
    # Simulated nodes are threads sharing one client per 25 nodes (as a few processes
    # would); each node still has its own lease, node key and watches.
    clients = [
        EtcdClient(EtcdConfig(endpoints=tuple(cluster.endpoints))) for _ in range((n + 24) // 25)
    ]
    handlers: list[EtcdRendezvousHandler] = []
    try:
        for i in range(n):
            h = make_handler(cluster, run_id, n, n, last_call_timeout=30)
            h._client, h._own_client = clients[i % len(clients)], False  # share the channel
            handlers.append(h)
        before = _counters(cluster)
        infos = Joins(handlers).start().infos(timeout=120)
        after = _counters(cluster)
        assert sorted(i.rank for i in infos.values()) == list(range(n))
        return {k: after[k] - before[k] for k in before}
    finally:
        shutdown_all(handlers)
        for c in clients:
            c.close()


def test_formation_writes_and_watch_events_grow_linearly(etcd1: EtcdCluster) -> None:
    small, large = 50, 200
    cost_small = _formation_cost(etcd1, small)
    cost_large = _formation_cost(etcd1, large)
    print(f"\nformation cost: N={small}: {cost_small}; N={large}: {cost_large}")
    for n, cost in ((small, cost_small), (large, cost_large)):
        # One node key per node plus one state commit (and a few bookkeeping commits).
        assert cost["writes"] <= 2 * n + 10, (n, cost)
        # The coordinator hears each join (unless it read it before its watch began), each
        # node hears the completion: at most a few events per node. O(N²) fan-out would be
        # N events per node: 200 per node at N = 200.
        assert cost["events"] <= 3 * n + 20, (n, cost)
    # Linear, not quadratic: 4x the nodes costs about 4x in writes, far from 16x.
    assert cost_large["writes"] <= 4.5 * cost_small["writes"]
