"""rdzvctl shows the last hang and the stalled nodes (status, --json, watch): a node
writes its progress record only when it suspects a hang, so these are all etcd knows."""

from __future__ import annotations

import dataclasses

from coordinator.core.etcd_client import KeyValue, WatchEvent
from coordinator.core.progress import NodeProgress, encode_progress
from coordinator.core.state import Hang
from coordinator.rdzvctl.format import status_json, status_lines
from coordinator.rdzvctl.watch import Tracker, diff_states
from tests.unit.rdzvctl_samples import KEYS, LIVE, NOW, ROUND1, UTC, snap

HANG = Hang(1, ("b-2-0",), 40, True, "a-1-0", 3400, NOW - 2000)


def _with_progress(state_hang: Hang | None, round: int = 1) -> list[str]:
    state = dataclasses.replace(ROUND1, hang=state_hang, round=round)
    progress = (
        NodeProgress("a-1-0", 1, 41, 1500, NOW - 3_500, 2, 2, True, 3000),
        NodeProgress("b-2-0", 1, 40, 1500, NOW - 4_100, 2, 2, True, 3000),
        # an agent of an earlier version published healthy nodes too
        NodeProgress("c-3-0", 1, 41, 0, NOW - 3_400, 1, 2, False, 0),
    )
    snapshot = dataclasses.replace(snap(state, LIVE), progress=progress)
    return status_lines(snapshot, NOW, UTC)


def test_status_names_the_hung_node_and_the_stalled_ones_with_their_steps() -> None:
    lines = _with_progress(HANG)
    start = lines.index(next(line for line in lines if line.startswith("last hang:")))
    assert lines[start : start + 6] == [
        "last hang:       round 1: [b-2-0] stopped first at step 40 (behind the others); "
        "declared by a-1-0 after 3.4s without progress",
        "stalled nodes:   2 in round 1, 0 in earlier rounds (nodes that make progress write "
        "nothing)",
        "  NODE   ROUND  STEP  SILENT  WORKERS  HANG TIMEOUT  STATE",
        "  a-1-0  1      41    3.5s    2/2      3.0s          stalled",
        "  b-2-0  1      40    4.1s    2/2      3.0s          stopped first",
        "  c-3-0  1      41    3.4s    1/2      off           -",
    ]


def test_status_shows_records_of_an_earlier_round_as_that_rounds() -> None:
    # Round 2 trains; the records of round 1 (which hung) stay until the next suspicion.
    lines = _with_progress(HANG, round=2)
    start = lines.index(next(line for line in lines if line.startswith("stalled nodes:")))
    assert lines[start : start + 4] == [
        "stalled nodes:   0 in round 2, 3 in earlier rounds (nodes that make progress write "
        "nothing)",
        "  NODE   ROUND  STEP  SILENT  WORKERS  HANG TIMEOUT  STATE",
        "  a-1-0  1      41    -       2/2      3.0s          was stalled",
        "  b-2-0  1      40    -       2/2      3.0s          stopped first",
    ]


def test_status_without_progress_or_hang_is_unchanged() -> None:
    plain = status_lines(snap(ROUND1, LIVE), NOW, UTC)
    assert not any(line.startswith(("last hang:", "stalled nodes:")) for line in plain)


def test_status_json_has_the_hang_and_the_progress() -> None:
    state = dataclasses.replace(ROUND1, hang=HANG)
    record = NodeProgress("b-2-0", 1, 40, 0, NOW - 4_100, 2, 2, True, 3000)
    out = status_json(dataclasses.replace(snap(state, LIVE), progress=(record,)))
    assert out["hang"] == {
        "round": 1, "nodes": ["b-2-0"], "step": 40, "behind": True, "declared_by": "a-1-0",
        "stalled_ms": 3400, "declared_at_unix_ms": NOW - 2000,
    }  # fmt: skip
    assert out["progress"][0]["step"] == 40 and out["progress"][0]["stalled"] is True
    assert status_json(snap(ROUND1, LIVE))["hang"] is None


def test_watch_shows_a_declared_hang_once() -> None:
    declared = dataclasses.replace(ROUND1, hang=HANG)
    changes = diff_states(ROUND1, declared, 77)
    assert [(c.kind, c.nodes, c.round) for c in changes] == [("hang", ("b-2-0",), 1)]
    assert changes[0].text.startswith("hang declared in round 1: [b-2-0] stopped first")
    assert [c.kind for c in diff_states(declared, declared, 78)] == ["state_rewritten"]


def test_watch_shows_a_suspicion_and_its_end() -> None:
    record = NodeProgress("b-2-0", 1, 40, 1500, NOW - 1_500, 2, 2, True, 3000)
    tracker = Tracker(snap(ROUND1, LIVE, rev=10))
    put = WatchEvent("put", _kv(KEYS.progress("b-2-0"), encode_progress(record), 11), None)
    gone = WatchEvent("delete", _kv(KEYS.progress("b-2-0"), b"", 12), None)
    changes = tracker.apply([put, gone])
    assert [(c.kind, c.node_id, c.text) for c in changes] == [
        ("suspects", "b-2-0", "node b-2-0 suspects a hang: no progress for 1.5s at step 40 in "
         "round 1 (hang timeout 3.0s)"),
        ("unsuspects", "b-2-0", "node b-2-0 no longer suspects a hang (progress again, or "
         "it left)"),
    ]  # fmt: skip
    # What the read held is not news; a healthy record of an earlier agent is none.
    old = WatchEvent("put", _kv(KEYS.progress("b-2-0"), encode_progress(record), 9), None)
    healthy = dataclasses.replace(record, stalled=False)
    quiet = WatchEvent("put", _kv(KEYS.progress("c-3-0"), encode_progress(healthy), 13), None)
    assert tracker.apply([old, quiet]) == []


def _kv(key: bytes, value: bytes, rev: int) -> KeyValue:
    return KeyValue(key, value, rev, rev, 1, 0)
