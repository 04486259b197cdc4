"""The chaos checker's view of etcd's own history: parsing etcdctl's JSON, and the
``fenced_commits`` invariant (a newer round is only ever committed by a node whose key
exists at that revision)."""

from __future__ import annotations

import base64
import json

from tests.chaos.etcd_log import KvEvent, fenced_commits, parse_line

RUN = "/etcd-elastic/r1"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def state(round_: int, writer: str) -> bytes:
    return json.dumps({"round": str(round_), "written_by": writer}).encode()


def put(key: str, revision: int, value: bytes = b"{}") -> KvEvent:
    return KvEvent("put", f"{RUN}/{key}", revision, revision, value)


def delete(key: str, revision: int) -> KvEvent:
    return KvEvent("delete", f"{RUN}/{key}", revision)


def test_parse_watch_answer_and_snapshot() -> None:
    watch = {
        "Events": [
            {"kv": {"key": b64(f"{RUN}/nodes/a"), "create_revision": 5, "mod_revision": 5,
                    "value": b64("{}")}},
            {"type": 1, "kv": {"key": b64(f"{RUN}/nodes/b"), "mod_revision": 6}},
        ]
    }  # fmt: skip
    assert parse_line(json.dumps(watch)) == [
        KvEvent("put", f"{RUN}/nodes/a", 5, 5, b"{}"),
        KvEvent("delete", f"{RUN}/nodes/b", 6, 0, b""),
    ]
    snapshot = {"snapshot": {"header": {"revision": 9}, "kvs": [
        {"key": b64(f"{RUN}/state"), "create_revision": 3, "mod_revision": 8,
         "value": b64("x")}]}}  # fmt: skip
    assert parse_line(json.dumps(snapshot)) == [
        KvEvent("gap", "", 9),
        KvEvent("snapshot", f"{RUN}/state", 9, 3, b"x"),
    ]
    assert parse_line("etcdctl: not json") == []


def test_a_commit_by_a_live_coordinator_is_fine() -> None:
    events = [
        KvEvent("gap", "", 1),
        put("nodes/a", 2),
        put("nodes/b", 3),
        put("state", 4, state(1, "a")),
        delete("nodes/a", 5),
        put("state", 6, state(1, "b")),  # marks a lost: no newer round
        put("state", 7, state(2, "b")),
    ]
    assert list(fenced_commits(events, RUN)) == []


def test_a_newer_round_committed_by_a_node_whose_key_is_gone_is_caught() -> None:
    events = [
        KvEvent("gap", "", 1),
        put("nodes/a", 2),
        put("nodes/b", 3),
        delete("nodes/a", 4),  # its lease expired while it was frozen
        put("state", 5, state(1, "a")),
    ]
    [violation] = fenced_commits(events, RUN)
    assert violation.invariant == "fenced_commits"
    assert violation.message == (
        "round 1 was committed at revision 5 by a, whose node key was gone: an unfenced "
        "commit from a stale node table"
    )


def test_after_a_gap_the_snapshot_decides() -> None:
    events = [
        KvEvent("gap", "", 1),
        put("nodes/a", 2),
        KvEvent("gap", "", 9),  # the watch ended; a's key went meanwhile
        KvEvent("snapshot", f"{RUN}/nodes/b", 9, 3),
        KvEvent("snapshot", f"{RUN}/state", 9, 4, state(3, "b")),
        put("state", 10, state(3, "a")),  # no newer round: not a formation commit
        put("state", 11, state(4, "a")),
    ]
    assert [v.event for v in fenced_commits(events, RUN)] == [
        {"revision": 11, "round": 4, "written_by": "a"}
    ]
