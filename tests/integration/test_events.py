"""The run's timeline on a real etcd: who writes which event, exactly once, bounded, and
what ``rdzvctl events`` / ``rdzvctl timeline`` make of it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from coordinator.core.commit_events import EventRecorder
from coordinator.core.etcd_client import EtcdClient
from coordinator.core.event_log import EventLog, record_event, round_generations, trim_events
from coordinator.core.events import Event, read_events
from coordinator.core.keys import RunKeys
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.integration.rdzvctl_support import RDZVCTL, ctl, form, handler
from tests.rdzv_helpers import Joins, wait_until

pytestmark = pytest.mark.integration


def _events(client: EtcdClient, keys: RunKeys) -> list[Event]:
    kvs, _ = client.get_prefix(keys.events_prefix)
    events, errors = read_events(kvs)
    assert errors == []
    return events


def _kinds(events: list[Event]) -> list[tuple[str, str, str]]:
    return [(e.kind, e.node_id, e.cause) for e in events]


def test_a_formed_run_records_joins_rounds_departures_and_the_close_in_order(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient,
    handlers: list[EtcdRendezvousHandler], capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:  # fmt: skip
    handlers += [handler(etcd1, run_id, 2, 3) for _ in range(3)]
    keys = RunKeys("/etcd-elastic", run_id)
    ranks = form(handlers)
    by_rank = sorted(handlers, key=lambda h: ranks[h.node_id])
    rank0, leaving, lost = by_rank
    # One leaves on its own (it says so before its lease goes); one is drained by an
    # operator; the last is re-formed with.
    assert ctl(capsys, etcd1, "drain", run_id, leaving.node_id)[0] == 0
    wait_until(lambda: leaving.drain_requested, 10, "the node to hear of its drain")
    leaving.leave()
    again = Joins([rank0, lost]).start().infos(30)
    assert sorted(i.rank for i in again.values()) == [0, 1]
    lost.leave()
    wait_until(
        lambda: sum(e.kind == "departed" for e in _events(client, keys)) == 2,
        15, "both departures to be recorded",
    )  # fmt: skip
    rank0.set_closed("the test is over")
    events = _events(client, keys)
    joined = {(e.node_id, e.kind) for e in events if e.kind == "joined"}
    assert joined == {(h.node_id, "joined") for h in handlers}
    rest = [(e.kind, e.node_id, e.cause) for e in events if e.kind != "joined"]
    assert rest == [
        ("round_completed", "", ""),
        ("drain_requested", leaving.node_id, ""),
        ("departed", leaving.node_id, "drained"),
        ("round_completed", "", ""),
        ("departed", lost.node_id, "left"),
        ("closed", "", ""),
    ]
    rounds = [e for e in events if e.kind == "round_completed"]
    assert [r.members for r in rounds] == [
        tuple(h.node_id for h in by_rank),
        (rank0.node_id, lost.node_id),
    ]
    assert [r.round for r in rounds] == [1, 2]
    assert events[-1].summary == "the test is over" and events[-1].close_mode == "finished"
    assert all(e.unix_ms > 0 and e.written_by for e in events)
    # Every join precedes the first round (ordered by the node keys' create revisions).
    assert {e.kind for e in events[:3]} == {"joined"}

    code, out, err = ctl(capsys, etcd1, "events", run_id)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert len(lines) == len(events)
    assert f"round 1 completed with 3 node(s): 0={rank0.node_id} 1={leaving.node_id}" in out
    assert f"{leaving.node_id} departed: drained by an operator" in lines[-4]
    assert lines[-1].endswith("run closed (finished): the test is over")
    code, out, err = ctl(capsys, etcd1, "events", run_id, "--json")
    assert code == 0
    objects = [json.loads(line) for line in out.splitlines()]
    assert [o["kind"] for o in objects] == [e.kind for e in events]
    assert objects[3]["members"][0] == {"node_id": rank0.node_id, "rank": 0}

    picture = tmp_path / "run.png"
    code, out, err = ctl(capsys, etcd1, "timeline", run_id, "-o", str(picture))
    assert (code, err) == (0, "")
    assert out == f"wrote {picture}: 3 node(s), 2 round(s), 3 mark(s) from 9 event(s)\n"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_killed_participant_is_recorded_as_lease_expired(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient,
    handlers: list[EtcdRendezvousHandler],
) -> None:  # fmt: skip
    handlers += [handler(etcd1, run_id, 2, 3) for _ in range(3)]
    keys = RunKeys("/etcd-elastic", run_id)
    ranks = form(handlers)
    victim = max(handlers, key=lambda h: ranks[h.node_id])
    # As SIGKILL would: the lease is revoked behind the node's back, nothing said.
    parts = victim._current()
    assert parts is not None
    me = parts.member.current()
    assert me is not None
    kv, _ = client.get(me.key)
    assert kv is not None
    client.lease_revoke(kv.lease)
    wait_until(
        lambda: any(e.kind == "departed" for e in _events(client, keys)),
        15, "the departure to be recorded",
    )  # fmt: skip
    departed = [e for e in _events(client, keys) if e.kind == "departed"]
    assert _kinds(departed) == [("departed", victim.node_id, "lease_expired")]
    assert departed[0].round == 1


def test_a_coordinator_that_leaves_is_recorded_once_as_left_by_its_successor_too(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient,
    handlers: list[EtcdRendezvousHandler],
) -> None:  # fmt: skip
    """The successor never saw the leaver's key (it led): the departure it records must
    carry the id the leaver wrote, or the timeline says the node left twice."""
    leader, *rest = [handler(etcd1, run_id, 2, 3) for _ in range(3)]
    handlers += [leader, *rest]
    keys = RunKeys("/etcd-elastic", run_id)
    first = Joins([leader]).start()  # the first node to come coordinates
    wait_until(lambda: leader.is_coordinator, 10, "the first node to coordinate")
    Joins(rest).start().infos()
    first.infos()
    wait_until(lambda: leader.last_round > 0, 10, "the round")
    rounds = leader.last_round
    leader.leave()
    again = Joins(rest).start().infos(30)
    assert sorted(i.rank for i in again.values()) == [0, 1]
    wait_until(lambda: any(h.is_coordinator for h in rest), 10, "a new coordinator")
    wait_until(
        lambda: sum(e.kind == "round_completed" for e in _events(client, keys)) == rounds + 1,
        15, "the round after the leave to be recorded",
    )  # fmt: skip
    departed = [e for e in _events(client, keys) if e.kind == "departed"]
    assert _kinds(departed) == [("departed", leader.node_id, "left")]


def test_a_coordinator_that_leaves_right_after_its_commit_still_records_the_round(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient,
    handlers: list[EtcdRendezvousHandler], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The others (and the coordinator's own view) see the round before the duty hands its
    event over; leaving then closed the timeline writer first and the event was lost."""
    committed = EventRecorder.committed

    def slowly(self: EventRecorder, *args: Any, **kwargs: Any) -> None:
        time.sleep(1.0)  # a duty thread that was slow to get here after its commit
        committed(self, *args, **kwargs)

    monkeypatch.setattr(EventRecorder, "committed", slowly)
    leader, other = handler(etcd1, run_id, 2, 2), handler(etcd1, run_id, 2, 2)
    handlers += [leader, other]
    keys = RunKeys("/etcd-elastic", run_id)
    first = Joins([leader]).start()
    wait_until(lambda: leader.is_coordinator, 10, "the first node to coordinate")
    Joins([other]).start().infos()
    first.infos()
    leader.leave()
    kinds = [e.kind for e in _events(client, keys)]
    assert kinds.count("round_completed") == 1, kinds


