"""How ``rdzvctl`` shows things: tables and lines for people, JSON for programs (pure).

Every function takes what it shows and the time it is (``now_ms``, ``tz``) as
arguments, so tests pin the exact text.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from coordinator.core.restart_budget import describe
from coordinator.rdzvctl.model import NodeView, RunSnapshot, joining, phase
from coordinator.rdzvctl.progress_format import hang_json, progress_json, progress_lines

if TYPE_CHECKING:
    # Types only: status and list need neither gc's writer nor the watch loop.
    from coordinator.rdzvctl.ops import GcResult, GcVerdict
    from coordinator.rdzvctl.watch import Change

__all__ = [
    "change_json",
    "change_line",
    "gc_json",
    "gc_lines",
    "list_json",
    "list_lines",
    "node_status",
    "status_json",
    "status_lines",
    "table",
]


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """Left-aligned columns two spaces apart; the last column is not padded."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for row in [headers, *rows]:
        cells = [str(c).ljust(w) for c, w in zip(row[:-1], widths[:-1], strict=True)]
        lines.append((indent + "  ".join([*cells, str(row[-1])])).rstrip())
    return lines


def _when(ms: int, now_ms: int, tz: datetime.tzinfo | None) -> str:
    if ms <= 0:
        return "unknown"
    moment = datetime.datetime.fromtimestamp(ms / 1000, tz=tz)
    return f"{moment:%Y-%m-%d %H:%M:%S} ({_ago(now_ms - ms)} ago)"


