"""How ``rdzvctl status`` shows training progress and the last hang (pure).

Shown only when there is something to show (a progress record or a recorded hang), so a
run without hang detection looks as it always did.
"""

from __future__ import annotations

from typing import Any

from coordinator.core.progress import NodeProgress
from coordinator.core.state import Hang
from coordinator.rdzvctl.model import RunSnapshot

__all__ = ["hang_json", "hang_text", "progress_json", "progress_lines"]


def _seconds(ms: int) -> str:
    return f"{max(0, ms) / 1000:.1f}s"


def hang_text(hang: Hang) -> str:
    """One line: the round, who stopped first and at which step, who declared it."""
    nodes = " ".join(hang.nodes)
    how = "behind the others" if hang.behind else "no node behind the others; first to time out"
    return (
        f"round {hang.round}: [{nodes}] stopped first at step {hang.step} ({how}); declared "
        f"by {hang.declared_by or '?'} after {_seconds(hang.stalled_ms)} without progress"
    )


def _row(record: NodeProgress, hung: set[str], now_ms: int) -> list[str]:
    age = _seconds(now_ms - record.reported_at_unix_ms) if record.reported_at_unix_ms else "-"
    state = "stopped first" if record.node_id in hung else ("stalled" if record.stalled else "")
    timeout = _seconds(record.hang_timeout_ms) if record.hang_timeout_ms else "off"
    return [
        record.node_id, str(record.round), str(record.step), age,
        f"{record.workers_reporting}/{record.local_world_size}", timeout, state or "-",
    ]  # fmt: skip


def progress_lines(snapshot: RunSnapshot, now_ms: int) -> list[str]:
    """The ``hang:`` line and the progress table (nothing when there is neither).

    AGE is the time since the node's step was reported, from the node's wall clock at
    that report and this machine's now: informational (clocks of two machines differ);
    the agents never compare clocks to decide.
    """
    from coordinator.rdzvctl.format import table  # format imports this module

    hang = snapshot.state.hang if snapshot.state is not None else None
    lines = [f"last hang:       {hang_text(hang)}"] if hang is not None else []
    if not snapshot.progress:
        return lines
    current = hang.round if hang is not None else -1
    hung = {n for n in hang.nodes} if hang is not None else set()
    rows = [_row(p, hung if p.round == current else set(), now_ms) for p in snapshot.progress]
    lines.append(f"progress:        {len(rows)} node(s) reporting")
    headers = ["NODE", "ROUND", "STEP", "AGE", "WORKERS", "HANG TIMEOUT", "STATE"]
    lines.extend(table(headers, rows))
    return lines


def hang_json(hang: Hang | None) -> dict[str, Any] | None:
    if hang is None:
        return None
    return {
        "round": hang.round,
        "nodes": list(hang.nodes),
        "step": hang.step,
        "behind": hang.behind,
        "declared_by": hang.declared_by,
        "stalled_ms": hang.stalled_ms,
        "declared_at_unix_ms": hang.declared_at_unix_ms,
    }


def progress_json(snapshot: RunSnapshot) -> list[dict[str, Any]]:
    return [
        {
            "node_id": p.node_id,
            "round": p.round,
            "step": p.step,
            "age_ms": p.age_ms,
            "reported_at_unix_ms": p.reported_at_unix_ms,
            "workers_reporting": p.workers_reporting,
            "local_world_size": p.local_world_size,
            "stalled": p.stalled,
            "hang_timeout_ms": p.hang_timeout_ms,
        }
        for p in snapshot.progress
    ]
