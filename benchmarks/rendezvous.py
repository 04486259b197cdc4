"""The rendezvous scenarios: formation, scale-up, node loss and idle cost.

Simulated nodes are threads in node processes (``benchmarks.node``), one handler each,
all built before the measured step starts; node loss puts each node in a process of its
own so that one can be SIGKILLed. Times are ``time.monotonic()`` stamps taken by the
nodes themselves (system-wide on Linux), so the harness's own latency does not count.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

from benchmarks import critical_path
from benchmarks.procs import NodeGroup, RunError, cpu_seconds, split_nodes
from benchmarks.runner import Sample
from benchmarks.stats import etcd_activity, rank_problem
from benchmarks.systems import System

__all__ = ["GroupPool", "formation_run", "idle_run", "node_loss_run", "scale_up_run"]

# torch's agent asks num_nodes_waiting() every monitor interval (LaunchConfig default).
MONITOR_INTERVAL_S = 0.1
# torch 2.13's default shares rank 0's TCPStore across rounds: a node that joins a formed
# group in a later round then waits for MASTER_ADDR, which rank 0 (set up in an earlier
# round) never publishes again, and fails after read_timeout (60 s; measured). Torch's
# own opt-out makes rank 0 publish it every round, so torch gets a number at all.
TORCH_SCALE_UP_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
_START_MARGIN_S = 0.5


class GroupPool:
    """Node processes kept across the repeats of one system (torch is imported once).

    Each repeat still gets fresh handlers for a fresh run id (the old ones are released
    first, so their threads do not load the next measurement); a killed process is
    restarted. A different system, or a run that failed, gets fresh processes: a failed
    run may leave threads blocked in ``next_rendezvous()``.
    """

    def __init__(self) -> None:
        self._group: NodeGroup | None = None
        self._system: System | None = None
        self._layout: list[list[int]] = []

    @contextlib.contextmanager
    def use(
        self, system: System, spec: dict[str, Any], layout: list[list[int]], timeout: float
    ) -> Iterator[NodeGroup]:
        """Yield a group of ``layout`` whose nodes hold fresh handlers for ``spec``."""
        if self._group is not None and self._system is system and self._layout == layout:
            try:
                self._group.rebuild(spec, timeout)
            except BaseException:
                self.close()
                raise
        else:
            self.close()
            self._group = NodeGroup(spec, layout)
            self._system, self._layout = system, layout
            try:
                self._group.start(timeout)
            except BaseException:
                self.close()
                raise
        try:
            yield self._group
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop and reap every node process (called when a system's runs are over)."""
        group, self._group, self._system = self._group, None, None
        if group is not None:
            group.close()


def _run_id(tag: str) -> str:
    return f"bench-{tag}-{uuid.uuid4().hex[:8]}"


def _check(replies: list[dict[str, Any]], expected: int, what: str) -> float:
    """Raise if any node failed or ranks are wrong; return the last node's ``t_end``."""
    errors = [r for r in replies if r["event"] == "error"]
    if errors:
        sample = "; ".join(f"node {r['node']}: {r['error']}" for r in errors[:3])
        raise RunError(f"{what}: {len(errors)} of {len(replies)} nodes failed ({sample})")
    problem = rank_problem([r["rank"] for r in replies], [r["world"] for r in replies], expected)
    if problem is not None:
        raise RunError(f"{what}: {problem}")
    return max(float(r["t_end"]) for r in replies)


def _figures(
    system: System, before: dict[str, float] | None, counters: dict[str, int]
) -> dict[str, float]:
    figures: dict[str, float] = {f"node_{k}": float(v) for k, v in counters.items()}
    after = system.metrics()
    if before is not None and after is not None:
        figures.update({f"etcd_{k}": float(v) for k, v in etcd_activity(before, after).items()})
    return figures


