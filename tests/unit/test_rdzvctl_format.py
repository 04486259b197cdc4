"""``rdzvctl``'s pure parts: argument checks (one pinned line, exit 2), what status, list,
gc and watch print, the run phase, gc's verdicts and the watch's event-to-line tracker."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from coordinator.core.etcd_client import KeyValue, WatchEvent
from coordinator.core.keys import RunKeys
from coordinator.core.state import NodeInfo, RdzvState, encode_node, encode_state
from coordinator.rdzvctl.cli import parse_args
from coordinator.rdzvctl.format import (
    change_json,
    change_line,
    gc_json,
    gc_lines,
    list_json,
    list_lines,
    parse_duration,
    status_json,
    status_lines,
    table,
)
from coordinator.rdzvctl.model import NodeView, RunSnapshot, phase, split_run_keys
from coordinator.rdzvctl.ops import GcResult, gc_verdict
from coordinator.rdzvctl.watch import Change, Tracker, diff_states

UTC = datetime.timezone.utc
KEYS = RunKeys("/etcd-elastic", "demo")
# 2026-11-20 14:02:11 UTC
T0 = 1_795_183_331_000
NOW = T0 + 125_000


def node(node_id: str, wanted: int, *, rev: int, ttl: int | None = 4, pid: int = 100) -> NodeView:
    info = NodeInfo(
        node_id=node_id,
        wanted_round=wanted,
        addr=f"10.0.0.{rev}",
        hostname=f"host{rev}",
        pid=pid,
        local_world_size=2,
        role="default",
        lease_id=0x1000 + rev,
        started_at_unix_ms=T0 - 1000,
        free_port=29500,
        create_revision=rev,
    )
    return NodeView(info, lease=0x1000 + rev, create_revision=rev, mod_revision=rev, ttl_left=ttl)


def snap(
    state: RdzvState | None, nodes: tuple[NodeView, ...] = (), *, store: int = 0, rev: int = 40
) -> RunSnapshot:
    return RunSnapshot(
        keys=KEYS,
        state=state,
        state_mod_revision=30 if state is not None else 0,
        state_revision=rev,
        nodes=nodes,
        nodes_revision=rev,
        store_keys=store,
    )


ROUND1 = RdzvState(
    round=1,
    participants=("a-1-0", "b-2-0", "c-3-0"),
    master_addr="10.0.0.1",
    master_port=29500,
    completed_at_unix_ms=T0,
    written_by="a-1-0",
)
LIVE = (node("a-1-0", 1, rev=1), node("b-2-0", 1, rev=2), node("c-3-0", 1, rev=3))


# -- arguments ------------------------------------------------------------------------


def error_of(
    argv: list[str], capsys: pytest.CaptureFixture[str], env: dict[str, str] | None = None
) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, environ=env or {})
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.rstrip("\n")


COMMANDS = "status, watch, list, close, gc"
ID_RULE = "use 1-128 characters from A-Z a-z 0-9 . _ - starting with a letter or digit"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], f"give a command: one of {COMMANDS}; see rdzvctl --help"),
        (["stats", "x"], f"'stats' is not a command; use one of {COMMANDS}"),
        (["status"], "RUN: missing; see rdzvctl status --help"),
        (["status", "a/b"], f"RUN: 'a/b' is invalid: {ID_RULE}"),
        (["status", "x", "--bogus"], "--bogus: unknown argument; see rdzvctl --help"),
        (["list", "--endpoints", "h:0"], "--endpoints: 'h:0': '0' is not a port number (1-65535)"),
        (
            ["list", "--endpoints", ""],
            "--endpoints: '' is empty: give the etcd members as host:port[,host:port...]",
        ),
        (
            ["list", "--rdzv-endpoint", "a:1,,b:2"],
            "--endpoints: 'a:1,,b:2': has an empty item (remove the extra ',')",
        ),
        (
            ["list", "--key-prefix", "etcd"],
            "--key-prefix: 'etcd' is invalid: it must start with '/'",
        ),
        (
            ["list", "--key-prefix", "/a/"],
            "--key-prefix: '/a/' is invalid: it must not end with '/'",
        ),
        (["list", "--protocol", "grpc"], "--protocol: 'grpc' is not http or https"),
        (
            ["list", "--endpoints", "https://h:1", "--protocol", "http"],
            "--protocol: 'http' but --endpoints uses https://: make them agree",
        ),
        (["list", "--read-timeout", "0"], "--read-timeout: '0' is not a number of seconds above 0"),
        (
            ["list", "--read-timeout", "soon"],
            "--read-timeout: 'soon' is not a number of seconds above 0",
        ),
        (["list", "--user", "root"], "--user: is set without --password (or $RDZVCTL_PASSWORD)"),
        (["list", "--password", "pw"], "--password: is set without --user: give both or neither"),
        (
            ["list", "--ca-cert", "/nonexistent/ca.pem"],
            "--ca-cert: '/nonexistent/ca.pem': no such file",
        ),
        (["watch", "x", "--count", "0"], "--count: '0' is not a whole number of changes above 0"),
        (["watch", "x", "--timeout", "-1"], "--timeout: '-1' is not a number of seconds above 0"),
        (
            ["close", "x", "--reason", "  "],
            "--reason: is empty: say why the run ends, or leave it out",
        ),
        (["gc"], "--older-than: missing; see rdzvctl gc --help"),
        (
            ["gc", "--older-than", "2 weeks"],
            "--older-than: '2 weeks' is not a duration; give e.g. 90s, 10m, 2h, 7d or 1h30m",
        ),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert error_of(argv, capsys) == f"rdzvctl: error: {message}"


def test_tls_file_checks_name_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pem = tmp_path / "c.pem"
    pem.write_text("x")
    assert error_of(["list", "--cert", str(pem)], capsys) == (
        "rdzvctl: error: --cert: is set without --key: give both or neither"
    )
    assert error_of(["list", "--ca-cert", str(pem)], capsys) == (
        "rdzvctl: error: --ca-cert: is set but the protocol is http: add --protocol=https"
    )


def test_good_arguments_in_either_position() -> None:
    before = parse_args(["--endpoints", "h1:1,h2", "--json", "status", "job-1"], environ={})
    after = parse_args(["status", "job-1", "--endpoints=h1:1,h2", "--json"], environ={})
    assert before == after
    assert before.etcd.endpoints == ("h1:1", "h2:2379")
    assert before.json and before.run == "job-1" and before.key_prefix == "/etcd-elastic"
    assert before.etcd.retry_budget == 10.0 and before.etcd.request_timeout == 5.0


def test_defaults_password_from_env_and_https_from_scheme() -> None:
    opts = parse_args(
        ["list", "--endpoints", "https://e:2379", "--user", "ops", "--read-timeout", "2"],
        environ={"RDZVCTL_PASSWORD": "s3cret"},
    )
    assert (opts.etcd.protocol, opts.etcd.user, opts.etcd.password) == ("https", "ops", "s3cret")
    assert (opts.etcd.request_timeout, opts.etcd.retry_budget) == (2.0, 2.0)
    plain = parse_args(["list"], environ={})
    assert plain.etcd.endpoints == ("127.0.0.1:2379",) and plain.etcd.password is None


def test_command_options() -> None:
    watch = parse_args(["watch", "r", "--count", "3", "--timeout", "1.5"], environ={})
    assert (watch.count, watch.timeout) == (3, 1.5)
    close = parse_args(["close", "r", "--reason", " maintenance   window "], environ={})
    assert close.reason == "maintenance window"
    gc = parse_args(["gc", "--older-than", "1h30m", "--dry-run"], environ={})
    assert (gc.older_than, gc.dry_run) == (5400.0, True)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        ("30s", 30),
        ("10m", 600),
        ("2h", 7200),
        ("7d", 604800),
        ("1h30m", 5400),
        ("0", 0),
        ("1.5m", 90),
        ("2H", 7200),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "1w", "-1s", "1 h", "1h-"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)


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
        "closed:          no",
        "master:          10.0.0.1:29500",
        "participants:    3 in round 1",
        "  RANK  NODE   ADDR      HOSTNAME  PID  WORKERS  LEASE LEFT  ASKS FOR",
        "  0     a-1-0  10.0.0.1  host1     100  2        4s          1",
        "  1     b-2-0  10.0.0.2  host2     100  2        4s          1",
        "  2     c-3-0  -         -         -    -        gone        -",
        "wait list:       d-4-0",
        "redundancy list: -",
        "lost:            c-3-0",
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
    assert lines[2] == "closed:          yes: maintenance"
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
        ("b-2-0", "redundant"),
    ]
    assert data["nodes"][0]["lease_id_hex"] == "1001"


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
        "RUN   PHASE     ROUND  PARTICIPANTS  ALIVE  WAITING  LOST  CLOSED",
        "demo  complete  1      3             3      0        0     no",
        "old   closed    3      0             0      0        0     yes: done",
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
    assert tracker.start_revision == 11
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
    assert tracker.start_revision == 91


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
