"""What a coordinator records on the run's timeline: joins from its node table, rounds and
departures from its commits (the :class:`~coordinator.core.events.Event` values; see
:mod:`coordinator.core.events` for what each kind means and how ids are chosen).

Pure: :func:`events_of_commit` maps one commit to its events, :class:`EventRecorder`
keeps the coordinator's bookkeeping between commits; writing is
:mod:`coordinator.core.event_log`.

Joins are held until the coordinator's next commit. The members of a round it completes
get no ``joined`` event of their own: the ``round_completed`` event carries each member's
key generation and when the coordinator saw the key, and readers derive the joins from
it (:func:`coordinator.core.events.expand_joins`). So a formation of N nodes writes one
event (the round), not N + 1: with the N node keys and the pre-flight check's N results,
a formation stays within 2N + O(1) writes (DESIGN §10). A node that joins but is not a
member of a round completed by that commit (it goes to the wait or spare list, or left)
gets its own ``joined`` event at that commit.

A new coordinator (after a failover, or one that stepped in for a node that came earlier)
sees every live node as new. The joins of the members of a round another coordinator
completed are not written again: that round's event shows them (before, such a
coordinator wrote N ``joined`` events at its first commit that completed no round). A
node whose key went before it saw the key (its predecessor, above all) has a departure
whose generation it reads from the last round the node was a member of
(``round_generations``: that round's event, one get per round, looked for in the
:data:`ROUNDS_BACK` rounds up to the departure's), so the departure's id is the one the
node wrote itself when it left: "left" is not recorded again as "lease expired". Its
later rounds list the nodes again with the same generations; readers show each join once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace

from coordinator.core.actions import Action, ActionKind
from coordinator.core.events import Cause, Event
from coordinator.core.state import NodeInfo, RdzvState

__all__ = ["ROUNDS_BACK", "EventRecorder", "events_of_commit"]

ROUNDS_BACK = 3
"""How many rounds, up to a departure's, a new coordinator reads for the key generation of
a node it never saw (went around the failover; a drained node was a member of an earlier
round than the last): each read is one get, once per round and term."""


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
    """The coordinator's events, for a sink (the background
    :class:`~coordinator.core.event_log.EventLog`).

    Args:
        written_by: the coordinator's node id.
        wall_ms: wall-clock milliseconds (when a key was seen: informational).
        round_generations: a round's members and their key generations as recorded
            (asked only for a departure of a node this recorder never saw; may do I/O).

    Not thread-safe: called from the coordinator's thread only.
    """

    def __init__(
        self,
        written_by: str,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        round_generations: Callable[[int], Mapping[str, int]] = lambda _round: {},
    ) -> None:
        self._written_by = written_by
        self._wall_ms = wall_ms
        self._round_generations = round_generations
        self._of_round: dict[int, Mapping[str, int]] = {}  # asked once per round
        self._round = 0  # the last round whose members' joins are accounted for
        self._generations: dict[str, int] = {}
        self._joins: dict[str, Event] = {}  # seen, not yet written or folded into a round
        self.pending: list[Event] = []

    def appeared(self, state: RdzvState, nodes: Mapping[str, NodeInfo]) -> None:
        """Note node keys that appeared (``joined``), as the node table reports them
        (:meth:`~coordinator.core.node_table.NodeTable.take_appeared`): O(new keys). A key
        already noted (the table re-read after a resync) is not noted twice. Held until
        the next commit (see the module docstring)."""
        now = self._wall_ms()
        for node_id, info in nodes.items():
            if self._generations.get(node_id) == info.create_revision:
                continue
            self._generations[node_id] = info.create_revision
            self._joins[node_id] = Event(
                "joined",
                node_id=node_id,
                round=state.round,
                revision=info.create_revision,
                incarnation=info.incarnation,
                written_by=self._written_by,
                unix_ms=now,
            )
        if state.round > self._round:
            # A round another coordinator completed: its event shows its members' joins.
            self._round = state.round
            for node in state.participants:
                self._joins.pop(node, None)

    def committed(
        self,
        before: RdzvState,
        after: RdzvState,
        actions: Sequence[Action],
        revision: int,
        live: Collection[str] | None = None,
    ) -> None:
        """Note what a successful commit did (rounds, departures; ``live``: see
        :func:`~coordinator.core.events.events_of_commit`), and the joins held so far:
        folded into a round it completed, else written with it."""
        events = events_of_commit(before, after, actions, revision, self._generations, live)
        out = []
        for event in events:
            if event.kind == "round_completed":
                event = self._fold_joins(event)
            if event.kind == "departed":
                self._generations.pop(event.node_id, None)
                if not event.generation:
                    event = replace(event, generation=self._recorded(event))
            out.append(replace(event, written_by=self._written_by))
        self.pending.extend(self._joins.values())
        self._joins.clear()
        self._round = max(self._round, after.round)
        self.pending.extend(out)

    def _recorded(self, departure: Event) -> int:
        """The generation of a departed node's key as its last round recorded it (0: not
        known)."""
        for round_ in range(departure.round, max(departure.round - ROUNDS_BACK, 0), -1):
            generation = self._members(round_).get(departure.node_id, 0)
            if generation:
                return generation
        return 0

    def _members(self, round_: int) -> Mapping[str, int]:
        """Round ``round_``'s members and their key generations as recorded (asked once)."""
        if round_ not in self._of_round:
            self._of_round[round_] = {
                node: generation
                for node, generation in self._round_generations(round_).items()
                if generation > 0
            }
        return self._of_round[round_]

    def _fold_joins(self, event: Event) -> Event:
        joins = [self._joins.pop(node, None) for node in event.members]
        return replace(
            event,
            member_generations=tuple(self._generations.get(n, 0) for n in event.members),
            member_joined_ms=tuple(0 if j is None else j.unix_ms for j in joins),
        )

    def take(self) -> list[Event]:
        """The events ready to write since the last call (joins wait for a commit)."""
        taken, self.pending = self.pending, []
        return taken
