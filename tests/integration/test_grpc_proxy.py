"""Our client and rendezvous through etcd's gRPC proxy (issue 20, item 2; docs/grpc-proxy.md).

One ``etcd grpc-proxy`` in front of the session's 3-member cluster:

* real rendezvous handlers form a round through it;
* a node whose process dies is noticed within its TTL; one frozen (SIGSTOP, its
  connection open) within two, because the proxy renews a lease on its own clock for
  up to a TTL after its client's last keep-alive;
* a lease revoked elsewhere is LOST; keep-alives and a quiet watch stay on the proxy (it
  answers a keep-alive only with its own next renewal, and drops progress requests); a
  single renewal (the run's lease, as an agent joins) answers within its budget;
* with etcd auth on, our calls, leases and watches work through it;
* a killed proxy: leases and watches go on through a second one;
* what it saves the cluster: one keep-alive stream and one watcher for all its clients.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.grpc_proxy import measure
from coordinator.core.etcd_client import EtcdClient, EtcdConfig, LeaseState
from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys
from coordinator.etcd_proxy import GrpcProxy
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.integration.etcd_client_support import (
    LeaseEvents,
    Recorder,
    _client,
    _eventually,
    _FirstEndpoint,
)
from tests.integration.test_etcd_watch import _Heard
from tests.integration.test_rendezvous import _NODE_SCRIPT, _changed_event
from tests.rdzv_helpers import Joins, make_handler

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def proxy(etcd3: EtcdCluster, etcd_binary: Path) -> Iterator[GrpcProxy]:
    with GrpcProxy(etcd3.endpoints, binary=etcd_binary) as started:
        yield started


def test_handlers_form_a_round_through_the_proxy(
    proxy: GrpcProxy, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    handlers += [make_handler(proxy.endpoint, run_id, 4, 4) for _ in range(4)]
    infos = Joins(handlers).start().infos()
    assert sorted(i.rank for i in infos.values()) == [0, 1, 2, 3]
    assert {i.world_size for i in infos.values()} == {4}


def _lost_node(
    proxy: GrpcProxy, run_id: str, handlers: list[EtcdRendezvousHandler], ttl: int, sig: int
) -> float:
    """Form a round of two handlers and a node process through the proxy, send the node
    ``sig``, return how long until both survivors see it gone."""
    handlers += [
        make_handler(proxy.endpoint, run_id, 2, 3, lease_ttl=ttl, last_call_timeout=30)
        for _ in range(2)
    ]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    node = subprocess.Popen(
        [sys.executable, "-c", _NODE_SCRIPT, proxy.endpoint, run_id, str(ttl)],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        # The two here join once the node process has (its start, torch's import, may
        # take longer than their last call on a loaded machine).
        nodes = RunKeys(DEFAULT_KEY_PREFIX, run_id).nodes_prefix
        with _client([proxy.endpoint]) as client:
            _eventually(lambda: client.count_prefix(nodes)[0] == 1, timeout=120)
        joins = Joins(handlers).start()
        assert node.stdout is not None
        assert node.stdout.readline().startswith("rank")
        assert {i.world_size for i in joins.infos().values()} == {3}
        lost = [_changed_event(h, lambda h: h.num_nodes_waiting() > 0) for h in handlers]
        hit_at = time.monotonic()
        node.send_signal(sig)
        for event in lost:
            assert event.wait(3 * ttl + 10), "survivors were never told of the lost node"
        return time.monotonic() - hit_at
    finally:
        node.kill()
        node.wait(10)


def test_a_killed_node_is_noticed_through_the_proxy_within_its_ttl(
    proxy: GrpcProxy, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    # Its connection is reset: the proxy stops renewing the lease at once.
    ttl = 3
    noticed = _lost_node(proxy, run_id, handlers, ttl, signal.SIGKILL)
    print(f"\nkilled node, through the proxy: noticed after {noticed:.2f} s (ttl {ttl} s)")
    assert noticed < ttl + 2


def test_a_frozen_node_is_noticed_through_the_proxy_within_two_ttls(
    proxy: GrpcProxy, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    # Its connection stays open: the proxy renews the lease on its own until a TTL after
    # its last answer to the node, and etcd expires it a TTL after that renewal.
    ttl = 3
    noticed = _lost_node(proxy, run_id, handlers, ttl, signal.SIGSTOP)
    print(f"\nfrozen node, through the proxy: noticed after {noticed:.2f} s (ttl {ttl} s)")
    assert noticed < 2 * ttl + 3


def test_keepalives_stay_on_the_proxy_and_a_revoked_lease_is_lost(
    proxy: GrpcProxy, etcd3: EtcdCluster
) -> None:
    # The proxy answers a keep-alive with its own next renewal (on a 0.5 s tick): paced
    # by the clock, ours ran ahead of it until one waited an interval and the proxy was
    # left as hung, every 2 s at TTL 2.
    failures, events = _Heard(), LeaseEvents()
    config = EtcdConfig((proxy.endpoint,), request_timeout=1.0)
    with EtcdClient(config, observer=failures) as client, _client(etcd3.endpoints) as other:
        kept = [client.lease_grant(ttl) for ttl in (2, 3, 5)]
        keepalives = [
            client.keep_alive(lease, ttl, events.on_lost, on_unreachable=events.on_unreachable)
            for lease, ttl in zip(kept, (2, 3, 5), strict=True)
        ]
        time.sleep(8)
        assert failures.failed == [] and events.lost == [] and events.unreachable == []
        assert all(ka.endpoint == proxy.endpoint for ka in keepalives)
        other.lease_revoke(kept[1])
        revoked_at = time.monotonic()
        assert keepalives[1].wait_lost(10)
        took = time.monotonic() - revoked_at
        assert keepalives[1].state is LeaseState.LOST
        assert keepalives[0].state is LeaseState.ALIVE and keepalives[2].state is LeaseState.ALIVE
        print(f"\nrevoked elsewhere, through the proxy: lost after {took:.2f} s (ttl 3 s)")
        for keepalive in keepalives:
            keepalive.close()


def test_a_single_renewal_through_the_proxy_answers_within_its_budget(proxy: GrpcProxy) -> None:
    # The run's lease is renewed once by each agent that joins (lease_refresh). The proxy
    # answers a keep-alive only with its own next renewal: at once for a lease it does not
    # keep yet, but up to a third of the TTL later for one it keeps alive for another
    # client; and it drops a keep-alive whose stream ends before the answer.
    with _client([proxy.endpoint]) as keeper, _client([proxy.endpoint]) as joiner:
        lease = keeper.lease_grant(60)
        keepalive = keeper.keep_alive(lease, 60)
        _eventually(lambda: keepalive.endpoint is not None)  # the proxy keeps it now
        began = time.monotonic()
        assert 30 <= joiner.lease_refresh(lease) <= 60  # its time to live, renewed by the proxy
        took = time.monotonic() - began
        alone = joiner.lease_grant(30)  # a lease the proxy does not keep: renewed at once
        assert joiner.lease_refresh(alone) == 30
        joiner.lease_revoke(alone)
        assert joiner.lease_refresh(alone) == 0
        print(f"\nrenewal of a lease the proxy keeps for another client: {took:.2f} s")
        assert took < 2 * joiner.config.request_timeout
        keepalive.close()


def test_a_quiet_watch_without_a_lease_stays_on_the_proxy(proxy: GrpcProxy, prefix: bytes) -> None:
    # The proxy drops progress requests; a member that answers the probe's read is not
    # hung. Before, this stream was left (and every watch re-created) every 1 s here.
    failures = _Heard()
    config = EtcdConfig((proxy.endpoint,), request_timeout=0.5)
    with EtcdClient(config, observer=failures) as client:
        rec = Recorder()
        client.watch(prefix, 0, rec.on_events, rec.on_compacted, prefix=True).wait_created()
        threading.Event().wait(4.0)  # eight intervals of silence
        client.put(prefix + b"k", b"v")
        rec.wait(lambda r: len(r.events) == 1)
        assert failures.failed == []


def test_calls_leases_and_watches_work_through_the_proxy_with_auth_on(
    etcd_binary: Path, prefix: bytes
) -> None:
    etcdctl = Path(sys.executable).parent / "etcdctl"
    allowed = prefix + b"app/"
    with EtcdCluster(1, binary=etcd_binary, no_fsync=True, stop_grace=1.0) as cluster:
        for args in (
            ("user", "add", "root:rootpw"), ("role", "add", "root"),
            ("user", "grant-role", "root", "root"), ("role", "add", "app"),
            ("role", "grant-permission", "app", "--prefix=true", "readwrite", allowed.decode()),
            ("user", "add", "alice:alicepw"), ("user", "grant-role", "alice", "app"),
            ("auth", "enable"),
        ):  # fmt: skip
            command = [str(etcdctl), f"--endpoints={cluster.endpoints[0]}", *args]
            subprocess.run(command, capture_output=True, timeout=30, check=True)
        with (
            GrpcProxy(cluster.endpoints, binary=etcd_binary) as proxy,
            _client([proxy.endpoint], user="alice", password="alicepw") as alice,
        ):
            rec = Recorder()
            alice.watch(allowed, 0, rec.on_events, rec.on_compacted, prefix=True).wait_created()
            lease = alice.lease_grant(3)
            keepalive = alice.keep_alive(lease, 3)
            alice.put(allowed + b"k", b"v", lease=lease)
            kv, _ = alice.get(allowed + b"k")
            assert kv is not None and kv.value == b"v" and kv.lease == lease
            rec.wait(lambda r: len(r.events) == 1)
            time.sleep(3)  # a TTL: renewed through the proxy
            assert keepalive.state is LeaseState.ALIVE and alice.lease_time_to_live(lease) > 0
            keepalive.close()
            assert alice.get(allowed + b"k")[0] is None


def test_a_killed_proxy_moves_leases_and_watches_to_the_second_one(
    etcd3: EtcdCluster, etcd_binary: Path, prefix: bytes
) -> None:
    # Deployed in pairs (--rdzv-endpoint=proxy-a,proxy-b), a proxy is no single point of
    # failure: the client fails over between proxies as between members.
    events = LeaseEvents()
    with (
        GrpcProxy(etcd3.endpoints, binary=etcd_binary) as first,
        GrpcProxy(etcd3.endpoints, binary=etcd_binary) as second,
        _client([first.endpoint, second.endpoint], rng=_FirstEndpoint()) as client,
    ):
        lease = client.lease_grant(3)
        keepalive = client.keep_alive(
            lease, 3, events.on_lost, on_unreachable=events.on_unreachable
        )
        rec = Recorder()
        client.watch(prefix, 0, rec.on_events, rec.on_compacted, prefix=True).wait_created()
        _eventually(lambda: keepalive.endpoint == first.endpoint)
        first.kill()
        _eventually(lambda: keepalive.endpoint == second.endpoint, timeout=10)
        client.put(prefix + b"k", b"v")
        rec.wait(lambda r: len(r.events) == 1, timeout=20)
        time.sleep(3)  # a TTL through the second proxy
        assert events.lost == [] and events.unreachable == []
        assert keepalive.state is LeaseState.ALIVE and client.lease_time_to_live(lease) > 0
        assert client.watch_endpoint == second.endpoint
        keepalive.close()


def test_the_proxy_gives_the_cluster_one_keepalive_stream_and_one_watcher(
    etcd3: EtcdCluster, etcd_binary: Path
) -> None:
    # A proxy of its own: one that served leases before keeps its stream to the cluster.
    clients, leases = 4, 3
    with GrpcProxy(etcd3.endpoints, binary=etcd_binary) as proxy:
        direct = measure(etcd3, etcd3.endpoints, clients, leases, ttl=3, seconds=3.0)
        proxied = measure(etcd3, [proxy.endpoint], clients, leases, ttl=3, seconds=3.0)
    print(f"\ndirect: {direct}\nthrough the proxy: {proxied}")
    assert direct["keepalive_streams_open"] == clients and proxied["keepalive_streams_open"] == 1
    assert direct["watchers"] == clients and proxied["watchers"] == 1
    assert direct["watch_events_per_write"] == clients
    assert proxied["watch_events_per_write"] == 1
    assert direct["leases_lost"] == proxied["leases_lost"] == 0
    # Each lease is still renewed on its own (the proxy merges streams, not leases).
    assert proxied["lease_renewals_per_s"] >= clients * leases / 2
