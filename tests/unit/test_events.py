"""The run's timeline, pure parts: codec, ids, order, trimming, what a commit records,
the formatter and the picture's data."""

from __future__ import annotations

import datetime
import json

import pytest

from coordinator.core.actions import Action, ActionKind, apply
from coordinator.core.commit_events import ROUNDS_BACK, EventRecorder, events_of_commit
from coordinator.core.errors import CorruptValueError
from coordinator.core.etcd_client import KeyValue
from coordinator.core.events import (
    Event,
    decode_event,
    encode_event,
    event_id,
    expand_joins,
    order_events,
    read_events,
    trim_count,
)
from coordinator.core.keys import RunKeys
from coordinator.core.state import NodeInfo, RdzvState
from coordinator.rdzvctl.history import event_json, event_line
from coordinator.rdzvctl.timeline import Band, Mark, Rank, Span, prepare

UTC = datetime.timezone.utc
T0 = 1_795_000_000_000  # 2026-11-18 ... in ms


def test_an_event_round_trips_as_readable_json() -> None:
    event = Event(
        "round_completed", round=3, members=("a-1-0", "b-2-0"), revision=42, unix_ms=T0,
        written_by="a-1-0", incarnation=1,
    )  # fmt: skip
    raw = encode_event(event)
    assert json.loads(raw) == {
        "schema_version": 2,
        "kind": "EVENT_KIND_ROUND_COMPLETED",
        "round": "3",
        "members": [{"node_id": "a-1-0"}, {"node_id": "b-2-0", "rank": 1}],
        "revision": "42",
        "unix_ms": str(T0),
        "written_by": "a-1-0",
        "incarnation": "1",
    }
    assert decode_event("k", raw) == event
    departed = Event("departed", node_id="n-1-0", cause="hung", summary="a\nb  c")
    assert decode_event("k", encode_event(departed)) == Event(
        "departed", node_id="n-1-0", cause="hung", summary="a b c"
    )
    closed = Event("closed", close_mode="drain", summary="x" * 600)
    back = decode_event("k", encode_event(closed))
    assert back.close_mode == "drain" and len(back.summary) == 500


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"nope", "not a RunEvent in JSON"),
        (b'{"kind": "EVENT_KIND_JOINED"}', "no schema_version: not written by etcd-elastic"),
        (
            b'{"schema_version": 9, "kind": "EVENT_KIND_JOINED"}',
            "schema_version 9 is newer than this etcd-elastic understands (2); upgrade rdzvctl",
        ),
        (b'{"schema_version": 1, "kind": 99}', "event kind 99 is unknown"),
        (b'{"schema_version": 1}', "event kind 0 is unknown"),
    ],
)
def test_a_value_that_is_not_an_event_is_refused_naming_the_key(raw: bytes, reason: str) -> None:
    with pytest.raises(CorruptValueError) as info:
        decode_event("/p/r/events/x", raw)
    assert info.value.key == "/p/r/events/x"
    assert info.value.reason.startswith(reason)


def test_ids_name_the_fact_so_two_writers_of_it_write_one_key() -> None:
    assert event_id(Event("joined", node_id="n-1-0", revision=7)) == "joined/n-1-0/7"
    said = Event("departed", node_id="n-1-0", cause="left", generation=7, revision=0)
    seen = Event("departed", node_id="n-1-0", cause="lease_expired", generation=7, revision=90)
    assert event_id(said) == event_id(seen) == "departed/n-1-0/7"
    assert event_id(Event("round_completed", round=12)) == "round_completed/12"
    assert event_id(Event("restarted", node_id="n", restart_count=2)) == "restarted/n/2"
    assert event_id(Event("closed", incarnation=3)) == "closed/3"
    # Two nodes recording one hang (or quarantine) at their own wall times: one key.
    hung = [Event("fault", node_id="n", cause="hung", round=4, unix_ms=ms) for ms in (5, 9)]
    assert {event_id(e) for e in hung} == {"fault/n/hung-4"}
    assert event_id(Event("fault", node_id="n", cause="quarantined", round=4)) == (
        "fault/n/quarantined-4"
    )
    drain = Event("drain_requested", node_id="n", revision=40, unix_ms=5)
    assert event_id(drain) == "drain_requested/n/40"
    keys = RunKeys("/p", "r")
    assert keys.event("joined/n-1-0/7") == b"/p/r/events/joined/n-1-0/7"


