"""Every lease of a client on one keep-alive stream, against real etcd (issue 20, item 1).

* many leases: one stream (etcd's own count of keep-alive streams) and one thread;
* a lease revoked elsewhere: LOST, while its siblings stay alive on the same stream;
* leases added and closed while the stream runs: the others are not disturbed;
* the stream's member blackholed, or frozen (SIGSTOP): every lease moves to the next
  endpoint together, none lost, none even UNREACHABLE.
"""

from __future__ import annotations

import threading
import time

import pytest

from benchmarks.stats import counter_where
from coordinator.core.etcd_client import EtcdClient, KeepAlive, LeaseState
from coordinator.etcd_server import EtcdCluster
from tests.chaos.proxy import Mode
from tests.integration.etcd_client_support import (
    LeaseEvents,
    _behind_a_proxy,
    _client,
    _eventually,
    _FirstEndpoint,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("threads_reaped")]


def _streams_opened(cluster: EtcdCluster) -> float:
    """Keep-alive streams etcd has accepted, summed over its members (its /metrics)."""
    return sum(
        counter_where(m.metrics(), "grpc_server_started_total", grpc_method="LeaseKeepAlive")
        for m in cluster.members
        if m.running
    )


def _keepalive_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("etcd-keepalive")]


def _keep_alive(
    client: EtcdClient, count: int, ttl: int, events: LeaseEvents | None = None
) -> list[KeepAlive]:
    made = []
    seen = events or LeaseEvents()
    for _ in range(count):
        granted_at = time.monotonic()
        lease = client.lease_grant(ttl)
        keepalive = client.keep_alive(
            lease, ttl, seen.on_lost, on_unreachable=seen.on_unreachable,
            on_reachable=seen.on_reachable, granted_at=granted_at,
        )  # fmt: skip
        made.append(keepalive)
    return made


def test_twenty_leases_of_one_client_share_one_stream_and_one_thread(etcd1: EtcdCluster) -> None:
    ttl = 2
    with _client(etcd1.endpoints) as client:
        before = _streams_opened(etcd1)
        keepalives = _keep_alive(client, 20, ttl)
        _eventually(lambda: all(ka.endpoint is not None for ka in keepalives))
        assert _keepalive_threads() == [f"etcd-keepalive-{_first_three(keepalives)} and 17 more"]
        time.sleep(2 * ttl)  # two TTLs: each lease needed several renewals
        assert all(ka.state is LeaseState.ALIVE for ka in keepalives)
        assert all(client.lease_time_to_live(ka.lease_id) > 0 for ka in keepalives)
        assert _streams_opened(etcd1) - before == 1
        for keepalive in keepalives:
            keepalive.close(revoke=True)
        assert all(client.lease_time_to_live(ka.lease_id) == -1 for ka in keepalives)


def _first_three(keepalives: list[KeepAlive]) -> str:
    return ",".join(f"{lease:x}" for lease in sorted(ka.lease_id for ka in keepalives)[:3])


def test_a_lease_revoked_elsewhere_is_lost_and_its_siblings_stay_alive_on_the_stream(
    etcd1: EtcdCluster, prefix: bytes
) -> None:
    ttl = 3
    siblings, victim = LeaseEvents(), LeaseEvents()
    with _client(etcd1.endpoints) as owner, _client(etcd1.endpoints) as other:
        before = _streams_opened(etcd1)
        keepalives = _keep_alive(owner, 4, ttl, siblings)
        revoked = _keep_alive(owner, 1, ttl, victim)[0]
        owner.put(prefix + b"victim", b"x", lease=revoked.lease_id)
        _eventually(lambda: all(ka.endpoint is not None for ka in [*keepalives, revoked]))
        other.lease_revoke(revoked.lease_id)
        began = time.monotonic()
        assert revoked.wait_lost(ttl / 3 + 1)
        took = time.monotonic() - began
        assert revoked.state is LeaseState.LOST and len(victim.lost) == 1
        time.sleep(ttl)  # a TTL later the others still renew, on the same stream
        assert siblings.lost == [] and siblings.unreachable == []
        assert all(ka.state is LeaseState.ALIVE for ka in keepalives)
        assert all(owner.lease_time_to_live(ka.lease_id) > 0 for ka in keepalives)
        assert _streams_opened(etcd1) - before == 1
        print(f"\nrevoked elsewhere: lost after {took:.2f} s; 4 siblings alive")
        for keepalive in [*keepalives, revoked]:
            keepalive.close()


