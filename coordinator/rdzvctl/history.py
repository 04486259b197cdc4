"""``rdzvctl events``: a run's timeline as lines or JSON objects, read or followed.

The formatting is pure (:func:`event_line`, :func:`event_json`); :func:`read_history`
and :func:`follow_history` read etcd. Order: by the etcd revision of each fact (see
:mod:`coordinator.core.events`), so the lines of one run read in the order things
happened in etcd, whoever wrote them.

A run started again with the same id while the ended run's events are still kept (within
its retention) has the events of several incarnations; :func:`pick_incarnation` chooses
those of one (the newest, unless asked), so the new run's timeline reads clean.
"""

from __future__ import annotations

import datetime
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.core.errors import CorruptValueError, EtcdElasticError
from coordinator.core.etcd_client import EtcdClient, WatchEvent
from coordinator.core.events import Event, JoinsShown, decode_event, read_events
from coordinator.core.keys import RunKeys

__all__ = [
    "History",
    "Stop",
    "event_json",
    "event_line",
    "follow_history",
    "pick_incarnation",
    "read_history",
]

_CAUSE_TEXT = {
    "lease_expired": "lease expired (killed, frozen or cut off)",
    "left": "left",
    "drained": "drained by an operator",
    "quarantined": "quarantined (health check failed)",
    "hung": "hung (no progress)",
}


def _when(unix_ms: int, tz: datetime.tzinfo | None) -> str:
    if unix_ms <= 0:
        return "-" * 23
    moment = datetime.datetime.fromtimestamp(unix_ms / 1000, tz)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{unix_ms % 1000:03d}"


def _what(event: Event) -> str:
    kind = event.kind
    if kind == "joined":
        return f"{event.node_id} joined"
    if kind == "departed":
        return f"{event.node_id} departed: {_CAUSE_TEXT.get(event.cause, event.cause or '?')}"
    if kind == "round_completed":
        ranks = " ".join(f"{rank}={node}" for rank, node in enumerate(event.members))
        return f"round {event.round} completed with {len(event.members)} node(s): {ranks}"
    if kind == "restarted":
        cause = f": {event.summary}" if event.summary else ""
        return f"{event.node_id} restarted its workers (restart {event.restart_count}){cause}"
    if kind == "closed":
        why = f": {event.summary}" if event.summary else ""
        return f"run closed ({event.close_mode}){why}"
    if kind == "drain_requested":
        return f"{event.node_id} asked to leave (drain) by {event.written_by or '?'}"
    if kind == "health_checked":
        # One per round (its judge's); agents before that recorded one per node.
        who = f"{event.node_id} " if event.node_id else ""
        return f"{who}pre-flight check of round {event.round}: {event.summary}"
    cause = f" {event.cause}" if event.cause else ""
    summary = f": {event.summary}" if event.summary else ""
    return f"{event.node_id} fault{cause}{summary}"


def event_line(event: Event, tz: datetime.tzinfo | None = None) -> str:
    """One line: wall time (the writer's clock), the ordering revision, the kind, what.

    ``tz``: the time zone of the wall time (None: local)."""
    revision = event.revision or event.written_revision
    return f"{_when(event.unix_ms, tz)}  rev {revision:<8d} {event.kind:<16s} {_what(event)}"


def event_json(run_id: str, event: Event) -> dict[str, Any]:
    """One JSON object (a line of ``--json``): every field, the members with ranks."""
    return {
        "run_id": run_id,
        "kind": event.kind,
        "revision": event.revision or event.written_revision,
        "unix_ms": event.unix_ms,
        "node_id": event.node_id,
        "cause": event.cause,
        "round": event.round,
        "members": [{"node_id": n, "rank": r} for r, n in enumerate(event.members)],
        "summary": event.summary,
        "restart_count": event.restart_count,
        "close_mode": event.close_mode,
        "incarnation": event.incarnation,
        "written_by": event.written_by,
        "key": event.key,
    }


