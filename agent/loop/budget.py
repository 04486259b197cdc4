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
"""

from __future__ import annotations

from typing import Protocol

from agent.loop.policy import RestartBudget
from coordinator.core.restart_budget import restarts_left
from coordinator.torch_adapter.surface import RendezvousSurface

__all__ = ["Budget", "JobBudget", "restart_budget"]


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


def restart_budget(max_restarts: int, rdzv: RendezvousSurface) -> Budget:
    """The job's budget where the rendezvous keeps one (ours), else each node's."""
    if rdzv.job_restart_budget:
        return JobBudget(max_restarts, rdzv)
    return RestartBudget(max_restarts)
