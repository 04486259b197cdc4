"""agent/observe/journal.py: the history line format, appends from many processes, torn lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.observe.journal import JOURNAL_ENV, JournalError, JournalWriter, read_journal


def test_a_line_has_the_common_keys_then_the_fields(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    with JournalWriter(str(path), "agent") as writer:
        writer.record("round", node="n1", round=3, members=["n1", "n2"], weird=Path("/x"))
    (line,) = path.read_text().splitlines()
    event = json.loads(line)
    assert list(event)[:5] == ["t", "mono", "src", "pid", "event"]
    assert event["src"] == "agent" and event["pid"] == os.getpid()
    assert event["event"] == "round" and event["members"] == ["n1", "n2"]
    assert event["weird"] == "/x"  # not JSON: written as its string, never an error
    assert read_journal(path) == [event]


def test_no_path_records_nothing_and_costs_nothing(tmp_path: Path) -> None:
    writer = JournalWriter.from_env("worker", env={})
    assert not writer.enabled
    writer.record("step", t=1)  # not even the reserved-key check runs
    assert JournalWriter.from_env("worker", env={JOURNAL_ENV: ""}).enabled is False
    on = JournalWriter.from_env("worker", env={JOURNAL_ENV: str(tmp_path / "h")})
    assert on.enabled
    on.close()
    on.close()
    on.record("after_close")
    assert read_journal(tmp_path / "h") == []


@pytest.mark.parametrize(("src", "message"), [("agnet", "history source 'agnet' is not one of")])
def test_bad_source_is_refused(src: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        JournalWriter(None, src)


def test_reserved_keys_are_refused(tmp_path: Path) -> None:
    with (
        JournalWriter(str(tmp_path / "h"), "harness") as writer,
        pytest.raises(TypeError, match=r"fields \['pid'\] are reserved"),
    ):
        writer.record("agent_started", pid=12)


def test_many_processes_append_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    code = (
        "import sys; from agent.observe.journal import JournalWriter\n"
        "w = JournalWriter(sys.argv[1], 'worker')\n"
        "for i in range(300): w.record('step', step=i, pad='x' * 900)\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.DEVNULL)
        for _ in range(4)
    ]
    try:
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0, 0, 0]
    events = read_journal(path)
    assert len(events) == 1200
    for pid in {e["pid"] for e in events}:
        assert [e["step"] for e in events if e["pid"] == pid] == list(range(300))


def test_a_torn_last_line_is_dropped_and_damage_before_it_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    good = '{"mono": 1, "event": "a"}\n'
    path.write_text(good + '{"mono": 2, "ev')
    assert read_journal(path) == [{"mono": 1, "event": "a"}]
    path.write_text(good + '{"mono": 2, "ev\n' + good)
    with pytest.raises(JournalError, match="line 2 is not JSON"):
        read_journal(path)
    path.write_text(good + "[1, 2]\n")
    with pytest.raises(JournalError, match="line 2 is not a JSON object"):
        read_journal(path)
    assert read_journal(tmp_path / "missing") == []
