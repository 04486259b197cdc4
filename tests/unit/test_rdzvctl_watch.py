"""``rdzvctl watch``'s tracker: etcd events in, the operator's lines out (pure)."""

from __future__ import annotations

import dataclasses

from coordinator.core.etcd_client import KeyValue, WatchEvent
from coordinator.core.state import NodeInfo, RdzvState, encode_node, encode_state
from coordinator.rdzvctl.watch import Change, Tracker, diff_states
from tests.unit.rdzvctl_samples import KEYS, LIVE, ROUND1, snap

# -- watch ---------------------------------------------------------------------------


def kv(key: bytes, value: bytes, rev: int) -> KeyValue:
    return KeyValue(key, value, rev, rev, 1, 0)


def put_state(state: RdzvState, rev: int) -> WatchEvent:
    return WatchEvent("put", kv(KEYS.state, encode_state(state), rev), None)


def put_node(node_id: str, wanted: int, rev: int) -> WatchEvent:
    record = encode_node(NodeInfo(node_id=node_id, wanted_round=wanted))
    return WatchEvent("put", kv(KEYS.node(node_id), record, rev), None)


def delete(key: bytes, rev: int) -> WatchEvent:
    return WatchEvent("delete", kv(key, b"", rev), None)


def texts(changes: list[Change]) -> list[str]:
    return [c.text for c in changes]


def test_tracker_turns_events_into_lines() -> None:
    tracker = Tracker(snap(None, rev=10))
    # What the read at revision 10 holds is not news: the watch may still deliver it.
    assert tracker.apply([put_node("z-9-0", 1, 10)]) == []
    assert texts(tracker.apply([put_node("a-1-0", 1, 11), put_node("b-2-0", 1, 12)])) == [
        "node a-1-0 joined (asks for round 1)",
        "node b-2-0 joined (asks for round 1)",
    ]
    round1 = RdzvState(round=1, participants=("a-1-0", "b-2-0"), written_by="a-1-0")
    changes = tracker.apply([put_state(round1, 13)])
    assert texts(changes) == ["round 1 complete: 2 nodes [a-1-0 b-2-0]"]
    assert changes[0].nodes == ("a-1-0", "b-2-0") and changes[0].round == 1
    # Store keys are the agents' business: no line.
    store = WatchEvent("put", kv(KEYS.store_key(1, "x"), b"1", 14), None)
    assert tracker.apply([store]) == []
    waiting = RdzvState(**{**round1.__dict__, "wait_list": ("c-3-0",)})
    assert texts(tracker.apply([put_node("c-3-0", 2, 15), put_state(waiting, 16)])) == [
        "node c-3-0 joined (asks for round 2)",
        "node c-3-0 waits for round 2",
    ]
    lost = RdzvState(**{**waiting.__dict__, "lost": ("b-2-0",)})
    assert texts(tracker.apply([delete(KEYS.node("b-2-0"), 17), put_state(lost, 18)])) == [
        "node b-2-0 left (its key is gone: lease revoked or expired)",
        "node b-2-0 lost (rank 1 of round 1)",
    ]
    assert texts(tracker.apply([put_node("a-1-0", 2, 19)])) == ["node a-1-0 asks for round 2"]
    closed = RdzvState(**{**lost.__dict__, "closed": True, "closed_reason": "maintenance"})
    assert texts(tracker.apply([put_state(closed, 20)])) == ["run closed (maintenance)"]
    assert texts(tracker.apply([put_state(closed, 21)])) == ["state rewritten by a-1-0 (round 1)"]
    assert texts(tracker.apply([delete(KEYS.state, 22)])) == [
        "state key deleted (the run was garbage-collected or reset)"
    ]


def test_tracker_skips_what_the_snapshot_already_holds_and_reports_bad_values() -> None:
    tracker = Tracker(snap(ROUND1, LIVE, rev=20))
    assert tracker.apply([put_state(ROUND1, 20), put_node("a-1-0", 1, 19)]) == []
    bad = WatchEvent("put", kv(KEYS.state, b"\x80pickle", 21), None)
    assert texts(tracker.apply([bad])) == [
        "corrupt value at etcd key '/etcd-elastic/demo/state': not a RendezvousState in JSON "
        "('utf-8' codec can't decode byte 0x80 in position 0: invalid start byte)"
    ]
    foreign = WatchEvent("put", kv(b"/etcd-elastic/demo/zz", b"1", 22), None)
    assert texts(tracker.apply([foreign])) == ["key /etcd-elastic/demo/zz written (not ours)"]


def test_diff_states_lists_redundant_nodes_and_round_change() -> None:
    new = RdzvState(round=2, participants=("a", "b"), redundancy_list=("c",))
    assert texts(diff_states(ROUND1, new, 5)) == ["round 2 complete: 2 nodes [a b], redundant [c]"]
    full = RdzvState(**{**ROUND1.__dict__, "redundancy_list": ("d",)})
    assert texts(diff_states(ROUND1, full, 6)) == ["node d is redundant (round 1 is full)"]
    assert texts(diff_states(full, ROUND1, 7)) == ["node d left the redundancy list"]


def test_tracker_resync_summarises_what_was_missed() -> None:
    tracker = Tracker(snap(ROUND1, LIVE[:2], rev=20))
    round2 = RdzvState(round=2, participants=("b-2-0", "c-3-0"))
    changes = tracker.resync(snap(round2, LIVE[1:], rev=90))
    assert texts(changes) == [
        "watch history compacted; re-read at 90",
        "node a-1-0 left (its key is gone: lease revoked or expired)",
        "node c-3-0 joined (asks for round 1)",
        "round 2 complete: 2 nodes [b-2-0 c-3-0]",
    ]
    # The fresh read's revision is the new horizon: 90 is in it, 91 is news.
    assert tracker.apply([put_node("d-4-0", 1, 90)]) == []
    assert texts(tracker.apply([put_node("d-4-0", 1, 91)])) == [
        "node d-4-0 joined (asks for round 1)"
    ]


def test_diff_states_names_a_new_incarnation_and_a_drain() -> None:
    ended = dataclasses.replace(ROUND1, closed=True, closed_reason="done")
    again = RdzvState(round=ROUND1.round, incarnation=2)
    assert texts(diff_states(ended, again, 8)) == ["run started again as incarnation 2 (round 1)"]
    asked = dataclasses.replace(ROUND1, draining=("b",))
    assert texts(diff_states(ROUND1, asked, 9)) == ["node b asked to leave (drain)"]
