"""The job's restart budget, its pure rules (coordinator/core/restart_budget.py) and the
actions that carry them (actions.count_restart, the refund in a completion): counted
once per round, judged against the budget before the round was counted, given back when
the next round is smaller, nothing in a closed run, and a node that leaves and joins
again cannot reset it. Then the agent's wait for a departure that would explain a
failure with no restart left (agent.loop.policy, agent.loop.budget.DepartureHold)."""

from __future__ import annotations

import dataclasses

import pytest

from agent.loop.budget import DepartureHold
from agent.loop.policy import RestartBudget, Step, failure_with_no_restart_left, next_step
from agent.workers.state import WorkerState
from coordinator.core.actions import Action, ActionKind, apply, count_restart
from coordinator.core.restart_budget import (
    RestartCount,
    counted_before,
    counts,
    restarts_left,
    settled,
)
from coordinator.core.state import RdzvState
from coordinator.rdzvctl.format import status_json, status_lines
from coordinator.torch_adapter.surface import ForeignSurface
from tests.unit.rdzvctl_samples import LIVE, NOW, ROUND1, UTC, snap

K = ActionKind
NOTHING = RestartCount()


def _running(round: int, members: str, restarts: RestartCount = NOTHING) -> RdzvState:
    return RdzvState(round=round, participants=tuple(members), restarts=restarts)


def _complete(state: RdzvState, members: str) -> RdzvState:
    return apply(state, [Action(K.MARK_RENDEZVOUS_COMPLETE, node_ids=tuple(members))])


def _count(state: RdzvState, round: int, incarnation: int = 0) -> RdzvState:
    return apply(state, count_restart(state, round, incarnation))


# (count, round, state round, closed) -> counted now
COUNTS = [
    (RestartCount(), 3, 3, False, True),  # the first node to see round 3 fail
    (RestartCount(1, 3), 3, 3, False, False),  # round 3 counted already: a second node
    (RestartCount(1, 2, refunded=True), 3, 3, False, True),  # an older round's count
    (RestartCount(), 2, 3, False, False),  # round 2 is over: the run re-formed
    (RestartCount(), 4, 3, False, False),  # a round the state has not reached
    (RestartCount(), 3, 3, True, False),  # a closed run counts nothing
    (RestartCount(), 0, 0, False, False),  # nothing formed yet: no workers ran
]


@pytest.mark.parametrize(("count", "round", "state_round", "closed", "expected"), COUNTS)
def test_counts(
    count: RestartCount, round: int, state_round: int, closed: bool, expected: bool
) -> None:
    assert counts(count, round, state_round, closed) is expected


def test_counting_is_idempotent_per_round() -> None:
    state = _running(3, "ab")
    once = _count(state, 3)
    assert once.restarts == RestartCount(used=1, round=3)
    assert count_restart(once, 3) == ()  # a second node finds it counted: no write
    assert _count(once, 3) == once
    later = _count(_complete(once, "ab"), 4)
    assert later.restarts == RestartCount(used=2, round=4)


def test_a_count_is_one_action_naming_its_round() -> None:
    assert count_restart(_running(5, "ab"), 5) == (Action(K.COUNT_RESTART, restart_round=5),)


# (count, failed round, max) -> left for that failure; the same before and after the
# count of that round landed, so every node of the round decides alike.
LEFT = [
    (RestartCount(), 3, 1, 1),  # nothing counted: the whole budget
    (RestartCount(1, 3), 3, 1, 1),  # round 3 counted: judged as before its count
    (RestartCount(1, 2), 3, 1, 0),  # round 2 used the only restart: give up
    (RestartCount(0, 2, refunded=True), 3, 1, 1),  # round 2's restart was given back
    (RestartCount(1, 2, refunded=True), 3, 1, 0),  # ... but an older one is still used
    (RestartCount(0, 3, refunded=True), 3, 1, 1),
    (RestartCount(3, 3), 3, 1, 0),  # more used than this node's --max-restarts: 0, not -1
    (RestartCount(2, 5), 5, 0, 0),  # --max-restarts=0 never restarts
]


