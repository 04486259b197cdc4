"""Pure rules of hang detection: who stopped first, when a node suspects a hang and what
it writes or deletes, when a failed declaration is tried again, the fold of its workers'
slots, the state's one hang per round, and the stored forms."""

from __future__ import annotations

import json

import pytest

from agent.health.hang_rules import (
    LocalProgress,
    RecordOp,
    Suspicion,
    declare_retry_seconds,
    fold,
    hang_line,
    record_op,
    suspect_after_ns,
    suspicion,
    tick_seconds,
    track,
)
from coordinator.core.actions import Action, ActionKind, apply, declare_hang
from coordinator.core.errors import CorruptValueError
from coordinator.core.progress import (
    Blame,
    NodeProgress,
    decode_progress,
    encode_progress,
    who_stopped_first,
)
from coordinator.core.state import Hang, RdzvState, decode_state, encode_state

KEY = "/etcd-elastic/job42/state"
PKEY = "/etcd-elastic/job42/progress/b-2-0"


def _p(node: str, step: int, round: int = 3, stalled: bool = True) -> NodeProgress:
    return NodeProgress(node_id=node, round=round, step=step, stalled=stalled)


# (declarer, its own step, suspicions as node -> (step, round), the round's nodes,
#  expected blame). A node of the round without a record was not stalled.
BLAME = [
    # b stopped inside step 41 after the collective: the others finished 41 and wait.
    ("a", 41, {"a": (41, 3), "b": (40, 3), "c": (41, 3)}, "abc", Blame(("b",), 40, True)),
    # two nodes behind: both named
    ("c", 41, {"a": (40, 3), "b": (40, 3)}, "abc", Blame(("a", "b"), 40, True)),
    # the declarer's own step is fresher than its record
    ("a", 42, {"a": (40, 3), "b": (41, 3)}, "ab", Blame(("b",), 41, True)),
    # every node stalled at the same step: progress cannot tell; the first to time out
    ("b", 40, {"a": (40, 3), "b": (40, 3), "c": (40, 3)}, "abc", Blame(("b",), 40, False)),
    # the others went on (no suspicion of theirs): the stalled node is behind them
    ("b", 29, {"b": (29, 3)}, "ab", Blame(("b",), 29, True)),
    # so are two stalled nodes while a third went on
    ("b", 29, {"a": (29, 3), "b": (29, 3)}, "abc", Blame(("a", "b"), 29, True)),
    # the others of a long step stalled a step later and did not suspect yet
    ("a", 7, {}, "abc", Blame(("a",), 7, True)),
    # alone in the run, or the round's nodes unknown: a tie
    ("a", 7, {}, "a", Blame(("a",), 7, False)),
    ("a", 7, {"b": (7, 3)}, "", Blame(("a",), 7, False)),
    # a record of an older round (it made progress since, in a new round) does not count
    ("a", 5, {"b": (900, 2), "c": (6, 3)}, "ac", Blame(("a",), 5, True)),
    ("a", 5, {"b": (1, 2)}, "", Blame(("a",), 5, False)),
]  # fmt: skip


@pytest.mark.parametrize(("declarer", "own", "records", "nodes", "expected"), BLAME)
def test_who_stopped_first(
    declarer: str, own: int, records: dict[str, tuple[int, int]], nodes: str, expected: Blame
) -> None:
    got = who_stopped_first(
        declarer, own, {n: _p(n, s, r) for n, (s, r) in records.items()}, 3, tuple(nodes)
    )
    assert got == expected


def test_a_record_that_is_no_suspicion_does_not_count() -> None:
    # An agent of an earlier version published healthy nodes too, with stalled false.
    records = {"a": _p("a", 40), "b": _p("b", 12, stalled=False)}
    assert who_stopped_first("a", 40, records, 3, ("a", "b")) == Blame(("a",), 40, True)
    assert who_stopped_first("a", 40, records, 3, ("a",)) == Blame(("a",), 40, False)


def test_fold_judges_running_workers_that_reported() -> None:
    slots = [(10, 4, 5_000), None, (9, 3, 7_000), (3, 1, 1_000)]
    # rank 3 exited (not running); rank 1 never reported
    assert fold(slots, frozenset({0, 1, 2})) == LocalProgress(step=9, last_ns=5_000, reporting=2)
    assert fold(slots, frozenset({1})) is None
    assert fold(slots, frozenset()) is None
    assert fold([None, None], frozenset({0, 1})) is None


S = 1_000_000_000  # ns


def test_a_node_suspects_at_the_timeout_less_half_of_it_at_most_10_s() -> None:
    assert suspect_after_ns(3 * S) == 3 * S // 2
    assert suspect_after_ns(1 * S) == S // 2
    assert suspect_after_ns(20 * S) == 10 * S
    assert suspect_after_ns(120 * S) == 110 * S


_LOCAL = LocalProgress(step=29, last_ns=0, reporting=2)

SUSPICION = [
    # (local progress, silence, suspect after, the record wanted)
    (_LOCAL, 2 * S, 3 * S, None),  # not long enough
    (_LOCAL, 3 * S, 3 * S, Suspicion(4, 29)),
    (_LOCAL, 9 * S, None, None),  # detection off: never
    (None, 9 * S, 3 * S, None),  # no running worker reported: not judged
]  # fmt: skip


@pytest.mark.parametrize(("local", "silent", "after", "wanted"), SUSPICION)
def test_suspicion(
    local: LocalProgress | None, silent: int, after: int | None, wanted: Suspicion | None
) -> None:
    assert suspicion(4, local, silent, after) == wanted


RECORD = [
    # (written, wanted, round judged, what to do)
    (None, None, 4, RecordOp.KEEP),  # healthy: nothing, ever
    (None, Suspicion(4, 29), 4, RecordOp.WRITE),  # begins to suspect: one write
    (Suspicion(4, 29), Suspicion(4, 29), 4, RecordOp.KEEP),  # still: nothing more
    (Suspicion(4, 29), Suspicion(4, 31), 4, RecordOp.WRITE),  # a worker moved, one did not
    (Suspicion(4, 29), None, 4, RecordOp.DELETE),  # progress again: one delete
    (Suspicion(3, 29), None, 4, RecordOp.KEEP),  # last round's: left as it is
    (Suspicion(3, 29), Suspicion(4, 2), 4, RecordOp.WRITE),  # suspects again: replaced
    (Suspicion(4, 29), None, None, RecordOp.KEEP),  # workers being stopped: left
]  # fmt: skip


@pytest.mark.parametrize(("written", "wanted", "round", "op"), RECORD)
def test_record_op_writes_only_on_a_change(
    written: Suspicion | None, wanted: Suspicion | None, round: int | None, op: RecordOp
) -> None:
    assert record_op(written, wanted, round) is op


def test_a_failed_declaration_is_retried_after_a_bounded_backoff() -> None:
    # jitter 0.999...: the top of each step's range; 0: half of it
    top = [round(declare_retry_seconds(n, 0.9999), 2) for n in range(1, 7)]
    assert top == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    assert declare_retry_seconds(1, 0.0) == 0.125
    assert declare_retry_seconds(50, 0.0) == 1.0


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
