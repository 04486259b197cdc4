"""Helpers of the no-orphans tests: processes a test must reap, and "gone" with a bound."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.e2e.agents import alive

__all__ = ["GONE_WITHIN_S", "Tracked", "start_time", "wait_gone"]

# The bound for "gone": generous for a loaded 2-core machine; the time measured
# is printed (pytest -s) and is far below it.
GONE_WITHIN_S = 5.0


def start_time(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


class Tracked:
    """Pids a test must not leave running: SIGKILLed at the end if still the same process."""

    def __init__(self) -> None:
        self.procs: list[tuple[int, int]] = []
        self.popens: list[subprocess.Popen[bytes]] = []

    def add(self, pid: int) -> int:
        start = start_time(pid)
        if start is not None:
            self.procs.append((pid, start))
        return pid

    def popen(self, *args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        proc: subprocess.Popen[bytes] = subprocess.Popen(*args, **kwargs)  # type: ignore[call-overload]
        self.popens.append(proc)
        self.add(proc.pid)
        return proc

    def cleanup(self) -> None:
        for pid, start in self.procs:
            if alive(pid) and start_time(pid) == start:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self.popens:
            proc.kill()
            proc.wait(30)


def wait_gone(pids: list[int], within: float = GONE_WITHIN_S) -> float:
    """Seconds until every pid is gone (a zombie counts as gone); fails after ``within``."""
    start = time.monotonic()
    while any(alive(p) for p in pids):
        took = time.monotonic() - start
        assert took < within, f"pids {[p for p in pids if alive(p)]} still run after {took:.1f} s"
        time.sleep(0.005)  # the kernel tells a non-parent nothing: look often, briefly
    return time.monotonic() - start