def _ago(ms: int) -> str:
    seconds = max(0, ms // 1000)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _ttl(node: NodeView | None) -> str:
    if node is None:
        return "-"
    if node.ttl_left is None:
        return "?"
    return "expired" if node.ttl_left < 0 else f"{node.ttl_left}s"


def _list(ids: Sequence[str]) -> str:
    return " ".join(ids) if ids else "-"


def node_status(snapshot: RunSnapshot, node_id: str) -> str:
    """What a live node is in the run: ``rank N``, waiting, redundant, joining, or idle;
    ``unknown`` while the state does not decode (ranks and lists are in it)."""
    if phase(snapshot) == "unreadable":
        return "unknown"
    state = snapshot.effective_state
    rank = state.rank_of(node_id)
    node = snapshot.node(node_id)
    if node_id in state.draining:
        return "draining"  # rdzvctl drain: it is leaving
    if state.quarantine_of(node_id) is not None:
        return "quarantined"  # left out of the rounds for a while (--health-check)
    if node is not None and node.info.incarnation != state.incarnation:
        if state.closed and node.info.incarnation == state.incarnation + 1:
            return "starting it again"  # waits for the closed incarnation's nodes to leave
        return f"of incarnation {node.info.incarnation}"
    asks_next = node is not None and node.info.wanted_round == state.round + 1
    if rank is not None and state.round > 0:
        return f"rank {rank}, rejoining" if asks_next else f"rank {rank}"
    if node_id in state.wait_list:
        return "waiting"
    if node_id in state.redundancy_list:
        return "spare"  # listed as redundant: it takes a lost node's place
    return "joining" if asks_next else "idle"


def _state_line(snapshot: RunSnapshot, now_ms: int, tz: datetime.tzinfo | None) -> str:
    state = snapshot.effective_state
    current = phase(snapshot)
    if current == "empty":
        return "empty: no state and no node key"
    parts = [current]
    if state.round > 0:
        parts.append(
            f"round {state.round} completed {_when(state.completed_at_unix_ms, now_ms, tz)}"
        )
        if state.written_by:
            parts.append(f"state last written by {state.written_by}")
    else:
        parts.append("no round completed yet")
    joiners = joining(snapshot)
    if current == "forming":
        parts.append(f"round {state.round + 1} has {len(joiners)} joiner(s)")
    return ", ".join(parts)


def _state_block(snapshot: RunSnapshot, now_ms: int, tz: datetime.tzinfo | None) -> list[str]:
    """The lines that come from the state key: phase, closed, master, ranks, lists."""
    if phase(snapshot) == "unreadable":
        # Nothing of the state is known; an empty state's defaults (round 0, open, no
        # participants) would be made up, so none are shown.
        return ["state:           unreadable: its value does not decode, so round, ranks, "
                "lists and closed are unknown"]  # fmt: skip
    state = snapshot.effective_state
    closed = "no"
    if state.closed:
        closed = f"yes: {state.closed_reason}" if state.closed_reason else "yes"
    lines = [
        f"state:           {_state_line(snapshot, now_ms, tz)}",
        f"incarnation:     {state.incarnation}",
        f"closed:          {closed}",
    ]
    if state.master_addr:
        lines.append(f"master:          {state.master_addr}:{state.master_port}")
    lines.append(f"participants:    {len(state.participants)} in round {state.round}")
    rows = []
    for rank, node_id in enumerate(state.participants):
        node = snapshot.node(node_id)
        if node is None:
            rows.append([str(rank), node_id, "-", "-", "-", "-", "gone", "-"])
            continue
        info = node.info
        rows.append(
            [str(rank), node_id, info.addr, info.hostname, str(info.pid),
             str(info.local_world_size), _ttl(node), str(info.wanted_round)]
        )  # fmt: skip
    if rows:
        headers = ["RANK", "NODE", "ADDR", "HOSTNAME", "PID", "WORKERS", "LEASE LEFT", "ASKS FOR"]
        lines.extend(table(headers, rows))
    lines += [
        f"wait list:       {_list(state.wait_list)}",
        f"spares:          {_list(state.redundancy_list)}",
        f"lost:            {_list(state.lost)}",
        f"draining:        {_list(state.draining)}",
    ]
    if state.restarts.round:  # once the job counted a restart (etcdrun's --max-restarts)
        lines.append(f"restarts:        {describe(state.restarts)}")
    if state.quarantined:
        # Shown only when there are some: a run without --health-check never has any.
        lines.append(f"quarantined:     {len(state.quarantined)} (left out of the rounds)")
        rows = [
            [q.node_id, q.addr or "-", _left(q.until_unix_ms - now_ms), q.reason]
            for q in state.quarantined
        ]
        lines.extend(table(["NODE", "ADDR", "TIME LEFT", "REASON"], rows))
    return lines


def _left(ms: int) -> str:
    # By this machine's clock; the coordinator's clock decides (docs/health-check.md).
    return "ending" if ms <= 0 else _ago(ms + 999)


def status_lines(
    snapshot: RunSnapshot, now_ms: int, tz: datetime.tzinfo | None = None
) -> list[str]:
    """``rdzvctl status``: the run as a block of labelled lines and two tables.

    Only what etcd holds is shown: a state key that does not decode gives one line that
    says so (no defaults in its place), and every key that does not decode is listed by
    name at the end (the error, printed before these lines, says why).
    """
    keys = snapshot.keys
    lines = [
        f"run:             {keys.run_id} (key prefix {keys.key_prefix}, "
        f"etcd revision {snapshot.revision})",
        *_state_block(snapshot, now_ms, tz),
        f"nodes alive:     {len(snapshot.nodes)}",
    ]
    node_rows = [
        [n.node_id, str(n.info.wanted_round), node_status(snapshot, n.node_id),
         f"{n.lease:x}", _ttl(n), n.info.role or "-"]
        for n in snapshot.nodes
    ]  # fmt: skip
    if node_rows:
        headers = ["NODE", "ASKS FOR ROUND", "IS", "LEASE (hex)", "LEASE LEFT", "ROLE"]
        lines.extend(table(headers, node_rows))
    lines.extend(progress_lines(snapshot, now_ms))
    lines.append(f"store:           {snapshot.store_keys} key(s)")
    if snapshot.foreign_keys:
        lines.append(f"foreign keys:    {_list(snapshot.foreign_keys)}")
    if snapshot.unreadable_keys:
        lines.append(f"unreadable keys: {_list(snapshot.unreadable_keys)}")
    return lines


def _node_json(snapshot: RunSnapshot, node: NodeView) -> dict[str, Any]:
    info = node.info
    return {
        "node_id": info.node_id,
        "status": node_status(snapshot, info.node_id),
        "wanted_round": info.wanted_round,
        "addr": info.addr,
        "hostname": info.hostname,
        "pid": info.pid,
        "local_world_size": info.local_world_size,
        "role": info.role,
        "lease_id": node.lease,
        "lease_id_hex": f"{node.lease:x}",
        "lease_ttl_left": node.ttl_left,
        "free_port": info.free_port,
        "started_at_unix_ms": info.started_at_unix_ms,
        "create_revision": node.create_revision,
    }


def status_json(snapshot: RunSnapshot) -> dict[str, Any]:
    """``rdzvctl status --json``: every fact of :func:`status_lines`, machine-readable.

    While the state does not decode (``phase`` ``unreadable``), every field that comes
    from it is null: unknown, not the defaults of an empty state.
    """
    state = snapshot.effective_state
    participants = []
    for rank, node_id in enumerate(state.participants):
        node = snapshot.node(node_id)
        entry: dict[str, Any] = {"rank": rank, "node_id": node_id, "alive": node is not None}
        if node is not None:
            entry.update(_node_json(snapshot, node))
            del entry["status"]
        participants.append(entry)
    from_state: dict[str, Any] = {
        "incarnation": state.incarnation,
        "round": state.round,
        "closed": state.closed,
        "closed_reason": state.closed_reason,
        "completed_at_unix_ms": state.completed_at_unix_ms,
        "written_by": state.written_by,
        "master_addr": state.master_addr,
        "master_port": state.master_port,
        "participants": participants,
        "wait_list": list(state.wait_list),
        "redundancy_list": list(state.redundancy_list),
        "lost": list(state.lost),
        "draining": list(state.draining),
        "quarantined": [
            {
                "node_id": q.node_id,
                "addr": q.addr,
                "reason": q.reason,
                "until_unix_ms": q.until_unix_ms,
            }
            for q in state.quarantined
        ],
        "joining": list(joining(snapshot)),
        "hang": hang_json(state.hang),
        "restarts": dict(vars(state.restarts)),  # used, round, refunded
    }
    current = phase(snapshot)
    if current == "unreadable":
        from_state = dict.fromkeys(from_state)
    return {
        "run_id": snapshot.run_id,
        "key_prefix": snapshot.keys.key_prefix,
        "revision": snapshot.revision,
        "phase": current,
        **from_state,
        "state_mod_revision": snapshot.state_mod_revision,
        "nodes": [_node_json(snapshot, n) for n in snapshot.nodes],
        "progress": progress_json(snapshot),
        "store_keys": snapshot.store_keys,
        "foreign_keys": list(snapshot.foreign_keys),
        "errors": list(snapshot.errors),
        "unreadable_keys": list(snapshot.unreadable_keys),
    }


def _list_row(snapshot: RunSnapshot) -> dict[str, Any]:
    state = snapshot.effective_state
    return {
        "run_id": snapshot.run_id,
        "phase": phase(snapshot),
        "incarnation": state.incarnation,
        "round": state.round,
        "participants": len(state.participants),
        "alive": len(snapshot.nodes),
        "waiting": len(state.wait_list),
        "redundant": len(state.redundancy_list),
        "lost": len(state.lost),
        "closed": state.closed,
        "closed_reason": state.closed_reason,
        "completed_at_unix_ms": state.completed_at_unix_ms,
        "errors": list(snapshot.errors),
    }


def list_lines(snapshots: Sequence[RunSnapshot], key_prefix: str) -> list[str]:
    """``rdzvctl list``: one row per run."""
    if not snapshots:
        return [f"no runs under {key_prefix}/"]
    rows = []
    for snapshot in snapshots:
        row = _list_row(snapshot)
        closed = "no"
        if row["closed"]:
            closed = f"yes: {row['closed_reason']}" if row["closed_reason"] else "yes"
        rows.append(
            [row["run_id"], row["phase"], str(row["incarnation"]), str(row["round"]),
             str(row["participants"]), str(row["alive"]), str(row["waiting"]),
             str(row["lost"]), closed]
        )  # fmt: skip
    headers = ["RUN", "PHASE", "INCARNATION", "ROUND", "PARTICIPANTS", "ALIVE", "WAITING",
               "LOST", "CLOSED"]  # fmt: skip
    return table(headers, rows, indent="")


def list_json(
    snapshots: Sequence[RunSnapshot], key_prefix: str, foreign_keys: Sequence[str]
) -> dict[str, Any]:
    """``rdzvctl list --json``."""
    return {
        "key_prefix": key_prefix,
        "runs": [_list_row(s) for s in snapshots],
        "foreign_keys": list(foreign_keys),
    }


def gc_lines(verdicts: Sequence[GcVerdict], results: Sequence[GcResult] | None) -> list[str]:
    """``rdzvctl gc``: what goes (or would go, when ``results`` is None) and what stays."""
    if not verdicts:
        return ["no runs"]
    done = {r.run_id: r for r in results or ()}
    rows = []
    for v in verdicts:
        if not v.collect:
            rows.append(["keep", v.run_id, "-", v.reason])
        elif results is None:
            rows.append(["would remove", v.run_id, str(v.keys), v.reason])
        else:
            r = done[v.run_id]
            rows.append(["removed" if r.removed else "kept", v.run_id, str(v.keys), r.message])
    return table(["ACTION", "RUN", "KEYS", "WHY"], rows, indent="")


def gc_json(
    verdicts: Sequence[GcVerdict], results: Sequence[GcResult] | None, older_than: float
) -> dict[str, Any]:
    """``rdzvctl gc --json`` (with ``--dry-run``, ``results`` is None)."""
    done = {r.run_id: r for r in results or ()}
    runs = []
    for v in verdicts:
        entry: dict[str, Any] = {
            "run_id": v.run_id, "collect": v.collect, "reason": v.reason, "keys": v.keys
        }  # fmt: skip
        if v.run_id in done:
            entry["removed"] = done[v.run_id].removed
            entry["result"] = done[v.run_id].message
        runs.append(entry)
    return {"dry_run": results is None, "older_than_seconds": older_than, "runs": runs}


def change_line(change: Change, when: datetime.datetime) -> str:
    """One ``rdzvctl watch`` line: ``14:02:11 node vm-1-0 joined (asks for round 3)``."""
    return f"{when:%H:%M:%S} {change.text}"


def change_json(run_id: str, change: Change, when: datetime.datetime) -> str:
    """One ``rdzvctl watch --json`` line (a JSON object)."""
    record: dict[str, Any] = {
        "time": when.isoformat(timespec="milliseconds"),
        "run_id": run_id,
        "revision": change.revision,
        "event": change.kind,
        "text": change.text,
    }
    if change.node_id:
        record["node_id"] = change.node_id
    if change.round:
        record["round"] = change.round
    if change.nodes:
        record["nodes"] = list(change.nodes)
    if change.reason:
        record["reason"] = change.reason
    return json.dumps(record, sort_keys=True)
