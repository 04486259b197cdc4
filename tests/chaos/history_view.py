"""An indexed, time-ordered view of a run's history, shared by the checker and the report.

Pure: built from the list of events :func:`agent.observe.journal.read_journal` returns, it keeps
each event's index in that list (the checker names events by it) and orders events by
``mono`` (CLOCK_MONOTONIC, one clock for every process of the machine; ties keep file
order).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tests.chaos import events as ev

__all__ = ["FaultSpan", "History", "Indexed"]

Event = Mapping[str, Any]


@dataclass(frozen=True)
class Indexed:
    """One event and its index in the history as read."""

    index: int
    event: Event

    @property
    def mono(self) -> float:
        return float(self.event["mono"])

    @property
    def name(self) -> str:
        return str(self.event.get("event", ""))

    def int_field(self, key: str, default: int = -1) -> int:
        value = self.event.get(key, default)
        return value if isinstance(value, int) and not isinstance(value, bool) else default


@dataclass(frozen=True)
class FaultSpan:
    """A fault as the harness ran it: from ``fault_start`` to ``fault_end``."""

    start: Indexed
    end_mono: float

    @property
    def kind(self) -> str:
        return str(self.start.event.get("kind", "?"))

    @property
    def start_mono(self) -> float:
        return self.start.mono

    @property
    def removes_node(self) -> bool:
        return bool(self.start.event.get("removes_node"))

    @property
    def disruptive(self) -> bool:
        return bool(self.start.event.get("disruptive", self.removes_node))

    @property
    def pids(self) -> list[int]:
        value = self.start.event.get("pids", [])
        return [p for p in value if isinstance(p, int)] if isinstance(value, list) else []


class History:
    """The events of one run, ordered by time, with the lookups the invariants need."""

    def __init__(self, events: Sequence[Event]) -> None:
        self.malformed: list[Indexed] = []
        good: list[Indexed] = []
        for index, event in enumerate(events):
            item = Indexed(index, event)
            mono = event.get("mono")
            if not isinstance(mono, (int, float)) or not isinstance(event.get("event"), str):
                self.malformed.append(item)
            else:
                good.append(item)
        self.ordered = sorted(good, key=lambda e: (e.mono, e.index))
        self._by_name: dict[str, list[Indexed]] = {}
        for item in self.ordered:
            self._by_name.setdefault(item.name, []).append(item)
        self.steps = self.of(ev.STEP)
        self._step_monos = [s.mono for s in self.steps]
        # worker pid -> its worker_start (a pid is reused only after many processes).
        self.worker_start = {w.int_field("pid"): w for w in self.of(ev.WORKER_START)}
        teardown = self.of(ev.TEARDOWN_START)
        self.teardown_mono = teardown[0].mono if teardown else float("inf")
        last = self.ordered[-1].mono if self.ordered else 0.0
        self.end_mono = min(self.teardown_mono, last)

    def of(self, *names: str) -> list[Indexed]:
        """Events with one of ``names``, in time order."""
        if len(names) == 1:
            return list(self._by_name.get(names[0], []))
        found = [e for n in names for e in self._by_name.get(n, [])]
        return sorted(found, key=lambda e: (e.mono, e.index))

    def judged(self, items: list[Indexed]) -> list[Indexed]:
        """``items`` before teardown: stopping everything is not a fault to judge."""
        return [e for e in items if e.mono < self.teardown_mono]

    def run_start(self) -> Indexed | None:
        found = self.of(ev.RUN_START)
        return found[0] if found else None

    def faults(self) -> list[FaultSpan]:
        """Every started fault; one without ``fault_end`` ends at the history's end."""
        ends = {e.int_field("index"): e.mono for e in self.of(ev.FAULT_END)}
        return [
            FaultSpan(s, ends.get(s.int_field("index"), self.end_mono))
            for s in self.of(ev.FAULT_START)
        ]

    def agent_of_worker(self, worker_pid: int) -> int:
        """The agent pid a worker recorded at start, or -1."""
        start = self.worker_start.get(worker_pid)
        return start.int_field("agent_pid") if start is not None else -1

    def steps_between(self, lo: float, hi: float) -> list[Indexed]:
        """Steps with lo <= mono < hi."""
        a = bisect.bisect_left(self._step_monos, lo)
        b = bisect.bisect_left(self._step_monos, hi)
        return self.steps[a:b]

    def last_round_before(self, mono: float) -> int:
        """The newest round any step or agent round event had before ``mono``, or -1."""
        rounds = [s.int_field("round") for s in self.steps_between(float("-inf"), mono)]
        rounds += [r.int_field("round") for r in self.of(ev.ROUND) if r.mono < mono]
        return max(rounds, default=-1)

    def recovery(self, span: FaultSpan) -> float | None:
        """Seconds from the fault's start to the first step of a newer round, or None.

        A step counts when its round is newer than any round seen before the fault; when
        rounds are unknown (-1), when its worker started after the fault (every start of
        workers is a new round).
        """
        start = span.start_mono
        before = self.last_round_before(start)
        for step in self.steps_between(start, float("inf")):
            round_ = step.int_field("round")
            if round_ >= 0 and before >= 0:
                newer = round_ > before
            else:
                began = self.worker_start.get(step.int_field("pid"))
                newer = began is not None and began.mono >= start
            if newer:
                return step.mono - start
        return None

    def first_start_step(self, since: float) -> float | None:
        """Seconds from ``since`` to the first step of a worker started at or after it
        (every start of workers is a new round), or None."""
        for step in self.steps_between(since, float("inf")):
            began = self.worker_start.get(step.int_field("pid"))
            if began is not None and began.mono >= since:
                return step.mono - since
        return None

    def stall(self, lo: float, hi: float) -> float:
        """The longest stretch of [lo, hi] in which no worker recorded a step."""
        if hi <= lo:
            return 0.0
        times = [lo, *(s.mono for s in self.steps_between(lo, hi)), hi]
        return max(b - a for a, b in itertools.pairwise(times))