def test_events_are_ordered_by_the_facts_revision_then_the_writes() -> None:
    def kv(event: Event, created: int) -> KeyValue:
        return KeyValue(event_id(event).encode(), encode_event(event), created, created, 1, 0)

    join_late = Event("joined", node_id="late-1-0", revision=5)  # written at 30
    round1 = Event("round_completed", round=1, members=("a",), revision=10)  # written at 11
    restart_a = Event("restarted", node_id="a", restart_count=1, unix_ms=T0 + 2)  # at 20
    restart_b = Event("restarted", node_id="b", restart_count=1, unix_ms=T0 + 1)  # at 20
    events, errors = read_events(
        [kv(restart_a, 20), kv(round1, 11), kv(join_late, 30), kv(restart_b, 20)]
    )
    assert errors == []
    assert [(e.kind, e.node_id) for e in events] == [
        ("joined", "late-1-0"), ("round_completed", ""), ("restarted", "b"), ("restarted", "a"),
    ]  # fmt: skip
    bad = KeyValue(b"/p/r/events/x", b"{", 3, 3, 1, 0)
    events, errors = read_events([bad, kv(round1, 11)])
    assert len(events) == 1 and [e.key for e in errors] == ["/p/r/events/x"]
    assert order_events([]) == []


@pytest.mark.parametrize(
    ("count", "limit", "delete"),
    [(0, 1000, 0), (1000, 1000, 0), (1100, 1000, 0), (1101, 1000, 101), (5000, 1000, 4000),
     (11, 10, 0), (12, 10, 2), (3, 1, 2)],
)  # fmt: skip
def test_trimming_waits_for_a_tenth_over_the_limit_then_goes_back_to_it(
    count: int, limit: int, delete: int
) -> None:
    assert trim_count(count, limit) == delete


def _commit(state: RdzvState, *actions: Action) -> tuple[RdzvState, tuple[Action, ...]]:
    return apply(state, actions, now_unix_ms=T0), actions


def test_a_commit_records_rounds_with_ranks_and_departures_with_their_cause() -> None:
    running = RdzvState(round=2, participants=("a", "b", "c"), wait_list=("w",),
                        draining=("c",))  # fmt: skip
    after, actions = _commit(
        running,
        Action(ActionKind.REMOVE_FROM_PARTICIPANTS, ("b", "c")),
        Action(ActionKind.REMOVE_FROM_WAIT_LIST, ("w",)),
    )
    events = events_of_commit(running, after, actions, 77, {"b": 4, "w": 9})
    # c is being drained: its departure comes when its key goes (REMOVE_FROM_DRAINING).
    assert [(e.kind, e.node_id, e.cause, e.revision, e.generation) for e in events] == [
        ("departed", "b", "lease_expired", 77, 4),
        ("departed", "w", "lease_expired", 77, 9),
    ]
    after2, actions2 = _commit(after, Action(ActionKind.REMOVE_FROM_DRAINING, ("c",)))
    assert [(e.node_id, e.cause) for e in events_of_commit(after, after2, actions2, 80, {})] == [
        ("c", "drained")
    ]
    done, actions3 = _commit(
        after2, Action(ActionKind.MARK_RENDEZVOUS_COMPLETE, node_ids=("a", "x"))
    )
    (completed,) = events_of_commit(after2, done, actions3, 90, {})
    assert (completed.kind, completed.round, completed.members, completed.revision) == (
        "round_completed", 3, ("a", "x"), 90,
    )  # fmt: skip
    closed, actions4 = _commit(
        done, Action(ActionKind.MARK_RENDEZVOUS_CLOSED, reason="bye", mode="failed")
    )
    (event,) = events_of_commit(done, closed, actions4, 99, {})
    assert (event.kind, event.summary, event.close_mode, event.round) == (
        "closed", "bye", "failed", 3,
    )  # fmt: skip
    waiting, actions5 = _commit(done, Action(ActionKind.ADD_TO_WAIT_LIST, ("z",)))
    assert events_of_commit(done, waiting, actions5, 100, {}) == []


def _node(node_id: str, created: int) -> NodeInfo:
    return NodeInfo(node_id=node_id, wanted_round=1, create_revision=created)


