"""What ends the formation phase while the pre-flight check runs (agent.loop.rounds)."""

from __future__ import annotations

from typing import Any

from agent.loop.phase import Phase
from agent.loop.rounds import EXCHANGE, HEALTH_CHECK, formation_changed
from coordinator.torch_adapter.surface import ForeignSurface


class FakeHandler:
    """The watched facts the phase reads, set by the test."""

    def __init__(self) -> None:
        self.waiting = 0
        self.lost: list[str] = []
        self.quarantined_nodes: frozenset[str] = frozenset()
        self.last_members = ("a", "b", "c")

    def num_nodes_waiting(self) -> int:
        return self.waiting

    def departed_participants(self) -> list[str]:
        return list(self.lost)


def _phase(stage: str) -> Phase[Any]:
    phase: Phase[Any] = Phase("rendezvous", lambda _p: None, lambda: None)
    phase.mark(stage)
    return phase


def test_during_the_check_only_a_participant_that_left_ends_the_wait() -> None:
    handler = FakeHandler()
    changed = formation_changed(handler, handler)  # type: ignore[arg-type]
    check = _phase(HEALTH_CHECK)
    # A node that finished its verdict first re-joins: listed as waiting. Not a change.
    handler.waiting = 1
    assert changed(check) is None
    # The node this check quarantined: recorded as lost by the coordinator. Its outcome.
    handler.quarantined_nodes, handler.lost = frozenset({"c"}), ["c"]
    assert changed(check) is None
    # A participant whose lease ended: its result may never come.
    handler.lost = ["c", "b"]
    assert changed(check) == "b left during the pre-flight check"
    # During the rank exchange, any change still ends the wait.
    handler.lost = []
    assert changed(_phase(EXCHANGE)) == "the membership changed (1 waiting or lost)"
    assert changed(_phase("started")) is None


def test_a_handler_without_departures_never_ends_the_check() -> None:
    class Foreign:
        def num_nodes_waiting(self) -> int:
            return 3

    changed = formation_changed(Foreign(), ForeignSurface())  # type: ignore[arg-type]
    assert changed(_phase(HEALTH_CHECK)) is None
