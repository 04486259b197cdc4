"""What one worker is started with: its ranks, command line, environment and log plan."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.workers.logs import WorkerLogs

__all__ = ["WorkerLaunch", "WorkerRanks"]


@dataclass(frozen=True)
class WorkerRanks:
    """The ranks of one worker."""

    local_rank: int
    global_rank: int
    role_rank: int
    world_size: int
    role_world_size: int


@dataclass(frozen=True)
class WorkerLaunch:
    """Everything needed to start one worker."""

    ranks: WorkerRanks
    argv: Sequence[str]
    env: Mapping[str, str]
    logs: WorkerLogs
