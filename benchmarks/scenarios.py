"""Each scenario as the CLI runs it: its defaults, its settings, its JSON result.

Every result has ``scenario``, ``point`` (what was measured), ``unit``, ``method``
(how), ``environment`` and ``systems`` (per system: ``available``, ``min``, ``median``,
``max``, ``n``, ``samples``, ``errors``, ``figures``, ``config``,
``ratio_vs_torch_c10d``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from benchmarks import critical_path, rendezvous
from benchmarks.rendezvous import GroupPool
from benchmarks.runner import Sample, environment, finish, measure
from benchmarks.systems import System

__all__ = ["SCENARIOS", "run_all", "run_scenario"]

Result = dict[str, Any]

# Whole seconds: torch parses its timeouts as integers. A realistic last call where it
# matters (scale-up, node loss), the same on both sides.
_LAST_CALL_REALISTIC_S = 5
# Formation uses min = max = N, where last call never starts; 1 s as in the runs.
_LAST_CALL_FORMATION_S = 1
# A formation run slower than this is not repeated (the sweep must fit in 15 minutes;
# the targets are 0.15 s at N = 32 and 3 s at N = 1000).
FORMATION_SLOW_S = 15.0


def _measure_pooled(
    args: argparse.Namespace,
    run: Callable[[System, int], Sample],
    shared: dict[str, Any],
    pool: GroupPool,
    slow_s: float | None = None,
) -> dict[str, dict[str, Any]]:
    """``measure`` with the common options; the pool's node processes end per system."""
    return measure(
        args.systems,
        run,
        args.repeat,
        shared,
        lease_ttl=args.lease_ttl,
        client=args.client,
        slow_s=slow_s,
        after_system=pool.close,
    )


def formation_bound(nodes: int) -> float:
    """The most one formation of ``nodes`` may take before it counts as failed, s.

    10 s plus 20 ms per node (10.6 s at N = 32, 20 s at 512, 30 s at 1000): at least twice
    what any system that completes needed on this machine (torch's slowest completed point,
    etcd-v2 at N = 128, took 5.2 s; ours at 1000, 3.5 s), so a failure costs a bounded wait
    and `all` stays within 15 minutes.
    """
    return 10.0 + 0.02 * nodes


_REUSE = (
    "The node processes start once per system and point and are reused across its "
    "repeats; each repeat builds fresh handlers for a fresh run id before the measured "
    "step (the previous run's handlers are released first: ours leave, torch's stop "
    "their heartbeats)."
)


def _layout(args: argparse.Namespace, nodes: int) -> str:
    count = max(1, min(nodes, args.processes))
    return f"{nodes} nodes as threads in {count} node processes (one handler per thread)"


def _result(scenario: str, point: str, unit: str, method: str, systems: Result) -> Result:
    return {
        "scenario": scenario,
        "point": point,
        "unit": unit,
        "method": method,
        "environment": environment(),
        "systems": finish(systems),
    }


def formation(args: argparse.Namespace) -> Result:
    nodes = args.nodes or (2 if args.smoke else 32)
    last_call = args.last_call or _LAST_CALL_FORMATION_S
    timeout = min(args.timeout, formation_bound(nodes))
    pool = GroupPool()
    paths: dict[str, list[dict[str, float]]] = {}

    def run(system: System, _: int) -> Sample:
        sample = rendezvous.formation_run(pool, system, nodes, args.processes, last_call, timeout)
        paths.setdefault(system.name, []).append(critical_path.path_of(sample.figures))
        return sample

    shared = {"min_nodes": nodes, "max_nodes": nodes, "last_call_timeout": last_call}
    systems = _measure_pooled(args, run, shared, pool, slow_s=FORMATION_SLOW_S)
    for name, entry in systems.items():
        if paths.get(name):
            entry["critical_path"] = paths[name]
    method = (
        f"{_layout(args, nodes)}; {_REUSE} Every node calls "
        "next_rendezvous() at one common start; time from that start to the last node "
        f"returning, bounded by {timeout:g} s (a run over {FORMATION_SLOW_S:g} s is not "
        "repeated); ranks checked to be a permutation of 0..N-1. etcd_proposals = raft "
        "proposals committed (every write request incl. failed CAS txns and lease grants), "
        "etcd_revision = successful key-changing txns, etcd_watch_events = events sent "
        "to watchers; node_failed_cas / node_state_writes count torch's backend calls. "
        "critical_path (ours, per run, s after the start): the last node key written "
        "(cp_last_key_s), the round's commit sent and answered (cp_commit_sent_s, "
        "cp_commit_s), the first and last node returning; coordinator_cpu_s = CPU of "
        "the committing node's coordinator thread in the run, coordinator_watch_cpu_s = "
        "its process's watch thread (which decodes the node keys it hears of)."
    )
    return _result("formation", f"N={nodes}", "seconds", method, systems)


