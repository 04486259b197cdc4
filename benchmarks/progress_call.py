"""``python -m benchmarks.progress_call``: what ``report_progress`` costs a training step.

Measures, each in a fresh interpreter (the API resolves its slot once per process), the
nanoseconds per call of:

* ``report_progress(step)`` under the agent (``ETCD_ELASTIC_PROGRESS_FILE`` set: one
  ``struct.pack_into`` into a shared mapping plus ``time.monotonic_ns()``),
* the same call without the agent (the no-op),
* an empty Python function of one argument: the floor of any per-step hook, and the
  baseline the ratio is taken against, measured in the same run so the numbers hold on
  a loaded machine.

The best of ``--repeat`` runs of ``--calls`` calls each is kept (timeit's advice: the
slower runs measure the other processes). It also counts the system calls of 100,000
reports with ``strace -c`` when strace is installed. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from etcd_elastic.progress import PROGRESS_FILE_ENV, ProgressFile

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent

_TIMED = """
import timeit, sys
from etcd_elastic.progress import report_progress
def empty(step):
    pass
fn = empty if sys.argv[1] == "empty" else report_progress
calls, repeat = int(sys.argv[2]), int(sys.argv[3])
best = min(timeit.repeat("fn(12345)", globals={"fn": fn}, number=calls, repeat=repeat))
print(best / calls * 1e9)
"""

_LOOP = """
from etcd_elastic.progress import report_progress
for step in range(100000):
    report_progress(step)
"""


def _ns(kind: str, env: dict[str, str], calls: int, repeat: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _TIMED, kind, str(calls), str(repeat)],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(out.stdout)


def _syscalls(env: dict[str, str]) -> dict[str, int] | None:
    """System calls of a process that reports 100,000 steps, and of one that reports none."""
    strace = shutil.which("strace")
    if strace is None:
        return None
    counts = {}
    for name, code in (("report_100000_steps", _LOOP), ("baseline_no_reports", "pass")):
        with tempfile.NamedTemporaryFile("r") as out:
            subprocess.run(
                [strace, "-f", "-c", "-o", out.name, sys.executable, "-c", code],
                env=env, cwd=ROOT, capture_output=True, check=True,
            )  # fmt: skip
            total = [ln for ln in out.read().splitlines() if ln.strip().endswith("total")]
            counts[name] = int(total[0].split()[-2]) if total else -1
    return counts


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.progress_call")
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    base = {k: v for k, v in os.environ.items() if k != PROGRESS_FILE_ENV}
    progress = ProgressFile(1)
    try:
        agent_env = {**base, PROGRESS_FILE_ENV: progress.path, "LOCAL_RANK": "0"}
        empty = _ns("empty", base, args.calls, args.repeat)
        enabled = _ns("report", agent_env, args.calls, args.repeat)
        disabled = _ns("report", base, args.calls, args.repeat)
        syscalls = _syscalls(agent_env)
    finally:
        progress.close()
    result = {
        "scenario": "progress_call",
        "calls": args.calls,
        "repeat": args.repeat,
        "ns_per_call": {
            "report_progress_under_agent": round(enabled, 1),
            "report_progress_without_agent": round(disabled, 1),
            "empty_function_call": round(empty, 1),
        },
        "ratio_to_empty_call": round(enabled / empty, 2),
        "syscalls": syscalls,
        "load_average": [round(x, 1) for x in os.getloadavg()],
        "etcd_writes_per_step": 0,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
