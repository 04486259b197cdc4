"""A run's timeline: the events kept at ``<prefix>/<run_id>/events/``, as plain values.

What is recorded, and by whom (docs/timeline.md):

* ``joined``: a node key appeared (the coordinator, from its node watch). For the members
  of a round it is not written apart: the ``round_completed`` carries each member's key
  generation and when it was seen, and readers derive the join (:func:`expand_joins`),
  so a formation of N nodes writes one event, not N + 1;
* ``departed`` with a cause: ``lease_expired`` (its key went without the node saying it
  leaves), ``left`` (it said so before revoking its lease), ``drained`` (an operator's
  ``rdzvctl drain``), ``quarantined`` and ``hung`` (for the health check and the hang
  detector: :func:`coordinator.core.event_log.record_event`);
* ``round_completed`` with the members and their ranks (the coordinator that committed it);
* ``restarted`` with the root cause (the agent making a counted restart);
* ``closed`` with the mode and reason (whoever closed the run: an agent, ``rdzvctl close``);
* ``drain_requested`` (``rdzvctl drain``) and ``fault`` (something noticed, no departure:
  ``hung``, ``quarantined``);
* ``health_checked``: a round's pre-flight check (the node that judged it, once).

Each event has an id that names the fact, not the writer (:func:`event_id`): two writers
recording the same fact (a departing node and the coordinator that sees its key go; two
coordinators, one after the other, that both saw a join) write the same key, and only the
first write lands (put-if-absent). So a node that says "left" before revoking its lease is
not also recorded as "lease expired".

Order: by the etcd revision of the fact (``revision``: a node key's create revision, a
commit's revision), else by the revision at which the event was written. Wall times are
informational (``unix_ms``: the writer's clock; machines' clocks are never compared to
order anything).

Everything here is pure; what a coordinator's commit records is
:mod:`coordinator.core.commit_events`, writing is :mod:`coordinator.core.event_log`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from google.protobuf import json_format

from coordinator.core.errors import CorruptValueError
from coordinator.core.etcd_client import KeyValue
from coordinator.core.state import (
    CLOSE_MODE_CODES,
    CloseMode,
    close_mode_of,
)
from coordinator.generated import rendezvous_pb2 as pb

__all__ = [
    "EVENT_SCHEMA_VERSION",
    "Cause",
    "Event",
    "EventKind",
    "JoinsShown",
    "decode_event",
    "encode_event",
    "event_id",
    "expand_joins",
    "order_events",
    "read_events",
    "trim_count",
]

EVENT_SCHEMA_VERSION = 2
"""2 added each member's join to ``round_completed`` (``member_generations``)."""

EventKind = Literal[
    "joined",
    "departed",
    "round_completed",
    "restarted",
    "closed",
    "drain_requested",
    "fault",
    "health_checked",
]
"""What happened (see the module docstring and ``EventKind`` in the .proto)."""

Cause = Literal["", "lease_expired", "left", "drained", "quarantined", "hung"]
"""Why a node departed (or what a fault was); "" for events that have none."""

_KINDS: dict[str, int] = {
    "joined": pb.EVENT_KIND_JOINED,
    "departed": pb.EVENT_KIND_DEPARTED,
    "round_completed": pb.EVENT_KIND_ROUND_COMPLETED,
    "restarted": pb.EVENT_KIND_RESTARTED,
    "closed": pb.EVENT_KIND_CLOSED,
    "drain_requested": pb.EVENT_KIND_DRAIN_REQUESTED,
    "fault": pb.EVENT_KIND_FAULT,
    "health_checked": pb.EVENT_KIND_HEALTH_CHECKED,
}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
_CAUSES: dict[str, int] = {
    "": pb.DEPARTURE_CAUSE_UNSPECIFIED,
    "lease_expired": pb.DEPARTURE_CAUSE_LEASE_EXPIRED,
    "left": pb.DEPARTURE_CAUSE_LEFT,
    "drained": pb.DEPARTURE_CAUSE_DRAINED,
    "quarantined": pb.DEPARTURE_CAUSE_QUARANTINED,
    "hung": pb.DEPARTURE_CAUSE_HUNG,
}
_CAUSE_NAMES = {v: k for k, v in _CAUSES.items()}
# A summary is one line for people; a traceback belongs in the agent's log.
_MAX_SUMMARY = 500


