"""The coordinator decides from counts kept as keys change: same decisions as from scratch.

``decide_coordinator`` takes its decision from a :class:`Tally` (counts of the node keys
against the state) and scans the keys only to build a commit. These tests pin the counts
case by case, then check with Hypothesis that

* the counts kept incrementally (:class:`TallyIndex`, and the coordinator's
  :class:`NodeTable` fed with watch events) always equal the counts from scratch, and
* the decision taken from them equals the decision of the code before this change
  (``decide_reference.py``, kept verbatim), for any state, keys, limits and time.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.core.etcd_client import KeyValue, WatchEvent
from coordinator.core.node_table import NodeTable
from coordinator.core.state import NodeInfo, RdzvState, encode_node
from coordinator.core.tally import Tally, TallyIndex, tally_of
from coordinator.core.transitions import Limits, decide_coordinator
from tests.unit.decide_reference import reference_decide

SETTINGS = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
IDS = [f"n{i}" for i in range(8)]
PREFIX = b"/p/run/nodes/"


def _node(node_id: str, wanted: int, incarnation: int = 1, created: int = 0) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        wanted_round=wanted,
        addr=f"h-{node_id}",
        free_port=1000 + int(node_id[1:]),
        incarnation=incarnation,
        create_revision=created or 10 + int(node_id[1:]),
    )


# -- case by case ----------------------------------------------------------------------


def test_first_formation_counts_the_joiners_only() -> None:
    nodes = {n: _node(n, 1) for n in ("n0", "n1")} | {"n2": _node("n2", 0)}
    assert tally_of(RdzvState(), nodes) == Tally(total=3, joiners=2, unlisted_joiners=2)


def test_a_completed_round_counts_survivors_lost_and_lists() -> None:
    state = RdzvState(
        round=1,
        participants=("n0", "n1", "n2"),
        lost=("n2",),
        wait_list=("n3", "n4"),
        redundancy_list=("n5",),
        draining=("n6",),
    )
    nodes = {
        "n0": _node("n0", 2),  # a survivor re-joined
        "n1": _node("n1", 1),  # a survivor still running round 1
        "n3": _node("n3", 2),  # listed, still here
        "n6": _node("n6", 2),  # draining: alive but not eligible
        "n7": _node("n7", 2),  # a newcomer not listed yet
    }
    # n2 was lost already (not newly); n4 and n5 left their lists; n0 and n7 and n3 join;
    # n0 is a returning participant not listed; n3 waits, alive.
    assert tally_of(state, nodes) == Tally(
        total=5,
        joiners=3,
        live_prev=2,
        prev_joined=1,
        unlisted_joiners=2,
        gone_listed=2,
        newly_lost=0,
        left_draining=0,
        unlisted_returning=1,
        waiting_live=1,
    )


def test_a_closed_run_counts_the_next_incarnation_and_a_drained_node_that_left() -> None:
    state = RdzvState(round=3, closed=True, incarnation=2, draining=("n5",))
    nodes = {"n0": _node("n0", 4, incarnation=3), "n1": _node("n1", 3, incarnation=2)}
    assert tally_of(state, nodes) == Tally(total=2, next_incarnation=1, left_draining=1)


def test_a_participant_of_another_incarnation_counts_as_newly_lost() -> None:
    state = RdzvState(round=1, participants=("n0", "n1"), incarnation=2)
    nodes = {"n0": _node("n0", 2, incarnation=2), "n1": _node("n1", 2, incarnation=1)}
    tally = tally_of(state, nodes)
    assert (tally.live_prev, tally.prev_joined, tally.newly_lost) == (1, 1, 1)


def test_the_index_recounts_only_for_a_new_state() -> None:
    index = TallyIndex()
    nodes: dict[str, NodeInfo] = {}
    state = RdzvState()
    assert index.tally(state, nodes) == Tally()
    for node_id in IDS[:3]:
        node = _node(node_id, 1)
        nodes[node_id] = node
        index.changed(node_id, None, node)
    assert index.tally(state, nodes) == Tally(total=3, joiners=3, unlisted_joiners=3)
    # A new state (round 1 formed with n0, n1): the same keys count differently.
    formed = RdzvState(round=1, participants=("n0", "n1"))
    assert index.tally(formed, nodes) == Tally(total=3, live_prev=2)
    old = nodes.pop("n1")
    index.changed("n1", old, None)
    assert index.tally(formed, nodes) == Tally(total=2, live_prev=1, newly_lost=1)


def test_a_forgotten_index_counts_nothing_until_asked_again() -> None:
    index = TallyIndex()
    nodes = {"n0": _node("n0", 1)}
    state = RdzvState()
    assert index.tally(state, nodes).joiners == 1
    index.forget()
    index.changed("n1", None, _node("n1", 1))  # ignored: no basis
    nodes["n1"] = _node("n1", 1)
    assert index.tally(state, nodes).joiners == 2  # recounted from the table


def test_the_node_table_keeps_its_tally_with_the_events() -> None:
    table = NodeTable()
    state = RdzvState()
    table.load([_kv(_node("n0", 1), 3)], 3)
    assert table.tally(state) == Tally(total=1, joiners=1, unlisted_joiners=1)
    table.apply([_event(_node("n1", 1), 4), _event(_node("n0", 0), 5)])
    assert table.tally(state) == tally_of(state, table.snapshot())
    assert table.tally(state) == Tally(total=2, joiners=1, unlisted_joiners=1)
    table.apply([WatchEvent("delete", KeyValue(PREFIX + b"n1", b"", 0, 6, 0, 0), None)])
    assert table.tally(state) == Tally(total=1)
    assert dict(table.nodes) == table.snapshot()


# -- properties ------------------------------------------------------------------------


@st.composite
def states(draw: st.DrawFn) -> RdzvState:
    round_ = draw(st.integers(0, 3))
    ids = st.sampled_from(IDS)
    participants = draw(st.lists(ids, max_size=6, unique=True)) if round_ else []
    # The lists may repeat a name: a hand-written state could, and every entry counts.
    return RdzvState(
        round=round_,
        closed=draw(st.booleans()),
        participants=tuple(participants),
        wait_list=tuple(draw(st.lists(ids, max_size=4))),
        redundancy_list=tuple(draw(st.lists(ids, max_size=3))),
        lost=tuple(draw(st.lists(st.sampled_from(participants or IDS), max_size=3))),
        incarnation=draw(st.integers(1, 2)),
        draining=tuple(draw(st.lists(ids, max_size=2))),
    )


@st.composite
def records(draw: st.DrawFn, node_id: str) -> NodeInfo:
    return _node(
        node_id,
        wanted=draw(st.integers(0, 4)),
        incarnation=draw(st.integers(1, 3)),
        created=draw(st.integers(1, 40)),
    )


@st.composite
def node_tables(draw: st.DrawFn) -> dict[str, NodeInfo]:
    present = draw(st.lists(st.sampled_from(IDS), max_size=len(IDS), unique=True))
    return {n: draw(records(n)) for n in present}


LIMITS = st.builds(
    lambda lo, extra, call: Limits(lo, lo + extra, call),
    st.integers(1, 5),
    st.integers(0, 4),
    st.sampled_from([0.0, 5.0]),
)
NOW = st.sampled_from([0.0, 4.0, 10.0])
DEADLINES = st.sampled_from([None, 3.0, 12.0])


def _same_decision(
    state: RdzvState,
    nodes: dict[str, NodeInfo],
    tally: Tally,
    limits: Limits,
    now: float,
    deadline: float | None,
) -> None:
    expected = reference_decide(state, nodes, limits, now, deadline)
    assert decide_coordinator(state, nodes, limits, now, deadline, tally=tally) == expected
    assert decide_coordinator(state, nodes, limits, now, deadline) == expected


@SETTINGS
@given(states(), node_tables(), LIMITS, NOW, DEADLINES)
def test_the_counted_decision_is_the_old_decision(
    state: RdzvState,
    nodes: dict[str, NodeInfo],
    limits: Limits,
    now: float,
    deadline: float | None,
) -> None:
    _same_decision(state, nodes, tally_of(state, nodes), limits, now, deadline)


_STEP = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(IDS), st.integers(0, 4), st.integers(1, 3)),
    st.tuples(st.just("delete"), st.sampled_from(IDS), st.just(0), st.just(0)),
    st.tuples(st.just("state"), st.just(""), st.just(0), st.just(0)),
)


@SETTINGS
@given(st.data(), st.lists(_STEP, min_size=1, max_size=30), LIMITS, NOW, DEADLINES)
def test_counts_kept_per_change_equal_counts_from_scratch(
    data: st.DataObject,
    steps: list[tuple[str, str, int, int]],
    limits: Limits,
    now: float,
    deadline: float | None,
) -> None:
    index = TallyIndex()
    table = NodeTable()
    table.load([], 1)
    nodes: dict[str, NodeInfo] = {}
    state = data.draw(states())
    revision = 1
    for kind, node_id, wanted, incarnation in steps:
        revision += 1
        if kind == "state":
            state = data.draw(states())
        elif kind == "put":
            created = nodes[node_id].create_revision if node_id in nodes else revision
            new = _node(node_id, wanted, incarnation, created)
            index.changed(node_id, nodes.get(node_id), new)
            nodes[node_id] = new
            table.apply([_event(new, revision)])
        else:
            index.changed(node_id, nodes.pop(node_id, None), None)
            key = PREFIX + node_id.encode()
            table.apply([WatchEvent("delete", KeyValue(key, b"", 0, revision, 0, 0), None)])
        expected = tally_of(state, nodes)
        assert index.tally(state, nodes) == expected
        assert table.tally(state) == expected
        assert table.snapshot() == nodes
        _same_decision(state, nodes, table.tally(state), limits, now, deadline)


def test_the_decision_of_a_large_formation_needs_no_scan_until_it_commits() -> None:
    # 1,000 joins decided one by one: each decision sees the counts, not the keys (a
    # mapping that refuses to be read proves it), until the last join completes the round.
    limits = Limits(1000, 1000, 1.0)
    state = RdzvState()
    table = NodeTable()
    table.load([], 1)

    class Sealed(dict[str, NodeInfo]):
        def _refuse(self, *_: object) -> None:
            raise AssertionError("the decision scanned the node keys")

        items = values = keys = __iter__ = __getitem__ = __contains__ = _refuse  # type: ignore[assignment]

    for i in range(999):
        table.apply([_event(_node(f"n{i}", 1, created=i + 2), i + 2)])
        decision = decide_coordinator(state, Sealed(), limits, 0.0, None, table.tally(state))
        assert decision.actions == () and decision.wake_at == math.inf
    table.apply([_event(_node("n999", 1, created=1001), 1001)])
    decision = decide_coordinator(state, table.nodes, limits, 0.0, None, table.tally(state))
    (complete,) = decision.actions
    assert complete.node_ids == tuple(f"n{i}" for i in range(1000))


def _kv(node: NodeInfo, revision: int) -> KeyValue:
    key = PREFIX + node.node_id.encode()
    return KeyValue(key, encode_node(node), node.create_revision or revision, revision, 1, 7)


def _event(node: NodeInfo, revision: int) -> WatchEvent:
    return WatchEvent("put", _kv(node, revision), None)
