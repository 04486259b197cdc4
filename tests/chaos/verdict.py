"""The verdict types of the chaos checker: the bounds a run is held to, and a violation."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tests.chaos.history_view import History, Indexed

__all__ = ["CheckConfig", "Violation", "at", "str_list"]


@dataclass(frozen=True)
class CheckConfig:
    """The bounds a run is held to (from its ``run_start`` unless given)."""

    min_nodes: int
    max_nodes: int
    lease_ttl: float
    recovery_slack_s: float = 5.0
    orphan_grace_s: float = 1.0
    agents: int = 0
    """Agents the job runs with (0: unknown; the bound below min_nodes is then not used)."""
    agent_start_s: float = 15.0
    """How long a new agent may take from its start to its first workers' first step
    when the run waits for it: its interpreter and imports (torch, on a shared machine),
    then a join at once (issue 21, item 12), the round, and its workers' first step.
    Measured in the run that set it: see docs/chaos.md."""
    require_rounds: bool = True
    """A real run must carry round numbers; only synthetic unit-test histories may not."""

    @classmethod
    def from_history(cls, history: History) -> CheckConfig | None:
        start = history.run_start()
        if start is None:
            return None
        return cls(
            min_nodes=start.int_field("min_nodes", 1),
            max_nodes=start.int_field("max_nodes", 1 << 30),
            lease_ttl=float(start.event.get("lease_ttl", 5.0)),
            agents=start.int_field("agents", 0),
        )


@dataclass(frozen=True)
class Violation:
    """One broken invariant at one event."""

    invariant: str
    message: str
    index: int | None = None
    event: Mapping[str, Any] | None = None

    def __str__(self) -> str:
        where = ""
        if self.index is not None:
            line = json.dumps(self.event, separators=(",", ":"), default=str)
            where = f"\n    event #{self.index}: {line[:600]}"
        return f"{self.invariant}: {self.message}{where}"


def at(invariant: str, item: Indexed, message: str) -> Violation:
    """A violation of ``invariant`` at ``item``."""
    return Violation(invariant, message, item.index, item.event)


def str_list(value: Any) -> list[str]:
    """A JSON list as strings (anything else: empty)."""
    return [str(v) for v in value] if isinstance(value, list) else []
