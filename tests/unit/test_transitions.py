"""The pure rendezvous decisions, case by case: decide_node, decide_coordinator, apply, close.

Time is a plain float; node keys are a dict of NodeInfo (a key present = a live lease).
Each coordinator case states the whole expected decision (actions, running last-call
deadline, wake-up time), so a change in any part of it shows up here.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest

from coordinator.core.actions import Action, ActionKind, apply, close, drain
from coordinator.core.join_decision import NodeAction, decide_node, incarnation_to_join
from coordinator.core.state import NodeInfo, RdzvState
from coordinator.core.transitions import CoordinatorDecision, Limits, decide_coordinator

K = ActionKind
INF = math.inf
LIM = Limits(min_nodes=2, max_nodes=4, last_call_timeout=10.0)

# Arrival order (create revision) differs from name order on purpose: ranks follow arrival.
_REVISION = {"a": 11, "b": 12, "c": 13, "d": 14, "e": 15, "f": 16, "g": 17, "x": 9, "y": 10}


def _node(name: str, wanted: int) -> NodeInfo:
    return NodeInfo(
        node_id=name,
        wanted_round=wanted,
        addr=f"host-{name}",
        free_port=29500 + _REVISION[name],
        create_revision=_REVISION[name],
    )


def _nodes(wanted: int, names: str, **others: int) -> dict[str, NodeInfo]:
    """Live node keys: every name in ``names`` asks for ``wanted``; ``others`` name=round."""
    out = {n: _node(n, wanted) for n in names}
    out.update({n: _node(n, w) for n, w in others.items()})
    return out


def _complete(ids: str, redundant: str = "") -> Action:
    return Action(
        K.MARK_RENDEZVOUS_COMPLETE,
        node_ids=tuple(ids),
        redundant=tuple(redundant),
        master_addr=f"host-{ids[0]}",
        master_port=29500 + _REVISION[ids[0]],
    )


def _act(kind: ActionKind, names: str) -> Action:
    return Action(kind, tuple(names))


def _done(*actions: Action) -> CoordinatorDecision:
    return CoordinatorDecision(actions, None, INF)


def _wait(deadline: float | None, *actions: Action) -> CoordinatorDecision:
    return CoordinatorDecision(actions, deadline, INF if deadline is None else deadline)


def _round1(
    participants: str = "abc",
    *,
    wait_list: tuple[str, ...] = (),
    redundancy_list: tuple[str, ...] = (),
    lost: tuple[str, ...] = (),
    closed: bool = False,
) -> RdzvState:
    """A completed round 1 (single-letter node ids, in rank order)."""
    return RdzvState(
        round=1,
        participants=tuple(participants),
        wait_list=wait_list,
        redundancy_list=redundancy_list,
        lost=lost,
        closed=closed,
    )


# --- decide_node ---------------------------------------------------------------------

_R2 = RdzvState(round=2, participants=("a", "b"))

NODE_CASES: list[tuple[str, RdzvState, str, int, float, NodeAction]] = [
    # (id, state, node, wanted_round, now, expected); the join deadline is 100.
    ("closed", RdzvState(closed=True), "a", 1, 0.0, NodeAction.ERROR_CLOSED),
    ("closed beats finish", RdzvState(round=2, participants=("a",), closed=True), "a", 2, 0.0,
     NodeAction.ERROR_CLOSED),
    ("closed beats timeout", RdzvState(closed=True), "a", 1, 500.0, NodeAction.ERROR_CLOSED),
    ("finish: the round it asked for completed with it", _R2, "b", 2, 0.0, NodeAction.FINISH),
    ("finish even past the join deadline", _R2, "a", 2, 100.0, NodeAction.FINISH),
    ("timeout at the deadline", _R2, "c", 3, 100.0, NodeAction.ERROR_TIMEOUT),
    ("timeout past the deadline", _R2, "c", 3, 250.0, NodeAction.ERROR_TIMEOUT),
    ("timeout before ever asking", _R2, "c", 0, 100.0, NodeAction.ERROR_TIMEOUT),
    ("join: never asked, nothing formed", RdzvState(), "a", 0, 0.0, NodeAction.JOIN),
    ("join: never asked, a participant calls again", _R2, "a", 0, 0.0, NodeAction.JOIN),
    ("join: the wanted round completed without it", _R2, "c", 2, 0.0, NodeAction.JOIN),
    ("join: it missed a round entirely", _R2, "c", 1, 0.0, NodeAction.JOIN),
    ("sync: waiting for the first round", RdzvState(), "a", 1, 0.0, NodeAction.SYNC),
    ("sync: waiting for the next round", _R2, "a", 3, 99.9, NodeAction.SYNC),
    ("sync: a newcomer waits", _R2, "c", 3, 0.0, NodeAction.SYNC),
]  # fmt: skip


@pytest.mark.parametrize(
    ("state", "node_id", "wanted", "now", "expected"),
    [c[1:] for c in NODE_CASES],
    ids=[c[0] for c in NODE_CASES],
)
def test_decide_node(
    state: RdzvState, node_id: str, wanted: int, now: float, expected: NodeAction
) -> None:
    # Every node here belongs to the state's incarnation (it asked before).
    got = decide_node(state, node_id, wanted, now, join_deadline=100.0, incarnation=1)
    assert got is expected


def test_spare_in_redundancy_list_of_full_round_does_not_time_out() -> None:
    full = RdzvState(round=1, participants=("a", "b", "c", "d"), redundancy_list=("e",))
    assert decide_node(full, "e", 2, now=1000.0, join_deadline=600.0) is NodeAction.SYNC


# --- decide_coordinator ----------------------------------------------------------------

_R0 = RdzvState()

COORD_CASES: list[
    tuple[str, RdzvState, dict[str, NodeInfo], float, float | None, CoordinatorDecision]
] = [
    # (id, state, live node keys, now, last_call_deadline in, expected decision)
    # First formation.
    ("first: nobody", _R0, {}, 0.0, None, _wait(None)),
    ("first: below min waits without a timer", _R0, _nodes(1, "a"), 5.0, None, _wait(None)),
    ("first: min reached starts last call", _R0, _nodes(1, "ab"), 5.0, None, _wait(15.0)),
    ("first: below max keeps the running last call", _R0, _nodes(1, "abc"), 12.0, 15.0,
     _wait(15.0)),
    ("first: completes at max at once", _R0, _nodes(1, "dcba"), 5.0, None,
     _done(_complete("abcd"))),
    ("first: completes at the last-call deadline", _R0, _nodes(1, "ab"), 15.0, 15.0,
     _done(_complete("ab"))),
    ("first: completes past the last-call deadline", _R0, _nodes(1, "abc"), 40.0, 15.0,
     _done(_complete("abc"))),
    ("first: deadline resets when joiners fall below min", _R0, _nodes(1, "a"), 12.0, 15.0,
     _wait(None)),
    ("first: over-max joiners become the redundancy list", _R0, _nodes(1, "gfedcba"), 0.0, None,
     _done(_complete("abcd", redundant="efg"))),
    ("first: ranks follow arrival, not names", _R0, _nodes(1, "abxy"), 20.0, 15.0,
     _done(_complete("xyab"))),
    ("first: keys asking for another round are not joiners", _R0, _nodes(1, "a", b=2, c=3), 5.0,
     None, _wait(None)),
    # A re-opened round: a live participant of round 1 asked for round 2.
    ("reopen: all live participants back completes at once", _round1(), _nodes(2, "abc"), 5.0,
     None, _done(_complete("abc"))),
    ("reopen: all live participants back, one lost", _round1(), _nodes(2, "ab"), 5.0, None,
     _done(_complete("ab"))),
    ("reopen: all back with waiting newcomers", _round1(), _nodes(2, "abcd"), 5.0, None,
     _done(_complete("abcd"))),
    ("reopen: some back starts last call", _round1(), _nodes(2, "ab", c=1), 5.0, None,
     _wait(15.0, _act(K.ADD_TO_WAIT_LIST, "ab"))),
    ("reopen: some back completes at the deadline", _round1(wait_list=("a", "b")),
     _nodes(2, "ab", c=1), 15.0, 15.0, _done(_complete("ab"))),
    ("reopen: once one waits, the others back are not listed (no write per node)",
     _round1(wait_list=("a",)), _nodes(2, "ab", c=1), 5.0, None, _wait(15.0)),
    ("reopen: the one that waited left: the others back are listed",
     _round1(wait_list=("d",)), _nodes(2, "ab", c=1), 5.0, None,
     _wait(15.0, _act(K.REMOVE_FROM_WAIT_LIST, "d"), _act(K.ADD_TO_WAIT_LIST, "ab"))),
    ("reopen: a newcomer is listed though one waits", _round1(wait_list=("a",)),
     _nodes(2, "abd", c=1), 5.0, None, _wait(15.0, _act(K.ADD_TO_WAIT_LIST, "d"))),
    ("reopen: one back is below min", _round1(), _nodes(2, "a", b=1, c=1), 5.0, None,
     _wait(None, _act(K.ADD_TO_WAIT_LIST, "a"))),
    ("reopen: back below min, the others lost", _round1(), _nodes(2, "a"), 5.0, None,
     _wait(None, _act(K.REMOVE_FROM_PARTICIPANTS, "bc"), _act(K.ADD_TO_WAIT_LIST, "a"))),
    ("reopen: over-max joiners become the redundancy list", _round1(), _nodes(2, "abcde"), 5.0,
     None, _done(_complete("abcd", redundant="e"))),
    # Newcomers while the last round's participants are alive and none asked: they wait.
    ("not open: a newcomer goes to the wait list", _round1(), _nodes(2, "d", a=1, b=1, c=1),
     5.0, None, _wait(None, _act(K.ADD_TO_WAIT_LIST, "d"))),
    ("not open: even max newcomers only wait", _round1("ab"),
     _nodes(2, "cdef", a=1, b=1), 5.0, None, _wait(None, _act(K.ADD_TO_WAIT_LIST, "cdef"))),
    ("not open: listed newcomers are not listed again", _round1(wait_list=("d",)),
     _nodes(2, "d", a=1, b=1, c=1), 5.0, None, _wait(None)),
    ("not open: a running timer is dropped", _round1(), _nodes(2, "de", a=1, b=1, c=1), 30.0,
     15.0, _wait(None, _act(K.ADD_TO_WAIT_LIST, "de"))),
    # A round with no live participant left forms from whoever asks.
    ("orphaned: newcomers start last call", _round1("ab"), _nodes(2, "de"), 5.0, None,
     _wait(15.0, _act(K.REMOVE_FROM_PARTICIPANTS, "ab"), _act(K.ADD_TO_WAIT_LIST, "de"))),
    ("orphaned: newcomers complete at the deadline", _round1("ab", lost=("a", "b"),
     wait_list=("d", "e")), _nodes(2, "de"), 15.0, 15.0, _done(_complete("de"))),
    ("orphaned: newcomers complete at max at once", _round1("ab"), _nodes(2, "cdef"), 5.0, None,
     _done(_complete("cdef"))),
    # Bookkeeping of a completed round.
    ("lost participant is recorded", _round1(), _nodes(1, "ab"), 5.0, None,
     _wait(None, _act(K.REMOVE_FROM_PARTICIPANTS, "c"))),
    ("a lost participant is recorded once", _round1(lost=("c",)), _nodes(1, "ab"), 5.0, None,
     _wait(None)),
    ("gone waiting node is removed", _round1(wait_list=("d", "e")), _nodes(2, "e", a=1, b=1, c=1),
     5.0, None, _wait(None, _act(K.REMOVE_FROM_WAIT_LIST, "d"))),
    ("gone redundant node is removed", _round1("abcd", redundancy_list=("e", "f")),
     _nodes(1, "abcd", f=2), 5.0, None, _wait(None, _act(K.REMOVE_FROM_REDUNDANCY_LIST, "e"))),
    ("full round: newcomers go to the redundancy list", _round1("abcd"), _nodes(2, "fe", a=1, b=1,
     c=1, d=1), 5.0, None, _wait(None, _act(K.ADD_TO_REDUNDANCY_LIST, "ef"))),
    ("full round: a returning participant waits, a newcomer is redundant", _round1("abcd"),
     _nodes(2, "ae", b=1, c=1, d=1), 5.0, None,
     _wait(15.0, _act(K.ADD_TO_WAIT_LIST, "a"), _act(K.ADD_TO_REDUNDANCY_LIST, "e"))),
    ("full round with a loss: newcomers wait", _round1("abcd"), _nodes(2, "e", a=1, b=1, c=1),
     5.0, None, _wait(None, _act(K.REMOVE_FROM_PARTICIPANTS, "d"), _act(K.ADD_TO_WAIT_LIST, "e"))),
    ("every change in one decision", _round1("abcd", wait_list=("x",), redundancy_list=("y",)),
     _nodes(2, "e", a=1, b=1, c=1), 5.0, None,
     _wait(None, _act(K.REMOVE_FROM_PARTICIPANTS, "d"), _act(K.REMOVE_FROM_WAIT_LIST, "x"),
           _act(K.REMOVE_FROM_REDUNDANCY_LIST, "y"), _act(K.ADD_TO_WAIT_LIST, "e"))),
    # Closed.
    ("closed: no actions at max", RdzvState(closed=True), _nodes(1, "abcd"), 5.0, None,
     _wait(None)),
    ("closed: no bookkeeping", _round1(closed=True), _nodes(2, "de"), 50.0, 15.0, _wait(None)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("state", "nodes", "now", "deadline", "expected"),
    [c[1:] for c in COORD_CASES],
    ids=[c[0] for c in COORD_CASES],
)
def test_decide_coordinator(
    state: RdzvState,
    nodes: dict[str, NodeInfo],
    now: float,
    deadline: float | None,
    expected: CoordinatorDecision,
) -> None:
    assert decide_coordinator(state, nodes, LIM, now, deadline) == expected


RANK_CASES: list[tuple[str, RdzvState, dict[str, NodeInfo], tuple[str, ...]]] = [
    # (id, state of round 1, live keys asking for round 2, expected participants of round 2)
    ("survivors keep their order", _round1("cab"), _nodes(2, "abc"), ("c", "a", "b")),
    ("rank 0 stays put, newcomers follow by arrival", _round1("cab"), _nodes(2, "abcyx"),
     ("c", "a", "b", "x", "y")),
    ("rank 0 lost: survivors keep their relative order", _round1("cab"), _nodes(2, "bad"),
     ("a", "b", "d")),
    ("newcomers by arrival even with earlier names", _round1("gf"), _nodes(2, "gfba"),
     ("g", "f", "a", "b")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("state", "nodes", "expected"),
    [c[1:] for c in RANK_CASES],
    ids=[c[0] for c in RANK_CASES],
)
def test_rank_order_at_completion(
    state: RdzvState, nodes: dict[str, NodeInfo], expected: tuple[str, ...]
) -> None:
    limits = Limits(min_nodes=1, max_nodes=8, last_call_timeout=10.0)
    decision = decide_coordinator(state, nodes, limits, 100.0, 50.0)
    new = apply(state, decision.actions)
    assert new.round == 2
    assert new.participants == expected
    assert (new.master_addr, new.master_port) == (
        f"host-{expected[0]}",
        nodes[expected[0]].free_port,
    )


def test_last_call_runs_from_first_reaching_min_to_completion() -> None:
    """Follow one first formation through the deadline the decisions hand back."""
    state, deadline = RdzvState(), None
    timeline = [(0.0, "a"), (3.0, "ab"), (8.0, "a"), (9.0, "abc"), (18.9, "abc"), (19.0, "abc")]
    seen = []
    for now, names in timeline:
        decision = decide_coordinator(state, _nodes(1, names), LIM, now, deadline)
        deadline = decision.last_call_deadline
        seen.append((deadline, bool(decision.actions)))
        state = apply(state, decision.actions)
    # Min reached at 3 (deadline 13), lost at 8 (reset), reached again at 9 (deadline 19).
    assert seen == [(None, False), (13.0, False), (None, False), (19.0, False), (19.0, False),
                    (None, True)]  # fmt: skip
    assert state.round == 1
    assert state.participants == ("a", "b", "c")


# --- apply, close, num_waiting ---------------------------------------------------------

_BASE = RdzvState(
    round=3,
    participants=("a", "b", "c"),
    wait_list=("d",),
    redundancy_list=("e",),
    lost=("c",),
    master_addr="host-a",
    master_port=1,
    completed_at_unix_ms=5,
    written_by="a",
)

APPLY_CASES: list[tuple[str, Action, dict[str, object]]] = [
    ("wait list: add, no duplicates", _act(K.ADD_TO_WAIT_LIST, "fdg"),
     {"wait_list": ("d", "f", "g")}),
    ("redundancy list: add, no duplicates", _act(K.ADD_TO_REDUNDANCY_LIST, "ef"),
     {"redundancy_list": ("e", "f")}),
    ("lost participant is recorded, rank table kept", _act(K.REMOVE_FROM_PARTICIPANTS, "bc"),
     {"lost": ("c", "b")}),
    ("wait list: remove", _act(K.REMOVE_FROM_WAIT_LIST, "dz"), {"wait_list": ()}),
    ("redundancy list: remove", _act(K.REMOVE_FROM_REDUNDANCY_LIST, "e"),
     {"redundancy_list": ()}),
    ("complete: next round, lists reset", Action(K.MARK_RENDEZVOUS_COMPLETE, ("d", "a"),
     redundant=("e",), master_addr="host-d", master_port=7),
     {"round": 4, "participants": ("d", "a"), "wait_list": (), "redundancy_list": ("e",),
      "lost": (), "master_addr": "host-d", "master_port": 7, "completed_at_unix_ms": 99}),
    ("closed", Action(K.MARK_RENDEZVOUS_CLOSED, reason="training done", mode="drain"),
     {"closed": True, "closed_reason": "training done", "close_mode": "drain",
      "closed_at_unix_ms": 99}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("action", "changed"), [c[1:] for c in APPLY_CASES], ids=[c[0] for c in APPLY_CASES]
)
def test_apply(action: Action, changed: dict[str, object]) -> None:
    before = copy.deepcopy(_BASE)
    new = apply(_BASE, [action], now_unix_ms=99)
    assert before == _BASE  # the input is untouched
    expected = {**vars(_BASE), **changed}
    assert vars(new) == expected


def test_apply_records_the_writer_and_applies_in_order() -> None:
    actions = [
        _act(K.REMOVE_FROM_PARTICIPANTS, "a"),
        Action(K.MARK_RENDEZVOUS_COMPLETE, ("b",), master_addr="host-b", master_port=2),
        _act(K.ADD_TO_WAIT_LIST, "a"),
    ]
    before = copy.deepcopy(_BASE)
    new = apply(_BASE, actions, written_by="coord-1", now_unix_ms=123)
    assert before == _BASE
    assert (new.round, new.participants, new.lost, new.wait_list) == (4, ("b",), (), ("a",))
    assert (new.written_by, new.completed_at_unix_ms) == ("coord-1", 123)
    assert apply(_BASE, []) is _BASE
    assert apply(_BASE, [], written_by="").written_by == "a"


def test_close_is_idempotent() -> None:
    actions = close(_BASE, "operator stop")
    assert actions == (Action(K.MARK_RENDEZVOUS_CLOSED, reason="operator stop", mode="finished"),)
    assert close(_BASE, "ops", "drain")[0].mode == "drain"
    closed = apply(_BASE, actions)
    assert (closed.closed, closed.closed_reason) == (True, "operator stop")
    assert close(closed, "again") == ()
    assert apply(closed, close(closed, "again")) == closed
    assert decide_coordinator(closed, _nodes(4, "abcd"), LIM, 0.0, None) == _wait(None)


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (RdzvState(), 0),
        (RdzvState(round=1, participants=("a", "b"), redundancy_list=("e",)), 0),
        (RdzvState(round=1, participants=("a", "b"), wait_list=("d", "e")), 2),
        (RdzvState(round=1, participants=("a", "b"), lost=("b",)), 1),
        (RdzvState(round=1, participants=("a", "b"), wait_list=("a", "d"), lost=("b",)), 3),
    ],
    ids=["nothing", "redundant nodes do not count", "wait list", "lost", "wait list plus lost"],
)
def test_num_waiting(state: RdzvState, expected: int) -> None:
    assert state.num_waiting == expected


# --- incarnations: a run started again with the same id -----------------------------------

_ENDED = RdzvState(round=3, participants=("a", "b"), closed=True, closed_reason="done")


def _of(incarnation: int, nodes: dict[str, NodeInfo]) -> dict[str, NodeInfo]:
    return {k: dataclasses.replace(n, incarnation=incarnation) for k, n in nodes.items()}


@pytest.mark.parametrize(
    ("state", "incarnation", "wanted", "now", "expected"),
    [
        (_ENDED, 0, 0, 0.0, NodeAction.JOIN),  # a retry asks for incarnation 2...
        (_ENDED, 2, 4, 0.0, NodeAction.SYNC),  # ...and waits while the old nodes leave
        (_ENDED, 2, 4, 100.0, NodeAction.ERROR_TIMEOUT),  # bounded by join_timeout
        (_ENDED, 1, 3, 0.0, NodeAction.ERROR_CLOSED),  # a node of the closed incarnation
        (_ENDED, 1, 0, 0.0, NodeAction.ERROR_CLOSED),
        (RdzvState(round=3, incarnation=2), 1, 0, 0.0, NodeAction.ERROR_SUPERSEDED),
        (RdzvState(round=3, incarnation=2), 1, 4, 0.0, NodeAction.ERROR_SUPERSEDED),
        (RdzvState(round=3, incarnation=2), 3, 4, 0.0, NodeAction.ERROR_SUPERSEDED),  # reset
        (RdzvState(round=3, incarnation=2), 2, 4, 0.0, NodeAction.SYNC),
        (RdzvState(round=3, incarnation=2), 0, 0, 0.0, NodeAction.JOIN),
    ],
)
def test_decide_node_by_incarnation(
    state: RdzvState, incarnation: int, wanted: int, now: float, expected: NodeAction
) -> None:
    assert decide_node(state, "c", wanted, now, 100.0, incarnation) is expected


def test_a_node_joins_the_open_incarnation_or_the_next_one_of_a_closed_run() -> None:
    assert incarnation_to_join(RdzvState(round=3, incarnation=2)) == 2
    assert incarnation_to_join(_ENDED) == 2


def test_a_closed_run_starts_again_only_when_every_live_node_asks_for_the_next() -> None:
    fresh = _of(2, _nodes(4, "cd"))
    assert decide_coordinator(_ENDED, {}, LIM, 0.0, None) == _done()
    # A node of the closed incarnation is still shutting down: nothing yet.
    assert decide_coordinator(_ENDED, {**fresh, **_of(1, _nodes(3, "a"))}, LIM, 0.0, None) == (
        _done()
    )
    assert decide_coordinator(_ENDED, fresh, LIM, 0.0, None) == _done(Action(K.START_INCARNATION))
    started = apply(_ENDED, [Action(K.START_INCARNATION)], written_by="c", now_unix_ms=5)
    assert started == RdzvState(round=3, incarnation=2, written_by="c")
    # The new incarnation forms from its own nodes (rounds go on from 3); a late node of
    # incarnation 1 is not one of them.
    late = _of(1, _nodes(4, "x"))
    decision = decide_coordinator(started, {**fresh, **late}, LIM, 0.0, None)
    assert decision == _wait(10.0)
    assert decide_coordinator(started, {**fresh, **late}, LIM, 10.0, 10.0) == _done(_complete("cd"))


def test_nodes_of_another_incarnation_are_not_counted_alive() -> None:
    running = RdzvState(round=3, participants=("a", "b"), incarnation=2)
    nodes = {**_of(2, _nodes(3, "a")), **_of(1, _nodes(3, "b"))}
    decision = decide_coordinator(running, nodes, LIM, 0.0, None)
    assert decision == _done(_act(K.REMOVE_FROM_PARTICIPANTS, "b"))


def test_a_node_closes_only_its_own_incarnation() -> None:
    running = RdzvState(round=3, participants=("a",), incarnation=2)
    assert close(running, "late", "finished", incarnation=1) == ()
    assert close(running, "mine", "failed", incarnation=2) == (
        Action(K.MARK_RENDEZVOUS_CLOSED, reason="mine", mode="failed"),
    )


# --- spares and waiting nodes at the end of a job ------------------------------------------

_FULL = RdzvState(round=2, participants=("a", "b"), redundancy_list=("c",))


@pytest.mark.parametrize(
    ("state", "wanted", "now", "expected"),
    [
        (_FULL, 3, 500.0, NodeAction.SYNC),  # listed: no deadline
        # A round completed without it (still listed): it asks for the next, no timeout.
        (dataclasses.replace(_FULL, round=3), 3, 500.0, NodeAction.JOIN),
        (dataclasses.replace(_FULL, redundancy_list=()), 3, 500.0, NodeAction.ERROR_TIMEOUT),
    ],
)
def test_a_listed_spare_has_no_deadline(
    state: RdzvState, wanted: int, now: float, expected: NodeAction
) -> None:
    assert decide_node(state, "c", wanted, now, 100.0, 1) is expected


@pytest.mark.parametrize(
    ("mode", "node", "expected"),
    [
        ("finished", "c", NodeAction.EXIT_GRACEFULLY),  # a spare at the job's end
        ("drain", "c", NodeAction.EXIT_GRACEFULLY),
        ("finished", "d", NodeAction.EXIT_GRACEFULLY),  # wait-listed, or joining
        ("failed", "c", NodeAction.ERROR_CLOSED),  # the job failed: so does it
        ("finished", "a", NodeAction.ERROR_CLOSED),  # a participant re-rendezvousing
    ],
)
def test_a_node_outside_the_round_ends_gracefully_when_the_job_ends(
    mode: str, node: str, expected: NodeAction
) -> None:
    ended = dataclasses.replace(_FULL, closed=True, close_mode=mode, wait_list=("d",))
    assert decide_node(ended, node, 3, 0.0, 100.0, 1) is expected


def test_a_spare_does_not_take_the_place_of_a_live_participant_that_is_slower_to_rejoin() -> None:
    lim = Limits(min_nodes=2, max_nodes=2, last_call_timeout=10.0)
    running = RdzvState(round=1, participants=("a", "b"), redundancy_list=("c",))
    # a restarts first; c (the spare) asks for round 2 too: b is alive, so it is waited for.
    first = decide_coordinator(running, _nodes(2, "ac", b=1), lim, 0.0, None)
    assert first == _wait(10.0, _act(K.ADD_TO_WAIT_LIST, "a"))
    # b comes back: the round completes with the participants, c stays a spare.
    assert decide_coordinator(running, _nodes(2, "abc"), lim, 1.0, 10.0) == _done(
        _complete("ab", "c")
    )
    # b never comes back (alive, but stuck): last call ends and c takes its place.
    assert decide_coordinator(running, _nodes(2, "ac", b=1), lim, 10.0, 10.0) == _done(
        _complete("ac")
    )
    # b's key is gone (lost): c takes its place at once.
    assert decide_coordinator(running, _nodes(2, "ac"), lim, 0.0, None) == _done(_complete("ac"))


# --- drain: an operator asks one node to leave -----------------------------------------------


def test_a_drained_node_leaves_and_the_others_reform_without_it() -> None:
    running = RdzvState(round=1, participants=("a", "b", "c"))
    assert drain(running, "b") == (Action(K.ADD_TO_DRAINING, ("b",)),)
    asked = apply(running, drain(running, "b"))
    assert asked.draining == ("b",) and drain(asked, "b") == ()
    # Its agent learns it from the state (so do the others: it counts as waiting).
    assert decide_node(asked, "b", 0, 0.0, 100.0, 1) is NodeAction.EXIT_GRACEFULLY
    assert asked.num_waiting == 1
    # The coordinator counts it out at once: lost for this round, never a joiner again.
    assert decide_coordinator(asked, _nodes(1, "abc"), LIM, 0.0, None) == _done(
        _act(K.REMOVE_FROM_PARTICIPANTS, "b")
    )
    lost = apply(asked, [_act(K.REMOVE_FROM_PARTICIPANTS, "b")])
    assert lost.num_waiting == 1  # not counted twice
    assert decide_coordinator(lost, _nodes(2, "acb"), LIM, 0.0, None) == _done(_complete("ac"))
    # Once its key is gone it leaves the list.
    done = apply(lost, [_complete("ac")])
    assert decide_coordinator(done, _nodes(2, "ac"), LIM, 0.0, None) == _done(
        _act(K.REMOVE_FROM_DRAINING, "b")
    )
    forming = RdzvState(draining=("x",))
    assert decide_coordinator(forming, _nodes(1, "a"), LIM, 0.0, None) == _done(
        _act(K.REMOVE_FROM_DRAINING, "x")
    )


def test_a_restart_of_n_nodes_coming_back_one_by_one_commits_twice_not_n_times() -> None:
    """Each commit is a state write that every node hears: one per returning node was
    O(N) writes and O(N²) watch events per restart (2,175 events at N = 64)."""
    n = 50
    ids = tuple(f"n{i:02d}" for i in range(n))
    state = RdzvState(round=1, participants=ids)
    nodes = {node: NodeInfo(node, 1, create_revision=i + 1) for i, node in enumerate(ids)}
    limits = Limits(n, n, 30.0)
    commits = []
    deadline: float | None = None
    for node in ids:  # the first node's worker failed; the others follow one by one
        nodes[node] = dataclasses.replace(nodes[node], wanted_round=2)
        decision = decide_coordinator(state, nodes, limits, 1.0, deadline)
        deadline = decision.last_call_deadline
        if decision.actions:
            commits.append(tuple(a.kind for a in decision.actions))
            state = apply(state, decision.actions)
    assert commits == [(K.ADD_TO_WAIT_LIST,), (K.MARK_RENDEZVOUS_COMPLETE,)]
    assert state.round == 2 and state.participants == ids and state.wait_list == ()
