"""Pure rules of hang detection: who stopped first, when a node publishes, the fold of
its workers' slots, the state's one hang per round, and the stored forms."""

from __future__ import annotations

import json

import pytest

from agent.health.hang_rules import (
    LocalProgress,
    Published,
    fold,
    hang_line,
    publish_due,
    tick_seconds,
    track,
)
from coordinator.core.errors import CorruptValueError
from coordinator.core.progress import (
    Blame,
    NodeProgress,
    decode_progress,
    encode_progress,
    who_stopped_first,
)
from coordinator.core.state import Hang, RdzvState, decode_state, encode_state
from coordinator.core.transitions import Action, ActionKind, apply, declare_hang

KEY = "/etcd-elastic/job42/state"
PKEY = "/etcd-elastic/job42/progress/b-2-0"


def _p(node: str, step: int, round: int = 3) -> NodeProgress:
    return NodeProgress(node_id=node, round=round, step=step)


# (declarer, its own step, records as node -> (step, round), expected blame)
BLAME = [
    # b stopped inside step 41 after the collective: the others finished 41 and wait.
    ("a", 41, {"a": (40, 3), "b": (40, 3), "c": (41, 3)}, Blame(("b",), 40, True)),
    # two nodes behind: both named
    ("c", 41, {"a": (40, 3), "b": (40, 3)}, Blame(("a", "b"), 40, True)),
    ("c", 41, {"a": (41, 3), "b": (40, 3), "c": (41, 3)}, Blame(("b",), 40, True)),
    # the declarer's own step is fresher than its record
    ("a", 42, {"a": (40, 3), "b": (41, 3)}, Blame(("b",), 41, True)),
    # every node at the same step: progress cannot tell; the first to time out is named
    ("b", 40, {"a": (40, 3), "b": (40, 3), "c": (40, 3)}, Blame(("b",), 40, False)),
    # alone in the run
    ("a", 7, {}, Blame(("a",), 7, False)),
    # a record of an older round (a node that has not reported yet) does not count
    ("a", 5, {"b": (900, 2), "c": (6, 3)}, Blame(("a",), 5, True)),
    ("a", 5, {"b": (1, 2)}, Blame(("a",), 5, False)),
]  # fmt: skip


@pytest.mark.parametrize(("declarer", "own", "records", "expected"), BLAME)
def test_who_stopped_first(
    declarer: str, own: int, records: dict[str, tuple[int, int]], expected: Blame
) -> None:
    got = who_stopped_first(
        declarer, own, {n: _p(n, s, r) for n, (s, r) in records.items()}, round=3
    )
    assert got == expected


def test_fold_judges_running_workers_that_reported() -> None:
    slots = [(10, 4, 5_000), None, (9, 3, 7_000), (3, 1, 1_000)]
    # rank 3 exited (not running); rank 1 never reported
    assert fold(slots, frozenset({0, 1, 2})) == LocalProgress(step=9, last_ns=5_000, reporting=2)
    assert fold(slots, frozenset({1})) is None
    assert fold(slots, frozenset()) is None
    assert fold([None, None], frozenset({0, 1})) is None


PUBLISH = [
    (None, 5, False, 0.0, True),  # first report of the round
    (Published(5, False, 10.0), 5, False, 99.0, False),  # nothing new: no write
    (Published(5, False, 10.0), 6, False, 10.5, False),  # new step, too soon
    (Published(5, False, 10.0), 6, False, 11.0, True),  # new step, interval passed
    (Published(5, False, 10.0), 5, True, 10.1, True),  # stalled: at once
    (Published(5, True, 10.0), 5, False, 10.1, True),  # progress again: at once
]  # fmt: skip


@pytest.mark.parametrize(("last", "step", "stalled", "now", "due"), PUBLISH)
def test_publish_due(
    last: Published | None, step: int, stalled: bool, now: float, due: bool
) -> None:
    assert publish_due(last, step, stalled, now, interval=1.0) is due


def test_tick_is_a_quarter_of_the_timeout_at_most_a_quarter_second() -> None:
    assert tick_seconds(None) == 0.25
    assert tick_seconds(1.0) == 0.25
    assert tick_seconds(0.4) == 0.1


