"""rdzvctl shows each node's last progress and the last hang (status, --json, watch)."""

from __future__ import annotations

import dataclasses

from coordinator.core.progress import NodeProgress
from coordinator.core.state import Hang
from coordinator.rdzvctl.format import status_json, status_lines
from coordinator.rdzvctl.watch import diff_states
from tests.unit.rdzvctl_samples import LIVE, NOW, ROUND1, UTC, snap

HANG = Hang(1, ("b-2-0",), 40, True, "a-1-0", 3400, NOW - 2000)


def _with_progress(state_hang: Hang | None) -> list[str]:
    state = dataclasses.replace(ROUND1, hang=state_hang)
    progress = (
        NodeProgress("a-1-0", 1, 41, 100, NOW - 3_500, 2, 2, True, 3000),
        NodeProgress("b-2-0", 1, 40, 0, NOW - 4_100, 2, 2, True, 3000),
        NodeProgress("c-3-0", 1, 41, 0, NOW - 3_400, 1, 2, False, 0),
    )
    snapshot = dataclasses.replace(snap(state, LIVE), progress=progress)
    return status_lines(snapshot, NOW, UTC)


def test_status_names_the_hung_node_and_every_nodes_step_and_age() -> None:
    lines = _with_progress(HANG)
    start = lines.index(next(line for line in lines if line.startswith("last hang:")))
    assert lines[start : start + 5] == [
        "last hang:       round 1: [b-2-0] stopped first at step 40 (behind the others); "
        "declared by a-1-0 after 3.4s without progress",
        "progress:        3 node(s) reporting",
        "  NODE   ROUND  STEP  AGE   WORKERS  HANG TIMEOUT  STATE",
        "  a-1-0  1      41    3.5s  2/2      3.0s          stalled",
        "  b-2-0  1      40    4.1s  2/2      3.0s          stopped first",
    ]
    assert lines[start + 5] == "  c-3-0  1      41    3.4s  1/2      off           -"


def test_status_without_progress_or_hang_is_unchanged() -> None:
    plain = status_lines(snap(ROUND1, LIVE), NOW, UTC)
    assert not any(line.startswith(("last hang:", "progress:")) for line in plain)


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
