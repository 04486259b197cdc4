"""The pure refund rule of the agent's restart policy: a worker failure followed by a
smaller group is put down to the node that went away, and not counted."""

from __future__ import annotations

import pytest

from agent.loop.policy import RestartBudget, restart_refunded, stop_for_closed_run
from agent.workers.state import WorkerState


@pytest.mark.parametrize(
    ("failed", "after", "refunded"),
    [
        (3, 2, True),  # a node died: its peers' broken collectives do not count
        (4, 1, True),
        (2, 2, False),  # a genuine failure: same nodes come back
        (2, 3, False),  # a node joined meanwhile: still the same failure
        (1, 1, False),
    ],
)
def test_refund_when_the_group_shrank(failed: int, after: int, refunded: bool) -> None:
    assert restart_refunded(failed, after) is refunded


@pytest.mark.parametrize(("failed", "after"), [(0, 1), (1, 0), (-1, 2)])
def test_sizes_below_one_are_refused(failed: int, after: int) -> None:
    with pytest.raises(ValueError, match=f"group sizes must be >= 1, got {failed} and {after}"):
        restart_refunded(failed, after)


def test_budget_charges_and_refunds_once() -> None:
    budget = RestartBudget(2)
    assert (budget.left, budget.used) == (2, 0)
    assert not budget.settle(3)  # nothing charged: nothing to give back
    budget.charge(3)
    assert (budget.left, budget.used) == (1, 1)
    assert budget.settle(2)  # the group shrank: the failure followed a departure
    assert (budget.left, budget.used) == (2, 0)
    assert not budget.settle(1)  # a charge is refunded once
    budget.charge(2)
    assert not budget.settle(2)  # same size: a real worker failure stays counted
    assert budget.left == 1


# (state, closed, mode) -> stop now: a failed close stops healthy workers; any close
# meets failed workers; a drain or finished close lets healthy workers run to the end.
CLOSED_RUN = {
    (WorkerState.HEALTHY, False, ""): False,
    (WorkerState.HEALTHY, True, "failed"): True,
    (WorkerState.HEALTHY, True, "drain"): False,
    (WorkerState.HEALTHY, True, "finished"): False,
    (WorkerState.FAILED, True, "drain"): True,
    (WorkerState.FAILED, True, "finished"): True,
    (WorkerState.FAILED, False, ""): False,
    (WorkerState.SUCCEEDED, True, "failed"): False,
    (WorkerState.STOPPED, True, "failed"): False,
}


@pytest.mark.parametrize(("case", "stop"), CLOSED_RUN.items(), ids=str)
def test_stop_for_closed_run(case: tuple[WorkerState, bool, str], stop: bool) -> None:
    assert stop_for_closed_run(*case) is stop
