"""What a coordinator records on the run's timeline: joins from its node table, rounds and
departures from its commits (the :class:`~coordinator.core.events.Event` values; see
:mod:`coordinator.core.events` for what each kind means and how ids are chosen).

Pure: :func:`events_of_commit` maps one commit to its events, :class:`EventRecorder`
keeps the coordinator's bookkeeping between commits; writing is
:mod:`coordinator.core.event_log`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from coordinator.core.events import Cause, Event
from coordinator.core.state import NodeInfo, RdzvState
from coordinator.core.transitions import Action, ActionKind

__all__ = ["EventRecorder", "events_of_commit"]


def events_of_commit(
    before: RdzvState,
    after: RdzvState,
    actions: Sequence[Action],
    revision: int,
    generations: Mapping[str, int],
    live: Collection[str] | None = None,
) -> list[Event]:
    """The events a coordinator's successful commit records.

    Args:
        before, after: the state the commit was decided from, and the one it wrote.
        actions: what it applied.
        revision: the commit's etcd revision.
        generations: node id -> create revision of its key, for the nodes the coordinator
            has seen (a departure's id names the key that went).
        live: the participants of ``before`` whose key was alive when it decided: one
            whose key went and whom a completed round leaves out departed, even when no
            commit marked it lost first (the others re-joined before its lease ended).
            None: not known (no such departure is recorded).
    """
    out: list[Event] = []

    def departed(node: str, cause: Cause) -> None:
        out.append(
            Event(
                "departed",
                node_id=node,
                cause=cause,
                round=before.round,
                revision=revision,
                incarnation=before.incarnation,
                generation=generations.get(node, 0),
            )
        )

    for action in actions:
        kind = action.kind
        if kind is ActionKind.MARK_RENDEZVOUS_COMPLETE:
            gone = (
                set()
                if live is None
                else set(before.participants) - set(after.participants) - set(live)
            )
            for node in before.participants:
                if node in gone and node not in before.lost and node not in before.draining:
                    departed(node, "lease_expired")
            out.append(
                Event(
                    "round_completed",
                    round=after.round,
                    members=after.participants,
                    revision=revision,
                    incarnation=after.incarnation,
                )
            )
        elif kind is ActionKind.REMOVE_FROM_DRAINING:
            for node in action.node_ids:
                departed(node, "drained")
        elif kind in (
            ActionKind.REMOVE_FROM_PARTICIPANTS,
            ActionKind.REMOVE_FROM_WAIT_LIST,
            ActionKind.REMOVE_FROM_REDUNDANCY_LIST,
        ):
            for node in action.node_ids:
                # A participant being drained is counted lost while its key still lives;
                # its departure is recorded when the key goes (REMOVE_FROM_DRAINING).
                if node not in before.draining:
                    # Its key went without the node saying it leaves (a node that leaves
                    # on its own records "left" first, and that write wins).
                    departed(node, "lease_expired")
        elif kind is ActionKind.MARK_RENDEZVOUS_CLOSED:
            out.append(
                Event(
                    "closed",
                    round=after.round,
                    summary=action.reason,
                    close_mode=action.mode,
                    revision=revision,
                    incarnation=after.incarnation,
                )
            )
    return out


class EventRecorder:
    """The coordinator's part of the timeline: joins from its node table, rounds and
    departures from its commits. Pure bookkeeping; the events go to a sink (the
    background :class:`~coordinator.core.event_log.EventLog`).

    Not thread-safe: called from the coordinator's thread only.
    """

    def __init__(self, written_by: str) -> None:
        self._written_by = written_by
        self._generations: dict[str, int] = {}
        self.pending: list[Event] = []

    def appeared(self, state: RdzvState, nodes: Mapping[str, NodeInfo]) -> None:
        """Note node keys that appeared (``joined``), as the node table reports them
        (:meth:`~coordinator.core.node_table.NodeTable.take_appeared`): O(new keys), so
        a formation of N nodes records its joins in O(N). A key already noted (the
        table re-read after a resync) is not noted twice."""
        for node_id, info in nodes.items():
            if self._generations.get(node_id) == info.create_revision:
                continue
            self._generations[node_id] = info.create_revision
            self.pending.append(
                Event(
                    "joined",
                    node_id=node_id,
                    round=state.round,
                    revision=info.create_revision,
                    incarnation=info.incarnation,
                    written_by=self._written_by,
                )
            )

    def committed(
        self,
        before: RdzvState,
        after: RdzvState,
        actions: Sequence[Action],
        revision: int,
        live: Collection[str] | None = None,
    ) -> None:
        """Note what a successful commit did (rounds, departures); ``live``: see
        :func:`events_of_commit`."""
        for event in events_of_commit(before, after, actions, revision, self._generations, live):
            self.pending.append(replace(event, written_by=self._written_by))
            if event.kind == "departed":
                self._generations.pop(event.node_id, None)

    def take(self) -> list[Event]:
        """The events noted since the last call."""
        taken, self.pending = self.pending, []
        return taken