@dataclass(frozen=True)
class Event:
    """One entry of a run's timeline.

    Attributes:
        kind: what happened.
        node_id: the node it is about ("" for rounds and closes).
        cause: why a node departed (or what a fault was).
        round: the completed round (``round_completed``), else the last completed round
            the writer knew of (0: none).
        members: ``round_completed``: node ids in group-rank order (index = rank).
        revision: the etcd revision of the fact (0: use ``written_revision``).
        unix_ms: the writer's wall clock, informational.
        written_by: a node id, or ``rdzvctl@host``.
        summary: one line (a restart's root cause, a close's reason).
        restart_count: ``restarted``: counted restarts so far, this one included.
        close_mode: ``closed``: how.
        incarnation: the incarnation of the run (0: not known to the writer).
        written_revision: not stored: the create revision of the event's key (set when
            read back from etcd).
        key: not stored: the event's key, when read back.
        generation: not stored: ``joined``/``departed``: the create revision of the
            node's key (names the event, see :func:`event_id`; 0: ``revision``).
        member_generations, member_joined_ms: ``round_completed``: each member's key
            create revision and when the coordinator saw it (0: not by this one); empty
            or as long as ``members``.
    """

    kind: EventKind
    node_id: str = ""
    cause: Cause = ""
    round: int = 0
    members: tuple[str, ...] = ()
    revision: int = 0
    unix_ms: int = 0
    written_by: str = ""
    summary: str = ""
    restart_count: int = 0
    close_mode: CloseMode = "unspecified"
    incarnation: int = 0
    written_revision: int = field(default=0, compare=False)
    key: str = field(default="", compare=False)
    generation: int = field(default=0, compare=False)
    member_generations: tuple[int, ...] = ()
    member_joined_ms: tuple[int, ...] = ()

    @property
    def order(self) -> tuple[int, int, int]:
        """Sort key: the fact's revision (else the write's), then the write's, then the
        wall time (events written in one transaction share its revision; one writer's
        times increase)."""
        return (self.revision or self.written_revision, self.written_revision, self.unix_ms)


def event_id(event: Event) -> str:
    """The id of ``event``'s key under ``events/``: it names the fact, so that every
    writer of the same fact writes the same key (the first write wins).

    ``joined/<node>/<n>`` and ``departed/<node>/<n>`` (n: the create revision of the node's
    key, which a re-join changes), ``round_completed/<round>``,
    ``restarted/<node>/<restart count>``, ``closed/<incarnation>``,
    ``health_checked/<node>/<round>``, ``fault/<node>/<cause>-<round>`` (a hang is
    declared once per round, a node quarantined once per round's check: two nodes that
    record the same fault write one key), and ``drain_requested/<node>/<n>`` (n: the
    revision of the drain's write; the writer's wall-clock milliseconds when it has none).
    No id holds a wall time that two writers of one fact would not share.
    """
    kind = event.kind
    node = event.node_id or "run"
    if kind in ("joined", "departed"):
        return f"{kind}/{node}/{event.generation or event.revision}"
    if kind == "round_completed":
        return f"{kind}/{event.round}"
    if kind == "restarted":
        return f"{kind}/{node}/{event.restart_count}"
    if kind == "closed":
        return f"{kind}/{event.incarnation}"
    if kind == "health_checked":
        return f"{kind}/{node}/{event.round}"
    if kind == "fault":
        return f"{kind}/{node}/{event.cause or 'unspecified'}-{event.round}"
    return f"{kind}/{node}/{event.revision or event.unix_ms}"


def encode_event(event: Event) -> bytes:
    """The stored form: compact protobuf JSON (fields at their default left out)."""
    message = pb.RunEvent(
        schema_version=EVENT_SCHEMA_VERSION,
        kind=_KINDS[event.kind],  # type: ignore[arg-type]
        node_id=event.node_id,
        cause=_CAUSES[event.cause],  # type: ignore[arg-type]
        round=event.round,
        members=[pb.Participant(node_id=n, rank=r) for r, n in enumerate(event.members)],
        revision=event.revision,
        unix_ms=event.unix_ms,
        written_by=event.written_by,
        summary=_one_line(event.summary),
        restart_count=event.restart_count,
        close_mode=CLOSE_MODE_CODES[event.close_mode],  # type: ignore[arg-type]
        incarnation=event.incarnation,
        member_generations=event.member_generations,
        member_joined_unix_ms=event.member_joined_ms,
    )
    fields = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode()


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _MAX_SUMMARY else line[: _MAX_SUMMARY - 1] + "…"


