"""``python -m benchmarks SCENARIO [options] --json``: measure ours against torch's own.

Scenarios: formation, scale-up, node-loss, worker-failure, idle, etcd-ceiling, and
``all`` (every scenario, then docs/performance.md, its JSON and its PNG plot); and
``recovery`` (a real torch worker: failure to first step, not part of ``all``) and
``crash-timing`` (the same worker: an early crash, a steady one and a burst, ours only).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.critical_path import describe
from benchmarks.scenarios import SCENARIOS, run_all, run_scenario
from benchmarks.systems import ALL_SYSTEMS, CLIENT_MODES

__all__ = ["main", "parse_args"]


def _systems(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--systems {text!r}: use a comma-separated subset of {','.join(ALL_SYSTEMS)}"
        )
    return names


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be more than 0 seconds")
    return value


def _cases(text: str) -> list[str]:
    from benchmarks.recovery import parse_cases

    return parse_cases(text)


def _seconds_or_size(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be more than 0")
    return value


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse the command line (see ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Rendezvous benchmarks: ours (etcd-v3) against torch's c10d and etcd-v2.",
    )
    parser.add_argument("scenario", choices=[*SCENARIOS, "all"])
    parser.add_argument("--nodes", type=_positive, help="nodes (default: per scenario)")
    parser.add_argument("--repeat", "--runs", type=_positive, default=3, help="runs per point (3)")
    parser.add_argument("--systems", type=_systems, default=list(ALL_SYSTEMS), help="subset to run")
    parser.add_argument(
        "--processes", type=_positive, default=4, help="node processes for thread nodes (4)"
    )
    parser.add_argument(
        "--seconds",
        type=_seconds,
        default=None,
        help="idle window (30 s) / ceiling time per concurrency level (5 s)",
    )
    parser.add_argument(
        "--timeout", type=_seconds, default=120.0, help="bound of one measured step (120 s)"
    )
    parser.add_argument(
        "--last-call", type=_positive, default=None, help="last_call_timeout, s, both sides"
    )
    parser.add_argument(
        "--client",
        choices=CLIENT_MODES,
        default=CLIENT_MODES[0],
        help="ours: one etcd client per node process, shared by its nodes (default), "
        "or one per simulated node",
    )
    parser.add_argument("--lease-ttl", type=_positive, default=5, help="our lease TTL (5 s)")
    parser.add_argument(
        "--sizes", default=None, help="formation sizes for `all` (2,8,32,128,512,1000)"
    )
    parser.add_argument(
        "--cases", type=_cases, default=None, help="recovery: subset of a,b,c (all)"
    )
    parser.add_argument(
        "--checkpoint-mb",
        type=_seconds_or_size,
        default=None,
        help="recovery: checkpoint size each worker loads, MB (100)",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON result only")
    parser.add_argument("--smoke", action="store_true", help="smallest sizes, short windows")
    return parser.parse_args(argv)


def _print_human(result: dict[str, Any]) -> None:
    print(f"{result['scenario']}: {result.get('point', '')}")
    for name, entry in result.get("systems", {}).items():
        if not entry.get("available", True):
            print(f"  {name:8} not run: {entry.get('reason')}")
            continue
        med = entry.get("median")
        ratio = entry.get("ratio_vs_torch_c10d")
        errors = len(entry.get("errors", []))
        med_s = "-" if med is None else f"{med:.4g}"
        ratio_s = "-" if ratio is None else f"{ratio:.3g}"
        print(f"  {name:8} median {med_s} ({result['unit']}), ratio {ratio_s}, errors {errors}")
        for index, path in enumerate(entry.get("critical_path", []), 1):
            print(f"    run {index}: {describe(path)}")
        for error in entry.get("errors", []):
            print(f"    {error}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = run_all(args) if args.scenario == "all" else run_scenario(args.scenario, args)
    if args.scenario == "recovery" and not args.json:
        from benchmarks.recovery import print_human

        print_human(result)
    elif args.json or args.scenario in ("all", "crash-timing"):
        json.dump(result, sys.stdout, indent=2, sort_keys=False)
        sys.stdout.write("\n")
    else:
        _print_human(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