def scale_up(args: argparse.Namespace) -> Result:
    nodes = args.nodes or (2 if args.smoke else 8)
    last_call = args.last_call or _LAST_CALL_REALISTIC_S
    max_nodes = 2 * nodes
    pool = GroupPool()

    def run(system: System, _: int) -> Sample:
        return rendezvous.scale_up_run(
            pool, system, nodes, max_nodes, args.processes, last_call, args.timeout
        )

    shared = {"min_nodes": nodes, "max_nodes": max_nodes, "last_call_timeout": last_call}
    method = (
        f"{_layout(args, nodes)} form a group (min {nodes}, max {max_nodes}); one more node "
        "(own process, handler built beforehand) calls next_rendezvous(); the group's "
        "nodes re-join when num_nodes_waiting() > 0, checked on each change our handler "
        f"announces (subscribe), for torch every {rendezvous.MONITOR_INTERVAL_S} s (torch "
        "agent's monitor interval); time from the new node's "
        f"call to the last of the {nodes + 1} returning with world size {nodes + 1}. {_REUSE}"
    )
    systems = _measure_pooled(args, run, shared, pool)
    for name, entry in systems.items():
        if name != "etcd-v3":
            entry["config"]["env"] = dict(rendezvous.TORCH_SCALE_UP_ENV)
            entry["config"]["env_why"] = (
                "with torch's default (shared TCPStore) the new node fails: it waits for "
                "MASTER_ADDR, which rank 0 never publishes again after its first round"
            )
    return _result("scale-up", f"N={nodes}+1", "seconds", method, systems)


def node_loss(args: argparse.Namespace) -> Result:
    nodes = args.nodes or (3 if args.smoke else 8)
    last_call = args.last_call or _LAST_CALL_REALISTIC_S
    min_nodes = max(1, nodes // 2)
    pool = GroupPool()

    def run(system: System, _: int) -> Sample:
        return rendezvous.node_loss_run(pool, system, nodes, min_nodes, 0, last_call, args.timeout)

    shared = {"min_nodes": min_nodes, "max_nodes": nodes, "last_call_timeout": last_call}
    method = (
        f"{nodes} nodes, one process each, form a group (min {min_nodes}, max {nodes}); the "
        "process holding group rank 0 is SIGKILLed and every survivor calls "
        "next_rendezvous() at once (torch's best case); time from the kill to the last "
        f"of the {nodes - 1} survivors returning with world size {nodes - 1}. {_REUSE} "
        "The killed process is restarted before the next repeat."
    )
    systems = _measure_pooled(args, run, shared, pool)
    return _result("node-loss", f"N={nodes}", "seconds", method, systems)


def idle(args: argparse.Namespace) -> Result:
    nodes = args.nodes or (2 if args.smoke else 32)
    seconds = 2.0 if args.smoke else (args.seconds or 30.0)
    pool = GroupPool()

    def run(system: System, _: int) -> Sample:
        return rendezvous.idle_run(pool, system, nodes, args.processes, seconds, args.timeout)

    shared = {"min_nodes": nodes, "max_nodes": nodes, "last_call_timeout": 1}
    method = (
        f"{_layout(args, nodes)} form a group, then sit idle {seconds:g} s; the sample is "
        "CPU seconds per node over the window (node processes, /proc utime+stime, all "
        "threads, divided by N); figures give it as % of one core, the server's CPU, "
        f"etcd gRPC messages received per second per node, and torch's backend calls. {_REUSE}"
    )
    systems = _measure_pooled(args, run, shared, pool)
    return _result("idle", f"N={nodes}, {seconds:g} s", "CPU seconds per node", method, systems)


def worker_failure(args: argparse.Namespace) -> Result:
    from benchmarks.agents import worker_failure as run

    return run(args)


def recovery(args: argparse.Namespace) -> Result:
    from benchmarks.recovery import recovery as run

    return run(args)


def crash_timing(args: argparse.Namespace) -> Result:
    from benchmarks.recovery_timing import crash_timing as run

    return run(args)


def etcd_ceiling(args: argparse.Namespace) -> Result:
    from benchmarks.ceiling import etcd_ceiling as run

    return run(args)


SCENARIOS: dict[str, Callable[[argparse.Namespace], Result]] = {
    "formation": formation,
    "scale-up": scale_up,
    "node-loss": node_loss,
    "worker-failure": worker_failure,
    "idle": idle,
    "etcd-ceiling": etcd_ceiling,
    "recovery": recovery,
    "crash-timing": crash_timing,
}


def run_scenario(name: str, args: argparse.Namespace) -> Result:
    """Run one scenario by its CLI name."""
    return SCENARIOS[name](args)


def run_all(args: argparse.Namespace) -> Result:
    """Every scenario, formation over all sizes; writes docs/performance.{md,json,png}."""
    from benchmarks.report import run_all as run

    return run(args)