def test_the_recorder_notes_each_key_once_and_a_new_key_as_a_new_join() -> None:
    recorder = EventRecorder("lead-1-0", wall_ms=lambda: 1000)
    state = RdzvState()
    recorder.appeared(state, {"a": _node("a", 5), "b": _node("b", 6)})
    recorder.appeared(state, {"a": _node("a", 5), "b": _node("b", 6)})  # a re-read
    assert recorder.take() == []  # joins wait for the next commit
    # A commit that completes no round writes them, one event each.
    listed, actions = _commit(state, Action(ActionKind.ADD_TO_WAIT_LIST, ("a", "b")))
    recorder.committed(state, listed, actions, 7)
    joined = recorder.take()
    assert sorted((e.node_id, e.revision, e.written_by, e.unix_ms) for e in joined) == [
        ("a", 5, "lead-1-0", 1000), ("b", 6, "lead-1-0", 1000),
    ]  # fmt: skip
    recorder.appeared(state, {"b": _node("b", 20)})  # b's key went and came back
    recorder.committed(state, state, (), 25)
    assert [(e.node_id, e.revision) for e in recorder.take()] == [("b", 20)]
    running = RdzvState(round=1, participants=("a", "b"))
    after, actions = _commit(running, Action(ActionKind.REMOVE_FROM_PARTICIPANTS, ("b",)))
    recorder.committed(running, after, actions, 30)
    (gone,) = recorder.take()
    assert (gone.node_id, gone.generation, gone.written_by) == ("b", 20, "lead-1-0")
    assert recorder.take() == []


def test_a_round_carries_its_members_joins_instead_of_one_event_per_node() -> None:
    times = iter([1000, 2000, 3000])
    recorder = EventRecorder("a", wall_ms=lambda: next(times))
    state = RdzvState()
    recorder.appeared(state, {"a": _node("a", 5)})
    recorder.appeared(state, {"b": _node("b", 6), "c": _node("c", 9)})
    done, actions = _commit(state, Action(ActionKind.MARK_RENDEZVOUS_COMPLETE, ("b", "a")))
    recorder.committed(state, done, actions, 12)
    # One event for the members' joins and the round, not one more per member; c joined
    # too but is no member of the round: its join is an event of its own.
    c_joined, completed = recorder.take()
    assert (c_joined.kind, c_joined.node_id, c_joined.revision) == ("joined", "c", 9)
    assert completed.kind == "round_completed" and completed.members == ("b", "a")
    assert (completed.member_generations, completed.member_joined_ms) == ((6, 5), (2000, 1000))
    # The next round of the same keys lists them again; they joined once.
    recorder.appeared(done, {})
    again, actions = _commit(done, Action(ActionKind.MARK_RENDEZVOUS_COMPLETE, ("b", "a", "c")))
    recorder.committed(done, again, actions, 20)
    (second,) = recorder.take()
    assert (second.member_generations, second.member_joined_ms) == ((6, 5, 9), (0, 0, 0))


def test_a_successor_names_a_departure_it_never_saw_join_as_its_round_recorded_it() -> None:
    # The new coordinator never saw b's key (b led before it and left): the departure's
    # id must be the one b wrote when it left ("left" wins, no second "lease expired").
    asked: list[int] = []

    def of_round(round_: int) -> dict[str, int]:
        asked.append(round_)
        return {6: {"a": 5, "b": 6}, 5: {"a": 5, "d": 3}}.get(round_, {})

    recorder = EventRecorder("a", wall_ms=lambda: 1000, round_generations=of_round)
    recorder.appeared(RdzvState(), {"a": _node("a", 5)})
    # d, drained, was a member of the round before; c of none looked at.
    running = RdzvState(round=6, participants=("a", "b", "c"), draining=("d",))
    after, actions = _commit(
        running,
        Action(ActionKind.REMOVE_FROM_PARTICIPANTS, ("b", "c")),
        Action(ActionKind.REMOVE_FROM_DRAINING, ("d",)),
    )
    recorder.committed(running, after, actions, 30)
    gone = {e.node_id: e for e in recorder.take() if e.kind == "departed"}
    assert {n: e.generation for n, e in gone.items()} == {"b": 6, "c": 0, "d": 3}
    assert event_id(gone["b"]) == event_id(Event("departed", node_id="b", generation=6))
    # Each round once, and no further back than ROUNDS_BACK rounds.
    assert asked == [6, 5, 4] and ROUNDS_BACK == 3


def test_a_coordinator_does_not_write_the_joins_a_round_it_did_not_complete_showed() -> None:
    def of_round(round_: int) -> dict[str, int]:
        raise AssertionError("nothing to read: the round's event shows them")

    recorder = EventRecorder("b", wall_ms=lambda: 1000, round_generations=of_round)
    # Still forming when this node starts to lead; then another coordinator completes
    # round 1 (a node that came earlier, or this node's predecessor).
    recorder.appeared(RdzvState(), {"a": _node("a", 5), "b": _node("b", 6)})
    formed = RdzvState(round=1, participants=("a", "b"))
    recorder.appeared(formed, {"c": _node("c", 9)})
    listed, actions = _commit(formed, Action(ActionKind.ADD_TO_WAIT_LIST, ("c",)))
    recorder.committed(formed, listed, actions, 13)
    assert [(e.node_id, e.revision) for e in recorder.take()] == [("c", 9)]
    # A new coordinator's first look at a formed run: the same.
    fresh = EventRecorder("a", wall_ms=lambda: 1000, round_generations=of_round)
    fresh.appeared(formed, {"a": _node("a", 5), "b": _node("b", 6), "d": _node("d", 14)})
    again, actions = _commit(formed, Action(ActionKind.ADD_TO_WAIT_LIST, ("d",)))
    fresh.committed(formed, again, actions, 15)
    assert [(e.node_id, e.revision) for e in fresh.take()] == [("d", 14)]


