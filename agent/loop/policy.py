"""The agent's restart policy: a pure function from what it observed to what it does next.

The loop in :mod:`agent.loop.agent` observes the local worker group (:class:`WorkerState`),
counts the restarts it has left and asks the rendezvous whether the membership changed;
:func:`next_step` turns those three facts into a :class:`Step`. Nothing here touches a
process, a clock or the network, so every combination is tested by a table.
"""

from __future__ import annotations

from enum import Enum

from agent.workers.state import WorkerState
from coordinator.core.restart_budget import restart_refunded

__all__ = [
    "RestartBudget",
    "Step",
    "failure_with_no_restart_left",
    "next_step",
    "restart_cause",
    "restart_refunded",
    "stop_for_closed_run",
]


class Step(str, Enum):
    """What the loop does after one observation."""

    CONTINUE = "CONTINUE"
    """Keep the workers running and wait for the next event."""

    RESTART_COUNTED = "RESTART_COUNTED"
    """Stop the group, re-rendezvous, start again; uses one of ``--max-restarts``."""

    RESTART_UNCOUNTED = "RESTART_UNCOUNTED"
    """Stop the group, re-rendezvous, start again for a membership change; free."""

    SUCCEED = "SUCCEED"
    """All local workers succeeded: exit barrier, close the run, exit 0."""

    FAIL = "FAIL"
    """Give up: stop the group, close the run, report the root cause, exit non-zero."""


def next_step(group_state: WorkerState, restarts_left: int, membership_changed: bool) -> Step:
    """Decide the loop's next step.

    Args:
        group_state: the observed state of the local worker group.
        restarts_left: how many counted restarts remain (``--max-restarts`` minus used).
        membership_changed: a node is waiting to join or a participant was lost.

    Returns:
        The step to take. A finished group (SUCCEEDED) ignores membership changes: its
        work is done and the exit barrier lets the others finish. A failed group restarts
        whether or not the membership changed, and that restart is counted, because a
        worker failure happened either way.

    Raises:
        ValueError: ``restarts_left`` is negative, or ``group_state`` is INIT or STOPPED
            (states in which no workers run, so there is nothing to observe).
    """
    if restarts_left < 0:
        raise ValueError(f"restarts_left must be >= 0, got {restarts_left}")
    if group_state in (WorkerState.INIT, WorkerState.STOPPED):
        raise ValueError(
            f"next_step: the worker group is {group_state.value}, so no workers run; "
            "start the workers before asking the policy"
        )
    if group_state is WorkerState.SUCCEEDED:
        return Step.SUCCEED
    if group_state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
        return Step.RESTART_COUNTED if restarts_left > 0 else Step.FAIL
    if group_state is WorkerState.UNKNOWN:
        return Step.FAIL
    return Step.RESTART_UNCOUNTED if membership_changed else Step.CONTINUE


def failure_with_no_restart_left(
    step: Step, state: WorkerState, departed: bool, held: float, window: float
) -> Step:
    """What a worker failure with no restart left does while a departure may explain it.

    A node that dies breaks its peers' collectives at once, and the rendezvous learns of
    it only when its lease ends, up to a TTL later. With restarts left, the failure is
    counted and given back when the next round forms smaller (:func:`restart_refunded`);
    with none left, giving up at once would end the job for a node's departure, which is
    free (DESIGN §5). So the failure waits, up to ``window`` seconds (the lease TTL and a
    second), for a participant of the round to be seen gone.

    Args:
        step: what :func:`next_step` decided.
        state: the worker group's state.
        departed: a participant of this node's round has been seen gone.
        held: seconds since this failure first came here.
        window: how long a departure takes to be seen (0: never waited for).

    Returns:
        ``step``, unless it gives up on failed workers: then RESTART_UNCOUNTED once a
        departure is seen (a membership change), CONTINUE while ``held < window``, FAIL
        after.
    """
    if step is not Step.FAIL or state is not WorkerState.FAILED:
        return step
    if departed:
        return Step.RESTART_UNCOUNTED
    return Step.CONTINUE if held < window else Step.FAIL


def stop_for_closed_run(group_state: WorkerState, closed: bool, close_mode: str) -> bool:
    """Whether a run that another node (or an operator) closed ends this attempt now.

    Closed as ``failed`` (a node gave up): running workers can only wait for peers that
    are gone, up to a collective's timeout, so they are stopped. Closed as ``finished``
    or ``drain`` (an operator's close): the attempt runs to its end and a success still
    exits 0. Failed workers meet any closed run: no restart is left to make.
    """
    if not closed or group_state not in (WorkerState.HEALTHY, WorkerState.FAILED):
        return False
    return group_state is WorkerState.FAILED or close_mode == "failed"


class RestartBudget:
    """The counted restarts a node has left, and the one it may get back: torchrun's
    per-node budget, kept where the rendezvous keeps no count of the job (a handler that
    is not ours; the job's budget is :class:`agent.loop.budget.JobBudget`).

    A restart is charged when a worker fails; when the next round turns out smaller, the
    failure followed a node's departure and the charge is refunded (see
    :func:`restart_refunded`).
    """

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.left = max_restarts
        self._charged_group_size: int | None = None

    @property
    def used(self) -> int:
        return self.max_restarts - self.left

    @property
    def left_for_failure(self) -> int:
        """The restarts a failure of the current round may use: ``left``, per node."""
        return self.left

    def charge(self, group_size: int) -> None:
        """A worker of a group of ``group_size`` nodes failed: one restart is used."""
        self.left -= 1
        self._charged_group_size = group_size

    def settle(self, next_group_size: int) -> bool:
        """The next round formed with ``next_group_size`` nodes; True if refunded."""
        charged, self._charged_group_size = self._charged_group_size, None
        if charged is None or not restart_refunded(charged, next_group_size):
            return False
        self.left += 1
        return True


def restart_cause(step: Step, state: WorkerState) -> str:
    """The ``cause`` label of a restart the policy asked for.

    ``worker_failure``: a worker exited non-zero (a counted restart); ``unhealthy``: a
    health check found the workers making no progress (counted too); ``membership_change``:
    a node joined, left or lost its lease (not counted).

    Raises:
        ValueError: ``step`` is not a restart.
    """
    if step is Step.RESTART_UNCOUNTED:
        return "membership_change"
    if step is Step.RESTART_COUNTED:
        return "unhealthy" if state is WorkerState.UNHEALTHY else "worker_failure"
    raise ValueError(f"restart_cause: {step.value} is not a restart")
