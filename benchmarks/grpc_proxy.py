"""What etcd's gRPC proxy saves the cluster: K clients, direct against it or through one proxy.

``python -m benchmarks.grpc_proxy [--clients 20] [--leases 5] [--ttl 5] [--seconds 20] [--json]``

A fresh 3-member etcd (loopback, no fsync) and one ``etcd grpc-proxy`` in front of it.
Each of K clients (one ``EtcdClient`` each: its own connections, as K agents on K hosts)
keeps L leases alive and watches one prefix they all share (as the agents of one run
watch its keys). First every client talks to the members directly, then every client
talks to the proxy only. For each, from the members' own ``/metrics`` (summed over the
three): the keep-alive and watch streams open on the members, the keep-alive messages
they receive and the lease renewals they make per second, the watchers they serve, and
the watch events they send for one write to the shared prefix. Our client keeps all
leases of a client on one keep-alive stream in both cases.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from benchmarks.stats import counter_where
from coordinator.core.etcd_client import EtcdClient, EtcdConfig, KeepAlive
from coordinator.etcd_proxy import GrpcProxy
from coordinator.etcd_server import EtcdCluster

__all__ = ["main", "measure", "scrape"]

_PREFIX = b"/etcd-elastic/bench-proxy/"


def scrape(cluster: EtcdCluster) -> dict[str, float]:
    """The counters this benchmark reads, summed over the running members."""
    totals: dict[str, float] = {}
    for member in cluster.members:
        if not member.running:
            continue
        text = member.metrics()
        values = {
            "keepalive_streams_started": counter_where(
                text, "grpc_server_started_total", grpc_method="LeaseKeepAlive"
            ),
            "keepalive_streams_ended": counter_where(
                text, "grpc_server_handled_total", grpc_method="LeaseKeepAlive"
            ),
            "keepalive_messages": counter_where(
                text, "grpc_server_msg_received_total", grpc_method="LeaseKeepAlive"
            ),
            "lease_renewals": counter_where(text, "etcd_debugging_lease_renewed_total"),
            "watch_streams": counter_where(text, "etcd_debugging_mvcc_watch_stream_total"),
            "watchers": counter_where(text, "etcd_debugging_mvcc_watcher_total"),
            "watch_events": counter_where(text, "etcd_debugging_mvcc_events_total"),
            "grpc_messages": counter_where(text, "grpc_server_msg_received_total"),
        }
        for name, value in values.items():
            totals[name] = totals.get(name, 0.0) + value
    return totals


@contextlib.contextmanager
def _clients(
    endpoints: Sequence[str], count: int, leases: int, ttl: int
) -> Iterator[tuple[list[EtcdClient], list[KeepAlive]]]:
    clients = [
        EtcdClient(EtcdConfig(tuple(endpoints), request_timeout=max(1.0, ttl / 2)))
        for _ in range(count)
    ]
    keepalives: list[KeepAlive] = []
    try:
        for client in clients:
            for _ in range(leases):
                keepalives.append(client.keep_alive(client.lease_grant(ttl), ttl))
            client.watch(_PREFIX, 0, lambda events, revision: None, lambda revision: None,
                         prefix=True).wait_created()  # fmt: skip
        yield clients, keepalives
    finally:
        for keepalive in keepalives:
            with contextlib.suppress(Exception):
                keepalive.close(revoke=True)
        for client in clients:
            client.close()


def measure(
    cluster: EtcdCluster,
    endpoints: Sequence[str],
    clients: int,
    leases: int,
    ttl: int,
    seconds: float,
) -> dict[str, float]:
    """Run ``clients`` clients of ``leases`` leases and one watch each against
    ``endpoints`` (the members, or a proxy) and return what ``cluster`` saw: open streams
    and watchers (beyond those before the clients came), rates per second over
    ``seconds`` of steady state, and the watch events one write cost."""
    idle = scrape(cluster)
    with _clients(endpoints, clients, leases, ttl) as (made, keepalives):
        deadline = time.monotonic() + 30
        while any(ka.endpoint is None for ka in keepalives) and time.monotonic() < deadline:
            threading.Event().wait(0.05)  # the streams open: nothing signals it
        threading.Event().wait(ttl)  # steady state: every lease renewed at its pace
        before = scrape(cluster)
        threading.Event().wait(seconds)
        after = scrape(cluster)
        made[0].put(_PREFIX + b"k", b"v")
        threading.Event().wait(1.0)  # the event reaches every watcher
        written = scrape(cluster)
        lost = sum(ka.lost() for ka in keepalives)

    def rate(name: str) -> float:
        return round((after[name] - before[name]) / seconds, 2)

    def extra(name: str) -> float:
        return after[name] - idle[name]

    return {
        "keepalive_streams_open": extra("keepalive_streams_started")
        - extra("keepalive_streams_ended"),
        "watch_streams_open": extra("watch_streams"),
        "watchers": extra("watchers"),
        "keepalive_messages_per_s": rate("keepalive_messages"),
        "lease_renewals_per_s": rate("lease_renewals"),
        "grpc_messages_per_s": rate("grpc_messages"),
        "watch_events_per_write": written["watch_events"] - after["watch_events"],
        "leases_lost": float(lost),
    }


def run(clients: int, leases: int, ttl: int, seconds: float) -> dict[str, Any]:
    """Both measurements on one fresh cluster and proxy; the JSON this module prints."""
    with (
        EtcdCluster(3, no_fsync=True, stop_grace=2.0) as cluster,
        GrpcProxy(cluster.endpoints) as proxy,
    ):
        direct = measure(cluster, cluster.endpoints, clients, leases, ttl, seconds)
        proxied = measure(cluster, [proxy.endpoint], clients, leases, ttl, seconds)
    config = {"clients": clients, "leases_per_client": leases, "ttl": ttl, "seconds": seconds}
    return {"config": {**config, "members": 3}, "direct": direct, "through_proxy": proxied}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grpc_proxy")
    parser.add_argument("--clients", type=int, default=20, help="clients (hosts), 20")
    parser.add_argument("--leases", type=int, default=5, help="leases per client, 5")
    parser.add_argument("--ttl", type=int, default=5, help="lease TTL, s (5)")
    parser.add_argument("--seconds", type=float, default=20.0, help="window, s (20)")
    parser.add_argument("--json", action="store_true", help="print the JSON only")
    args = parser.parse_args(argv)
    result = run(args.clients, args.leases, args.ttl, args.seconds)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{args.clients} clients x {args.leases} leases (TTL {args.ttl} s), one watch each")
    print(f"{'on the members':32} {'direct':>10} {'via proxy':>10}")
    for name, value in result["direct"].items():
        print(f"{name:32} {value:>10g} {result['through_proxy'][name]:>10g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
