"""The agent's history: what it records, and that a bad history path never stops it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.observe.journal import JOURNAL_ENV, NODE_ENV, ROUND_ENV, read_journal
from agent.observe.recording import RoundRecorder
from coordinator.torch_adapter.surface import ForeignSurface


class _Handler(ForeignSurface):
    """What the recorder reads of our handler (the values a completed round leaves)."""

    node_id = "host_1_0_abc"
    last_round = 4
    last_members = ("host_1_0_abc", "host_2_0_def")


def _recorder(env: dict[str, str]) -> RoundRecorder:
    return RoundRecorder(_Handler(), "job", env)


def test_a_round_its_workers_and_the_exit_are_recorded(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    rec = _recorder({JOURNAL_ENV: str(path)})
    assert rec.formed(0, 2) == {ROUND_ENV: "4", NODE_ENV: "host_1_0_abc"}
    rec.started({1: 11, 0: 10}, 0)
    rec.stopped("membership")
    rec.exited(0)
    lines = read_journal(path)
    assert [e["event"] for e in lines] == [
        "round",
        "workers_started",
        "workers_stopped",
        "agent_exit",
    ]
    assert lines[0]["members"] == ["host_1_0_abc", "host_2_0_def"]
    assert lines[1]["pids"] == [10, 11]
    assert lines[2]["reason"] == "membership" and lines[3]["code"] == 0


def test_an_unwritable_history_path_is_a_warning_not_a_crash(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "missing" / "history.jsonl"
    with caplog.at_level(logging.WARNING, logger="agent.observe.recording"):
        rec = _recorder({JOURNAL_ENV: str(bad)})
    assert [r.getMessage() for r in caplog.records] == [
        f"{JOURNAL_ENV}={bad} cannot be written ([Errno 2] No such file or directory: "
        f"'{bad}'); no history is recorded"
    ]
    rec.formed(0, 1)
    rec.exited(0)
    assert not bad.exists()
