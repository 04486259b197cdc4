"""The formation benchmark's critical path, put together from the node processes' stamps."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from benchmarks.critical_path import combine, describe, path_of, process_report, thread_cpu_by_id


def _report(
    keys: tuple[float, float] | None = None,
    commits: list[tuple[float, float]] | None = None,
    coordinator_cpu: float = 0.0,
    watch_cpu: float = 0.0,
    failed: int = 0,
) -> dict[str, Any]:
    report: dict[str, Any] = {"coordinator_cpu_s": coordinator_cpu, "watch_cpu_s": watch_cpu}
    if keys is not None:
        report["node_key"] = {"count": 2, "first_start": keys[0], "last_end": keys[1]}
        report["lease_grant"] = {"count": 2, "first_start": keys[0], "last_end": keys[1] - 1}
    if commits:
        report["commit"] = {
            "count": len(commits),
            "first_start": min(s for s, _ in commits),
            "last_end": max(e for _, e in commits),
            "spans": commits,
        }
    if failed:
        report["failed_commit"] = {"count": failed, "first_start": 0.0, "last_end": 0.0}
    return report


def test_the_path_runs_from_the_last_key_to_the_commit_to_the_last_node_back() -> None:
    reports = [
        _report(keys=(100.1, 101.5), watch_cpu=0.5),
        _report(keys=(100.2, 101.8), commits=[(101.9, 102.0)], coordinator_cpu=0.03, watch_cpu=0.2),
        _report(failed=1),
    ]
    path = combine(100.0, [102.1, 102.4, 102.2], reports)
    assert path == pytest.approx(
        {
            "cp_last_lease_s": 0.8,
            "cp_last_key_s": 1.8,
            "cp_commit_sent_s": 1.9,
            "cp_commit_s": 2.0,
            "commits": 1.0,
            "coordinator_cpu_s": 0.03,  # the committing process's threads
            "coordinator_watch_cpu_s": 0.2,
            "failed_commits": 1.0,
            "cp_first_return_s": 2.1,
            "cp_last_return_s": 2.4,
        }
    )


def test_the_last_of_several_commits_is_the_one_on_the_path() -> None:
    reports = [_report(commits=[(10.5, 10.6)]), _report(commits=[(11.0, 11.2)], coordinator_cpu=1)]
    path = combine(10.0, [11.3], reports)
    assert path["cp_commit_s"] == pytest.approx(1.2) and path["commits"] == 2.0
    assert path["coordinator_cpu_s"] == 1.0


def test_a_run_without_stamps_keeps_only_the_returns() -> None:
    # torch's systems: no client of ours, so no key, lease or commit stamps.
    assert combine(5.0, [6.0, 7.0], [_report(), _report()]) == {
        "cp_first_return_s": 1.0,
        "cp_last_return_s": 2.0,
    }
    assert combine(5.0, [], []) == {}


def test_the_text_line_names_each_step_and_marks_what_is_missing() -> None:
    path = path_of(
        {"cp_last_key_s": 1.23456, "cp_commit_s": 1.3, "cp_last_return_s": 1.5, "other": 9.0}
    )
    assert path == {"cp_last_key_s": 1.2346, "cp_commit_s": 1.3, "cp_last_return_s": 1.5}
    assert describe(path) == (
        "last key 1.235 s -> commit 1.300 s (sent -) -> last node back 1.500 s (first -)"
    )
    assert describe({"coordinator_cpu_s": 0.01234}).endswith(
        "; coordinator thread CPU 0.012 s, its process's watch thread 0.000 s"
    )


def test_a_process_reports_the_cpu_of_its_busiest_coordinator_thread() -> None:
    before = thread_cpu_by_id()
    done = threading.Event()

    def spin() -> None:
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        done.wait(5)

    thread = threading.Thread(target=spin, name="rdzv-coordinator")
    thread.start()
    try:
        deadline = time.monotonic() + 10
        report: dict[str, Any] = {}
        while time.monotonic() < deadline:
            report = process_report(time.monotonic(), before)
            if report["coordinator_cpu_s"] >= 0.04:
                break
            time.sleep(0.01)
        assert 0.04 <= report["coordinator_cpu_s"] < 5
        assert "node_key" not in report  # nothing stamped after `since`
    finally:
        done.set()
        thread.join()
