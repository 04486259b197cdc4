"""The per-kind table of a chaos run: how many faults of each kind, and what they cost.

For a fault that restarts workers (it removes a node, kills a worker, adds a node) the
cost is its **recovery**: seconds from the fault's start to the first step of a newer
round. For a fault that must cost nothing, it is the **stall**: the longest stretch
without any worker step from the fault's start to the next fault's start (the harness
waits for the job to be steady in between, so a restart the fault caused late still
shows; one step period, ``CHAOS_STEP_SECONDS``, is the floor). Pure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tests.chaos.history_view import History

__all__ = ["KindRow", "format_table", "percentile", "summarize"]


@dataclass(frozen=True)
class KindRow:
    """What the faults of one kind cost."""

    kind: str
    count: int
    measure: str  # "recovery" or "stall"
    values: tuple[float, ...]  # one per fault that recovered (recovery) / every fault
    never: int  # faults after which no newer round trained (recovery only)

    @property
    def p50(self) -> float | None:
        return percentile(self.values, 50)

    @property
    def p99(self) -> float | None:
        return percentile(self.values, 99)

    @property
    def max(self) -> float | None:
        return max(self.values, default=None)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(events: Sequence[Mapping[str, Any]]) -> list[KindRow]:
    """One row per fault kind that ran, in order of first appearance."""
    history = History(events)
    measured: dict[str, tuple[str, list[float], list[None]]] = {}
    spans = history.faults()
    for i, span in enumerate(spans):
        if span.disruptive:
            _, values, never = measured.setdefault(span.kind, ("recovery", [], []))
            took = history.recovery(span)
            if took is None:
                never.append(None)
            else:
                values.append(took)
        else:
            _, values, _ = measured.setdefault(span.kind, ("stall", [], []))
            hi = spans[i + 1].start_mono if i + 1 < len(spans) else history.end_mono
            values.append(history.stall(span.start_mono, hi))
    return [
        KindRow(kind, len(values) + len(never), measure, tuple(values), len(never))
        for kind, (measure, values, never) in measured.items()
    ]


def format_table(rows: Sequence[KindRow]) -> str:
    """A fixed-width table: kind, count, measure, p50/p99/max in seconds, never."""

    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    header = f"{'kind':<22} {'n':>3}  {'measure':<8} {'p50 s':>7} {'p99 s':>7} {'max s':>7} never"
    lines = [header, "-" * len(header)]
    for row in sorted(rows, key=lambda r: r.kind):
        lines.append(
            f"{row.kind:<22} {row.count:>3}  {row.measure:<8} {num(row.p50):>7} "
            f"{num(row.p99):>7} {num(row.max):>7} {row.never:>5}"
        )
    total = sum(r.count for r in rows)
    lines.append(f"{'total':<22} {total:>3}")
    return "\n".join(lines)
