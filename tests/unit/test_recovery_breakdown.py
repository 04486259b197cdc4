"""The recovery benchmark's pure part: which workers recovered, and the breakdown."""

from __future__ import annotations

import json
from typing import Any

import pytest

from benchmarks.recovery_breakdown import (
    AGENT_COMPONENTS,
    TORCHRUN_COMPONENTS,
    Breakdown,
    WorkerRecord,
    breakdown,
    check_target,
    median_breakdown,
    parse_worker_lines,
    recovered_attempt,
)


def _worker(
    pid: int, rank: int, start: float, *, world: int = 2, restart: int = 1, rnd: int = 7,
    step: float | None = None,
) -> WorkerRecord:  # fmt: skip
    times = {"start": start, "imported": start + 0.1, "pg": start + 0.3, "checkpoint": start + 0.4}
    times["step1"] = start + 0.5 if step is None else step
    return WorkerRecord(pid=pid, rank=rank, world=world, restart=restart, round=rnd, times=times)


def _line(ev: str, mono: float, **extra: Any) -> str:
    fields = {"pid": 11, "rank": 1, "world": 2, "restart": 0, "round": 3, **extra}
    return json.dumps({"ev": ev, "mono": mono, "wall": 0.0, **fields})


def test_parse_worker_lines_keeps_each_first_milestone_and_skips_a_torn_line() -> None:
    text = "\n".join([_line("start", 1.0), _line("imported", 2.0), _line("pg", 3.0)])
    record = parse_worker_lines(text + '\n{"ev": "checkp')
    assert record == WorkerRecord(11, 1, 2, 0, 3, {"start": 1.0, "imported": 2.0, "pg": 3.0})


def test_parse_worker_lines_without_a_start_is_none() -> None:
    assert parse_worker_lines("") is None
    assert parse_worker_lines(_line("imported", 2.0)) is None


def test_recovered_attempt_takes_the_latest_worker_of_each_rank_after_the_failure() -> None:
    old = [_worker(1, 0, 1.0, restart=0), _worker(2, 1, 1.0, restart=0)]
    failed_try = _worker(3, 0, 10.5)  # started after the failure, replaced again
    new = [_worker(4, 0, 11.0), _worker(5, 1, 11.2)]
    assert recovered_attempt([*old, failed_try, *new], 10.0, 2) == new


@pytest.mark.parametrize(
    "workers",
    [
        [_worker(4, 0, 11.0)],  # rank 1 missing
        [_worker(4, 0, 11.0), _worker(5, 1, 9.0)],  # rank 1 from before the failure
        [_worker(4, 0, 11.0), _worker(5, 1, 11.0, world=4)],  # another group size
        [_worker(4, 0, 11.0), WorkerRecord(5, 1, 2, 1, 7, {"start": 11.0, "pg": 11.3})],
    ],
)
def test_recovered_attempt_is_none_until_every_rank_completed_a_step(
    workers: list[WorkerRecord],
) -> None:
    assert recovered_attempt(workers, 10.0, 2) is None


def _events() -> list[dict[str, Any]]:
    return [
        {"event": "round", "node": "n0", "round": 6, "mono": 1.0},
        {"event": "workers_stopped", "node": "n0", "round": 6, "mono": 10.05},
        {"event": "workers_stopped", "node": "n1", "round": 6, "mono": 10.08},
        {"event": "workers_stopped", "node": "n1", "round": 6, "mono": 10.3},  # a later one
        {"event": "round", "node": "n0", "round": 7, "mono": 10.2},
        {"event": "round", "node": "n1", "round": 7, "mono": 10.25},
    ]


def test_breakdown_of_ours_follows_the_last_node_and_worker_and_sums_to_the_total() -> None:
    new = [_worker(4, 0, 10.3), _worker(5, 1, 10.4, step=10.95)]
    before = [_worker(1, 0, 1.0, restart=0), _worker(2, 1, 1.0, restart=0)]
    result = breakdown(10.0, new, _events(), before)
    assert tuple(result.components) == AGENT_COMPONENTS
    expected = {
        "detect": 0.08,
        "rendezvous": 0.17,
        "spawn": 0.15,
        "import": 0.1,
        "process_group": 0.2,
        "checkpoint": 0.1,
        "first_step": 0.15,
    }
    assert result.components == pytest.approx(expected)
    assert result.total == pytest.approx(0.95)
    assert sum(result.components.values()) == pytest.approx(result.total)
    assert (result.restarts, result.world) == (1, 2)


