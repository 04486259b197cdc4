"""``rdzvctl``'s pure parts: what status, list, gc and watch print, the run phase and
gc's verdicts."""

from __future__ import annotations

import dataclasses
import datetime
import json

import pytest

from coordinator.core.keys import RunKeys
from coordinator.core.state import RdzvState
from coordinator.rdzvctl.format import (
    change_json,
    change_line,
    gc_json,
    gc_lines,
    list_json,
    list_lines,
    node_status,
    status_json,
    status_lines,
    table,
)
from coordinator.rdzvctl.model import NodeView, RunSnapshot, phase, split_run_keys
from coordinator.rdzvctl.ops import GcResult, gc_verdict
from coordinator.rdzvctl.watch import Change
from tests.unit.rdzvctl_samples import KEYS, LIVE, NOW, ROUND1, T0, UTC, node, snap

# -- phase ---------------------------------------------------------------------------


def test_phase() -> None:
    assert phase(snap(None)) == "empty"
    assert phase(snap(None, (node("a-1-0", 1, rev=1),))) == "forming"
    assert phase(snap(ROUND1, LIVE)) == "complete"
    # A newcomer alone does not open round 2 while the participants run: it waits.
    newcomer = node("d-4-0", 2, rev=9)
    assert phase(snap(ROUND1, (*LIVE, newcomer))) == "complete"
    # A participant asking for round 2 re-opens it.
    assert phase(snap(ROUND1, (node("a-1-0", 2, rev=1), *LIVE[1:]))) == "forming"
    # No participant alive and someone asks: forming.
    assert phase(snap(ROUND1, (newcomer,))) == "forming"
    assert phase(snap(RdzvState(round=1, closed=True), LIVE)) == "closed"
    unreadable = RunSnapshot(KEYS, None, 30, 40, (), 40, errors=("bad",))
    assert phase(unreadable) == "unreadable"


# -- status --------------------------------------------------------------------------


def test_status_lines() -> None:
    state = RdzvState(
        round=1,
        participants=("a-1-0", "b-2-0", "c-3-0"),
        wait_list=("d-4-0",),
        lost=("c-3-0",),
        master_addr="10.0.0.1",
        master_port=29500,
        completed_at_unix_ms=T0,
        written_by="a-1-0",
    )
    nodes = (*LIVE[:2], node("d-4-0", 2, rev=9, ttl=-1))
    lines = status_lines(snap(state, nodes, store=6), NOW, UTC)
    assert lines == [
        "run:             demo (key prefix /etcd-elastic, etcd revision 40)",
        "state:           complete, round 1 completed 2026-11-20 14:02:11 (2m05s ago), "
        "state last written by a-1-0",
        "incarnation:     1",
        "closed:          no",
        "master:          10.0.0.1:29500",
        "participants:    3 in round 1",
        "  RANK  NODE   ADDR      HOSTNAME  PID  WORKERS  LEASE LEFT  ASKS FOR",
        "  0     a-1-0  10.0.0.1  host1     100  2        4s          1",
        "  1     b-2-0  10.0.0.2  host2     100  2        4s          1",
        "  2     c-3-0  -         -         -    -        gone        -",
        "wait list:       d-4-0",
        "spares:          -",
        "lost:            c-3-0",
        "draining:        -",
        "nodes alive:     3",
        "  NODE   ASKS FOR ROUND  IS       LEASE (hex)  LEASE LEFT  ROLE",
        "  a-1-0  1               rank 0   1001         4s          default",
        "  b-2-0  1               rank 1   1002         4s          default",
        "  d-4-0  2               waiting  1009         expired     default",
        "store:           6 key(s)",
    ]


def test_status_lines_closed_and_forming() -> None:
    closed = RdzvState(round=2, closed=True, closed_reason="maintenance", participants=("a",))
    lines = status_lines(snap(closed), NOW, UTC)
    assert lines[1] == "state:           closed, round 2 completed unknown"
    assert lines[2] == "incarnation:     1"
    assert lines[3] == "closed:          yes: maintenance"
    forming = status_lines(snap(None, (node("a-1-0", 1, rev=1, ttl=None),)), NOW, UTC)
    assert forming[1] == "state:           forming, no round completed yet, round 1 has 1 joiner(s)"
    assert "  a-1-0  1               joining  1001         ?           default" in forming
    assert (
        status_lines(snap(None), NOW, UTC)[1] == "state:           empty: no state and no node key"
    )


