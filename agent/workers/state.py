"""The state of one node's worker group, as the loop's policy reads it."""

from __future__ import annotations

from enum import Enum

__all__ = ["WorkerState"]


class WorkerState(str, Enum):
    """The state of this node's worker group (all local workers change state as a unit).

    Transitions::

        INIT ──start──▶ HEALTHY ──a worker exits non-zero──▶ FAILED ──restart──▶ STOPPED
                          │  ▲                                                      │
                          │  └──────────────── rendezvous + start ◀─────────────────┘
                          ├──every worker exits 0──▶ SUCCEEDED (terminal)
                          └──membership change──▶ STOPPED ──rendezvous + start──▶ HEALTHY

    Any action that is left half done (an exception while starting or stopping) leads
    to UNKNOWN, from which the agent does not try to recover.
    """

    INIT = "INIT"
    """The group exists but no worker was started yet. Nothing runs, nothing to stop.
    Safety: not observable by the policy; the loop starts workers before it asks."""

    HEALTHY = "HEALTHY"
    """Every worker is running (or some already exited 0 while others still run).
    Safety: the ranks the workers hold are valid for the current round only."""

    UNHEALTHY = "UNHEALTHY"
    """Workers run but a health check says they make no progress (e.g. a worker stuck
    in the kernel). Treated like FAILED: counts against ``--max-restarts``."""

    STOPPED = "STOPPED"
    """The agent stopped the workers on purpose (a restart is under way): every process
    of the group was terminated and reaped. Safety: nothing of the group runs; a new
    rendezvous must complete before anything is started again."""

    SUCCEEDED = "SUCCEEDED"
    """Every worker exited with code 0. Terminal: the agent enters the exit barrier."""

    FAILED = "FAILED"
    """At least one worker exited non-zero or was killed by a signal. Other workers may
    still be running until the agent stops the group."""

    UNKNOWN = "UNKNOWN"
    """The agent lost track of the group (an action on it failed half way). Terminal:
    some workers may still be running with stale ranks, so the only safe move is to stop
    everything and let the job scheduler retry the node."""