def test_readers_show_each_join_once_where_it_happened() -> None:
    def stored(event: Event, written: int) -> Event:
        return decode_event("k", encode_event(event), written)

    round1 = Event(
        "round_completed",
        round=1,
        members=("b", "a"),
        revision=12,
        unix_ms=5000,
        member_generations=(6, 5),
        member_joined_ms=(2000, 1000),
        written_by="a",
    )
    c_joined = Event("joined", node_id="c", revision=9, unix_ms=3000)
    round2 = Event(
        "round_completed",
        round=2,
        members=("b", "a", "c"),
        revision=20,
        unix_ms=8000,
        member_generations=(6, 5, 9),
        member_joined_ms=(0, 0, 0),
    )
    # A new coordinator (failover) lists a again with its key's generation; b re-joined
    # with a new key (generation 30).
    round3 = Event(
        "round_completed",
        round=3,
        members=("b", "a"),
        revision=40,
        unix_ms=9000,
        member_generations=(30, 5),
        member_joined_ms=(8500, 8600),
    )
    events = [stored(round1, 13), stored(c_joined, 14), stored(round2, 21), stored(round3, 41)]
    shown = [(e.kind, e.node_id, e.round, e.revision, e.unix_ms) for e in expand_joins(events)]
    assert shown == [
        ("joined", "a", 0, 5, 1000),
        ("joined", "b", 0, 6, 2000),
        ("joined", "c", 0, 9, 3000),
        ("round_completed", "", 1, 12, 5000),
        ("round_completed", "", 2, 20, 8000),
        ("joined", "b", 2, 30, 8500),
        ("round_completed", "", 3, 40, 9000),
    ]
    assert event_line(expand_joins(events)[0], UTC).endswith("joined           a joined")


def test_member_joins_that_do_not_match_the_members_are_refused() -> None:
    raw = encode_event(Event("round_completed", round=1, members=("a", "b"),
                             member_generations=(5,)))  # fmt: skip
    with pytest.raises(
        CorruptValueError, match=r"member joins \(\[5\], \[\]\) do not match 2 members"
    ):
        decode_event("k", raw)


def test_one_line_per_event_with_the_cause_in_words() -> None:
    def line(event: Event) -> str:
        return event_line(event, UTC)

    at = datetime.datetime(2026, 11, 23, 23, 10, 1, 123000, tzinfo=UTC)
    ms = int(at.timestamp() * 1000)
    assert line(Event("joined", node_id="n-1-0", revision=12, unix_ms=ms)) == (
        "2026-11-23 23:10:01.123  rev 12       joined           n-1-0 joined"
    )
    assert line(Event("round_completed", round=2, members=("a", "b"), revision=40,
                      unix_ms=ms)).endswith(
        "round_completed  round 2 completed with 2 node(s): 0=a 1=b"
    )  # fmt: skip
    restart = Event("restarted", node_id="b", restart_count=1, unix_ms=ms, written_revision=44,
                    summary="rank 3: RuntimeError: boom")  # fmt: skip
    assert line(restart) == (
        "2026-11-23 23:10:01.123  rev 44       restarted        b restarted its workers "
        "(restart 1): rank 3: RuntimeError: boom"
    )
    causes = {
        "lease_expired": "lease expired (killed, frozen or cut off)",
        "left": "left",
        "drained": "drained by an operator",
        "quarantined": "quarantined (health check failed)",
        "hung": "hung (no progress)",
    }
    for cause, words in causes.items():
        event = Event("departed", node_id="c", cause=cause, revision=1)  # type: ignore[arg-type]
        assert line(event).endswith(f"departed         c departed: {words}")
    assert line(Event("closed", close_mode="finished", summary="done", revision=9)) == (
        "-----------------------  rev 9        closed           run closed (finished): done"
    )
    assert line(Event("drain_requested", node_id="c", written_by="rdzvctl@h")).endswith(
        "c asked to leave (drain) by rdzvctl@h"
    )
    assert line(Event("fault", node_id="c", cause="hung", summary="no step")).endswith(
        "fault            c fault hung: no step"
    )
    as_json = event_json("job", restart)
    assert as_json["revision"] == 44 and as_json["summary"] == "rank 3: RuntimeError: boom"
    assert set(as_json) == {
        "run_id", "kind", "revision", "unix_ms", "node_id", "cause", "round", "members",
        "summary", "restart_count", "close_mode", "incarnation", "written_by", "key",
    }  # fmt: skip


