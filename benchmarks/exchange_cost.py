"""What one round costs etcd, phase by phase: formation, rank exchange, master address,
pre-flight exchange, exit barrier (DESIGN §10: O(N) in all, O(1) per node).

``python -m benchmarks.exchange_cost --nodes 4 16 64 [--rounds 2] [--json] [--store-exchange]``

Starts one etcd, then for each N runs N simulated nodes:
threads of this process, each with its own handler of ours, lease and node key (one
etcd client per 16 nodes, as a few processes would share a connection). Every feature
that writes during a formation is on: the run's timeline, the pre-flight check's
exchange (the check itself is not run: each node publishes a made-up passing result) and
the judge's timeline event. The exchange runs as the agents run it, through the bootstrap
TCPStore rank 0 hosts for the round (``--store-exchange``: through the round's etcd store,
as where torch's c10d handler hosts the workers' store, and as before issue 20). Each
round is formed, then its phases run one after the other on every node at once, and each
phase is counted on its own:

* ``server``: etcd's own counters (:func:`benchmarks.etcd_counts.server_counts`): gRPC
  requests by method (``grpc:Range``, ``grpc:Put``, ``grpc:Txn``, ``grpc:Watch`` =
  watch creations and cancellations, ...), ``writes`` (mvcc puts + delete ops),
  ``watch_events``;
* ``calls``: the nodes' own client calls by method, and ``per_node_max``: the most
  requests (unary calls + watches created) one node made in the phase.

The first round is the first formation (every join new); later rounds are re-formations
(every node re-joins with its key, as after a worker failure; round 3 on also deletes the
store of the round two before). Keep-alives are not counted (one per lease every TTL/3,
whatever the phase; ``lease_ttl`` is 30 s here so few fall inside a phase).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agent.config import LaunchConfig
from agent.health.exchange import exchange_on_bootstrap, exchange_results
from agent.health.verdict import NodeResult, Thresholds
from agent.loop.ending import exit_barrier
from agent.loop.launches import resolve_master
from agent.loop.ranks import RoleInfo, exchange_ranks
from agent.observe.timeline import record_health
from agent.workers.bootstrap import BootstrapHost
from benchmarks.etcd_counts import RequestCounter, count_watches, delta, server_counts
from benchmarks.systems import benchmark_etcd_binary
from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.settings import RendezvousSettings
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from coordinator.torch_adapter.store_wait import wait_for_key

__all__ = ["FORMATION", "Fleet", "PhaseCost", "main", "measure", "run_round"]

T = TypeVar("T")
_NODES_PER_CLIENT = 16
_PHASE_TIMEOUT_S = 300.0


@dataclass
class PhaseCost:
    """What one phase cost (see the module docstring)."""

    server: dict[str, int]
    calls: dict[str, int] = field(default_factory=dict)
    per_node_max: int = 0

    @property
    def requests(self) -> int:
        """Unary requests etcd received (keep-alive and watch streams excluded)."""
        return sum(v for k, v in self.server.items() if k.startswith("grpc:") and k not in (
            "grpc:Watch", "grpc:LeaseKeepAlive"))  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "writes": self.server.get("writes", 0),
            "watch_events": self.server.get("watch_events", 0),
            "watch_messages": self.server.get("grpc:Watch", 0),
            "per_node_max": self.per_node_max,
            "calls": dict(sorted(self.calls.items())),
            "server": {k: v for k, v in sorted(self.server.items()) if v},
        }


class Fleet:
    """N simulated nodes of one run: handlers of ours, one thread per node and phase.

    Args:
        endpoints: etcd's client endpoints.
        metrics: returns etcd's ``/metrics`` text (one member: what it counts is the
            cluster's requests only when every client talks to it).
        n: nodes (min = max = n, so each round completes as soon as every node joined).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        metrics: Callable[[], str],
        n: int,
        *,
        store_exchange: bool = False,
    ) -> None:
        self.n = n
        self.store_exchange = store_exchange
        self.counter = RequestCounter()
        self._metrics = metrics
        config = EtcdConfig(endpoints=tuple(endpoints))
        self._clients = [
            EtcdClient(config, observer=self.counter)
            for _ in range((n + _NODES_PER_CLIENT - 1) // _NODES_PER_CLIENT)
        ]
        for client in self._clients:
            count_watches(client, self.counter)
        self.settings = RendezvousSettings(
            run_id=f"cost-{n}-{uuid.uuid4().hex[:8]}", min_nodes=n, max_nodes=n,
            endpoints=tuple(endpoints), local_addr="127.0.0.1", last_call_timeout=30,
            lease_ttl=30,
        )  # fmt: skip
        self.handlers = [
            EtcdRendezvousHandler(
                self.settings,
                client=self._clients[i % len(self._clients)],
                local_world_size=1,
                role="default",
            )
            for i in range(n)
        ]
        self.infos: list[Any] = [None] * n  # RendezvousInfo by group rank
        self.by_rank: list[EtcdRendezvousHandler] = []
        self.servers: dict[int, BootstrapHost] = {}  # rank 0's bootstrap store, up for the round
        self.masters: list[tuple[str, int]] = [("", 0)] * n  # where each node was told it is

    def close(self) -> None:
        for handler in self.handlers:
            handler.leave()
        for client in self._clients:
            client.close()

    def _run(self, body: Callable[[int], T]) -> list[T]:
        results: list[Any] = [None] * self.n
        errors: dict[int, BaseException] = {}

        def run(i: int) -> None:
            try:
                results[i] = body(i)
            except BaseException as exc:  # reported below, with every node's
                errors[i] = exc

        threads = [
            threading.Thread(target=run, args=(i,), name=f"node-{i}", daemon=True)
            for i in range(self.n)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + _PHASE_TIMEOUT_S
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0.0))
        if errors or any(t.is_alive() for t in threads):
            alive = [t.name for t in threads if t.is_alive()]
            raise RuntimeError(f"nodes failed: {errors!r}; still running: {alive}")
        return results

    def phase(self, body: Callable[[int], T]) -> tuple[PhaseCost, list[T]]:
        """Run ``body(i)`` on every node at once (thread ``node-<i>``); what it cost."""
        self.counter.take()
        before = server_counts(self._metrics())
        results = self._run(body)
        after = server_counts(self._metrics())
        calls: collections.Counter[str] = collections.Counter()
        per_node: collections.Counter[str] = collections.Counter()
        for (thread, method), count in self.counter.take().items():
            if thread.startswith("node-"):
                calls[method] += count
                per_node[thread] += count
        cost = PhaseCost(delta(before, after), dict(calls), max(per_node.values(), default=0))
        return cost, results

    def form(self) -> PhaseCost:
        """Every node joins the next round; counted until its events are written and etcd
        is quiet (:meth:`_quiet`)."""
        self.counter.take()
        before = server_counts(self._metrics())
        infos = self._run(lambda i: self.handlers[i].next_rendezvous())
        round_ = self.handlers[0].last_round
        # The coordinator writes the round's event in the background once it committed.
        key = self.settings.keys.event(f"round_completed/{round_}")
        if wait_for_key(self._clients[0], key, time.monotonic() + 30) is None:
            raise RuntimeError(f"the event of round {round_} was not written within 30 s")
        self._flush_events()
        after = self._quiet()
        self.counter.take()
        handlers = {h.node_id: h for h in self.handlers}
        self.by_rank = [handlers[node] for node in self.handlers[0].last_members]
        for info in infos:
            self.infos[info.rank] = info
        for host in self.servers.values():
            host.release()  # the last round's bootstrap store stops listening
        self.servers = {}
        return PhaseCost(delta(before, after))

    def _quiet(self, pause: float = 0.25, still: int = 2, budget: float = 5.0) -> dict[str, float]:
        """etcd's counts once ``still`` reads in a row, ``pause`` apart, show no new
        request or watch message but keep-alives (at most ``budget`` seconds): what a
        formation set going in the background (a coordinator that steps down for a node
        that came earlier, and looks for its place in line again; on a loaded machine its
        watch thread may hear of that node late) is the formation's, not the next phase's."""
        deadline = time.monotonic() + budget
        counts = server_counts(self._metrics())
        quiet = 0
        while quiet < still and time.monotonic() < deadline:
            time.sleep(pause)
            again = server_counts(self._metrics())
            moved = any(
                v and k.startswith("grpc:") and k != "grpc:LeaseKeepAlive"
                for k, v in delta(counts, again).items()
            )
            counts, quiet = again, 0 if moved else quiet + 1
        return counts

    def _flush_events(self) -> None:
        for handler in self.handlers:
            log = handler._presence.events  # the handler's background timeline writer
            if log is not None:
                log.flush(30)

    def ranks(self, i: int) -> Any:
        info, handler = self.infos[i], self.by_rank[i]
        return exchange_ranks(info.store, RoleInfo("default", i, 1), self.n, handler.last_workers)

    def master(self, i: int) -> tuple[str, int]:
        config = LaunchConfig(min_nodes=self.n, max_nodes=self.n, nproc_per_node=1,
                              entrypoint="x", local_addr="127.0.0.1")  # fmt: skip
        host = self.servers.setdefault(i, BootstrapHost())
        got = resolve_master(config, self.infos[i], self.infos[i].store, i, host.next_formation())
        self.masters[i] = (got.addr, got.port)
        return got.addr, got.port

    def preflight(self, i: int) -> bool:
        handler = self.by_rank[i]
        mine = NodeResult(i, handler.node_id, "127.0.0.1", devices="cpu", matmul_s=0.01)
        if self.store_exchange:
            verdict, judged = exchange_results(
                self.infos[i].store, mine, self.n, handler.last_members, Thresholds(), 60.0
            )
        else:
            verdict, judged = exchange_on_bootstrap(
                self.masters[i], handler.last_round, mine, self.n, handler.last_members,
                Thresholds(), 60.0,
            )  # fmt: skip
        if judged:  # what the agent that judged records (agent.observe.recording)
            record_health(handler, handler.last_round, verdict.summary())
            log = handler._presence.events
            if log is not None:
                log.flush(30)
        return not verdict.failed

    def barrier(self, i: int) -> bool:
        return exit_barrier(self.infos[i].store, self.n, 60.0, f"node {i}")