def test_a_rounds_members_are_read_from_its_event_and_a_bad_one_reads_as_unknown(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient,
    handlers: list[EtcdRendezvousHandler],
) -> None:  # fmt: skip
    """What a successor reads for a node it never saw (``round_generations``): the
    round's members and key generations; nothing (not an error) for a round without an
    event or with a value an operator broke, so the departure is still recorded."""
    handlers += [handler(etcd1, run_id, 2, 2) for _ in range(2)]
    keys = RunKeys("/etcd-elastic", run_id)
    form(handlers)
    wait_until(lambda: client.get(keys.event("round_completed/1"))[0] is not None, 10,
               "the round's event")  # fmt: skip
    members = round_generations(client, keys, 1)
    assert sorted(members) == sorted(h.node_id for h in handlers)
    for h in handlers:
        parts = h._current()
        me = parts.member.current() if parts is not None else None
        assert me is not None and members[h.node_id] == me.create_revision
    assert round_generations(client, keys, 2) == {}  # not completed
    client.put(keys.event("round_completed/1"), b"not an event")
    assert round_generations(client, keys, 1) == {}


def test_each_fact_is_written_once_and_the_log_keeps_the_newest(
    client: EtcdClient, run_id: str
) -> None:
    keys = RunKeys("/etcd-elastic", run_id)
    first = Event("departed", node_id="n-1-0", cause="left", generation=7)
    assert record_event(client, keys, first, written_by="n-1-0")
    # The coordinator seeing the same key go: same id, the first write stays.
    later = Event("departed", node_id="n-1-0", cause="lease_expired", generation=7)
    assert not record_event(client, keys, later, written_by="coordinator")
    assert _kinds(_events(client, keys)) == [("departed", "n-1-0", "left")]

    log = EventLog(client, keys, written_by="w", limit=20)
    for start in range(1, 41, 10):
        log.submit(
            Event("restarted", node_id="n-2-0", restart_count=i) for i in range(start, start + 10)
        )
        assert log.flush(30)
    # Ten events in one batch (one transaction) are kept in the order they were submitted.
    assert [e.restart_count for e in _events(client, keys)[-10:]] == list(range(31, 41))
    log.close()
    # Trimmed back to the limit each time it passed it by a tenth: the newest kept.
    assert [e.restart_count for e in _events(client, keys)] == list(range(21, 41))
    assert trim_events(client, keys, 10) == 10
    assert [e.restart_count for e in _events(client, keys)] == list(range(31, 41))