@pytest.mark.parametrize(("count", "round", "max_restarts", "left"), LEFT)
def test_restarts_left_for_a_failure_of_a_round(
    count: RestartCount, round: int, max_restarts: int, left: int
) -> None:
    assert restarts_left(count, round, max_restarts) == left


def test_every_node_of_a_round_reaches_the_same_verdict_before_and_after_its_count() -> None:
    for max_restarts in range(3):
        for used in range(3):
            before = _running(4, "ab", RestartCount(used=used, round=2))
            after = _count(before, 4)
            assert counted_before(after.restarts, 4) == counted_before(before.restarts, 4)
            verdicts = {
                next_step(WorkerState.FAILED, restarts_left(s.restarts, 4, max_restarts), False)
                for s in (before, after)
            }
            assert len(verdicts) == 1, (max_restarts, used, verdicts)


# The round after a counted failure: (members of the failed round, of the next) -> used
# after; the restart is given back when the group shrank (a node's departure broke the
# collectives before its lease ended).
REFUNDS = [
    ("abc", "ab", 0, True),
    ("abcd", "a", 0, True),
    ("ab", "ab", 1, False),  # a genuine failure: the same nodes came back
    ("ab", "ac", 1, False),  # a fresh agent in a node's place: still counted
    ("ab", "abc", 1, False),  # a node joined meanwhile: still the same failure
]


@pytest.mark.parametrize(("failed", "after", "used", "refunded"), REFUNDS)
def test_the_completion_after_a_counted_failure_gives_it_back_when_smaller(
    failed: str, after: str, used: int, refunded: bool
) -> None:
    state = _complete(_count(_running(3, failed), 3), after)
    assert state.round == 4
    assert state.restarts == RestartCount(used=used, round=3, refunded=refunded)
    # Given back once: the round after that compares with round 4, not with round 3.
    assert _complete(state, after[:1]).restarts == state.restarts


def test_no_refund_without_a_count_of_the_round_that_ended() -> None:
    old = RestartCount(used=1, round=2)
    state = _complete(_running(3, "abc", old), "a")  # round 3 shrank, but never failed
    assert state.restarts == old
    assert settled(old, 3, 3, 1) == old
    assert settled(RestartCount(used=1, round=3), 3, 0, 1) == RestartCount(used=1, round=3)


def test_a_closed_run_or_another_incarnation_counts_nothing() -> None:
    closed = apply(_running(3, "ab"), [Action(K.MARK_RENDEZVOUS_CLOSED, reason="x")])
    assert count_restart(closed, 3) == ()
    running = _running(3, "ab")
    assert count_restart(running, 3, incarnation=2) == ()  # a node of an ended incarnation
    assert count_restart(running, 3, incarnation=1) != ()


def test_a_new_incarnation_starts_with_nothing_counted() -> None:
    state = apply(_count(_running(3, "ab"), 3), [Action(K.MARK_RENDEZVOUS_CLOSED)])
    again = apply(state, [Action(K.START_INCARNATION)])
    assert (again.incarnation, again.restarts) == (2, RestartCount())


def test_leaving_and_joining_again_cannot_exceed_the_jobs_budget() -> None:
    """--max-restarts=1, two nodes: b's worker fails in round 1 (counted); b's agent is
    replaced by a fresh one (c) and round 3 forms with a and c; a second failure is past
    the job's budget. Per node, b2 would have started from a full budget."""
    max_restarts = 1
    state = _running(1, "ab")
    left = restarts_left(state.restarts, 1, max_restarts)
    assert next_step(WorkerState.FAILED, left, False) is Step.RESTART_COUNTED
    state = _count(state, 1)
    state = _complete(state, "ab")  # round 2: the same two nodes
    state = _complete(state, "ac")  # round 3: a and a fresh agent (c) in b's place
    assert state.restarts == RestartCount(used=1, round=1)
    left = restarts_left(state.restarts, state.round, max_restarts)
    assert next_step(WorkerState.FAILED, left, False) is Step.FAIL
    fresh = RestartBudget(max_restarts)  # torchrun's count on the fresh agent
    assert next_step(WorkerState.FAILED, fresh.left_for_failure, False) is Step.RESTART_COUNTED


