"""``rdzvctl events``/``timeline`` of a run started again while the ended run's events
are still kept: one incarnation at a time (pure)."""

from __future__ import annotations

import pytest

from coordinator.core.events import Event
from coordinator.rdzvctl.history import pick_incarnation

OLD = [
    Event("joined", node_id="a", revision=1, incarnation=1),
    Event("round_completed", round=1, members=("a",), revision=2, incarnation=1),
    Event("drain_requested", node_id="a", revision=3),  # its writer named none
    Event("closed", round=1, revision=4, incarnation=1),
]
NEW = [
    Event("joined", node_id="b", revision=5, incarnation=2),
    Event("round_completed", round=2, members=("b",), revision=6, incarnation=2),
]


def test_the_newest_incarnation_is_shown_and_the_left_out_are_named() -> None:
    shown, note = pick_incarnation("job", OLD + NEW)
    assert shown == NEW
    assert note == (
        "run job was started again with the same id: these are the events of incarnation "
        "2; 4 event(s) of incarnation(s) 1 are kept until the run's retention passes "
        "(--incarnation N shows them)"
    )


def test_an_older_incarnation_on_request_with_the_events_that_name_none() -> None:
    shown, note = pick_incarnation("job", OLD + NEW, 1)
    assert shown == OLD
    assert note is not None and "incarnation 1; 2 event(s) of incarnation(s) 2" in note


def test_one_incarnation_needs_no_note_and_a_missing_one_is_named() -> None:
    assert pick_incarnation("job", NEW) == (NEW, None)
    assert pick_incarnation("job", []) == ([], None)
    with pytest.raises(ValueError) as info:
        pick_incarnation("job", OLD + NEW, 3)
    assert str(info.value) == (
        "run 'job' has no events of incarnation 3: it has events of incarnation(s) 1, 2"
    )
