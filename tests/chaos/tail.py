"""The harness's live view of the history file: new lines as they are appended.

The harness decides when the job is steady again, which worker to kill and when the
nodes start re-forming from what agents and workers wrote; it reads only whole lines
(a line is one append, see ``agent/observe/journal.py``), keeping a partial last line for the
next read.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

from tests.chaos import events as ev

__all__ = ["HistoryTail"]

_REORDER_S = 5.0  # far beyond any scheduling delay between reading mono and appending


class HistoryTail:
    """Incremental reader of one history file, with the queries the harness needs."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = 0
        self._partial = b""
        self.events: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self.worker_start: dict[int, dict[str, Any]] = {}  # worker pid -> its start
        self.max_round = -1  # newest round an agent reported
        self.rank0_pid = -1  # the agent that reported group rank 0 of that round
        self.agent_events = 0

    def poll(self) -> int:
        """Read what was appended since the last call; returns how many new events."""
        try:
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        added = 0
        for raw in lines:
            if not raw.strip():
                continue
            try:
                event = json.loads(raw)
            except ValueError:
                continue  # the checker reports damaged lines; the harness keeps going
            if isinstance(event, dict):
                self._index(event)
                added += 1
        return added

    def _index(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        name = event.get("event")
        if name == ev.STEP:
            self.steps.append(event)
        elif name == ev.WORKER_START and isinstance(event.get("pid"), int):
            self.worker_start[event["pid"]] = event
        if event.get("src") == "agent":
            self.agent_events += 1
            if name == ev.ROUND and isinstance(event.get("round"), int):
                self.max_round = max(self.max_round, event["round"])
                if event["round"] == self.max_round and event.get("group_rank") == 0:
                    self.rank0_pid = int(event.get("pid", -1))

    def first_after(self, name: str, mono: float, src: str | None = None) -> dict[str, Any] | None:
        """The first ``name`` event at or after ``mono`` (from ``src``), if any yet.

        Scans back from the newest event only as far as shortly before ``mono``: lines
        are appended in about time order (a line's ``mono`` is read just before its
        append, so lines of different processes may swap by a scheduling delay).
        """
        found = None
        for event in reversed(self.events):
            at = float(event.get("mono", 0))
            if at < mono - _REORDER_S:
                break
            if (
                at >= mono
                and event.get("event") == name
                and (src is None or event.get("src") == src)
                and (found is None or at < float(found["mono"]))
            ):
                found = event
        return found

    def workers_of(self, agent_pid: int) -> list[int]:
        """Pids of every worker the agent ever started (newest last)."""
        return [pid for pid, w in self.worker_start.items() if w.get("agent_pid") == agent_pid]

    def steady(
        self,
        agent_pids: Collection[int],
        world: int,
        *,
        now: float,
        window: float,
        started_after: float | None = None,
    ) -> bool:
        """Whether, in the last ``window`` seconds, workers of ``agent_pids`` covering
        every rank of one group of ``world`` stepped (and started after
        ``started_after``, when given: a restart happened since)."""
        ranks: dict[tuple[int, int], set[int]] = {}
        for step in reversed(self.steps):
            if float(step["mono"]) < now - window:
                break
            start = self.worker_start.get(step.get("pid", -1))
            if start is None or start.get("agent_pid") not in agent_pids:
                continue
            if started_after is not None and float(start["mono"]) < started_after:
                continue
            if step.get("world") != world:
                continue
            key = (int(step.get("round", -1)), int(start.get("group_world", -1)))
            ranks.setdefault(key, set()).add(int(step.get("rank", -1)))
        return any(len(r) == world and r == set(range(world)) for r in ranks.values())

    def stepped_since(self, since: float) -> bool:
        """Whether a worker started after ``since`` has stepped."""
        for step in reversed(self.steps):
            if float(step["mono"]) < since:
                return False
            start = self.worker_start.get(step.get("pid", -1))
            if start is not None and float(start["mono"]) >= since:
                return True
        return False

    def last_step_mono(self) -> float | None:
        return float(self.steps[-1]["mono"]) if self.steps else None