def test_status_json_is_complete_and_serialisable() -> None:
    state = RdzvState(round=1, participants=("a-1-0", "gone-9-0"), redundancy_list=("b-2-0",))
    data = json.loads(json.dumps(status_json(snap(state, LIVE[:2]))))
    assert data["phase"] == "complete" and data["round"] == 1 and data["closed"] is False
    assert data["participants"][0]["rank"] == 0 and data["participants"][0]["alive"] is True
    assert data["participants"][0]["lease_ttl_left"] == 4
    assert data["participants"][0]["local_world_size"] == 2
    assert data["participants"][1] == {"rank": 1, "node_id": "gone-9-0", "alive": False}
    assert data["redundancy_list"] == ["b-2-0"]
    assert [(n["node_id"], n["status"]) for n in data["nodes"]] == [
        ("a-1-0", "rank 0"),
        ("b-2-0", "spare"),
    ]
    assert data["nodes"][0]["lease_id_hex"] == "1001"


def unreadable_state(*nodes: NodeView) -> RunSnapshot:
    """A run whose state key holds a value that does not decode."""
    return RunSnapshot(
        KEYS, None, 30, 40, nodes, 40, store_keys=2,
        errors=("corrupt value at etcd key '/etcd-elastic/demo/state': not JSON",),
        unreadable_keys=("/etcd-elastic/demo/state",),
    )  # fmt: skip


def test_status_of_an_unreadable_state_shows_only_what_etcd_holds() -> None:
    # No round 0, "closed: no" or empty lists: they would be the defaults of an empty
    # state, not facts. The live node is real, but what it is in the run is not known.
    lines = status_lines(unreadable_state(LIVE[0]), NOW, UTC)
    assert lines == [
        "run:             demo (key prefix /etcd-elastic, etcd revision 40)",
        "state:           unreadable: its value does not decode, so round, ranks, lists and "
        "closed are unknown",
        "nodes alive:     1",
        "  NODE   ASKS FOR ROUND  IS       LEASE (hex)  LEASE LEFT  ROLE",
        "  a-1-0  1               unknown  1001         4s          default",
        "store:           2 key(s)",
        "unreadable keys: /etcd-elastic/demo/state",
    ]
    data = json.loads(json.dumps(status_json(unreadable_state(LIVE[0]))))
    assert data["phase"] == "unreadable"
    unknown = ("round", "closed", "closed_reason", "completed_at_unix_ms", "written_by",
               "master_addr", "master_port", "participants", "wait_list", "redundancy_list",
               "lost", "draining", "joining")  # fmt: skip
    assert {k: data[k] for k in unknown} == dict.fromkeys(unknown)
    assert [(n["node_id"], n["status"]) for n in data["nodes"]] == [("a-1-0", "unknown")]
    assert data["unreadable_keys"] == ["/etcd-elastic/demo/state"]
    assert data["errors"] == ["corrupt value at etcd key '/etcd-elastic/demo/state': not JSON"]


def test_status_names_a_node_key_that_does_not_decode() -> None:
    snapshot = RunSnapshot(
        KEYS, ROUND1, 30, 40, LIVE, 40,
        errors=("corrupt value at etcd key '/etcd-elastic/demo/nodes/x': not JSON",),
        unreadable_keys=("/etcd-elastic/demo/nodes/x",),
    )  # fmt: skip
    lines = status_lines(snapshot, NOW, UTC)
    assert lines[1].startswith("state:           complete, round 1 completed ")
    assert lines[-1] == "unreadable keys: /etcd-elastic/demo/nodes/x"
    assert status_json(snapshot)["round"] == 1


def test_status_shows_the_incarnation_and_the_nodes_starting_the_run_again() -> None:
    ended = RdzvState(round=2, closed=True, closed_reason="done", incarnation=3)
    retry, stale = node("r-7-0", 3, rev=12), node("s-8-0", 3, rev=13)
    nodes = (
        dataclasses.replace(retry, info=dataclasses.replace(retry.info, incarnation=4)),
        dataclasses.replace(stale, info=dataclasses.replace(stale.info, incarnation=2)),
    )
    snapshot = snap(ended, nodes)
    lines = status_lines(snapshot, NOW, UTC)
    assert "incarnation:     3" in lines
    assert node_status(snapshot, "r-7-0") == "starting it again"
    assert node_status(snapshot, "s-8-0") == "of incarnation 2"
    assert status_json(snapshot)["incarnation"] == 3
    started = RdzvState(round=2, incarnation=4)
    assert phase(snap(started, nodes[:1])) == "forming"
    assert list_json([snap(started)], "/etcd-elastic", [])["runs"][0]["incarnation"] == 4


# -- list and gc ---------------------------------------------------------------------


