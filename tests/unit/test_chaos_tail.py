"""The harness's live history reader: whole lines only, and its steady-state question."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.chaos.tail import HistoryTail


def _line(mono: float, pid: int, event: str, **fields: Any) -> bytes:
    record = {"t": 0, "mono": mono, "src": fields.pop("src", "worker"), "pid": pid}
    return (json.dumps({**record, "event": event, **fields}) + "\n").encode()


def _starts(agent_pid: int, pids: list[int], ranks: list[int], mono: float) -> bytes:
    return b"".join(
        _line(mono, pid, "worker_start", rank=r, agent_pid=agent_pid, round=1, group_world=2)
        for pid, r in zip(pids, ranks, strict=True)
    )


def _steps(pids: list[int], ranks: list[int], mono: float, world: int = 4) -> bytes:
    return b"".join(
        _line(mono, pid, "step", rank=r, world=world, round=1)
        for pid, r in zip(pids, ranks, strict=True)
    )


def test_reads_whole_lines_as_they_come(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    tail = HistoryTail(path)
    assert tail.poll() == 0  # no file yet
    whole = _line(1.0, 7, "round", src="agent", round=3)
    path.write_bytes(whole + whole[:10])
    assert tail.poll() == 1 and tail.max_round == 3 and tail.agent_events == 1
    with open(path, "ab") as f:
        f.write(whole[10:] + b"not json\n")
    assert tail.poll() == 1  # the rest of the torn line; a damaged line is skipped
    assert len(tail.events) == 2
    assert tail.first_after("round", 0.5, src="agent") == tail.events[0]
    assert tail.first_after("round", 1.5) is None


def test_steady_needs_every_rank_of_live_agents_recently(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    path.write_bytes(
        _starts(100, [101, 102], [0, 1], 10.0)
        + _starts(200, [201, 202], [2, 3], 10.0)
        + _steps([101, 102, 201], [0, 1, 2], 11.0)
    )
    tail = HistoryTail(path)
    tail.poll()
    assert not tail.steady({100, 200}, 4, now=11.5, window=1.0)  # rank 3 missing
    with open(path, "ab") as f:
        f.write(_steps([202], [3], 11.2))
    tail.poll()
    assert tail.steady({100, 200}, 4, now=11.5, window=1.0)
    assert not tail.steady({100, 200}, 4, now=13.0, window=1.0)  # too long ago
    assert not tail.steady({100}, 4, now=11.5, window=1.0)  # agent 200 is not ours
    assert not tail.steady({100, 200}, 6, now=11.5, window=1.0)  # the wrong world
    assert not tail.steady({100, 200}, 4, now=11.5, window=1.0, started_after=10.5)
    assert tail.stepped_since(10.0) and not tail.stepped_since(10.5)
    assert tail.workers_of(200) == [201, 202]
