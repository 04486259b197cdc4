"""Table-driven tests of the agent's pure restart policy: every (state, restarts, change)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from agent.loop.policy import Step, next_step
from agent.workers import state as state_module
from agent.workers.state import WorkerState

S = WorkerState

# (state, restarts_left, membership_changed) -> step, for every combination that has one.
TABLE: dict[tuple[WorkerState, int, bool], Step] = {
    (S.HEALTHY, 0, False): Step.CONTINUE,
    (S.HEALTHY, 0, True): Step.RESTART_UNCOUNTED,
    (S.HEALTHY, 3, False): Step.CONTINUE,
    (S.HEALTHY, 3, True): Step.RESTART_UNCOUNTED,
    (S.UNHEALTHY, 0, False): Step.FAIL,
    (S.UNHEALTHY, 0, True): Step.FAIL,
    (S.UNHEALTHY, 3, False): Step.RESTART_COUNTED,
    (S.UNHEALTHY, 3, True): Step.RESTART_COUNTED,
    (S.FAILED, 0, False): Step.FAIL,
    (S.FAILED, 0, True): Step.FAIL,
    (S.FAILED, 1, False): Step.RESTART_COUNTED,
    (S.FAILED, 1, True): Step.RESTART_COUNTED,
    (S.FAILED, 3, False): Step.RESTART_COUNTED,
    (S.FAILED, 3, True): Step.RESTART_COUNTED,
    (S.SUCCEEDED, 0, False): Step.SUCCEED,
    (S.SUCCEEDED, 0, True): Step.SUCCEED,
    (S.SUCCEEDED, 3, False): Step.SUCCEED,
    (S.SUCCEEDED, 3, True): Step.SUCCEED,
    (S.UNKNOWN, 0, False): Step.FAIL,
    (S.UNKNOWN, 0, True): Step.FAIL,
    (S.UNKNOWN, 3, False): Step.FAIL,
    (S.UNKNOWN, 3, True): Step.FAIL,
}


@pytest.mark.parametrize(("case", "expected"), sorted(TABLE.items(), key=str))
def test_table(case: tuple[WorkerState, int, bool], expected: Step) -> None:
    assert next_step(*case) is expected


def test_table_covers_every_observable_state() -> None:
    observable = set(S) - {S.INIT, S.STOPPED}
    for state, restarts, changed in itertools.product(observable, (0, 3), (False, True)):
        assert (state, restarts, changed) in TABLE


@pytest.mark.parametrize("state", [S.INIT, S.STOPPED])
@pytest.mark.parametrize("changed", [False, True])
def test_unobservable_states_are_rejected(state: WorkerState, changed: bool) -> None:
    with pytest.raises(ValueError) as err:
        next_step(state, 1, changed)
    assert str(err.value) == (
        f"next_step: the worker group is {state.value}, so no workers run; "
        "start the workers before asking the policy"
    )


def test_negative_restarts_rejected() -> None:
    with pytest.raises(ValueError, match=r"^restarts_left must be >= 0, got -1$"):
        next_step(S.FAILED, -1, False)


def test_every_state_is_documented() -> None:
    source = Path(state_module.__file__ or "").read_text()
    for state in S:
        # each member is followed by its docstring in the enum body
        assert f'{state.name} = "{state.value}"\n    """' in source