# --- a failure with no restart left waits for a departure that would explain it ---------

F, H, U = WorkerState.FAILED, WorkerState.HEALTHY, WorkerState.UNHEALTHY
# (step, state, departed, held, window) -> step
HOLD = [
    (Step.FAIL, F, False, 0.0, 4.0, Step.CONTINUE),  # wait: a lease may be ending
    (Step.FAIL, F, True, 1.0, 4.0, Step.RESTART_UNCOUNTED),  # a participant went: free
    (Step.FAIL, F, False, 4.0, 4.0, Step.FAIL),  # none went within the window
    (Step.FAIL, F, True, 9.0, 4.0, Step.RESTART_UNCOUNTED),
    (Step.FAIL, F, False, 0.0, 0.0, Step.FAIL),  # a backend that cannot tell: no wait
    (Step.FAIL, U, True, 0.0, 4.0, Step.FAIL),  # a hang is no node's departure
    (Step.FAIL, WorkerState.UNKNOWN, True, 0.0, 4.0, Step.FAIL),
    (Step.RESTART_COUNTED, F, True, 0.0, 4.0, Step.RESTART_COUNTED),  # restarts left
    (Step.CONTINUE, H, True, 0.0, 4.0, Step.CONTINUE),
]


@pytest.mark.parametrize(("step", "state", "departed", "held", "window", "out"), HOLD)
def test_failure_with_no_restart_left(
    step: Step, state: WorkerState, departed: bool, held: float, window: float, out: Step
) -> None:
    assert failure_with_no_restart_left(step, state, departed, held, window) is out


class _Rendezvous(ForeignSurface):
    """A surface whose departures and window a test sets (the rest: a foreign one's)."""

    def __init__(self, window: float) -> None:
        self.departure_seen_within = window
        self.gone: list[str] = []

    def departed_participants(self) -> list[str]:
        return list(self.gone)


def test_departure_hold_waits_its_window_then_gives_up_or_restarts_for_the_departure() -> None:
    now = [100.0]
    rdzv = _Rendezvous(window=4.0)
    hold = DepartureHold(rdzv, clock=lambda: now[0])
    assert hold.judge(Step.FAIL, F) is Step.CONTINUE
    now[0] += 3.9
    assert hold.judge(Step.FAIL, F) is Step.CONTINUE
    now[0] += 0.1
    assert hold.judge(Step.FAIL, F) is Step.FAIL  # the window is over: give up
    # The next failure waits a window of its own; a departure seen ends the wait.
    now[0] += 60.0
    assert hold.judge(Step.FAIL, F) is Step.CONTINUE
    now[0] += 2.0
    rdzv.gone = ["b"]
    assert hold.judge(Step.FAIL, F) is Step.RESTART_UNCOUNTED
    # Other steps pass through and end any wait.
    rdzv.gone = []
    assert hold.judge(Step.FAIL, F) is Step.CONTINUE
    assert hold.judge(Step.RESTART_COUNTED, F) is Step.RESTART_COUNTED
    now[0] += 10.0
    assert hold.judge(Step.FAIL, F) is Step.CONTINUE
    assert DepartureHold(_Rendezvous(window=0.0)).judge(Step.FAIL, F) is Step.FAIL


def test_rdzvctl_status_shows_the_jobs_restarts_once_one_was_counted() -> None:
    assert not [x for x in status_lines(snap(ROUND1, LIVE), NOW, UTC) if "restarts" in x]
    counted = dataclasses.replace(ROUND1, restarts=RestartCount(used=1, round=1))
    assert "restarts:        1 counted for the job (the last in round 1)" in status_lines(
        snap(counted, LIVE), NOW, UTC
    )
    back = dataclasses.replace(ROUND1, round=2, restarts=RestartCount(0, 1, refunded=True))
    assert (
        "restarts:        0 counted for the job (the last in round 1, given back: the next "
        "round was smaller)"
    ) in status_lines(snap(back, LIVE), NOW, UTC)
    assert status_json(snap(counted, LIVE))["restarts"] == {
        "used": 1,
        "round": 1,
        "refunded": False,
    }