def decode_event(key: str, raw: bytes, written_revision: int = 0) -> Event:
    """Decode a stored event (``key`` names it in errors).

    Raises:
        CorruptValueError: not a RunEvent in JSON, no or a newer schema_version, or a
            kind this version does not know.
    """
    message = pb.RunEvent()
    try:
        json_format.Parse(raw.decode("utf-8"), message, ignore_unknown_fields=False)
    except (UnicodeDecodeError, json_format.ParseError) as exc:
        raise CorruptValueError(key, f"not a RunEvent in JSON ({exc})") from exc
    if message.schema_version == 0:
        raise CorruptValueError(key, "no schema_version: not written by etcd-elastic")
    if message.schema_version > EVENT_SCHEMA_VERSION:
        raise CorruptValueError(
            key,
            f"schema_version {message.schema_version} is newer than this etcd-elastic "
            f"understands ({EVENT_SCHEMA_VERSION}); upgrade rdzvctl",
        )
    kind = _KIND_NAMES.get(message.kind)
    if kind is None:
        raise CorruptValueError(key, f"event kind {message.kind} is unknown")
    by_rank = sorted(range(len(message.members)), key=lambda i: message.members[i].rank)
    members = [message.members[i] for i in by_rank]
    joins = (list(message.member_generations), list(message.member_joined_unix_ms))
    if any(values and len(values) != len(members) for values in joins):
        raise CorruptValueError(key, f"member joins {joins} do not match {len(members)} members")
    return Event(
        kind=kind,  # type: ignore[arg-type]
        node_id=message.node_id,
        cause=_CAUSE_NAMES.get(message.cause, ""),  # type: ignore[arg-type]
        round=message.round,
        members=tuple(p.node_id for p in members),
        revision=message.revision,
        unix_ms=message.unix_ms,
        written_by=message.written_by,
        summary=message.summary,
        restart_count=message.restart_count,
        close_mode=close_mode_of(message.close_mode),
        incarnation=message.incarnation,
        written_revision=written_revision,
        key=key,
        member_generations=tuple(joins[0][i] for i in by_rank) if joins[0] else (),
        member_joined_ms=tuple(joins[1][i] for i in by_rank) if joins[1] else (),
    )


class JoinsShown:
    """Which joins a reader has shown: a ``round_completed`` implies the ``joined`` of each
    member whose key generation was not shown yet (by its own ``joined`` event or an
    earlier round). Pure; feed it the events in timeline order."""

    def __init__(self) -> None:
        self._shown: set[tuple[str, int]] = set()

    def expand(self, event: Event) -> list[Event]:
        """``event``, after the joins it implies that were not shown yet (in order)."""
        if event.kind == "joined":
            self._shown.add((event.node_id, event.revision))
            return [event]
        if event.kind != "round_completed" or not event.member_generations:
            return [event]
        out = []
        seen_ms = event.member_joined_ms or (0,) * len(event.members)
        for node, generation, ms in zip(
            event.members, event.member_generations, seen_ms, strict=True
        ):
            if generation <= 0 or (node, generation) in self._shown:
                continue
            self._shown.add((node, generation))
            out.append(
                Event(
                    "joined", node_id=node, round=event.round - 1, revision=generation,
                    unix_ms=ms or event.unix_ms, written_by=event.written_by,
                    incarnation=event.incarnation, written_revision=event.written_revision,
                    key=event.key,
                )
            )  # fmt: skip
        return [*out, event]


def expand_joins(events: Iterable[Event]) -> list[Event]:
    """``events`` (in timeline order) with the joins their rounds imply, in order."""
    shown = JoinsShown()
    return order_events(e for event in events for e in shown.expand(event))


def read_events(kvs: Iterable[KeyValue]) -> tuple[list[Event], list[CorruptValueError]]:
    """Decode the keys of an ``events/`` read, in timeline order; the undecodable ones
    are returned apart (a stray value must not hide the rest)."""
    events: list[Event] = []
    errors: list[CorruptValueError] = []
    for kv in kvs:
        shown = kv.key.decode("utf-8", "backslashreplace")
        try:
            events.append(decode_event(shown, kv.value, kv.create_revision))
        except CorruptValueError as exc:
            errors.append(exc)
    return expand_joins(order_events(events)), errors


def order_events(events: Iterable[Event]) -> list[Event]:
    """``events`` in timeline order (see :attr:`Event.order`)."""
    return sorted(events, key=lambda e: e.order)


def trim_count(count: int, limit: int) -> int:
    """How many of the oldest events to delete when ``count`` are kept and the limit is
    ``limit``: none until the count passes the limit by a tenth (so trimming is one
    batch now and then, not a delete per write), then back down to the limit."""
    slack = max(1, limit // 10)
    return count - limit if count > limit + slack else 0