def test_joins_queued_before_a_close_was_recorded_are_written_unless_trimmed_since(
    client: EtcdClient, run_id: str
) -> None:
    """A one-node run closes at once: the close (written at once) lands before the
    coordinator's queued join, an older fact; the join is still written. Only a log at
    its limit (trimmed) skips joins older than everything it kept."""
    keys = RunKeys("/etcd-elastic", run_id)
    joined_at = client.put(keys.run_prefix + b"nodes-stand-in", b"")
    assert record_event(client, keys, Event("closed", incarnation=1, revision=joined_at + 1))
    log = EventLog(client, keys, written_by="w", limit=10)
    log.submit([Event("joined", node_id="n-1-0", revision=joined_at)])
    assert log.flush(30)
    log.close()
    assert _kinds(_events(client, keys)) == [("joined", "n-1-0", ""), ("closed", "", "")]

    full = RunKeys("/etcd-elastic", run_id + "-full")
    for i in range(1, 11):
        record_event(client, full, Event("restarted", node_id="n-2-0", restart_count=i))
    log = EventLog(client, full, written_by="w", limit=10)
    log.submit([Event("joined", node_id="n-1-0", revision=joined_at)])  # older than all
    assert log.flush(30)
    log.close()
    assert "joined" not in {e.kind for e in _events(client, full)}


def test_rdzvctl_events_and_timeline_error_paths(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient, capsys: pytest.CaptureFixture[str],
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    code, out, err = ctl(capsys, etcd1, "events", run_id)
    assert (code, out) == (1, "")
    assert err == (
        f"rdzvctl: error: run {run_id!r} not found: no key starts with /etcd-elastic/{run_id}/; "
        "see 'rdzvctl list' for the runs there are\n"
    )
    client.put(RunKeys("/etcd-elastic", run_id).node("n-1-0"), b"{}")
    for argv in (["events", run_id], ["timeline", run_id, "-o", str(tmp_path / "x.png")]):
        code, out, err = ctl(capsys, etcd1, *argv)
        assert (code, out) == (1, "")
        assert err == (
            f"rdzvctl: error: run {run_id!r} has no events: nothing under "
            f"/etcd-elastic/{run_id}/events/ (agents older than the run timeline record none)\n"
        )
    client.put(RunKeys("/etcd-elastic", run_id).event("fault/x/1"), b"not json")
    record_event(client, RunKeys("/etcd-elastic", run_id), Event("fault", node_id="n-1-0"))
    code, out, err = ctl(capsys, etcd1, "events", run_id)
    assert code == 0 and "n-1-0 fault" in out
    assert err == (
        f"rdzvctl: warning: skipped: corrupt value at etcd key "
        f"'/etcd-elastic/{run_id}/events/fault/x/1': not a RunEvent in JSON (Failed to load "
        "JSON: Expecting value: line 1 column 1 (char 0).)\n"
    )
    # Without matplotlib: one line that says what to install.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, err = ctl(capsys, etcd1, "timeline", run_id, "-o", str(tmp_path / "x.png"))
    assert (code, out) == (1, "")
    assert err.endswith(
        "rdzvctl: error: timeline needs matplotlib, which is not installed: "
        "pip install 'etcd-elastic[timeline]' (or pip install matplotlib)\n"
    )
    assert not (tmp_path / "x.png").exists()


def test_rdzvctl_events_follow_prints_the_stored_then_the_new_until_ctrl_c(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient
) -> None:
    keys = RunKeys("/etcd-elastic", run_id)
    record_event(client, keys, Event("fault", node_id="n-1-0", summary="first"))
    proc = subprocess.Popen(
        [str(RDZVCTL), "events", run_id, "--follow", "--json",
         f"--endpoints={etcd1.endpoint_list}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["summary"] == "first"
        record_event(client, keys, Event("restarted", node_id="n-1-0", restart_count=1))
        second = json.loads(proc.stdout.readline())
        assert (second["kind"], second["restart_count"]) == ("restarted", 1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert (proc.returncode, out, err) == (0, "", "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