@dataclass(frozen=True)
class History:
    """What :func:`read_history` read: the events in order, the values that do not
    decode, and the revision of the read (a follow starts after it)."""

    events: list[Event]
    errors: list[CorruptValueError]
    revision: int


def read_history(client: EtcdClient, keys: RunKeys) -> History:
    """Read and order every event of the run."""
    kvs, revision = client.get_prefix(keys.events_prefix)
    events, errors = read_events(kvs)
    return History(events, errors, revision)


def pick_incarnation(
    run_id: str, events: Sequence[Event], wanted: int | None = None
) -> tuple[list[Event], str | None]:
    """The events of incarnation ``wanted`` (None: the newest) among ``events`` (in
    order), and a line saying which were left out (None: none).

    An event that names no incarnation (0: its writer did not know it) belongs to the one
    of the event before it (the first ones: to the first incarnation named).

    Raises:
        ValueError: ``events`` has none of incarnation ``wanted`` (names those it has).
    """
    current = next((e.incarnation for e in events if e.incarnation), 0)
    numbered: list[tuple[int, Event]] = []
    for event in events:
        current = event.incarnation or current
        numbered.append((current, event))
    number = max((n for n, _ in numbered), default=0) if wanted is None else wanted
    picked = [e for n, e in numbered if n == number]
    others = sorted({n for n, _ in numbered if n != number})
    if events and not picked:
        raise ValueError(
            f"run {run_id!r} has no events of incarnation {number}: it has events of "
            f"incarnation(s) {', '.join(map(str, others))}"
        )
    if not others:
        return picked, None
    return picked, (
        f"run {run_id} was started again with the same id: these are the events of "
        f"incarnation {number}; {len(events) - len(picked)} event(s) of incarnation(s) "
        f"{', '.join(map(str, others))} are kept until the run's retention passes "
        "(--incarnation N shows them)"
    )


class Stop:
    """Put in a follow's inbox (e.g. by a SIGINT handler) to end it."""


def follow_history(
    client: EtcdClient,
    keys: RunKeys,
    emit: Callable[[Event], None],
    on_error: Callable[[CorruptValueError], None],
    inbox: queue.Queue[list[WatchEvent] | Exception | Stop],
    select: Callable[[list[Event]], list[Event]] = lambda events: events,
) -> int:
    """Emit every event of the run in order, then each new one as it is written, until a
    :class:`Stop` arrives in ``inbox``. Returns how many were emitted.

    The watch starts before the read (``watch_then_read``), and events the read already
    has are dropped by revision, so none is missed or shown twice. New events are shown
    as they arrive. ``select`` picks which of the stored events are shown.

    Raises:
        EtcdElasticError: the watch ended (etcd cancelled it, or its history was
            compacted: run the command again).
    """

    def on_compacted(revision: int) -> None:
        inbox.put(
            EtcdElasticError(
                f"the watch of {keys.events_prefix.decode()} was compacted at revision "
                f"{revision}; run the command again"
            )
        )

    watch, history = client.watch_then_read(
        keys.events_prefix,
        lambda: read_history(client, keys),
        lambda events, _rev: inbox.put(events),
        on_compacted,
        prefix=True,
        on_error=inbox.put,
    )
    try:
        for error in history.errors:
            on_error(error)
        stored = select(history.events)
        joins = JoinsShown()  # a new round shows its members' joins not shown yet
        for event in stored:
            joins.expand(event)
            emit(event)
        shown = len(stored)
        while True:
            item = inbox.get()
            if isinstance(item, Stop):
                return shown
            if isinstance(item, Exception):
                raise item
            for change in item:
                if change.kind != "put" or change.kv.mod_revision <= history.revision:
                    continue  # a trimmed event (old news), or one the read showed
                shown_key = change.kv.key.decode("utf-8", "backslashreplace")
                try:
                    event = decode_event(shown_key, change.kv.value, change.kv.create_revision)
                except CorruptValueError as exc:
                    on_error(exc)
                    continue
                for each in joins.expand(event):
                    emit(each)
                    shown += 1
    finally:
        watch.cancel()
