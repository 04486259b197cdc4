"""Worker failures: read the error file a worker left, pick the root cause, format a report.

A worker whose entry point is decorated with torch's ``@record`` writes JSON to the path
in ``TORCHELASTIC_ERROR_FILE`` when it dies of an exception::

    {"message": {"message": "RuntimeError: boom",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}}

(or, in the older flat form, ``{"message": "...", "timestamp": "..."}``). A worker killed
by a signal or exiting without ``@record`` leaves no file; the failure is then described
by its exit code or signal. The file is only parsed as JSON, never executed.
"""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

__all__ = ["Failure", "format_report", "read_failure", "root_cause"]

_HINT = "no error file; decorate the entry point with torch's @record to see the traceback"


@dataclass(frozen=True)
class Failure:
    """One failed worker.

    Attributes:
        global_rank, local_rank: which worker.
        pid: its process id.
        exitcode: its exit code; negative means killed by signal ``-exitcode``.
        error_file: the path it was given, or None when it left no readable file.
        message: one line: the exception (``RuntimeError: boom``) or what killed it.
        traceback: the worker's Python traceback, or "" when unknown.
        timestamp: seconds since the epoch when it failed (from the file, else observed).
            torch's ``@record`` writes whole seconds.
        exited_at: when the agent saw the process exit (seconds since the epoch).
    """

    global_rank: int
    local_rank: int
    pid: int
    exitcode: int
    error_file: str | None
    message: str
    traceback: str
    timestamp: float
    exited_at: float

    @property
    def signal_name(self) -> str | None:
        """``SIGKILL`` etc. when a signal ended the worker, else None."""
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"


def _exit_message(exitcode: int, pid: int, hint: bool = True) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown"
        return f"killed by signal {-exitcode} ({name}), pid {pid}"
    return f"exited with code {exitcode}, pid {pid}" + (f"; {_HINT}" if hint else "")


def _timestamp(raw: object) -> float:
    """The file's timestamp in seconds since the epoch, or 0 (unknown) when it is not one
    a report can show: "nan", "inf" or a year past 9999 would make the root cause's
    ordering and the report's date raise, and the agent would crash while restarting."""
    value = float(str(raw))
    if not math.isfinite(value):
        return 0.0
    try:
        datetime.fromtimestamp(value)
    except (OverflowError, OSError, ValueError):
        return 0.0
    return value


def _parse(data: object) -> tuple[str, str, float] | None:
    """(message, traceback, timestamp) from a decoded error file, or None if unknown."""
    if not isinstance(data, dict):
        return None
    outer = data.get("message")
    if isinstance(outer, str):
        return outer, "", _timestamp(data.get("timestamp", "0"))
    if not isinstance(outer, dict):
        return None
    message = outer.get("message")
    extra = outer.get("extraInfo", {})
    if not isinstance(message, str) or not isinstance(extra, dict):
        return None
    callstack = extra.get("py_callstack", "")
    return message, str(callstack), _timestamp(extra.get("timestamp", "0"))


def read_failure(
    *,
    global_rank: int,
    local_rank: int,
    pid: int,
    exitcode: int,
    error_file: str | None,
    observed_at: float,
) -> Failure:
    """Describe a failed worker from its exit code and, if present, its error file.

    Never raises for a bad file: an unreadable or foreign file becomes part of the
    message, so the report still names the worker.

    Args:
        observed_at: when the agent saw the exit (seconds since the epoch); used as the
            timestamp when the file does not carry one.
    """
    path = Path(error_file) if error_file else None
    if path is None or not path.is_file():
        return Failure(
            global_rank,
            local_rank,
            pid,
            exitcode,
            None,
            _exit_message(exitcode, pid),
            "",
            observed_at,
            observed_at,
        )
    try:
        parsed = _parse(json.loads(path.read_text(encoding="utf-8", errors="replace")))
    except (OSError, ValueError) as exc:
        parsed = None
        reason = f"{type(exc).__name__}: {exc}"
    else:
        reason = "not in @record's format"
    if parsed is None:
        head = _exit_message(exitcode, pid, hint=False)
        message = f"{head} (error file {str(path)!r} unreadable: {reason})"
        return Failure(
            global_rank, local_rank, pid, exitcode, str(path), message, "", observed_at, observed_at
        )
    message, traceback, timestamp = parsed
    return Failure(
        global_rank,
        local_rank,
        pid,
        exitcode,
        str(path),
        message,
        traceback,
        timestamp or observed_at,
        observed_at,
    )


def root_cause(failures: Mapping[int, Failure]) -> Failure:
    """The first failure: earliest second, then earliest exit, then lowest global rank.

    Error files carry whole seconds, so two workers failing in the same second tie on
    the timestamp. The one that exited first is the cause: a worker whose collective
    broke because a peer died exits after that peer (torch breaks the tie by the lowest
    rank instead, and so often blames the victim).

    Raises:
        ValueError: ``failures`` is empty.
    """
    if not failures:
        raise ValueError("root_cause: no failures to choose from")
    return min(
        failures.values(), key=lambda f: (math.floor(f.timestamp), f.exited_at, f.global_rank)
    )


def _describe(failure: Failure, hostname: str) -> list[str]:
    when = datetime.fromtimestamp(failure.timestamp).isoformat(sep=" ", timespec="seconds")
    code = f"{failure.exitcode}"
    if failure.signal_name:
        code += f" ({failure.signal_name})"
    lines = [
        f"  rank       : {failure.global_rank} (local rank {failure.local_rank}) "
        f"on {hostname}, pid {failure.pid}",
        f"  exit code  : {code}",
        f"  time       : {when}",
        f"  error file : {failure.error_file or '-'}",
        f"  error      : {failure.message}",
    ]
    if failure.traceback:
        lines.append("  traceback  :")
        lines.extend(f"    {line}" for line in failure.traceback.rstrip("\n").splitlines())
    return lines


def format_report(name: str, failures: Mapping[int, Failure], hostname: str) -> str:
    """A readable report of failed workers, root cause first.

    Args:
        name: what failed (the entry point), shown in the title.
        failures: global rank -> failure; must not be empty.
        hostname: the host the workers ran on.
    """
    first = root_cause(failures)
    others = sorted((f for f in failures.values() if f is not first), key=lambda f: f.global_rank)
    title = f"{name} FAILED ({len(failures)} worker(s))"
    rule = "=" * max(len(title), 40)
    lines = [rule, title, rule, "Root cause (first failure):", *_describe(first, hostname)]
    if others:
        lines.append("-" * len(rule))
        lines.append("Other failures:")
        for failure in others:
            lines.extend(_describe(failure, hostname))
    lines.append(rule)
    return "\n".join(lines)