def formation_run(
    pool: GroupPool, system: System, nodes: int, processes: int, last_call: int, timeout: float
) -> Sample:
    """``nodes`` nodes call ``next_rendezvous()`` together with min = max = ``nodes``."""
    config = {"last_call_timeout": last_call, "join_timeout": int(timeout)}
    spec = system.spec(_run_id(f"f{nodes}"), nodes, nodes, config)
    with pool.use(system, spec, split_nodes(nodes, processes), 60 + nodes * 0.2) as group:
        before = system.metrics()
        base = group.counters()
        pids = [c.pid for c in group.children]
        cpu0 = sum(cpu_seconds(p) for p in pids)
        server0 = system.server_cpu()
        at = time.monotonic() + _START_MARGIN_S
        cmd = group.command({"cmd": "rendezvous", "at": at})
        try:
            replies = group.results(cmd, nodes, timeout)
        except RunError as exc:
            raise RunError(f"{exc}; so far: {_so_far(group, at)}") from exc
        t_last = _check(replies, nodes, f"formation of {nodes}")
        # Where the time went: CPU of the node processes and of the server meanwhile
        # (2 cores in all: a sum near 2 x the time means the machine was the limit).
        cpu = sum(cpu_seconds(p) for p in pids) - cpu0
        server1 = system.server_cpu()
        after = group.counters()
        delta = {k: v - base.get(k, 0) for k, v in after.items()}
        figures = _figures(system, before, delta)
        figures["nodes_cpu_s"] = cpu
        # The critical path: last node key written, the commit, the last node returning.
        t_ends = [float(r["t_end"]) for r in replies]
        figures.update(critical_path.combine(at, t_ends, group.stamps(at)))
        if server0 is not None and server1 is not None:
            figures["server_cpu_s"] = server1 - server0
        return Sample(t_last - at, figures)


def _so_far(group: NodeGroup, at: float) -> str:
    """The stamps of a formation that did not finish: how far it got."""
    try:
        reports = group.stamps(at, timeout=10.0)
    except RunError as exc:
        return f"no stamps ({exc})"
    keys = sum(r["node_key"]["count"] for r in reports if "node_key" in r)
    leases = sum(r["lease_grant"]["count"] for r in reports if "lease_grant" in r)
    path = critical_path.path_of(critical_path.combine(at, [], reports))
    return f"{leases} leases granted, {keys} node keys written; {critical_path.describe(path)}"


def _form(group: NodeGroup, nodes: list[int], timeout: float) -> None:
    at = time.monotonic() + _START_MARGIN_S
    cmd = group.command({"cmd": "rendezvous", "at": at, "nodes": nodes})
    _check(group.results(cmd, len(nodes), timeout), len(nodes), "first formation")


def scale_up_run(
    pool: GroupPool,
    system: System,
    nodes: int,
    max_nodes: int,
    processes: int,
    last_call: int,
    timeout: float,
) -> Sample:
    """A formed group of ``nodes`` notices one new node and completes a round with it.

    The new node has a process of its own and its handler is built beforehand; its start
    is the moment it calls ``next_rendezvous()``. The group's nodes re-join once
    ``num_nodes_waiting()`` is > 0, asking it on each change ours announces, and for torch
    every :data:`MONITOR_INTERVAL_S` (torch's agent's monitor interval).
    """
    config = {"last_call_timeout": last_call, "join_timeout": int(timeout)}
    spec = system.spec(_run_id("up"), nodes, max_nodes, config)
    if system.name != "etcd-v3":
        spec["env"] = TORCH_SCALE_UP_ENV
    layout = [*split_nodes(nodes, processes), [nodes]]
    with pool.use(system, spec, layout, 120) as group:
        first = list(range(nodes))
        _form(group, first, timeout)
        before = system.metrics()
        base = group.counters()
        newcomer = group.process_of(nodes)
        members = [c for c in group.children if c is not newcomer]
        until = time.monotonic() + timeout
        old = group.command(
            {"cmd": "on_waiting", "poll": MONITOR_INTERVAL_S, "until": until}, members
        )
        at = time.monotonic() + _START_MARGIN_S
        new = group.command({"cmd": "rendezvous", "at": at}, [newcomer])
        replies = group.results(new, 1, timeout) + group.results(old, nodes, timeout)
        t_last = _check(replies, nodes + 1, f"scale-up from {nodes} to {nodes + 1}")
        delta = {k: v - base.get(k, 0) for k, v in group.counters().items()}
        return Sample(t_last - at, _figures(system, before, delta))


