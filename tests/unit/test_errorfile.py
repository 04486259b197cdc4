"""Reading torch @record error files, choosing the root cause, formatting the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.workers.errorfile import Failure, format_report, read_failure, root_cause

T0 = 1_700_000_000.0


def _record_file(tmp_path: Path, name: str, message: str, ts: int) -> str:
    path = tmp_path / name
    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": "Traceback:\n  line 1\nboom", "timestamp": str(ts)},
        }
    }
    path.write_text(json.dumps(data))
    return str(path)


def test_record_format(tmp_path: Path) -> None:
    path = _record_file(tmp_path, "e.json", "RuntimeError: boom", 1_700_000_005)
    f = read_failure(
        global_rank=3, local_rank=1, pid=42, exitcode=1, error_file=path, observed_at=T0
    )
    assert f == Failure(
        3, 1, 42, 1, path, "RuntimeError: boom", "Traceback:\n  line 1\nboom", 1_700_000_005.0, T0
    )
    assert f.signal_name is None


def test_flat_format(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"message": "it broke", "timestamp": "1700000009"}))
    f = read_failure(
        global_rank=0, local_rank=0, pid=1, exitcode=2, error_file=str(path), observed_at=T0
    )
    assert (f.message, f.traceback, f.timestamp) == ("it broke", "", 1_700_000_009.0)


def test_no_file_signal() -> None:
    f = read_failure(
        global_rank=0,
        local_rank=0,
        pid=7,
        exitcode=-9,
        error_file="/nonexistent/e.json",
        observed_at=T0,
    )
    assert f.message == "killed by signal 9 (SIGKILL), pid 7"
    assert f.signal_name == "SIGKILL"
    assert f.error_file is None
    assert f.timestamp == T0


def test_no_file_exit_code() -> None:
    f = read_failure(
        global_rank=0, local_rank=0, pid=7, exitcode=3, error_file=None, observed_at=T0
    )
    assert f.message == (
        "exited with code 3, pid 7; no error file; decorate the entry point with "
        "torch's @record to see the traceback"
    )


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "JSONDecodeError: Expecting property name enclosed in double quotes"),
        ('{"message": 5}', "not in @record's format"),
        ("[1, 2]", "not in @record's format"),
    ],
)
def test_bad_file_is_reported_not_raised(tmp_path: Path, content: str, reason: str) -> None:
    path = tmp_path / "e.json"
    path.write_text(content)
    f = read_failure(
        global_rank=0, local_rank=0, pid=7, exitcode=1, error_file=str(path), observed_at=T0
    )
    assert f.message.startswith(
        f"exited with code 1, pid 7 (error file {str(path)!r} unreadable: {reason}"
    )


def _f(rank: int, ts: float, exited_at: float | None = None) -> Failure:
    exited = ts if exited_at is None else exited_at
    return Failure(rank, rank, 100 + rank, 1, None, f"err {rank}", "", ts, exited)


def test_root_cause_earliest_then_lowest_rank() -> None:
    assert root_cause({2: _f(2, 5.0), 1: _f(1, 6.0)}).global_rank == 2
    assert root_cause({2: _f(2, 5.0), 1: _f(1, 5.0)}).global_rank == 1


def test_root_cause_same_second_the_first_to_exit_is_the_cause() -> None:
    """Rank 3 raised; rank 2's collective broke in the same second and it exited later."""
    culprit, victim = _f(3, 1000.0, exited_at=1000.31), _f(2, 1000.0, exited_at=1000.52)
    assert root_cause({2: victim, 3: culprit}) is culprit
    # A file's whole second still comes first: an earlier second wins over an earlier exit.
    assert root_cause({2: _f(2, 999.0, 1000.9), 3: _f(3, 1000.0, 1000.1)}).global_rank == 2
    # A failure without a file (observed time, fractional) ties with files of its second.
    assert root_cause({2: _f(2, 1000.0, 1000.6), 3: _f(3, 1000.4, 1000.4)}).global_rank == 3
    with pytest.raises(ValueError, match=r"^root_cause: no failures to choose from$"):
        root_cause({})


def test_report(tmp_path: Path) -> None:
    path = _record_file(tmp_path, "e.json", "RuntimeError: boom", int(T0))
    first = read_failure(
        global_rank=1, local_rank=1, pid=11, exitcode=1, error_file=path, observed_at=T0 + 9
    )
    other = read_failure(
        global_rank=0, local_rank=0, pid=10, exitcode=-15, error_file=None, observed_at=T0 + 1
    )
    report = format_report("train.py", {0: other, 1: first}, "hostA")
    lines = report.splitlines()
    assert lines[1] == "train.py FAILED (2 worker(s))"
    assert lines[3] == "Root cause (first failure):"
    assert lines[4] == "  rank       : 1 (local rank 1) on hostA, pid 11"
    assert lines[5] == "  exit code  : 1"
    assert "  error      : RuntimeError: boom" in lines
    assert "    boom" in lines
    assert "Other failures:" in lines
    assert "  exit code  : -15 (SIGTERM)" in lines
    assert report.index("RuntimeError") < report.index("SIGTERM")


@pytest.mark.parametrize("stamp", ["nan", "inf", "-inf", "1e300", "-1e300"])
@pytest.mark.parametrize("flat", [False, True])
def test_a_timestamp_no_clock_can_show_falls_back_to_the_exit_seen(
    tmp_path: Path, stamp: str, flat: bool
) -> None:
    # What the agent does with a failed worker at its restart: read the file, pick the
    # root cause, write the report; a "nan" or "inf" stamp crashed the agent here.
    path = tmp_path / "e.json"
    inner = {"message": "RuntimeError: boom", "extraInfo": {"timestamp": stamp}}
    flat_form = {"message": "RuntimeError: boom", "timestamp": stamp}
    path.write_text(json.dumps(flat_form if flat else {"message": inner}))
    bad = read_failure(
        global_rank=1, local_rank=1, pid=8, exitcode=1, error_file=str(path), observed_at=T0
    )
    other = read_failure(
        global_rank=0, local_rank=0, pid=7, exitcode=-9, error_file=None, observed_at=T0 + 1
    )
    assert (bad.message, bad.timestamp) == ("RuntimeError: boom", T0)
    failures = {1: bad, 0: other}
    assert root_cause(failures) is bad
    report = format_report("train.py", failures, "host")
    assert "error      : RuntimeError: boom" in report
