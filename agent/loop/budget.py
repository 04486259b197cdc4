"""The restart budget the agent's loop keeps: the job's with our rendezvous, each node's
with any other.

torchrun gives every agent its own ``--max-restarts``, so a node that exits and joins
again (or a fresh agent in its place) starts from a full budget, and a job can restart
without end (pytorch issues 147064, 135712). With our rendezvous the budget is the job's
(:class:`JobBudget`): a failure (or hang) of a round is counted once in the rendezvous
state, whichever nodes see it, and every agent, a new one included, reads the job's
count from its watched view (the rules: :mod:`coordinator.core.restart_budget`). With a
handler that is not ours, each node counts its own (:class:`~agent.loop.policy.RestartBudget`),
as torchrun does.

Both answer the loop the same questions: how many restarts a failure of the current
round may use (``left_for_failure``, what :func:`~agent.loop.policy.next_step` is
given), how many are used and left (logs, metrics, ``TORCHELASTIC_RESTART_COUNT``),
``charge`` one, and whether the round that just formed gave it back (``settle``).

A budget shared by the job runs out sooner on each node than torchrun's, and a node
lost once it is out must still cost nothing (its peers' collectives break before its
lease ends): :class:`DepartureHold` makes a failure with no restart left wait, up to a
lease TTL, for a departure that explains it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from agent.loop.policy import RestartBudget, Step, failure_with_no_restart_left
from agent.workers.state import WorkerState
from coordinator.core.restart_budget import restarts_left
from coordinator.torch_adapter.surface import RendezvousSurface

__all__ = ["Budget", "DepartureHold", "JobBudget", "restart_budget"]

log = logging.getLogger(__name__)


class Budget(Protocol):
    """What the loop asks of a restart budget."""

    @property
    def max_restarts(self) -> int:
        """``--max-restarts``."""
        ...

    @property
    def used(self) -> int:
        """Counted restarts so far (the job's, with :class:`JobBudget`)."""
        ...

    @property
    def left(self) -> int:
        """Counted restarts left now."""
        ...

    @property
    def left_for_failure(self) -> int:
        """The restarts a failure of the current round may use (0: give up)."""
        ...

    def charge(self, group_size: int) -> None:
        """The workers of the current round (``group_size`` nodes) failed or hung."""
        ...

    def settle(self, next_group_size: int) -> bool:
        """The next round formed with ``next_group_size`` nodes; True if the restart
        charged before it was given back."""
        ...


class JobBudget:
    """The job's ``--max-restarts``, counted in the rendezvous state.

    Every answer is read from the handler's watched view, never with a round trip; only
    :meth:`charge` writes, and only when the current round is not counted yet.

    Args:
        max_restarts: ``--max-restarts`` (give every agent of the job the same value: the
            first node whose budget is used up gives up and closes the run).
        rdzv: our rendezvous (``rdzv.job_restart_budget`` is True).
    """

    def __init__(self, max_restarts: int, rdzv: RendezvousSurface) -> None:
        self.max_restarts = max_restarts
        self._rdzv = rdzv
        self._charged: int | None = None  # the round this node charged, until settled

    @property
    def used(self) -> int:
        return self._rdzv.job_restarts.used

    @property
    def left(self) -> int:
        return max(0, self.max_restarts - self.used)

    @property
    def left_for_failure(self) -> int:
        # Against the budget as it was before this round was counted: every node of the
        # round reaches the same verdict, before or after the count landed.
        return restarts_left(self._rdzv.job_restarts, self._rdzv.last_round, self.max_restarts)

    def charge(self, group_size: int) -> None:
        """Count the current round once for the job (a guarded write by the first node
        that calls it; nothing for the others). ``group_size`` is not needed: the
        coordinator compares the rounds' sizes when it gives a restart back."""
        self._charged = self._rdzv.last_round
        self._rdzv.count_restart(self._charged)

    def settle(self, next_group_size: int) -> bool:
        charged, self._charged = self._charged, None
        count = self._rdzv.job_restarts
        return charged is not None and count.round == charged and count.refunded


class DepartureHold:
    """Holds a give-up on failed workers until a departure had time to show
    (:func:`~agent.loop.policy.failure_with_no_restart_left`): a participant seen gone
    turns it into a restart for a membership change, not counted.

    Args:
        rdzv: the rendezvous (its ``departure_seen_within`` is the longest wait; 0, as
            with a handler that is not ours: never waits).
        clock: monotonic seconds.
    """

    def __init__(
        self, rdzv: RendezvousSurface, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._rdzv = rdzv
        self._clock = clock
        self._since: float | None = None

    def judge(self, step: Step, state: WorkerState) -> Step:
        """``step``, or what it becomes while a departure may explain the failure."""
        window = self._rdzv.departure_seen_within
        if step is not Step.FAIL or state is not WorkerState.FAILED or window <= 0:
            self._since = None
            return step
        now = self._clock()
        if self._since is None:
            self._since = now
            log.warning(
                "node %s: workers of round %d failed with no restart left; waiting up to "
                "%.0f s for a node's departure that would explain it",
                self._rdzv.node_id, self._rdzv.last_round, window,
            )  # fmt: skip
        gone = self._rdzv.departed_participants()
        out = failure_with_no_restart_left(step, state, bool(gone), now - self._since, window)
        if out is not Step.CONTINUE:
            self._since = None
        if out is Step.RESTART_UNCOUNTED:
            log.warning(
                "node %s: %s left round %d: the failure is put down to that departure",
                self._rdzv.node_id, ", ".join(gone), self._rdzv.last_round,
            )  # fmt: skip
        return out


def restart_budget(max_restarts: int, rdzv: RendezvousSurface) -> Budget:
    """The job's budget where the rendezvous keeps one (ours), else each node's."""
    if rdzv.job_restart_budget:
        return JobBudget(max_restarts, rdzv)
    return RestartBudget(max_restarts)
