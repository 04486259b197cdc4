"""How ``rdzvctl status`` and ``watch`` show the last hang and the stalled nodes (pure).

A node writes its progress record only when it suspects a hang (its workers made no
progress for most of its ``--hang-timeout``) and deletes it when they make progress again
in that round; a record of an earlier round stays until the node's next suspicion or the
end of its lease. So what etcd knows, and shows, is the stalled nodes, never the steps
of healthy ones (those are in each agent's metrics, ``etcd_elastic_last_progress_step``).
Shown only when there is something to show (a record or a recorded hang), so a run
without hang detection looks as it always did.
"""

from __future__ import annotations

from typing import Any

from coordinator.core.progress import NodeProgress
from coordinator.core.state import Hang
from coordinator.rdzvctl.model import RunSnapshot

__all__ = ["hang_json", "hang_text", "progress_json", "progress_lines", "suspicion_text"]


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


def suspicion_text(record: NodeProgress) -> str:
    """One line: a node began to suspect a hang (``rdzvctl watch``)."""
    return (
        f"node {record.node_id} suspects a hang: no progress for {_seconds(record.age_ms)} at "
        f"step {record.step} in round {record.round} (hang timeout "
        f"{_seconds(record.hang_timeout_ms)})"
    )


def _row(record: NodeProgress, hang: Hang | None, round: int, now_ms: int) -> list[str]:
    now = record.round == round
    if hang is not None and record.round == hang.round and record.node_id in hang.nodes:
        state = "stopped first"
    elif not record.stalled:
        state = "-"  # an agent of an earlier version wrote healthy nodes too
    else:
        state = "stalled" if now else "was stalled"
    since = now_ms - record.reported_at_unix_ms
    silent = _seconds(since) if now and record.reported_at_unix_ms else "-"
    timeout = _seconds(record.hang_timeout_ms) if record.hang_timeout_ms else "off"
    return [
        record.node_id, str(record.round), str(record.step), silent,
        f"{record.workers_reporting}/{record.local_world_size}", timeout, state,
    ]  # fmt: skip


def progress_lines(snapshot: RunSnapshot, now_ms: int) -> list[str]:
    """The ``last hang:`` line and the table of stalled nodes (nothing when neither).

    SILENT is the time since the node's last report, from the node's wall clock at that
    report and this machine's now: informational (clocks of two machines differ); the
    agents never compare clocks to decide. It is shown for the current round only: a
    record of an earlier round says how that round ended, not what the node does now.
    """
    from coordinator.rdzvctl.format import table  # format imports this module

    state = snapshot.state
    hang = state.hang if state is not None else None
    lines = [f"last hang:       {hang_text(hang)}"] if hang is not None else []
    if not snapshot.progress:
        return lines
    round = state.round if state is not None else -1
    rows = [_row(p, hang, round, now_ms) for p in snapshot.progress]
    now = sum(1 for p in snapshot.progress if p.stalled and p.round == round)
    earlier = sum(1 for p in snapshot.progress if p.round != round)
    lines.append(
        f"stalled nodes:   {now} in round {round}, {earlier} in earlier rounds (nodes that "
        "make progress write nothing)"
    )
    headers = ["NODE", "ROUND", "STEP", "SILENT", "WORKERS", "HANG TIMEOUT", "STATE"]
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