def test_leases_added_and_closed_while_the_stream_runs_disturb_no_other(
    etcd1: EtcdCluster,
) -> None:
    ttl = 2
    events = LeaseEvents()
    with _client(etcd1.endpoints) as client:
        before = _streams_opened(etcd1)
        first = _keep_alive(client, 3, ttl, events)
        _eventually(lambda: all(ka.endpoint is not None for ka in first))
        added = _keep_alive(client, 3, ttl, events)
        _eventually(lambda: all(ka.endpoint is not None for ka in added))
        first[0].close(revoke=True)
        first[1].close(revoke=False)
        assert client.lease_time_to_live(first[0].lease_id) == -1
        assert first[0].state is LeaseState.CLOSED and not first[0].lost()
        time.sleep(2 * ttl)
        staying = [first[2], *added]
        assert all(ka.state is LeaseState.ALIVE for ka in staying)
        assert all(client.lease_time_to_live(ka.lease_id) > 0 for ka in staying)
        # The lease closed without revoking is no longer renewed: etcd expires it.
        _eventually(lambda: client.lease_time_to_live(first[1].lease_id) == -1, timeout=ttl + 5)
        assert events.lost == [] and events.unreachable == []
        assert _streams_opened(etcd1) - before == 1
        assert len(_keepalive_threads()) == 1
        for keepalive in staying:
            keepalive.close()


def test_a_blackholed_member_moves_every_lease_to_the_next_endpoint_losing_none(
    etcd1: EtcdCluster,
) -> None:
    # The stream's member answers nothing (a cut cable: connections stay open). Within an
    # interval the stream, with all its leases, is on the other endpoint.
    ttl = 3
    events = LeaseEvents()
    with _behind_a_proxy(etcd1, "blackholed-member") as (proxy, client):
        keepalives = _keep_alive(client, 10, ttl, events)
        _eventually(lambda: all(ka.endpoint == proxy.endpoint for ka in keepalives))
        proxy.set_mode(Mode.BLACKHOLE)
        began = time.monotonic()
        _eventually(lambda: all(ka.endpoint == etcd1.endpoints[0] for ka in keepalives), 10)
        took = time.monotonic() - began
        time.sleep(2 * ttl)
        assert events.lost == [] and events.unreachable == []
        assert all(ka.state is LeaseState.ALIVE for ka in keepalives)
        assert all(client.lease_time_to_live(ka.lease_id) > 0 for ka in keepalives)
        assert len(_keepalive_threads()) == 1
        print(f"\nblackholed member: 10 leases moved in {took:.2f} s (interval {ttl / 3:.1f} s)")
        for keepalive in keepalives:
            keepalive.close()


def _leader(cluster: EtcdCluster) -> int | None:
    for index, member in enumerate(cluster.members):
        if counter_where(member.metrics(), "etcd_server_is_leader") == 1:
            return index
    return None


def test_a_frozen_member_moves_every_lease_to_the_next_endpoint_losing_none(
    fresh_cluster3: EtcdCluster,
) -> None:
    # SIGSTOP a follower the stream is on (a paused VM: sockets open, nothing answers). A
    # follower, so that no election is needed: etcd keeps every lease meanwhile.
    cluster, ttl = fresh_cluster3, 3
    _eventually(lambda: _leader(cluster) is not None)
    leader = _leader(cluster)
    victim = next(i for i in range(3) if i != leader)
    endpoints = [
        cluster.endpoints[victim],
        *(e for i, e in enumerate(cluster.endpoints) if i != victim),
    ]
    events = LeaseEvents()
    with _client(endpoints, rng=_FirstEndpoint()) as client:
        keepalives = _keep_alive(client, 10, ttl, events)
        _eventually(lambda: all(ka.endpoint == endpoints[0] for ka in keepalives))
        cluster.freeze(victim)
        try:
            began = time.monotonic()
            _eventually(lambda: all(ka.endpoint in endpoints[1:] for ka in keepalives), 10)
            took = time.monotonic() - began
            time.sleep(2 * ttl)
            assert events.lost == [] and events.unreachable == []
            assert all(ka.state is LeaseState.ALIVE for ka in keepalives)
            assert all(client.lease_time_to_live(ka.lease_id) > 0 for ka in keepalives)
            assert len({ka.endpoint for ka in keepalives}) == 1  # they moved together
        finally:
            cluster.thaw(victim)
        print(f"\nfrozen member: 10 leases moved in {took:.2f} s (interval {ttl / 3:.1f} s)")
        for keepalive in keepalives:
            keepalive.close()


