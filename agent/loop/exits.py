"""How the agent's run ends, and its exit code.

* Success: every local worker succeeded. The workers are reaped, the node waits at the
  exit barrier (bounded; a participant that left ends it) and closes the run as
  finished: 0.
* Giving up (no restart left, a worker that cannot start, a rendezvous error): the run
  is closed first, with the root cause as the reason (mode ``failed``), so the other
  nodes stop their workers while ours stop; the exit barrier of the last round is
  released; the report is printed once: 1. A rendezvous error never closes the run.
* An operator's drain (``rdzvctl drain``): leave first, so the others re-form at once
  (not a counted restart); the workers get the early warning and the grace: 0.
* The run closed by another node: the workers stop at once (``failed``; a ``drain``
  close lets the attempt finish); the next rendezvous raises the closer's reason.
* A stop signal: the workers get it first, and the node leaves while they stop.

The pieces each ending is made of (the exit barrier, closing, leaving, the report) are
in :mod:`agent.loop.ending`.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Protocol, TextIO

from torch.distributed.elastic.rendezvous import RendezvousHandler

from agent.config import LaunchConfig
from agent.loop.ending import (
    close_reason,
    close_rendezvous,
    give_up_report,
    leave,
    release_exit_barrier,
)
from agent.loop.phase import MembershipChanged, PhaseWaiter
from agent.loop.policy import stop_for_closed_run
from agent.loop.rounds import barrier_changed, barrier_phase
from agent.store import Store
from agent.workers.errorfile import Failure, root_cause
from agent.workers.state import WorkerState
from coordinator.torch_adapter.surface import RendezvousSurface

__all__ = ["Exits", "StopWorkers", "signal_exit_code"]

log = logging.getLogger(__name__)


def signal_exit_code(signum: int) -> int:
    """The shell convention for "ended by signal N": 128 + N (143 for SIGTERM)."""
    return 128 + signum


class StopWorkers(Protocol):
    """Stops the workers (the agent's): ``then`` runs once they were signalled."""

    def __call__(
        self,
        sig: signal.Signals = ...,
        *,
        reason: str,
        then: Callable[[], None] | None = ...,
    ) -> None: ...


class Exits:
    """The ways this node's part in a run ends.

    Args:
        config: the launch configuration (signals, grace, exit barrier timeout).
        handler, rdzv: the rendezvous and our surface of it.
        phases: what the loop waits on a phase with (the exit barrier is one).
        stop_workers: stops the workers.
        wake: wakes the loop (a phase's end).
        console_err: where the report goes (None: sys.stderr at the time of writing).
        hostname: this machine, named in the close reason and the report.
    """

    def __init__(
        self,
        config: LaunchConfig,
        handler: RendezvousHandler,
        rdzv: RendezvousSurface,
        phases: PhaseWaiter,
        stop_workers: StopWorkers,
        wake: Callable[[], None],
        console_err: TextIO | None,
        hostname: str,
    ) -> None:
        self._config = config
        self._handler = handler
        self._rdzv = rdzv
        self._phases = phases
        self._stop_workers = stop_workers
        self._wake = wake
        self._console_err = console_err
        self._hostname = hostname

    def succeed(self, store: Store | None, group_world_size: int, ctx: str, *, watch: bool) -> int:
        """Every worker succeeded: reap them, wait at the exit barrier, close the run."""
        log.info("%s: all workers succeeded; waiting for the other nodes", ctx)
        self._stop_workers(reason="success")  # reaps them and their leftovers
        if store is not None:
            self._exit_barrier(store, group_world_size, ctx, watch=watch)
        close_rendezvous(
            self._handler, "the job finished: every worker succeeded", ctx, failed=False
        )
        return 0

    def _exit_barrier(self, store: Store, group_world_size: int, ctx: str, *, watch: bool) -> None:
        phase = barrier_phase(
            store, group_world_size, self._config.exit_barrier_timeout, ctx, self._wake
        )
        try:
            changed = barrier_changed(self._handler, self._rdzv) if watch else None
            self._phases.run(phase, changed)
        except MembershipChanged as exc:
            log.warning("%s: exit barrier: %s; closing anyway", ctx, exc)

    def give_up(
        self,
        reason: str | None,
        failures: Mapping[int, Failure],
        restarts_used: int,
        store: Store | None,
        group_rank: int,
        ctx: str,
        *,
        close: bool = True,
    ) -> str:
        """Give up: close the run with the root cause (unless ``close`` is False), release
        the exit barrier, stop the workers, print the report once; returns the report.

        Args:
            reason: why, when no worker failed (else the failures say it).
            failures: the last attempt's failures, by global rank.
            restarts_used: counted restarts used, for the close reason.
            store: the last round's store (None: no round formed).
            group_rank: this node's, named in the close reason.
            ctx: run, node and attempt, for the log lines.
            close: False after a rendezvous error (nothing to tell the others).
        """
        who = f"node {group_rank} ({self._hostname})"
        if close:
            # Close before stopping: the other nodes learn the root cause (and stop their
            # workers) while ours are still being stopped.
            why = close_reason(who, failures, restarts_used, reason)
            close_rendezvous(self._handler, why, ctx, failed=True)
        if store is not None:
            # Nodes of the last round already at its exit barrier stop waiting for us.
            release_exit_barrier(store, who, ctx)
        self._stop_workers(reason="failure")
        report = give_up_report(reason, failures, self._config.entrypoint, self._hostname)
        # The report goes to stderr once, below; logging it too would print it twice.
        log.error("%s: giving up", ctx)
        err = self._console_err or sys.stderr
        err.write(report + "\n")
        err.flush()
        return report

    def drain(self, ctx: str) -> int:
        """An operator asked this node to leave (``rdzvctl drain``): leave the run first
        (the lease is revoked, so the others re-form at once, not a counted restart), give
        the workers the early warning and the grace, exit 0."""
        first = self._config.drain_signal or signal.SIGTERM
        log.warning(
            "%s: drained by an operator: leaving the run; workers get %s and %.0f s before SIGKILL",
            ctx,
            first.name,
            self._config.stop_grace_period,
        )
        leave(self._rdzv, ctx)
        self._stop_workers(first, reason="drain")
        return 0

    def must_stop_for_closed_run(self, state: WorkerState, *, watch: bool) -> bool:
        """Whether the run was closed under running (or failed) workers, so they stop now.

        Only a handler that pushes events (``watch``: ours) is asked: it answers from
        memory, where torch's c10d handler would make a store round trip every tick."""
        if not watch or state not in (WorkerState.HEALTHY, WorkerState.FAILED):
            return False
        closed = self._handler.is_closed()
        return stop_for_closed_run(state, closed, self._rdzv.close_mode if closed else "")

    def stop_for_closed_run(
        self, state: WorkerState, failures: Mapping[int, Failure], ctx: str
    ) -> None:
        """Stop the workers of a run another node closed. The next rendezvous raises the
        handler's closed error, which carries the closer's reason (its root cause), and
        the agent ends with that line."""
        first = root_cause(failures) if failures else None
        log.warning(
            "%s: the run was closed by another node; stopping the workers%s",
            ctx,
            f" (one had failed: rank {first.global_rank}: {first.message})"
            if state is WorkerState.FAILED and first is not None
            else "",
        )
        self._stop_workers(reason="closed")

    def on_signal(self, signum: int, ctx: str) -> int:
        """A stop was requested with ``signum``: pass a signal on to the workers and leave
        the run while they stop; returns ``128 + signum``."""
        log.warning("%s: stopping workers on signal %d", ctx, signum)
        # Pass the signal on, as torch does: a script may treat SIGINT apart (or the early
        # warning, when one is configured).
        first = self._config.drain_signal or signal.Signals(signum)
        self._signal_then_leave(first, ctx)
        return signal_exit_code(signum)

    def _signal_then_leave(self, first: signal.Signals, ctx: str) -> None:
        """Signal the workers first, and leave the run (ours: revoke the lease) while
        they stop. Leaving flushes events, records the departure and revokes the lease:
        20 s and more while etcd does not answer, which under a scheduler's 30 s grace
        would come out of the workers' time to checkpoint. With etcd up the revoke
        (milliseconds) still lands before the workers are gone, so the other nodes
        re-form for a membership change; a counted restart they see is refunded when
        their next round is smaller
        (:func:`coordinator.core.restart_budget.restart_refunded`)."""
        leaving = threading.Thread(
            target=leave, args=(self._rdzv, ctx), name="agent-leave", daemon=True
        )
        self._stop_workers(first, reason="stop", then=leaving.start)
        leaving.join()
