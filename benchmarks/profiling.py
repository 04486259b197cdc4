"""Optional CPU profile of a node process, every thread included (standard library only).

Set ``BENCH_PROFILE_DIR`` and each node process profiles every Python thread it starts
with :mod:`cProfile` on that thread's CPU clock (``time.thread_time``), and writes
``node-PID.pstats`` there when it exits. Read them with :func:`top` or
``python -m benchmarks.profiling DIR``. The profiler slows the nodes down several
times: it tells where CPU goes, not how fast anything is. Beside it, ``node-PID.threads``
gives the kernel's CPU seconds per thread name (every live thread, C work included).
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import re
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["dump", "enable_from_env", "thread_cpu", "top"]

_profiles: list[cProfile.Profile] = []
_lock = threading.Lock()


def _start_in_thread(frame: FrameType, event: str, arg: Any) -> None:
    # threading installs this as the new thread's profile hook; its first call replaces
    # itself with a profiler of that thread.
    profile = cProfile.Profile(time.thread_time)
    with _lock:
        _profiles.append(profile)
    profile.enable()


def enable_from_env() -> bool:
    """Profile this thread and every thread started from now on, if ``BENCH_PROFILE_DIR``."""
    if not os.environ.get("BENCH_PROFILE_DIR"):
        return False
    threading.setprofile(_start_in_thread)
    profile = cProfile.Profile(time.thread_time)
    with _lock:
        _profiles.append(profile)
    profile.enable()
    return True


def dump() -> None:
    """Write the merged profile of this process to ``$BENCH_PROFILE_DIR/node-PID.pstats``."""
    target = os.environ.get("BENCH_PROFILE_DIR")
    if not target:
        return
    with _lock:
        profiles = list(_profiles)
    for profile in profiles:
        profile.disable()
    stats = pstats.Stats(profiles[0])
    for profile in profiles[1:]:
        stats.add(profile)
    stats.dump_stats(str(Path(target) / f"node-{os.getpid()}.pstats"))
    (Path(target) / f"node-{os.getpid()}.threads").write_text(json.dumps(thread_cpu()))


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system, from /proc) of this process's live threads, by name.

    Names lose their numbers ("Thread-12 (_run)" and "Thread-13 (_run)" add up); threads
    Python did not start (gRPC's own) are summed as "other"; "process" is the total,
    exited threads included.
    """
    ticks = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: re.sub(r"\d+", "#", t.name) for t in threading.enumerate()}
    totals: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(task.name), "other")
        totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    totals["process"] = (int(fields[11]) + int(fields[12])) / ticks
    return totals


def top(directory: Path, count: int = 40, sort: str = "tottime") -> None:
    """Print the ``count`` costliest functions over every profile in ``directory``."""
    files = sorted(str(p) for p in directory.glob("*.pstats"))
    if not files:
        raise SystemExit(f"no .pstats files in {directory}: run with BENCH_PROFILE_DIR set")
    stats = pstats.Stats(*files)
    stats.sort_stats(sort).print_stats(count)


if __name__ == "__main__":
    top(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 40, *sys.argv[3:4])
