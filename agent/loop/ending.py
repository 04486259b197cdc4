"""How a node ends its part in a run: the exit barrier, closing the run, leaving it.

The pieces each ending of :mod:`agent.loop.exits` is made of; each function takes the
handler or store it acts on and a context string for its log lines (run, node, attempt).
"""

from __future__ import annotations

import inspect
import logging
import secrets
from collections.abc import Callable, Mapping
from datetime import timedelta

from torch.distributed.elastic.rendezvous import RendezvousHandler

from agent.store import Store
from agent.workers.errorfile import Failure, format_report, read_failure, root_cause
from agent.workers.group import WorkerGroup
from coordinator.torch_adapter.store import EtcdStore
from coordinator.torch_adapter.surface import RendezvousSurface

__all__ = [
    "EXIT_BARRIER",
    "close_reason",
    "close_rendezvous",
    "collect_failures",
    "exit_barrier",
    "give_up_report",
    "leave",
    "release_exit_barrier",
]

log = logging.getLogger(__name__)

EXIT_BARRIER = "etcd_elastic/exit_barrier/"
"""Prefix of the exit barrier's keys in the round's store."""
_ALL_ARRIVED = "1"  # the value of its ``done`` key when every node arrived
_ARRIVED = f"{EXIT_BARRIER}arrived/"  # one key per node that arrived (our store)


def _arrive(store: Store, group_world_size: int, done: str) -> None:
    """Count this node in; whoever sees that every node arrived sets ``done``.

    On our store each node puts a key of its own and counts the keys (one count-only
    read): no compare-and-swap on one counter, whose retries cost O(N²) requests when N
    nodes arrive at once; a retried put is the same key, so it never counts twice. The
    node whose put came last sees them all (maybe others too: ``done`` is created once,
    the others' writes find it). On torch's stores, ``add`` is one request: a counter.
    """
    if isinstance(store, EtcdStore):
        store.set(f"{_ARRIVED}{secrets.token_hex(8)}", "1")
        if store.count_keys(_ARRIVED) >= group_world_size:
            store.compare_set(done, "", _ALL_ARRIVED)
    elif store.add(f"{EXIT_BARRIER}count", 1) >= group_world_size:
        store.set(done, _ALL_ARRIVED)


def exit_barrier(store: Store, group_world_size: int, timeout: float, ctx: str) -> bool:
    """Wait (bounded) until every node of the round reached success, like torch's
    ``store_util.barrier``: each node counts itself in, and the first to see them all
    sets a flag the others wait for (one key: one watch event each). O(1) requests per
    node, O(N) in all.

    Returns:
        Whether every node arrived within ``timeout`` seconds; a store error or the
        timeout is logged as a warning (the node closes the run anyway).
    """
    done = f"{EXIT_BARRIER}done"
    try:
        _arrive(store, group_world_size, done)
        store.wait([done], timedelta(seconds=timeout))
        value = store.get(done)
    except Exception as exc:
        log.warning(
            "%s: exit barrier: not every node finished within %.0fs (%s); closing anyway",
            ctx,
            timeout,
            exc,
        )
        return False
    if value != _ALL_ARRIVED.encode():
        log.warning(
            "%s: exit barrier released: %s; closing anyway", ctx, value.decode(errors="replace")
        )
        return False
    log.info("%s: every node finished", ctx)
    return True


def release_exit_barrier(store: Store, who: str, ctx: str) -> None:
    """Let the nodes waiting at this round's exit barrier go: ``who`` will not arrive.

    A node that gives up (its restarts exhausted, or the run closed under it) never
    reaches the barrier; without this the others would wait out the whole
    ``exit_barrier_timeout``. Best effort: a store error is logged.
    """
    try:
        store.set(f"{EXIT_BARRIER}done", f"{who} gave up and will not arrive")
    except Exception as exc:
        log.warning("%s: could not release the exit barrier: %s", ctx, exc)


def close_reason(
    who: str, failures: Mapping[int, Failure], restarts_used: int, reason: str | None
) -> str:
    """One line for the other nodes, saying who gave up and the root cause.

    Args:
        who: the node, e.g. ``"node 1 (host)"``.
        failures: global rank -> failure of the last attempt (may be empty).
        restarts_used: counted restarts used (the job's, with our rendezvous).
        reason: why it gave up when no worker failed (e.g. a worker could not start).
    """
    if failures:
        first = root_cause(failures)
        plural = "" if restarts_used == 1 else "s"
        return (
            f"{who} gave up after {restarts_used} restart{plural}: rank {first.global_rank} "
            f"failed: {first.message}"
        )
    return f"{who} gave up: {reason}" if reason else f"{who} gave up"


def close_rendezvous(handler: RendezvousHandler, reason: str, ctx: str, *, failed: bool) -> None:
    """Close the run for every node; a failure to close is logged, not raised (the
    workers' outcome decides the exit code).

    Our handler takes the reason, shown to every node that finds the run closed, and the
    mode: ``failed`` (the others stop their workers at once) or ``finished``; torch's
    handlers take neither.
    """
    set_closed: Callable[..., None] = handler.set_closed
    params = inspect.signature(set_closed).parameters
    kwargs: dict[str, str] = {}
    if "reason" in params:
        kwargs["reason"] = reason
    if "mode" in params:
        kwargs["mode"] = "failed" if failed else "finished"
    try:
        set_closed(**kwargs)
    except Exception:
        log.exception("%s: could not close the rendezvous", ctx)


def leave(rdzv: RendezvousSurface, ctx: str) -> None:
    """Leave the run without closing it, where the backend can (ours: ``leave()`` revokes
    the lease, so the others see this node go at once). Errors are logged."""
    try:
        rdzv.leave()
    except Exception:
        log.exception("%s: could not leave the rendezvous", ctx)


def collect_failures(group: WorkerGroup | None) -> dict[int, Failure]:
    """global rank -> failure of every worker of ``group`` that exited non-zero, read from
    its error file (torch's ``@record``) when it wrote one."""
    if group is None:
        return {}
    launches = {w.ranks.local_rank: w for w in group.launches}
    failures: dict[int, Failure] = {}
    for local_rank, exited in group.exits().items():
        if exited.returncode == 0:
            continue
        launch = launches[local_rank]
        failures[launch.ranks.global_rank] = read_failure(
            global_rank=launch.ranks.global_rank,
            local_rank=local_rank,
            pid=exited.pid,
            exitcode=exited.returncode,
            error_file=launch.logs.error_file,
            observed_at=exited.wall_time,
        )
    return failures


def give_up_report(
    reason: str | None, failures: Mapping[int, Failure], entrypoint: str, hostname: str
) -> str:
    """What a node that gives up prints once to stderr: the reason line, then torch's
    root-cause report of the failed workers."""
    parts = [reason] if reason else []
    if failures:
        parts.append(format_report(entrypoint, dict(failures), hostname))
    return "\n".join(parts) or f"{entrypoint} FAILED: worker group state unknown"
