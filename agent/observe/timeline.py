"""What the agent puts on the run's timeline (``rdzvctl events``, ``docs/timeline.md``).

Each function takes the rendezvous surface (:mod:`coordinator.torch_adapter.surface`); a
backend without a timeline drops the events. Recording never blocks and never raises:
the handler writes in the background.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agent.workers.errorfile import Failure
from coordinator.core.events import Cause, Event
from coordinator.core.state import Quarantine
from coordinator.torch_adapter.surface import RendezvousSurface

__all__ = ["quarantine_recorded", "record_faults", "record_health", "record_restart"]


def record_restart(
    rdzv: RendezvousSurface, restart_count: int, cause: Failure | None, why: str = ""
) -> None:
    """A counted restart, with its root cause (a worker's failure, else ``why``), on the
    run's timeline."""
    summary = why if cause is None else f"rank {cause.global_rank}: {cause.message}"
    rdzv.record_event(
        Event(
            "restarted",
            node_id=rdzv.node_id,
            round=max(rdzv.last_round, 0),
            restart_count=restart_count,
            summary=summary,
            incarnation=rdzv.incarnation,
        )
    )


def record_faults(
    rdzv: RendezvousSurface, node_ids: Sequence[str], cause: Cause, round: int, summary: str
) -> None:
    """Mark ``node_ids`` on the run's timeline with a fault (``hung``: named by a hang
    declared in ``round``; ``quarantined``: left out by the pre-flight check). Each node
    stays in the run (its key lives on), so this is a ``fault`` event, not a departure."""
    for node_id in node_ids:
        rdzv.record_event(
            Event("fault", node_id=node_id, cause=cause, round=round, summary=summary,
                  incarnation=rdzv.incarnation)
        )  # fmt: skip


def quarantine_recorded(
    rdzv: RendezvousSurface,
) -> Callable[[Sequence[Quarantine]], bool] | None:
    """The backend's ``quarantine`` (None where it cannot), which also marks each node on
    the run's timeline when this node's write is the one that landed (every node of the
    round reaches the same verdict; one of them writes it)."""
    if not rdzv.can_quarantine:
        return None

    def quarantine(entries: Sequence[Quarantine]) -> bool:
        written = rdzv.quarantine(entries)
        if written:
            round = max(rdzv.last_round, 0)
            for entry in entries:
                record_faults(rdzv, (entry.node_id,), "quarantined", round, entry.reason)
        return written

    return quarantine


def record_health(rdzv: RendezvousSurface, round: int, summary: str) -> None:
    """A round's pre-flight check on the run's timeline: one event per round, recorded by
    the node that judged it (not one per node: N writes a formation at scale); each failed
    node has its own ``fault`` event (:func:`quarantine_recorded`)."""
    rdzv.record_event(Event("health_checked", round=round, summary=summary))