def test_a_lost_callback_may_close_its_own_lease_and_a_sibling(etcd1: EtcdCluster) -> None:
    # Callbacks run on the stream's thread; close() waits for a callback of its lease to
    # return, unless it is called from one, which must not deadlock either.
    with _client(etcd1.endpoints) as owner, _client(etcd1.endpoints) as other:
        victim_lease, sibling_lease = owner.lease_grant(3), owner.lease_grant(3)
        made: dict[str, KeepAlive] = {}
        done = threading.Event()

        def on_lost() -> None:
            made["victim"].close()
            made["sibling"].close(revoke=True)
            done.set()

        made["victim"] = owner.keep_alive(victim_lease, 3, on_lost)
        made["sibling"] = owner.keep_alive(sibling_lease, 3)
        _eventually(lambda: all(ka.endpoint is not None for ka in made.values()))
        other.lease_revoke(victim_lease)
        assert done.wait(10), "the callback did not finish"
        assert made["victim"].state is LeaseState.LOST
        assert made["sibling"].state is LeaseState.CLOSED
        assert owner.lease_time_to_live(sibling_lease) == -1


def test_a_dead_thread_fails_every_lease_on_it_once_even_if_a_callback_closes_one(
    etcd1: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    deaths: list[object] = []
    with _client(etcd1.endpoints) as client:
        client.add_death_listener(deaths.append)
        events = LeaseEvents()
        keepalives = _keep_alive(client, 3, 3, events)
        first = keepalives[0]
        closing = client.keep_alive(client.lease_grant(3), 3, lambda: closing.close(revoke=True))
        _eventually(lambda: all(ka.endpoint is not None for ka in [*keepalives, closing]))

        def broken(index: int, rsp: object) -> bool:
            raise RuntimeError("injected into the keep-alive thread")

        monkeypatch.setattr(first, "_on_answer", broken)
        events.wait(lambda s: len(s.lost) == 3, timeout=10)
        assert all(ka.state is LeaseState.FAILED for ka in [*keepalives, closing])
        assert len(deaths) == 1
        # Its callback closed and revoked it, from the dying thread.
        _eventually(lambda: client.lease_time_to_live(closing.lease_id) == -1)
        # The next lease gets a new thread.
        again = _keep_alive(client, 1, 3)[0]
        _eventually(lambda: again.endpoint is not None)
        assert again.state is LeaseState.ALIVE
        for keepalive in [*keepalives, again]:
            keepalive.close()


def test_two_owners_of_one_lease_on_one_client_each_keep_it_alive(etcd1: EtcdCluster) -> None:
    # As the agents simulated in one process keep their run's lease alive, each its own
    # way: closing one leaves the other renewing it; etcd's word on it reaches both.
    ttl = 2
    with _client(etcd1.endpoints) as client, _client(etcd1.endpoints) as other:
        lease = client.lease_grant(ttl)
        first, second = LeaseEvents(), LeaseEvents()
        owners = [
            client.keep_alive(lease, ttl, seen.on_lost, on_unreachable=seen.on_unreachable)
            for seen in (first, second)
        ]
        _eventually(lambda: all(ka.endpoint is not None for ka in owners))
        time.sleep(2 * ttl)
        assert all(ka.state is LeaseState.ALIVE for ka in owners)
        owners[0].close(revoke=False)
        time.sleep(2 * ttl)  # the other alone renews it
        assert owners[1].state is LeaseState.ALIVE and client.lease_time_to_live(lease) > 0
        assert second.unreachable == [] and first.lost == [] and second.lost == []
        third = client.keep_alive(lease, ttl)
        other.lease_revoke(lease)
        assert owners[1].wait_lost(ttl + 2) and third.wait_lost(ttl + 2)
        assert owners[0].state is LeaseState.CLOSED
        for keepalive in [*owners, third]:
            keepalive.close()