def test_list_lines_and_json() -> None:
    other = RunSnapshot(
        RunKeys("/etcd-elastic", "old"),
        RdzvState(round=3, closed=True, closed_reason="done"),
        5,
        9,
        (),
        9,
        store_keys=2,
    )
    lines = list_lines([snap(ROUND1, LIVE), other], "/etcd-elastic")
    assert lines == [
        "RUN   PHASE     INCARNATION  ROUND  PARTICIPANTS  ALIVE  WAITING  LOST  CLOSED",
        "demo  complete  1            1      3             3      0        0     no",
        "old   closed    1            3      0             0      0        0     yes: done",
    ]
    assert list_lines([], "/x") == ["no runs under /x/"]
    data = list_json([other], "/etcd-elastic", ["/etcd-elastic/junk"])
    assert data["runs"][0]["closed_reason"] == "done" and data["foreign_keys"] == [
        "/etcd-elastic/junk"
    ]


def test_split_run_keys() -> None:
    keys = [
        b"/etcd-elastic/a/state",
        b"/etcd-elastic/a/nodes/n-1-0",
        b"/etcd-elastic/b/store/1/x",
        b"/etcd-elastic/loose",
        b"/etcd-elastic/bad id/state",
        b"/etcd-elastic/.x/state",
    ]
    found = split_run_keys("/etcd-elastic", keys)
    assert found.run_ids == ("a", "b")
    assert found.foreign_keys == (
        "/etcd-elastic/loose",
        "/etcd-elastic/bad id/state",
        "/etcd-elastic/.x/state",
    )


HOUR = 3_600_000


def closed_at(ms: int) -> RdzvState:
    return RdzvState(round=1, closed=True, closed_reason="done", completed_at_unix_ms=ms)


@pytest.mark.parametrize(
    ("snapshot", "collect", "reason"),
    [
        (snap(ROUND1, LIVE), False, "3 node(s) alive"),
        (snap(closed_at(NOW - 3 * HOUR)), True, "closed (done), last round completed 3h ago"),
        (
            snap(closed_at(NOW - HOUR // 2)),
            False,
            "closed (done), but its last round completed only 30m ago",
        ),
        (
            snap(RdzvState(round=2, completed_at_unix_ms=NOW - 2 * HOUR), store=4),
            True,
            "abandoned: no node alive, last round completed 2h ago",
        ),
        (
            snap(RdzvState(round=0, closed=True, closed_reason="x")),
            True,
            "closed (x), no round ever completed",
        ),
        (
            snap(None, store=3),
            True,
            "never formed: no state and no node alive, no round ever completed",
        ),
        (
            RunSnapshot(KEYS, None, 0, 1, (), 1, foreign_keys=("/etcd-elastic/demo/zz",)),
            False,
            "only 1 foreign key(s), not written by etcd-elastic: remove them by hand",
        ),
        (
            RunSnapshot(KEYS, None, 30, 1, (), 1, errors=("corrupt",)),
            False,
            "a value does not decode: inspect it with etcdctl and remove it by hand",
        ),
    ],
)
def test_gc_verdict(snapshot: RunSnapshot, collect: bool, reason: str) -> None:
    verdict = gc_verdict(snapshot, NOW, HOUR)
    assert (verdict.collect, verdict.reason) == (collect, reason)


def test_gc_lines_and_json() -> None:
    keep = gc_verdict(snap(ROUND1, LIVE), NOW, HOUR)
    go = gc_verdict(
        RunSnapshot(
            RunKeys("/etcd-elastic", "old"),
            RdzvState(round=1, closed=True, closed_reason="done"),
            5,
            9,
            (),
            9,
            store_keys=2,
        ),
        NOW,
        HOUR,
    )
    assert gc_lines([keep, go], None) == [
        "ACTION        RUN   KEYS  WHY",
        "keep          demo  -     3 node(s) alive",
        "would remove  old   3     closed (done), no round ever completed",
    ]
    done = [GcResult("old", True, "removed 3 key(s)")]
    assert gc_lines([keep, go], done)[2] == "removed  old   3     removed 3 key(s)"
    data = gc_json([keep, go], None, 3600.0)
    assert data["dry_run"] is True and data["older_than_seconds"] == 3600.0
    assert [r["collect"] for r in data["runs"]] == [False, True]
    assert gc_json([go], done, 1.0)["runs"][0]["removed"] is True


def test_table_pads_all_but_the_last_column() -> None:
    assert table(["A", "LONG"], [["xyz", "1"]], indent="") == ["A    LONG", "xyz  1"]


def test_change_line_and_json() -> None:
    when = datetime.datetime(2026, 11, 20, 14, 2, 11, 5000, tzinfo=UTC)
    change = Change(7, "node_joined", "node vm-123-0 joined (asks for round 3)", "vm-123-0", 3)
    assert change_line(change, when) == "14:02:11 node vm-123-0 joined (asks for round 3)"
    assert json.loads(change_json("demo", change, when)) == {
        "time": "2026-11-20T14:02:11.005+00:00",
        "run_id": "demo",
        "revision": 7,
        "event": "node_joined",
        "text": "node vm-123-0 joined (asks for round 3)",
        "node_id": "vm-123-0",
        "round": 3,
    }