def test_the_picture_data_has_bars_bands_ranks_and_marks() -> None:
    def at(seconds: float, event: Event) -> Event:
        return Event(**{**event.__dict__, "unix_ms": T0 + int(seconds * 1000)})

    events = [
        at(0, Event("joined", node_id="a")),
        at(0.5, Event("joined", node_id="b")),
        at(1, Event("joined", node_id="c")),
        at(2, Event("round_completed", round=1, members=("a", "b", "c"))),
        at(5, Event("restarted", node_id="c", restart_count=1, summary="rank 2: boom")),
        at(7, Event("round_completed", round=2, members=("a", "b", "c"))),
        at(10, Event("departed", node_id="b", cause="lease_expired")),
        at(12, Event("round_completed", round=3, members=("a", "c"))),
        at(14, Event("drain_requested", node_id="c")),
        at(15, Event("departed", node_id="c", cause="drained")),
        at(17, Event("round_completed", round=4, members=("a",))),
        at(20, Event("closed", close_mode="finished", summary="done")),
        at(20.5, Event("departed", node_id="a", cause="left")),
    ]
    data = prepare("job", events)
    assert data.t0_ms == T0 and data.end == 20.5
    assert data.nodes == ("a", "b", "c")
    assert set(data.spans) == {Span("b", 0.5, 10), Span("c", 1, 15), Span("a", 0, 20.5)}
    assert data.bands == (
        Band(1, 2, 7, ("a", "b", "c")), Band(2, 7, 12, ("a", "b", "c")),
        Band(3, 12, 17, ("a", "c")), Band(4, 17, 20, ("a",)),
    )  # fmt: skip
    assert [(m.node, m.at, m.kind) for m in data.marks] == [
        ("c", 5, "restart"), ("b", 10, "lease_expired"), ("c", 14, "drain_requested"),
        ("c", 15, "drained"), ("a", 20.5, "left"),
    ]  # fmt: skip
    assert data.marks[0] == Mark("c", 5, "restart", "rank 2: boom")
    assert Rank("c", 12, 3, 1) in data.ranks and len(data.ranks) == 9
    assert (data.closed_at, data.close_label) == (20, "closed (finished)")


def test_the_picture_of_a_run_still_going_leaves_its_bars_open() -> None:
    events = [
        Event("round_completed", round=5, members=("a", "b"), unix_ms=T0),
        Event("fault", node_id="b", cause="quarantined", unix_ms=T0 + 3000),
    ]
    data = prepare("job", events)
    # Nodes first seen in a round (their joins were trimmed) start at that round.
    assert set(data.spans) == {Span("a", 0, None), Span("b", 0, None)}
    assert data.bands == (Band(5, 0, 3, ("a", "b")),)
    assert [m.kind for m in data.marks] == ["quarantined"]
    assert data.closed_at is None
    with pytest.raises(ValueError, match="run 'job' has no events with a time to draw"):
        prepare("job", [Event("joined", node_id="a")])


def test_a_round_that_leaves_out_a_participant_whose_key_went_records_its_departure() -> None:
    # The survivors re-joined before b's lease ended, so no commit marked b lost: the
    # round that completes without b is where its departure shows (found in CI).
    running = RdzvState(round=2, participants=("a", "b", "c"), lost=("c",))
    complete = Action(ActionKind.MARK_RENDEZVOUS_COMPLETE, node_ids=("a", "d"))
    after, actions = _commit(running, complete)
    kinds = [(e.kind, e.node_id, e.cause, e.generation) for e in events_of_commit(
        running, after, actions, 50, {"b": 7}, live=["a"])]  # fmt: skip
    # c was recorded when it was marked lost; a is in the round; b's key is gone.
    assert kinds == [("departed", "b", "lease_expired", 7), ("round_completed", "", "", 0)]
    # A participant still alive but left out (slow to come back) has not departed, and a
    # caller that does not know who is alive records no such departure.
    assert [e.kind for e in events_of_commit(running, after, actions, 50, {}, live=["a", "b"])
            ] == ["round_completed"]  # fmt: skip
    assert [e.kind for e in events_of_commit(running, after, actions, 50, {})] == [
        "round_completed"
    ]