def test_breakdown_without_agent_history_lumps_detection_rendezvous_and_spawn() -> None:
    new = [_worker(4, 0, 12.0, rnd=-1), _worker(5, 1, 12.5, rnd=-1)]
    result = breakdown(10.0, new)
    assert tuple(result.components) == TORCHRUN_COMPONENTS
    assert result.components["detect_rendezvous_spawn"] == pytest.approx(2.5)
    assert result.total == pytest.approx(3.0)


def test_breakdown_never_has_a_negative_component() -> None:
    # A round event recorded after the workers' first line (clock of another process,
    # reordered writes): the milestone counts as reached at the next one's latest.
    events = [{"event": "round", "node": "n0", "round": 7, "mono": 10.9}]
    new = [_worker(4, 0, 10.3), _worker(5, 1, 10.4)]
    result = breakdown(10.0, new, events)
    assert min(result.components.values()) >= 0
    assert sum(result.components.values()) == pytest.approx(result.total)


def test_breakdown_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no recovered workers"):
        breakdown(1.0, [])


def test_median_breakdown_is_per_component() -> None:
    runs = [
        Breakdown(1.0, {"detect": 0.1, "spawn": 0.9}, 1, 2),
        Breakdown(2.0, {"detect": 0.3, "spawn": 1.7}, 1, 2),
        Breakdown(3.0, {"detect": 0.2, "spawn": 2.8}, 1, 2),
    ]
    assert median_breakdown(runs) == {"detect": 0.2, "spawn": 1.7}


@pytest.mark.parametrize(
    ("case", "ours", "torch", "met", "missed"),
    [
        ("a", 0.3, 1.2, True, None),
        ("a", 0.5, 2.0, False, "0.100 s over 0.4 s"),
        ("a", 0.3, 0.6, False, "2.00x faster, not 3x"),
        ("b", 0.5, None, True, None),  # torchrun did not recover
        ("c", 5.9, None, True, None),
        ("c", 7.0, 3.0, False, "1.000 s over 6 s"),
        ("a", None, 1.0, None, None),
    ],
)
def test_check_target(
    case: str, ours: float | None, torch: float | None, met: bool | None, missed: str | None
) -> None:
    result = check_target(case, ours, torch, lease_ttl=5)
    assert (result["met"], result["missed_by"]) == (met, missed)


def test_check_target_names_an_unknown_case() -> None:
    with pytest.raises(ValueError, match="unknown recovery case 'd': choose from a, b, c"):
        check_target("d", 1.0, 1.0, 5)


def test_markdown_has_a_row_per_system_and_the_verdict_per_case() -> None:
    from benchmarks.recovery_report import markdown

    def entry(name: str, median: float | None, parts: dict[str, float]) -> dict[str, Any]:
        return {
            "name": name, "median": median, "min": median, "max": median, "breakdown": parts,
            "restarts": [1] if median else [], "ratio_vs_torch_c10d": 4.0 if median else None,
            "errors": [] if median else ["run 1: did not recover within 90 s (no step)\nlog"],
        }  # fmt: skip

    ours = entry("ours (etcdrun)", 0.5, {name: 0.05 for name in AGENT_COMPONENTS})
    torch = entry("torchrun c10d", None, {})
    result = {
        "cases": {
            "a": {
                "title": "worker crash, 1 node x 2 workers",
                "systems": {"etcd-v3": ours, "c10d": torch},
                "target": check_target("a", 0.5, None, 5),
            }
        }
    }
    text = markdown(result)
    assert "| (a) | ours (etcdrun) | 0.500 (0.500-0.500) | 0.050 |" in text
    assert "| (a) | torchrun c10d | run 1: did not recover within 90 s (no step) |" in text
    assert "- (a) worker crash, 1 node x 2 workers: target <= 0.4 s and >= 3x faster" in text
    assert "ours 0.500 s; 4.0x faster than torchrun: MISSED: 0.100 s over 0.4 s" in text


def test_progress_says_how_far_the_late_workers_got() -> None:
    from benchmarks.recovery_breakdown import progress

    old = _worker(1, 0, 1.0)
    stuck = WorkerRecord(5, 1, 4, 1, -1, {"start": 58.2, "imported": 60.0})
    assert progress([old, stuck, WorkerRecord(6, 0, 4, 0, -1, {"start": 59.0})], 10.0) == (
        "2 workers started after the failure (first at +48.20 s); the furthest reached 'imported'"
    )
    assert progress([old], 10.0) == "no worker started after the failure"
