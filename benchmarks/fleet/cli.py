"""``python -m benchmarks.fleet``: run the fleet at some sizes, print and save what each
phase cost etcd; or (``--report``) turn saved runs into the model of ``docs/scale.md``.

    python -m benchmarks.fleet --nodes 10,100 --out /tmp/fleet.json
    python -m benchmarks.fleet --report /tmp/fleet.json [--ceiling c.json --formation f.json]

``scripts/scale`` runs the whole measurement (every size, the comparisons, the report).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.fleet.run import FleetOptions, run_fleet

__all__ = ["main", "parse_args"]


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--nodes {text!r}: use whole numbers, e.g. 10,100"
        ) from None
    if not sizes or min(sizes) < 3:
        raise argparse.ArgumentTypeError(f"--nodes {text!r}: every size must be at least 3")
    return sizes


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse the command line (see ``--help``)."""
    defaults = FleetOptions(nodes=10)
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", type=_sizes, default=[10], help="sizes, comma-separated (10)")
    p.add_argument("--jobs", default=defaults.jobs, help="which jobs run (abcde, see run.py)")
    p.add_argument(
        "--step",
        type=float,
        default=defaults.step_s,
        help="seconds per stand-in training step (0.25); 0: no progress reports",
    )
    p.add_argument("--lease-ttl", type=int, default=defaults.lease_ttl, help="seconds (5)")
    p.add_argument("--hosts", type=int, default=0, help="host processes (0: ~1 per 125 agents)")
    p.add_argument("--steady", type=float, default=defaults.steady_s, help="steady window, s")
    p.add_argument(
        "--formations",
        type=int,
        default=defaults.formations,
        help="formations in all (at least 3: jobs A, B, C)",
    )
    p.add_argument("--no-preflight", action="store_true", help="skip job D (--health-check)")
    p.add_argument("--retention", type=float, default=defaults.retention_s, help="seconds")
    p.add_argument(
        "--after",
        type=float,
        default=defaults.after_s,
        help="seconds after the retention before counting what is left (10)",
    )
    p.add_argument("--client", choices=("per-agent", "per-process"), default=defaults.client)
    p.add_argument("--churn-jobs", type=int, default=0, help="small jobs run one after another")
    p.add_argument("--churn-parallel", type=int, default=defaults.churn_parallel)
    p.add_argument("--out", type=Path, help="write the runs' JSON here")
    p.add_argument("--report", type=Path, nargs="+", help="saved runs to model (no run)")
    p.add_argument("--ceiling", type=Path, help="--report: etcd-ceiling scenario JSON")
    p.add_argument("--formation", type=Path, help="--report: formation scenario JSON")
    p.add_argument(
        "--formation-large", type=Path,
        help="--report: formation scenario JSON at N = 1000 (the time target)",
    )  # fmt: skip
    p.add_argument("--doc", type=Path, default=None, help="--report: the markdown to update")
    p.add_argument("--plot", type=Path, default=None, help="--report: the PNG to write")
    return p.parse_args(argv)


def options_for(args: argparse.Namespace, nodes: int) -> FleetOptions:
    """The run's options at one size from the command line."""
    return FleetOptions(
        nodes=nodes,
        jobs=args.jobs,
        step_s=args.step,
        lease_ttl=args.lease_ttl,
        hosts=args.hosts,
        steady_s=args.steady,
        formations=max(3, args.formations),
        preflight=not args.no_preflight,
        retention_s=args.retention,
        after_s=args.after,
        client=args.client,
        churn_jobs=args.churn_jobs,
        churn_parallel=args.churn_parallel,
    )


def summary(result: dict[str, Any]) -> list[str]:
    """One line per phase: etcd's main counts and the phase's times."""
    lines = [f"N={result['nodes']} ({result['seconds']} s), layout {result['layout']}"]
    keys = ("writes", "rpc_Range", "rpc_Txn", "keepalives", "watch_events", "bytes_put")
    for phase in result["phases"]:
        etcd = phase["etcd"]
        counts = " ".join(f"{k}={etcd.get(k, 0):g}" for k in keys)
        times = " ".join(f"{k}={v:.3g}" for k, v in phase["times"].items())
        lines.append(
            f"  {phase['phase']:20} n={phase['nodes']:<5} {phase['window_s']:6.1f}s "
            f"{counts} | {times} | {phase['harness'].get('bound')}"
        )
    for name, left in result["leftovers"].items():
        lines.append(f"  left after {name}: {left}")
    if result.get("churn"):
        lines.append(f"  churn: {result['churn']}")
    lines += [f"  error: {e}" for e in result["errors"]]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.report:
        from benchmarks.fleet.report import write_report

        return write_report(
            args.report, args.ceiling, args.formation, args.doc, args.plot, args.formation_large
        )
    runs = []
    for nodes in args.nodes:
        result = run_fleet(
            options_for(args, nodes),
            progress=lambda text: print(
                time.strftime("%H:%M:%S"), text, file=sys.stderr, flush=True
            ),
        )
        runs.append(result)
        print("\n".join(summary(result)), flush=True)
        if args.out:
            args.out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    return 0 if all(not r["errors"] for r in runs) else 1