def test_track_notes_when_each_worker_last_called_on_the_agents_clock() -> None:
    seen = track([], [None, (5, 1)], now_ns=100)
    assert seen == [None, (5, 1, 100)]
    seen = track(seen, [(3, 1), (5, 1)], now_ns=200)  # rank 0 reports, rank 1 did not call
    assert seen == [(3, 1, 200), (5, 1, 100)]
    # rank 1 called again with the same step (an evaluation loop): progress all the same
    seen = track(seen, [(4, 2), (5, 2)], now_ns=300)
    assert seen == [(4, 2, 300), (5, 2, 300)]
    # a new step read before its count (the two stores are not one): seen at the count
    assert track(seen, [(6, 2), (5, 2)], now_ns=350) == [(6, 2, 300), (5, 2, 300)]
    assert track(seen, [None, (5, 2)], now_ns=400) == [None, (5, 2, 300)]  # reset


def test_hang_line_names_the_nodes_and_says_how_sure() -> None:
    behind = Hang(4, ("b",), 40, True, "a", 3400)
    assert hang_line(behind) == (
        "hang in round 4: node(s) [b] stopped first: behind the others at step 40 "
        "(declared by a after 3.4 s without progress)"
    )
    tie = Hang(4, ("b",), 40, False, "b", 3100)
    assert hang_line(tie) == (
        "hang in round 4: node(s) [b] stopped first: no reporting node is behind the others "
        "(all at step 40), and b reached the timeout first (declared by b after 3.1 s "
        "without progress)"
    )


_STATE = RdzvState(round=3, participants=("a", "b"))
_HANG = Hang(3, ("b",), 40, True, "a", 3400, 1795272739909)


def test_one_hang_per_round_and_only_in_the_current_round() -> None:
    actions = declare_hang(_STATE, _HANG)
    assert [a.kind for a in actions] == [ActionKind.DECLARE_HANG]
    declared = apply(_STATE, actions)
    assert declared.hang == _HANG
    # a second node declaring in the same round follows the first
    assert declare_hang(declared, Hang(3, ("a",), 41, False, "b")) == ()
    # the round moved on: that hang is over
    assert declare_hang(RdzvState(round=4), _HANG) == ()
    # a closed run: nothing to restart
    assert declare_hang(RdzvState(round=3, closed=True), _HANG) == ()
    # the next round's hang replaces the last one; completing a round keeps it as history
    later = RdzvState(round=4, hang=_HANG)
    nxt = Hang(4, ("a",), 90, False, "a")
    assert apply(later, declare_hang(later, nxt)).hang == nxt
    complete = apply(declared, [Action(ActionKind.MARK_RENDEZVOUS_COMPLETE, ("a", "b"))])
    assert complete.round == 4 and complete.hang == _HANG


def test_the_hang_is_stored_readably_and_round_trips() -> None:
    state = RdzvState(round=3, participants=("a", "b"), hang=_HANG)
    raw = encode_state(state)
    assert json.loads(raw)["hang"] == {
        "round": "3", "nodes": ["b"], "step": "40", "behind": True, "declared_by": "a",
        "stalled_ms": "3400", "declared_at_unix_ms": "1795272739909",
    }  # fmt: skip
    assert decode_state(KEY, raw) == state
    # no hang: no field at all (agents that predate hang detection read it as before)
    assert "hang" not in json.loads(encode_state(RdzvState(round=3)))


def test_a_hang_without_nodes_is_refused() -> None:
    raw = json.loads(encode_state(_STATE))
    raw["hang"] = {"round": "3", "step": "1"}
    with pytest.raises(CorruptValueError, match="hang of round 3 names no node"):
        decode_state(KEY, json.dumps(raw).encode())


def test_progress_round_trips_and_refuses_garbage() -> None:
    record = NodeProgress("b-2-0", 3, 41, 1200, 1795272739909, 2, 2, True, 3000)
    raw = encode_progress(record)
    assert json.loads(raw)["step"] == "41"
    assert decode_progress(PKEY, raw) == record
    with pytest.raises(CorruptValueError, match="not a NodeProgress in JSON"):
        decode_progress(PKEY, b"{not json")
    bad = json.loads(raw)
    bad["age_ms"] = "-1"
    with pytest.raises(CorruptValueError, match="negative round, age_ms or workers_reporting"):
        decode_progress(PKEY, json.dumps(bad).encode())
