"""``rdzvctl`` against real etcd: runs built by real handlers, status, list and watch,
``--json`` parsed, exit codes and one-line errors (close and gc: test_rdzvctl_gc.py).

Tests that list runs use a key prefix of their own, so other tests' runs never show up.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from coordinator.core.etcd_client import EtcdClient
from coordinator.core.keys import RunKeys
from coordinator.core.ports import free_ports
from coordinator.core.state import NodeInfo, encode_node
from coordinator.etcd_server import EtcdCluster
from coordinator.rdzvctl import run_command
from coordinator.rdzvctl.cli import parse_args
from coordinator.rdzvctl.model import RunSnapshot
from coordinator.rdzvctl.watch import follow
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.integration.rdzvctl_support import RDZVCTL, ctl, ctl_json, form, handler
from tests.rdzv_helpers import Joins, wait_until

pytestmark = pytest.mark.integration


# -- status ---------------------------------------------------------------------------


def test_status_shows_round_ranks_hosts_leases_and_lists(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    handlers += [handler(etcd1, run_id, 2, 4) for _ in range(3)]
    ranks = form(handlers)
    data = ctl_json(capsys, etcd1, "status", run_id)
    assert (data["phase"], data["round"], data["closed"]) == ("complete", 1, False)
    assert {p["node_id"]: p["rank"] for p in data["participants"]} == ranks
    for p in data["participants"]:
        assert p["alive"] and p["pid"] == os.getpid() and p["local_world_size"] == 2
        assert p["hostname"] and p["addr"] and p["wanted_round"] == 1
        assert 0 < p["lease_ttl_left"] <= 3
    assert data["wait_list"] == data["redundancy_list"] == data["lost"] == []

    # A newcomer waits; a participant that leaves is recorded as lost.
    late = handler(etcd1, run_id, 2, 4)
    handlers.append(late)
    waiting = Joins([late]).start()
    wait_until(lambda: handlers[0].num_nodes_waiting() == 1, 10, "the newcomer on the wait list")
    handlers[2].leave()
    wait_until(lambda: handlers[0].num_nodes_waiting() == 2, 10, "the leaver recorded as lost")
    data = ctl_json(capsys, etcd1, "status", run_id)
    assert data["wait_list"] == [late.node_id] and data["lost"] == [handlers[2].node_id]
    gone = next(p for p in data["participants"] if p["node_id"] == handlers[2].node_id)
    assert gone == {"rank": ranks[handlers[2].node_id], "node_id": gone["node_id"], "alive": False}
    assert {n["node_id"]: n["status"] for n in data["nodes"]}[late.node_id] == "waiting"

    code, out, err = ctl(capsys, etcd1, "status", run_id)
    assert code == 0 and err == ""
    assert "state:           complete, round 1 completed " in out
    assert f"wait list:       {late.node_id}\n" in out
    assert f"lost:            {handlers[2].node_id}\n" in out
    assert "nodes alive:     3\n" in out
    # The survivors re-rendezvous with the newcomer: round 2 has three nodes.
    round2 = Joins(handlers[:2]).start()
    round2.infos()
    waiting.infos()
    data = ctl_json(capsys, etcd1, "status", run_id)
    assert data["round"] == 2 and len(data["participants"]) == 3 and data["lost"] == []


def test_status_of_a_missing_run_exits_1(
    etcd1: EtcdCluster, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = ctl(capsys, etcd1, "status", run_id)
    assert (code, out) == (1, "")
    assert err == (
        f"rdzvctl: error: run {run_id!r} not found: no key starts with /etcd-elastic/{run_id}/; "
        "see 'rdzvctl list' for the runs there are\n"
    )


def test_status_of_a_corrupt_state_names_the_key_and_exits_1(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = RunKeys("/etcd-elastic", run_id)
    client.put(keys.state, b"\x80\x04pickle")
    code, out, err = ctl(capsys, etcd1, "status", run_id)
    assert code == 1
    assert (
        "state:           unreadable: its value does not decode, so round, ranks, lists and "
        "closed are unknown\n"
    ) in out
    assert err == (
        f"rdzvctl: error: corrupt value at etcd key '/etcd-elastic/{run_id}/state': not a "
        "RendezvousState in JSON ('utf-8' codec can't decode byte 0x80 in position 0: "
        "invalid start byte)\n"
    )


def test_status_of_a_corrupt_state_prints_the_error_first_and_only_what_is_real(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient
) -> None:
    keys = RunKeys("/etcd-elastic", run_id)
    lease = client.lease_grant(30)
    try:
        record = NodeInfo(node_id="vm-1-0", wanted_round=2, role="trainer", lease_id=lease)
        client.put(keys.node("vm-1-0"), encode_node(record), lease=lease)
        client.put(keys.nodes_prefix + b"vm-\xff", b"{}", lease=lease)  # not a node id
        client.put(keys.state, b"\x80\x04pickle")
        opts = parse_args(["status", run_id, f"--endpoints={etcd1.endpoint_list}"], environ={})
        both = io.StringIO()  # stdout and stderr in one stream: their order shows
        assert run_command(opts, both, both) == 1
    finally:
        client.lease_revoke(lease)
    lines = both.getvalue().splitlines()
    # Keys as text (the byte that is not UTF-8 escaped as \xff), never b'...' reprs. The
    # error quotes the key with repr(), which doubles that backslash.
    assert lines[0] == (
        f"rdzvctl: error: corrupt value at etcd key '/etcd-elastic/{run_id}/state': not a "
        "RendezvousState in JSON ('utf-8' codec can't decode byte 0x80 in position 0: "
        "invalid start byte); corrupt value at etcd key "
        f"'/etcd-elastic/{run_id}/nodes/vm-\\\\xff': the part after nodes/ is not a node id"
    )
    assert lines[1].startswith(f"run:             {run_id} (key prefix /etcd-elastic, etcd ")
    assert lines[2:4] == [
        "state:           unreadable: its value does not decode, so round, ranks, lists and "
        "closed are unknown",
        "nodes alive:     1",
    ]
    # The lease column is as wide as the lease id's hex (15 or 16 digits, etcd's choice).
    lease_col = max(len("LEASE (hex)"), len(f"{lease:x}"))
    assert lines[4] == (
        f"  NODE    ASKS FOR ROUND  IS       {'LEASE (hex)':<{lease_col}}  LEASE LEFT  ROLE"
    )
    assert re.fullmatch(rf"  vm-1-0  2 {{15}}unknown  {lease:x}  [1-3]?\ds +trainer", lines[5])
    assert lines[6:] == [
        "store:           0 key(s)",
        f"unreadable keys: /etcd-elastic/{run_id}/state /etcd-elastic/{run_id}/nodes/vm-\\xff",
    ]
    assert "b'" not in both.getvalue()


# -- list -----------------------------------------------------------------------------


def test_list_shows_every_run_and_goes_on_past_a_corrupt_one(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient,
    handlers: list[EtcdRendezvousHandler], capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    prefix = f"/{run_id}"
    handlers += [handler(etcd1, "live", 2, 2, prefix) for _ in range(2)]
    form(handlers)
    finished = [handler(etcd1, "finished", 1, 1, prefix)]
    form(finished)
    finished[0].shutdown()  # closes the run, as torchrun does at the end
    client.put(f"{prefix}/broken/state".encode(), b"{not json")
    client.put(f"{prefix}/stray".encode(), b"x")

    code, out, err = ctl(capsys, etcd1, "list", "--key-prefix", prefix)
    assert code == 0
    assert out.splitlines() == [
        "RUN       PHASE       INCARNATION  ROUND  PARTICIPANTS  ALIVE  WAITING  LOST  CLOSED",
        "broken    unreadable  1            0      0             0      0        0     no",
        "finished  closed      1            1      1             0      0        0     "
        "yes: shutdown by an agent",
        "live      complete    1            1      2             2      0        0     no",
    ]
    assert err.splitlines()[0].startswith(
        f"rdzvctl: warning: corrupt value at etcd key '{prefix}/broken/state': not a "
        "RendezvousState in JSON"
    )
    assert err.splitlines()[1] == (
        f"rdzvctl: warning: key '{prefix}/stray' is not part of any run "
        "(not written by etcd-elastic)"
    )
    data = ctl_json(capsys, etcd1, "list", "--key-prefix", prefix)
    assert [(r["run_id"], r["phase"], r["alive"]) for r in data["runs"]] == [
        ("broken", "unreadable", 0), ("finished", "closed", 0), ("live", "complete", 2),
    ]  # fmt: skip
    assert data["runs"][0]["errors"] and data["foreign_keys"] == [f"{prefix}/stray"]
    assert ctl(capsys, etcd1, "list", "--key-prefix", f"{prefix}-none")[1] == (
        f"no runs under {prefix}-none/\n"
    )


def test_list_names_a_key_that_is_not_utf8_as_text(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = f"/{run_id}"
    client.put(f"{prefix}/".encode() + b"\xff", b"x")
    code, out, err = ctl(capsys, etcd1, "list", "--key-prefix", prefix)
    assert (code, out) == (0, f"no runs under {prefix}/\n")
    assert err == (
        f"rdzvctl: warning: key '{prefix}/\\xff' is not part of any run (not written by "
        "etcd-elastic)\n"
    )


# -- watch ----------------------------------------------------------------------------


def _watch_in_thread(
    etcd: EtcdCluster, argv: list[str]
) -> tuple[threading.Thread, io.StringIO, io.StringIO, list[int]]:
    opts = parse_args([*argv, f"--endpoints={etcd.endpoint_list}"], environ={})
    out, err, code = io.StringIO(), io.StringIO(), []
    thread = threading.Thread(target=lambda: code.append(run_command(opts, out, err)))
    thread.start()
    wait_until(lambda: "watching run" in err.getvalue(), 20, "the watch to start")
    return thread, out, err, code


def test_watch_prints_one_line_per_change_as_it_happens(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    thread, out, err, code = _watch_in_thread(etcd1, ["watch", run_id, "--count", "4",
                                                      "--timeout", "60"])  # fmt: skip
    handlers += [handler(etcd1, run_id, 2, 2) for _ in range(2)]
    ranks = form(handlers)
    in_rank_order = " ".join(sorted(ranks, key=ranks.__getitem__))
    handlers[0].set_closed("maintenance")
    thread.join(60)
    assert not thread.is_alive() and code == [0], err.getvalue()
    lines = [line.split(" ", 1) for line in out.getvalue().splitlines()]
    assert all(len(t) == 8 and t[2] == t[5] == ":" for t, _ in lines), lines
    texts = [text for _, text in lines]
    assert sorted(texts[:2]) == sorted(
        f"node {h.node_id} joined (asks for round 1)" for h in handlers
    )
    assert texts[2:] == [f"round 1 complete: 2 nodes [{in_rank_order}]", "run closed (maintenance)"]
    assert err.getvalue() == (
        f"rdzvctl: watching run {run_id} from etcd revision "
        f"{err.getvalue().split('revision ')[1].split(':')[0]}: empty, round 0, 0 node(s) alive "
        "(no key yet); Ctrl-C to stop\n"
    )


def test_watch_json_lines_and_timeout(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    handlers += [handler(etcd1, run_id, 2, 2) for _ in range(2)]
    form(handlers)
    thread, out, _err, code = _watch_in_thread(etcd1, ["watch", run_id, "--json", "--timeout",
                                                       "3"])  # fmt: skip
    handlers[1].leave()  # the survivor's coordinator records it as lost
    started = time.monotonic()
    thread.join(30)
    assert code == [0] and time.monotonic() - started < 20
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(e["event"], e.get("node_id")) for e in events] == [
        ("node_left", handlers[1].node_id),
        ("lost", handlers[1].node_id),
    ]
    assert all(e["run_id"] == run_id and e["revision"] > 0 for e in events)


def test_watch_misses_no_change_made_right_after_its_read(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient
) -> None:
    keys = RunKeys("/etcd-elastic", run_id)
    lease = client.lease_grant(30)
    lines: list[str] = []

    def write_after_the_read(_snapshot: RunSnapshot) -> None:
        # on_start runs once the run has been read: a node that joins now must still show.
        record = encode_node(NodeInfo(node_id="vm-7-0", wanted_round=1, lease_id=lease))
        client.put(keys.node("vm-7-0"), record, lease=lease)

    try:
        emitted = follow(
            client, keys, lambda change: lines.append(change.text),
            count=1, timeout=30, on_start=write_after_the_read,
        )  # fmt: skip
    finally:
        client.lease_revoke(lease)
    assert (emitted, lines) == (1, ["node vm-7-0 joined (asks for round 1)"])


def test_watch_ends_with_exit_0_on_ctrl_c(etcd1: EtcdCluster, run_id: str) -> None:
    proc = subprocess.Popen(
        [str(RDZVCTL), "watch", run_id, f"--endpoints={etcd1.endpoint_list}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        header = proc.stderr.readline()  # blocks until the watch is running
        assert header.startswith(f"rdzvctl: watching run {run_id} from etcd revision ")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
        assert code == 0, proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


# -- console path: exit codes 2 and 3 ------------------------------------------------


def test_console_bad_argument_is_one_line_and_exit_2() -> None:
    done = subprocess.run(
        [str(RDZVCTL), "status", "bad/id"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "rdzvctl: error: RUN: 'bad/id' is invalid: use 1-128 characters from A-Z a-z 0-9 . _ - "
        "starting with a letter or digit\n"
    )


def test_unreachable_etcd_exits_3_naming_the_endpoints() -> None:
    endpoints = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    started = time.monotonic()
    done = subprocess.run(
        [str(RDZVCTL), "status", "job", f"--endpoints={endpoints}", "--read-timeout=1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1
    first, second = endpoints.split(",")
    assert done.stderr.startswith("rdzvctl: error: no etcd member answered get within 1 s; tried ")
    assert first in done.stderr and second in done.stderr
    assert "Check that etcd runs and is reachable at these endpoints" in done.stderr
    assert time.monotonic() - started < 60
