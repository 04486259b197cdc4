"""How a restart is decided and counted: the restart budget as the agent's loop spends it.

Each wake-up of the loop becomes a step (:func:`agent.loop.policy.next_step`, then
:class:`~agent.loop.budget.DepartureHold`: a failure a departure may yet explain waits
for it). A counted restart (a worker failed, or a hang was declared in this node's
round) charges ``--max-restarts`` (the job's with our rendezvous,
:class:`~agent.loop.budget.JobBudget`), is recorded in the run's timeline and said in
one line with the root cause and what is left; a membership change is not counted; and
a counted restart is given back when the next round has fewer nodes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from agent.config import LaunchConfig
from agent.health.hang_rules import hang_line
from agent.loop.budget import DepartureHold, restart_budget
from agent.loop.policy import Step, next_step, restart_cause
from agent.observe.metrics import RunMetrics
from agent.observe.timeline import record_restart
from agent.workers.errorfile import Failure, root_cause
from agent.workers.state import WorkerState
from coordinator.core.state import Hang
from coordinator.torch_adapter.surface import RendezvousSurface

__all__ = ["Restarts"]

log = logging.getLogger(__name__)


class Restarts:
    """The restart budget of one agent, the step each wake-up takes, and each restart
    counted (or not) and said.

    Args:
        config: ``max_restarts``.
        rdzv: the rendezvous (the job's budget with ours; the timeline).
        metrics: hears of each restart and of what is left.
    """

    def __init__(self, config: LaunchConfig, rdzv: RendezvousSurface, metrics: RunMetrics) -> None:
        self._max_restarts = config.max_restarts
        self._rdzv = rdzv
        self._metrics = metrics
        self._budget = restart_budget(config.max_restarts, rdzv)
        self._hold = DepartureHold(rdzv)
        metrics.restarts_left(self._budget.left)

    @property
    def used(self) -> int:
        """Counted restarts used so far (the job's, with our rendezvous)."""
        return self._budget.used

    def step(self, state: WorkerState, membership_changed: bool) -> Step:
        """What the loop does for the workers' ``state``."""
        step = next_step(state, self._budget.left_for_failure, membership_changed)
        return self._hold.judge(step, state)  # a departure may yet explain it

    def begin(
        self,
        step: Step,
        state: WorkerState,
        hang: Hang | None,
        failures: Mapping[int, Failure],
        group_size: int,
        ctx: str,
    ) -> None:
        """Count (or not) the restart ``step`` asks for and say why.

        Args:
            step: a restart, counted or not.
            state: the workers' state it was decided from.
            hang: the hang declared in this node's round, if that is the cause.
            failures: the last attempt's failures, by global rank (the root cause).
            group_size: the nodes of the round that failed (what a refund compares to).
            ctx: run, node and attempt, for the log line.
        """
        self._metrics.restarted("hang" if hang is not None else restart_cause(step, state))
        if hang is not None:
            self._count_hang(hang, group_size, ctx)
        elif step is Step.RESTART_COUNTED:
            self._charge(group_size)
            first = root_cause(failures) if failures else None
            record_restart(self._rdzv, self.used, first)
            log.warning(
                "%s: worker group %s (root cause: rank %s: %s); restarting, %d of %d restarts left",
                ctx,
                state.value,
                first and first.global_rank,
                first and first.message,
                self._budget.left,
                self._max_restarts,
            )
        else:
            log.info("%s: membership changed; restarting (not counted)", ctx)

    def _count_hang(self, hang: Hang, group_size: int, ctx: str) -> None:
        """A hang was declared in this node's round (by this node or another): count the
        restart on this node, as every participant does, and say who stopped first.
        The one place every node handles a hang (the declaring node also calls
        ``HangWatch``'s ``on_hang``)."""
        self._charge(group_size)
        record_restart(self._rdzv, self.used, None, why=hang_line(hang))
        log.warning(
            "%s: %s; restarting the workers, %d of %d restarts left",
            ctx, hang_line(hang), self._budget.left, self._max_restarts,
        )  # fmt: skip

    def _charge(self, group_size: int) -> None:
        self._budget.charge(group_size)
        self._metrics.restarts_left(self._budget.left)

    def settle(self, group_size: int, ctx: str) -> None:
        """A round of ``group_size`` nodes formed: give back the last restart if the group
        shrank (the failure followed a node's departure)."""
        if self._budget.settle(group_size):
            log.info(
                "%s: the group shrank to %d nodes: the worker failure followed a node's "
                "departure, so that restart is not counted (%d of %d restarts left)",
                ctx, group_size, self._budget.left, self._max_restarts,
            )  # fmt: skip
        self._metrics.restarts_left(self._budget.left)
