"""The changes to the state: each kind, the ones a node or an operator asks for, and
:func:`apply`, which makes them.

Pure, like the decisions that produce them: the elected coordinator's
(:func:`coordinator.core.transitions.decide_coordinator`) and the few any node or an
operator asks for outside a formation, each written as a revision-guarded transaction by
the one writer of the state (:class:`coordinator.core.executor.StateExecutor`):

* :func:`close` — MARK_RENDEZVOUS_CLOSED, by whichever node (or operator) closes the run;
* :func:`drain` — ADD_TO_DRAINING (``rdzvctl drain``);
* :func:`declare_hang` — DECLARE_HANG, at most one per round (``--hang-timeout``);
* :func:`count_restart` — COUNT_RESTART, once per round for the job's ``--max-restarts``;
* :func:`quarantine` — ADD_TO_QUARANTINE (``--health-check``).

Each returns the actions to commit (none when there is nothing to change), so a lost
race decides again from the winner's state and writes nothing twice.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from coordinator.core.quarantine import new_entries
from coordinator.core.restart_budget import counted, counts, settled
from coordinator.core.state import CloseMode, Hang, Quarantine, RdzvState

__all__ = [
    "Action",
    "ActionKind",
    "apply",
    "close",
    "count_restart",
    "declare_hang",
    "drain",
    "quarantine",
]


class ActionKind(enum.Enum):
    """A change the coordinator (or a closing node) makes to the state."""

    ADD_TO_WAIT_LIST = "add_to_wait_list"
    ADD_TO_REDUNDANCY_LIST = "add_to_redundancy_list"
    #: A participant's lease ended: record it in ``lost`` (it stays in the rank table of
    #: the completed round, which is history, until the next round completes).
    REMOVE_FROM_PARTICIPANTS = "remove_from_participants"
    REMOVE_FROM_WAIT_LIST = "remove_from_wait_list"
    REMOVE_FROM_REDUNDANCY_LIST = "remove_from_redundancy_list"
    MARK_RENDEZVOUS_COMPLETE = "mark_rendezvous_complete"
    MARK_RENDEZVOUS_CLOSED = "mark_rendezvous_closed"
    #: Every node of the closed incarnation left and nodes ask for the next: open the run
    #: again, empty, as ``incarnation + 1`` (the round number goes on).
    START_INCARNATION = "start_incarnation"
    #: An operator asks a node to leave gracefully (``rdzvctl drain``).
    ADD_TO_DRAINING = "add_to_draining"
    #: A draining node's key is gone: it left.
    REMOVE_FROM_DRAINING = "remove_from_draining"
    #: A node's workers made no progress for ``--hang-timeout``: record the hang of the
    #: current round; every participant restarts its workers (a counted restart).
    DECLARE_HANG = "declare_hang"
    #: Nodes that failed the pre-flight check are left out until a time
    #: (:mod:`coordinator.core.quarantine`).
    ADD_TO_QUARANTINE = "add_to_quarantine"
    #: A quarantine ended (by the coordinator's clock) or its node's key is gone.
    REMOVE_FROM_QUARANTINE = "remove_from_quarantine"
    #: The workers of the state's round failed (or hung): one restart of the job's
    #: ``--max-restarts`` is used (:mod:`coordinator.core.restart_budget`).
    COUNT_RESTART = "count_restart"


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    node_ids: tuple[str, ...] = ()
    # MARK_RENDEZVOUS_COMPLETE only:
    redundant: tuple[str, ...] = ()
    master_addr: str = ""
    master_port: int = 0
    workers: tuple[tuple[str, int], ...] = ()  # (role, local world size) by rank
    # MARK_RENDEZVOUS_CLOSED only:
    reason: str = ""
    mode: CloseMode = "unspecified"
    # DECLARE_HANG only:
    hang: Hang | None = None
    # ADD_TO_QUARANTINE only:
    quarantine: tuple[Quarantine, ...] = ()
    # COUNT_RESTART only: the round whose failure is counted.
    restart_round: int = 0


def _without(items: tuple[str, ...], drop: tuple[str, ...]) -> tuple[str, ...]:
    gone = set(drop)
    return tuple(i for i in items if i not in gone)


def _with(items: tuple[str, ...], add: tuple[str, ...]) -> tuple[str, ...]:
    present = set(items)
    return items + tuple(i for i in add if i not in present)


def apply(
    state: RdzvState, actions: Iterable[Action], *, written_by: str = "", now_unix_ms: int = 0
) -> RdzvState:
    """Return the state after ``actions``; never mutates ``state``.

    Args:
        written_by: recorded in the state for operators.
        now_unix_ms: wall-clock time recorded at completion or close (informational only,
            and gc's measure of age).
    """
    for action in actions:
        kind, ids = action.kind, action.node_ids
        if kind is ActionKind.ADD_TO_WAIT_LIST:
            state = replace(state, wait_list=_with(state.wait_list, ids))
        elif kind is ActionKind.ADD_TO_REDUNDANCY_LIST:
            state = replace(state, redundancy_list=_with(state.redundancy_list, ids))
        elif kind is ActionKind.REMOVE_FROM_PARTICIPANTS:
            state = replace(state, lost=_with(state.lost, ids))
        elif kind is ActionKind.REMOVE_FROM_WAIT_LIST:
            state = replace(state, wait_list=_without(state.wait_list, ids))
        elif kind is ActionKind.REMOVE_FROM_REDUNDANCY_LIST:
            state = replace(state, redundancy_list=_without(state.redundancy_list, ids))
        elif kind is ActionKind.MARK_RENDEZVOUS_COMPLETE:
            state = replace(
                state,
                round=state.round + 1,
                participants=ids,
                wait_list=(),
                redundancy_list=action.redundant,
                lost=(),
                master_addr=action.master_addr,
                master_port=action.master_port,
                workers=action.workers,
                completed_at_unix_ms=now_unix_ms,
                # The last round's restart is given back if this round is smaller.
                restarts=settled(state.restarts, state.round, len(state.participants), len(ids)),
            )
        elif kind is ActionKind.MARK_RENDEZVOUS_CLOSED:
            state = replace(
                state,
                closed=True,
                closed_reason=action.reason,
                close_mode=action.mode,
                closed_at_unix_ms=now_unix_ms,
            )
        elif kind is ActionKind.ADD_TO_DRAINING:
            state = replace(state, draining=_with(state.draining, ids))
        elif kind is ActionKind.REMOVE_FROM_DRAINING:
            state = replace(state, draining=_without(state.draining, ids))
        elif kind is ActionKind.DECLARE_HANG:
            state = replace(state, hang=action.hang)
        elif kind is ActionKind.ADD_TO_QUARANTINE:
            known = {q.node_id for q in state.quarantined}
            new = tuple(q for q in action.quarantine if q.node_id not in known)
            state = replace(state, quarantined=state.quarantined + new)
        elif kind is ActionKind.REMOVE_FROM_QUARANTINE:
            gone = set(ids)
            kept = tuple(q for q in state.quarantined if q.node_id not in gone)
            state = replace(state, quarantined=kept)
        elif kind is ActionKind.COUNT_RESTART:
            state = replace(state, restarts=counted(state.restarts, action.restart_round))
        elif kind is ActionKind.START_INCARNATION:
            state = RdzvState(round=state.round, incarnation=state.incarnation + 1)
    return replace(state, written_by=written_by) if written_by else state


def close(
    state: RdzvState, reason: str, mode: CloseMode = "finished", incarnation: int = 0
) -> tuple[Action, ...]:
    """The actions that close the run (none if it is closed already).

    Args:
        reason: shown to every node that finds the run closed.
        mode: what the agents still running should do (see ``CloseMode``).
        incarnation: close only this incarnation (0: whichever is current). A node of
            an ended incarnation must never close the run started after it.
    """
    if state.closed or (incarnation and incarnation != state.incarnation):
        return ()
    return (Action(ActionKind.MARK_RENDEZVOUS_CLOSED, reason=reason, mode=mode),)


def drain(state: RdzvState, node_id: str) -> tuple[Action, ...]:
    """The actions that ask ``node_id`` to leave gracefully (none if already asked)."""
    if node_id in state.draining:
        return ()
    return (Action(ActionKind.ADD_TO_DRAINING, (node_id,)),)


def declare_hang(state: RdzvState, hang: Hang) -> tuple[Action, ...]:
    """The actions that record ``hang`` (none if it must not be recorded).

    At most one hang per round: none is recorded when the state already holds one for
    ``hang.round`` (another node declared it first: every node then follows that one),
    when ``hang.round`` is not the current round (it re-formed meanwhile: the hang is
    over), or when the run is closed.
    """
    if state.closed or hang.round != state.round:
        return ()
    if state.hang is not None and state.hang.round == hang.round:
        return ()
    return (Action(ActionKind.DECLARE_HANG, hang=hang),)


def count_restart(state: RdzvState, round: int, incarnation: int = 0) -> tuple[Action, ...]:
    """The actions that count a failure of ``round`` against the job's budget: none when
    it is counted already, is not the state's round, or the run (or ``incarnation``, when
    given) is closed or over (:func:`coordinator.core.restart_budget.counts`)."""
    if incarnation and incarnation != state.incarnation:
        return ()
    if not counts(state.restarts, round, state.round, state.closed):
        return ()
    return (Action(ActionKind.COUNT_RESTART, restart_round=round),)


def quarantine(state: RdzvState, entries: Sequence[Quarantine]) -> tuple[Action, ...]:
    """The actions that quarantine ``entries`` (none for nodes quarantined already, and
    none in a closed run)."""
    new = () if state.closed else new_entries(state, entries)
    return (Action(ActionKind.ADD_TO_QUARANTINE, quarantine=new),) if new else ()
