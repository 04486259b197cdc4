"""Who grants the run's lease (issue 20), on real etcd: one node per run, whatever the
number of nodes that start at once, and no run-lease round trip on a node's way to its
key; the others keep the lease alive once they read a state on it, so the run's state
outlives the node that granted it."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys
from coordinator.core.run_lease import ensure_run_lease, run_lease_id
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler, create_handler
from tests.rdzv_helpers import Joins, make_handler

pytestmark = pytest.mark.integration

# A grant etcd is slow to apply (a loaded member's fsync): every node that starts
# meanwhile and looks for the lease would find it absent and ask for it too.
_SLOW_GRANT_S = 0.3


class CountingClient(EtcdClient):
    """Our client, counting the run-lease calls of its node (shared by every client of
    the test), each grant of a fixed id made slow."""

    calls: Counter[tuple[str, int]] = Counter()
    lock = threading.Lock()

    def _count(self, call: str, lease_id: int) -> None:
        with self.lock:
            self.calls[(call, lease_id)] += 1

    def lease_grant_if_absent(self, lease_id: int, ttl: int) -> int:
        self._count("grant", lease_id)
        time.sleep(_SLOW_GRANT_S)
        return super().lease_grant_if_absent(lease_id, ttl)

    def lease_refresh(self, lease_id: int, *, budget: float | None = None) -> int:
        self._count("refresh", lease_id)
        return super().lease_refresh(lease_id, budget=budget)


@pytest.fixture
def counted(etcd1: EtcdCluster) -> Iterator[list[CountingClient]]:
    made: list[CountingClient] = []
    CountingClient.calls = Counter()
    yield made
    for c in made:
        c.close()


def _handler(etcd: EtcdCluster, run_id: str, n: int, client: EtcdClient) -> EtcdRendezvousHandler:
    params = RendezvousParameters(
        "etcd-v3", etcd.endpoint_list, run_id, n, n,
        last_call_timeout=0.5, join_timeout=60, lease_ttl=3, retention=60,
    )  # fmt: skip
    return create_handler(params, client=client)


def test_one_node_grants_the_run_lease_when_every_node_starts_at_once(
    etcd1: EtcdCluster, run_id: str, counted: list[CountingClient]
) -> None:
    n = 8
    lease = run_lease_id(RunKeys(DEFAULT_KEY_PREFIX, run_id))
    counted += [CountingClient(EtcdConfig(tuple(etcd1.endpoints))) for _ in range(n)]
    nodes = [_handler(etcd1, run_id, n, c) for c in counted]
    try:
        infos = Joins(nodes).start().infos(60)
        assert sorted(i.rank for i in infos.values()) == list(range(n))
        formed = dict(CountingClient.calls)
        terms = sum(parts.duty.terms for h in nodes if (parts := h._current()) is not None)
        ranks = {info.rank: info for info in infos.values()}
        ranks[0].store.set("written-by-rank-0", "x")  # on the lease, like every run key
    finally:
        for h in nodes:
            h.leave()
    # The run's lease is asked for by coordinators only, at most once per leadership
    # term (a failed grant is a raft proposal too: 1,750 grants for 1,001 leases at
    # N = 1000 when every node looked for it first), and no node renews it on its way to
    # its key. Nodes that start together may land in either order: a node that led for a
    # moment steps down for one that came earlier; if both looked before either granted,
    # both ask (one is refused and renews instead), else the later one renews.
    grants = formed.pop(("grant", lease))
    assert 1 <= grants <= terms, (grants, formed, terms)
    assert set(formed) <= {("refresh", lease)}
    assert formed.get(("refresh", lease), 0) <= terms - 1, (formed, terms)


def test_the_run_state_outlives_the_node_that_granted_its_lease(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient, handlers: list[EtcdRendezvousHandler]
) -> None:
    """The others read the state on the lease and keep it alive: once the node that
    granted it has left, the state stays for as long as they live (here 3 TTLs of the
    run's lease), not retention seconds after that node's last renewal."""
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    retention = 2  # lease_ttl 1: the run's lease lives 2 s without a renewal
    three = [make_handler(etcd1, run_id, 2, 3, lease_ttl=1, retention=retention) for _ in "abc"]
    handlers += three
    Joins(three).start().infos(30)
    granter = next(h for h in three if h.is_coordinator)
    granter.leave()
    time.sleep(3 * retention)
    state, _ = client.get(keys.state)
    assert state is not None and state.lease == run_lease_id(keys)
    assert client.lease_time_to_live(run_lease_id(keys)) > 0


def test_a_coordinator_that_finds_the_run_lease_renews_it_without_a_grant(
    etcd1: EtcdCluster, run_id: str, counted: list[CountingClient]
) -> None:
    """A coordinator that took over before the first commit (the one before it went, or
    stepped down for a node that came earlier) finds the lease granted: it looks (a read)
    and renews it; a refused grant would have been a raft proposal."""
    lease = run_lease_id(RunKeys(DEFAULT_KEY_PREFIX, run_id))
    counted.append(CountingClient(EtcdConfig(tuple(etcd1.endpoints))))
    (client,) = counted
    try:
        assert ensure_run_lease(client, lease, 30) == 30  # the first coordinator: granted
        assert ensure_run_lease(client, lease, 10) == 30  # the next one: the first's TTL
        assert dict(CountingClient.calls) == {("grant", lease): 1, ("refresh", lease): 1}
    finally:
        client.lease_revoke(lease)
