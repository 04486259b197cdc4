"""NodeTable: a read plus the watch's events, each change applied once and in order."""

from __future__ import annotations

from coordinator.core.etcd_client import KeyValue, WatchEvent
from coordinator.core.node_table import NodeTable
from coordinator.core.state import NodeInfo, encode_node

PREFIX = b"/p/run/nodes/"


def _kv(node_id: str, revision: int, created: int | None = None, round_: int = 1) -> KeyValue:
    value = encode_node(NodeInfo(node_id=node_id, wanted_round=round_))
    return KeyValue(PREFIX + node_id.encode(), value, created or revision, revision, 1, 7)


def _put(node_id: str, revision: int, created: int | None = None, round_: int = 1) -> WatchEvent:
    return WatchEvent("put", _kv(node_id, revision, created, round_), None)


def _delete(node_id: str, revision: int) -> WatchEvent:
    return WatchEvent("delete", KeyValue(PREFIX + node_id.encode(), b"", 0, revision, 0, 0), None)


def _rounds(table: NodeTable) -> dict[str, int]:
    return {n: info.wanted_round for n, info in table.snapshot().items()}


def test_events_before_the_read_are_held_then_only_newer_ones_apply() -> None:
    table = NodeTable()
    # The watch (from now, created at 10) reports 11..13 before the read (made at 12).
    assert table.apply([_put("a", 11), _put("b", 12)]) is False
    assert table.apply([_delete("a", 13)]) is False
    assert table.snapshot() == {}
    table.load([_kv("a", 11), _kv("b", 12), _kv("old", 5)], 12)
    # 11 and 12 are in the read; the delete at 13 is newer and applies.
    assert _rounds(table) == {"b": 1, "old": 1}
    assert table.read_at == 12


def test_events_the_read_already_has_are_ignored_afterwards() -> None:
    table = NodeTable()
    table.load([_kv("a", 20, created=8, round_=2)], 20)
    # A late event from before the read must not roll "a" back to round 1 or revive "z".
    assert table.apply([_put("a", 15, created=8, round_=1), _put("z", 18), _delete("z", 19)])
    assert _rounds(table) == {"a": 2}
    assert table.apply([_put("a", 21, created=8, round_=3), _put("c", 22)])
    assert _rounds(table) == {"a": 3, "c": 1}
    assert table.snapshot()["a"].create_revision == 8


def test_reset_forgets_and_holds_again() -> None:
    table = NodeTable()
    table.load([_kv("a", 3)], 3)
    table.reset()
    assert table.snapshot() == {} and table.read_at is None
    assert table.apply([_put("b", 4)]) is False
    table.load([], 4)
    assert table.snapshot() == {}  # b's put at 4 is the read's own revision: not re-applied


def test_a_corrupt_value_is_skipped_and_the_rest_kept() -> None:
    table = NodeTable()
    bad = KeyValue(PREFIX + b"bad", b"\x80not json", 2, 2, 1, 0)
    table.load([bad, _kv("a", 3)], 3)
    assert list(table.snapshot()) == ["a"]


def test_appeared_keys_are_reported_once_each_for_the_timeline() -> None:
    table = NodeTable()
    table.load([_kv("a", 3), _kv("b", 4)], 4)
    assert {n: i.create_revision for n, i in table.take_appeared().items()} == {"a": 3, "b": 4}
    assert table.take_appeared() == {}
    # A rewrite of a's key (a new wanted round) is not a join; c's new key is, and d's key
    # that came and went before anyone asked is none.
    table.apply([_put("a", 5, created=3, round_=2), _put("c", 6), _put("d", 7), _delete("d", 8)])
    assert list(table.take_appeared()) == ["c"]
    # b's key gone and created again (a re-join with a new lease): a join again.
    table.apply([_delete("b", 9), _put("b", 10)])
    assert {n: i.create_revision for n, i in table.take_appeared().items()} == {"b": 10}


def _foreign(key_id: str, named: str, revision: int) -> WatchEvent:
    """A put under ``nodes/<key_id>`` whose value names ``named``."""
    value = encode_node(NodeInfo(node_id=named, wanted_round=1))
    return WatchEvent(
        "put", KeyValue(PREFIX + key_id.encode(), value, revision, revision, 1, 9), None
    )


def test_a_value_naming_another_node_does_not_bring_a_dead_node_back() -> None:
    table = NodeTable()
    table.load([_kv("a", 3), _kv("b", 4)], 4)
    # b's lease ended (its key went); then a stray key holds a copy of b's record.
    assert table.apply([_delete("b", 5), _foreign("copy", "b", 6)])
    assert _rounds(table) == {"a": 1}


def test_a_value_naming_another_node_neither_replaces_it_nor_outlives_its_key() -> None:
    table = NodeTable()
    table.load([_kv("a", 3), _kv("b", 4, round_=2)], 4)
    assert table.apply([_foreign("copy", "b", 5)])
    assert _rounds(table) == {"a": 1, "b": 2}  # b's own record, not the copy
    assert table.apply([_delete("b", 6)])
    assert _rounds(table) == {"a": 1}  # gone with its own key
    assert table.apply([_delete("copy", 7)])
    assert _rounds(table) == {"a": 1}


def test_a_read_with_a_value_naming_another_node_counts_the_key_s_node_only() -> None:
    table = NodeTable()
    foreign = _foreign("copy", "gone", 5).kv
    table.load([_kv("a", 3), foreign], 5)
    assert _rounds(table) == {"a": 1}
