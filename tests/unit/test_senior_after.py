"""A waiting node's senior as the watch of its place in line hears of turn keys
(:func:`coordinator.core.turns.senior_after`): pure, no etcd."""

from __future__ import annotations

from typing import Literal

from coordinator.core.etcd_client import KeyValue, WatchEvent
from coordinator.core.turns import senior_after

# The waiting node's own key is b"m"; the watch covers (m, senior].
SENIOR = b"t"


def _event(kind: Literal["put", "delete"], key: bytes) -> WatchEvent:
    return WatchEvent(kind, KeyValue(key, b"", 0, 0, 0, 0), None)


def test_a_key_written_between_a_node_and_its_senior_is_its_senior() -> None:
    assert senior_after(SENIOR, [_event("put", b"p")]) == b"p"
    assert senior_after(SENIOR, [_event("put", b"p"), _event("put", b"n")]) == b"n"
    assert senior_after(SENIOR, [_event("put", b"n"), _event("put", b"p")]) == b"n"


def test_the_seniors_own_key_written_again_changes_nothing() -> None:
    assert senior_after(SENIOR, [_event("put", SENIOR)]) == SENIOR


def test_only_the_current_seniors_deletion_is_a_look_again() -> None:
    assert senior_after(SENIOR, [_event("delete", SENIOR)]) is None
    # The old senior goes after a nearer one came: the nearer one is still first.
    assert senior_after(SENIOR, [_event("put", b"p"), _event("delete", SENIOR)]) == b"p"
    assert senior_after(b"p", [_event("delete", SENIOR)]) == b"p"
    # The nearer one came and went: nobody knows who is first now.
    assert senior_after(SENIOR, [_event("put", b"p"), _event("delete", b"p")]) is None


def test_no_events_keep_the_senior() -> None:
    assert senior_after(SENIOR, []) == SENIOR