FORMATION = ("formation", "ranks", "master", "preflight")
"""The phases between a node's join and its workers' start: "writes per formation"."""


def run_round(fleet: Fleet) -> dict[str, PhaseCost]:
    """Form the next round, then run each phase on every node; what each cost.

    Raises:
        RuntimeError: a node failed, or the pre-flight check or exit barrier did not pass.
    """
    costs = {"formation": fleet.form()}
    phases: list[tuple[str, Callable[[int], Any]]] = [
        ("ranks", fleet.ranks),
        ("master", fleet.master),
        ("preflight", fleet.preflight),
        ("exit_barrier", fleet.barrier),
    ]
    for name, body in phases:
        cost, results = fleet.phase(body)
        if name in ("preflight", "exit_barrier") and not all(results):
            raise RuntimeError(f"{name} of {fleet.n} nodes did not pass: {results}")
        costs[name] = cost
    return costs


def measure(
    endpoints: Sequence[str],
    metrics: Callable[[], str],
    n: int,
    rounds: int,
    *,
    store_exchange: bool = False,
) -> dict[str, Any]:
    """Each phase's cost for ``rounds`` rounds of ``n`` nodes (see the module docstring)."""
    fleet = Fleet(endpoints, metrics, n, store_exchange=store_exchange)
    out: dict[str, Any] = {"nodes": n, "store_exchange": store_exchange, "rounds": []}
    try:
        for _ in range(rounds):
            costs = run_round(fleet)
            out["rounds"].append(
                {
                    "round": fleet.handlers[0].last_round,
                    "writes_per_formation": sum(
                        costs[k].server.get("writes", 0) for k in FORMATION
                    ),
                    **{k: v.as_dict() for k, v in costs.items()},
                }
            )
    finally:
        fleet.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.exchange_cost")
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="JSON only")
    parser.add_argument(
        "--store-exchange", action="store_true",
        help="the pre-flight exchange through the round's etcd store, not the bootstrap store",
    )  # fmt: skip
    args = parser.parse_args(argv)
    results = []
    with EtcdCluster(1, binary=benchmark_etcd_binary(), no_fsync=True, stop_grace=1.0) as cluster:
        for n in args.nodes:
            results.append(
                measure(
                    cluster.endpoints,
                    cluster.members[0].metrics,
                    n,
                    args.rounds,
                    store_exchange=args.store_exchange,
                )
            )
            if not args.json:
                print(_table(results[-1]), file=sys.stderr)
    print(json.dumps(results, indent=1))
    return 0


def _table(result: dict[str, Any]) -> str:
    lines = []
    for r in result["rounds"]:
        lines.append(f"N={result['nodes']} round {r['round']}: writes per formation "
                     f"{r['writes_per_formation']}")  # fmt: skip
        for phase in ("formation", "ranks", "master", "preflight", "exit_barrier"):
            c = r[phase]
            lines.append(
                f"  {phase:13s} requests {c['requests']:6d}  writes {c['writes']:5d}  "
                f"watch events {c['watch_events']:5d}  watches {c['watch_messages']:4d}  "
                f"per node {c['per_node_max']:3d}  {c['calls']}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