def node_loss_run(
    pool: GroupPool,
    system: System,
    nodes: int,
    min_nodes: int,
    victim_rank: int,
    last_call: int,
    timeout: float,
) -> Sample:
    """SIGKILL the process holding group rank ``victim_rank``; the survivors re-join at once.

    Each node is a process of its own. Torch's survivors are given their best case: they
    call ``next_rendezvous()`` right after the kill, as if they had heard of it at once.
    """
    config = {"last_call_timeout": last_call, "join_timeout": int(timeout)}
    spec = system.spec(_run_id("loss"), min_nodes, nodes, config)
    with pool.use(system, spec, [[i] for i in range(nodes)], 120) as group:
        at = time.monotonic() + _START_MARGIN_S
        cmd = group.command({"cmd": "rendezvous", "at": at})
        replies = group.results(cmd, nodes, timeout)
        _check(replies, nodes, "first formation")
        victim = next(r["node"] for r in replies if r["rank"] == victim_rank)
        doomed = group.process_of(victim)
        survivors = [c for c in group.children if c is not doomed]
        before = system.metrics()
        t_kill = group.kill(doomed)
        cmd = group.command({"cmd": "rendezvous", "at": t_kill}, survivors)
        t_last = _check(group.results(cmd, nodes - 1, timeout), nodes - 1, "re-rendezvous")
        return Sample(t_last - t_kill, _figures(system, before, {}))


def idle_run(
    pool: GroupPool, system: System, nodes: int, processes: int, seconds: float, timeout: float
) -> Sample:
    """A formed group of ``nodes`` sits idle for ``seconds``; the sample is CPU s per node.

    Figures: CPU seconds per node (node processes, all threads, from /proc), the same as a
    percentage of one core, the server's CPU, etcd gRPC messages per second per node
    (etcd systems) and backend calls per second per node (torch's, counted in the wrapper).
    """
    config = {"last_call_timeout": 1, "join_timeout": int(timeout)}
    spec = system.spec(_run_id("idle"), nodes, nodes, config)
    with pool.use(system, spec, split_nodes(nodes, processes), 120) as group:
        _form(group, list(range(nodes)), timeout)
        pids = [c.pid for c in group.children]
        before = system.metrics()
        base = group.counters()
        cpu0 = sum(cpu_seconds(p) for p in pids)
        server0 = system.server_cpu()
        t0 = time.monotonic()
        # The measured window itself: nothing to wait for but the clock.
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        cpu = sum(cpu_seconds(p) for p in pids) - cpu0
        server1 = system.server_cpu()
        delta = {k: v - base.get(k, 0) for k, v in group.counters().items()}
        figures = _figures(system, before, delta)
        per_node = cpu / nodes
        figures["cpu_percent_of_core_per_node"] = 100.0 * per_node / elapsed
        if server0 is not None and server1 is not None:
            figures["server_cpu_percent_of_core"] = 100.0 * (server1 - server0) / elapsed
        if "etcd_grpc_messages" in figures:
            figures["etcd_requests_per_s_per_node"] = (
                figures["etcd_grpc_messages"] / elapsed / nodes
            )
        calls = delta.get("state_reads", 0) + delta.get("state_writes", 0)
        if calls:
            figures["backend_calls_per_s_per_node"] = calls / elapsed / nodes
        return Sample(per_node, figures)
