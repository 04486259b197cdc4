"""What the agent puts on the run's timeline for a hang and for the pre-flight check: a
``fault`` per named node (they stay in the run: not a departure), each node's own check
result, and a quarantine marked only by the node whose write landed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent.observe.timeline import (
    quarantine_recorded,
    record_faults,
    record_health,
    record_restart,
)
from coordinator.core.events import Event, event_id
from coordinator.core.state import Quarantine
from coordinator.torch_adapter.surface import ForeignSurface, RendezvousSurface


class Handler(ForeignSurface):
    """What the recording helpers read from a handler (ours), and the events it got."""

    node_id = "n1"
    last_round = 4
    incarnation = 2
    can_quarantine = True

    def __init__(self, lands: bool = True) -> None:
        self.events: list[Event] = []
        self.written: list[Sequence[Quarantine]] = []
        self._lands = lands

    def record_event(self, event: Event) -> None:
        self.events.append(event)

    def quarantine(self, entries: Sequence[Quarantine]) -> bool:
        self.written.append(entries)
        return self._lands


def handler(**kw: Any) -> tuple[Handler, RendezvousSurface]:
    h = Handler(**kw)
    return h, h


def test_a_hang_marks_each_named_node_with_a_hung_fault() -> None:
    h, rdzv = handler()
    record_faults(rdzv, ("a", "b"), "hung", 4, "hang in round 4: node(s) [a b] stopped first")
    assert [(e.kind, e.node_id, e.cause, e.round, e.incarnation) for e in h.events] == [
        ("fault", "a", "hung", 4, 2),
        ("fault", "b", "hung", 4, 2),
    ]
    assert h.events[0].summary == "hang in round 4: node(s) [a b] stopped first"


def test_a_restart_without_a_worker_failure_names_its_reason() -> None:
    h, rdzv = handler()
    record_restart(rdzv, 3, None, why="hang in round 4: ...")
    (event,) = h.events
    assert (event.kind, event.node_id, event.restart_count, event.summary) == (
        "restarted", "n1", 3, "hang in round 4: ...",
    )  # fmt: skip


def test_only_the_node_whose_quarantine_write_landed_marks_the_nodes() -> None:
    entry = Quarantine("slow-1", "matmul 5.02 s, 3x the median 0.01 s", 1_000, "host-b")
    h, rdzv = handler()
    write = quarantine_recorded(rdzv)
    assert write is not None and write([entry]) is True
    assert [(e.kind, e.node_id, e.cause, e.summary) for e in h.events] == [
        ("fault", "slow-1", "quarantined", "matmul 5.02 s, 3x the median 0.01 s"),
    ]
    late, late_rdzv = handler(lands=False)
    late_write = quarantine_recorded(late_rdzv)
    assert late_write is not None and late_write([entry]) is False
    assert late.written == [[entry]] and late.events == []


def test_a_handler_without_a_timeline_or_quarantine_is_left_alone() -> None:
    plain = ForeignSurface()
    assert quarantine_recorded(plain) is None
    record_faults(plain, ("a",), "hung", 1, "x")  # no error, nothing to record
    record_health(plain, 1, "x")


def test_the_judge_records_the_round_s_check_once() -> None:
    h, rdzv = handler()
    record_health(rdzv, 4, "2 of 3 node(s) passed; failed: n1 (matmul 5.02 s)")
    (event,) = h.events
    assert event_id(event) == "health_checked/run/4"
    assert (event.node_id, event.round) == ("", 4)
    assert event.summary.startswith("2 of 3 node(s) passed")
