"""Pure decisions of the rendezvous: what to do, given the state, the nodes and the time.

Three deciders, all free of I/O and of the clock (``now`` is an argument):

* :func:`decide_node` — what one node inside ``next_rendezvous()`` does next: ask for the
  next round (JOIN), wait for an event (SYNC), return its rank (FINISH), or fail
  (ERROR_CLOSED, ERROR_TIMEOUT). A node only ever writes its own key.
* :func:`decide_coordinator` — what the elected coordinator commits to the state key, as a
  list of actions applied by :func:`apply` and written in ONE revision-guarded
  transaction: ADD_TO_WAIT_LIST, ADD_TO_REDUNDANCY_LIST, REMOVE_FROM_PARTICIPANTS,
  REMOVE_FROM_WAIT_LIST, REMOVE_FROM_REDUNDANCY_LIST, MARK_RENDEZVOUS_COMPLETE (which is
  where ADD_TO_PARTICIPANTS happens: ranks are assigned at completion). MARK_RENDEZVOUS_CLOSED
  is committed by whichever node closes the run (:func:`close`).
* :func:`to_restore` — what the coordinator writes back at a state key found absent
  (deleted by hand), so the rounds go on from the last one.

Round rules (DESIGN §4): nodes ask for ``state.round + 1``. A round may form once it is
*open*: it is the first round, or a live participant of the last round asked for it
(it re-rendezvoused), or no participant of the last round is alive. It completes at once
with ``max_nodes`` joiners; with ``min_nodes`` it completes when the last call ends, or
at once when every live participant of the last round has joined (a restart need not
wait out last call). Survivors keep their rank order; newcomers follow by arrival.

Incarnations (a run started again with the same id): a node belongs to the incarnation it
first asked to join (:func:`incarnation_to_join`). A closed run admits no node of its own
incarnation; a node that arrives at a closed run asks for ``incarnation + 1`` and waits;
once every live node key belongs to ``incarnation + 1`` (every node of the ended one has
left) the coordinator commits START_INCARNATION: the run is open again, empty, and its
round number goes on (no store key of an old round is ever reused). The coordinator
counts only the nodes of the current incarnation; a node of an older one never joins a
newer one (ERROR_SUPERSEDED).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from coordinator.core.quarantine import ended, new_entries, release_in
from coordinator.core.restart_budget import counted, counts, settled
from coordinator.core.state import CloseMode, Hang, NodeInfo, Quarantine, RdzvState
from coordinator.core.tally import Tally, tally_of
from coordinator.core.worker_kinds import pack_workers

__all__ = [
    "Action",
    "ActionKind",
    "CoordinatorDecision",
    "Limits",
    "NodeAction",
    "apply",
    "close",
    "count_restart",
    "decide_coordinator",
    "decide_node",
    "declare_hang",
    "drain",
    "incarnation_to_join",
    "is_spare",
    "quarantine",
    "to_restore",
    "workers_of",
]


@dataclass(frozen=True)
class Limits:
    """The part of the settings the decisions need."""

    min_nodes: int
    max_nodes: int
    last_call_timeout: float


class NodeAction(enum.Enum):
    """What a node inside ``next_rendezvous()`` does next."""

    #: Write this node's key asking for ``state.round + 1``.
    JOIN = "join"
    #: Nothing to do until the state changes or a deadline passes.
    SYNC = "sync"
    #: The round this node asked for completed with it: return its rank.
    FINISH = "finish"
    #: The run is closed: raise RendezvousClosedError.
    ERROR_CLOSED = "error_closed"
    #: The run finished (or was drained) while this node waited outside its round (a
    #: spare, wait-listed): nothing failed, the node is done (torch's graceful exit).
    EXIT_GRACEFULLY = "exit_gracefully"
    #: join_timeout passed: raise RendezvousTimeoutError.
    ERROR_TIMEOUT = "error_timeout"
    #: The run was started again (or reset) after this node's incarnation: this node
    #: belongs to an ended one and never joins another.
    ERROR_SUPERSEDED = "error_superseded"


def incarnation_to_join(state: RdzvState) -> int:
    """The incarnation a node that has none yet joins: the state's while the run is open,
    the next one once it is closed (the node then waits for every node of the ended
    incarnation to leave)."""
    return state.incarnation + 1 if state.closed else state.incarnation


def is_spare(state: RdzvState, node_id: str) -> bool:
    """Whether ``node_id`` is a listed spare of ``state`` (the redundancy list): it waits
    for a place without a deadline, on events only."""
    return node_id in state.redundancy_list and state.rank_of(node_id) is None


def decide_node(
    state: RdzvState,
    node_id: str,
    wanted_round: int,
    now: float,
    join_deadline: float,
    incarnation: int = 0,
) -> NodeAction:
    """Decide the next step of a node that asked for ``wanted_round`` (0: not yet asked).

    Args:
        state: the latest state the node has seen.
        node_id: this node.
        wanted_round: the round in this node's key, 0 if it has not asked in this call.
        now, join_deadline: monotonic seconds.
        incarnation: the incarnation this node belongs to (0: none yet; it takes
            :func:`incarnation_to_join` when it asks).
    """
    if node_id in state.draining and incarnation in (0, state.incarnation):
        return NodeAction.EXIT_GRACEFULLY  # drained: it leaves and is never admitted
    if incarnation:
        if state.closed and incarnation == state.incarnation:
            waited_outside = state.rank_of(node_id) is None
            if waited_outside and state.close_mode in ("finished", "drain"):
                return NodeAction.EXIT_GRACEFULLY
            return NodeAction.ERROR_CLOSED
        if incarnation != incarnation_to_join(state):
            return NodeAction.ERROR_SUPERSEDED
    if wanted_round and state.round == wanted_round and state.rank_of(node_id) is not None:
        return NodeAction.FINISH
    if now >= join_deadline and not is_spare(state, node_id):
        # A spare (listed as redundant because the round is full) waits without a
        # deadline, as torch's: it is what takes a lost node's place. A round that
        # completes without it keeps it listed, and it asks for the next one.
        return NodeAction.ERROR_TIMEOUT
    if wanted_round <= state.round:
        # Never asked, or the round it asked for completed without it: ask for the next.
        return NodeAction.JOIN
    return NodeAction.SYNC


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


@dataclass(frozen=True)
class CoordinatorDecision:
    """The coordinator's step: actions to commit (maybe none) and when to look again.

    Attributes:
        actions: applied in order by :func:`apply`, committed in one transaction.
        last_call_deadline: the running last-call deadline (monotonic seconds) to pass back
            in next time, or None when no round is in last call.
        wake_at: when to decide again even without an event (``math.inf``: only on events).
    """

    actions: tuple[Action, ...]
    last_call_deadline: float | None
    wake_at: float


def _order_joiners(state: RdzvState, joiners: Iterable[NodeInfo]) -> list[NodeInfo]:
    # Survivors first, in their old rank order (rank 0 stays put while alive), then
    # newcomers by arrival (create revision of their key), then node id for determinism.
    ranks: dict[str, int] = {}
    for rank, node_id in enumerate(state.participants):
        ranks.setdefault(node_id, rank)  # rank_of's answer: the first place

    def key(n: NodeInfo) -> tuple[float, int, str]:
        rank = ranks.get(n.node_id)
        return (math.inf if rank is None else rank, n.create_revision, n.node_id)

    return sorted(joiners, key=key)


def _eligible(state: RdzvState, nodes: Mapping[str, NodeInfo]) -> dict[str, NodeInfo]:
    # A draining node is leaving, a quarantined one is kept out: neither is a joiner nor
    # alive for the rounds to come (tally.Basis counts the same nodes).
    out = set(state.draining).union(q.node_id for q in state.quarantined)
    return {k: n for k, n in nodes.items() if n.incarnation == state.incarnation and k not in out}


def decide_coordinator(
    state: RdzvState,
    nodes: Mapping[str, NodeInfo],
    limits: Limits,
    now: float,
    last_call_deadline: float | None,
    tally: Tally | None = None,
    *,
    now_unix_ms: int | None = None,
) -> CoordinatorDecision:
    """Decide what the coordinator commits, given every live node key it sees.

    The decision is taken from the counts in ``tally``; ``nodes`` is scanned only to
    build the actions of a commit those counts call for. So with a ``tally`` kept up to
    date as keys change (:class:`~coordinator.core.tally.TallyIndex`), deciding after a
    join that commits nothing costs O(1), and a formation of N nodes O(N) in all.

    Args:
        state: the current state (as read with its revision).
        nodes: live node records by node id (a key exists = the node's lease is alive).
        limits: min/max nodes and the last-call timeout.
        now: monotonic seconds.
        last_call_deadline: from the previous decision (None at first).
        now_unix_ms: the coordinator's wall clock, the one clock quarantines end by
            (None: no quarantine ends in this decision).
        tally: ``tally_of(state, nodes)``, kept by the caller (None: counted here, O(N)).
    """
    if state.quarantined and not state.closed and now_unix_ms is not None:
        # Quarantines that ended go first, in the same commit as whatever follows (rare:
        # the counts are taken again against the state without them).
        done = ended(state, nodes, now_unix_ms)
        release = (Action(ActionKind.REMOVE_FROM_QUARANTINE, done),) if done else ()
        after = apply(state, release) if release else state
        decision = decide_coordinator(
            after, nodes, limits, now, last_call_deadline, tally=None if release else tally
        )
        wake_at = min(decision.wake_at, now + release_in(after, now_unix_ms))
        return CoordinatorDecision(release + decision.actions, decision.last_call_deadline, wake_at)
    if tally is None:
        tally = tally_of(state, nodes)
    if state.closed:
        # Started again only when no node of the ended incarnation (or any other) is left.
        restart = tally.total > 0 and tally.next_incarnation == tally.total
        start = (Action(ActionKind.START_INCARNATION),) if restart else ()
        return CoordinatorDecision(start, None, math.inf)
    # A round is open: the first, or no participant of the last round is alive, or one of
    # them asked for the next round (it re-rendezvoused).
    reopened = state.round == 0 or tally.live_prev == 0 or tally.prev_joined > 0
    deadline: float | None = None
    if reopened and tally.joiners >= limits.min_nodes:
        everyone_back = state.round > 0 and 0 < tally.live_prev == tally.prev_joined
        deadline = last_call_deadline
        if deadline is None:
            deadline = now + limits.last_call_timeout
        # max_nodes joiners complete at once, except while a live participant of the last
        # round has not re-joined yet: spares must not take the places of live nodes that
        # are only slower to come back (they are waited for until last call ends).
        full = tally.joiners >= limits.max_nodes and (state.round == 0 or tally.live_prev == 0)
        if full or everyone_back or now >= deadline:
            joiners = _joiners(state, _eligible(state, nodes))
            chosen = joiners[: limits.max_nodes]
            rank0 = chosen[0]
            complete = Action(
                ActionKind.MARK_RENDEZVOUS_COMPLETE,
                node_ids=tuple(n.node_id for n in chosen),
                redundant=tuple(n.node_id for n in joiners[limits.max_nodes :]),
                master_addr=rank0.addr,
                master_port=rank0.free_port,
                workers=workers_of(chosen),
            )
            return CoordinatorDecision((complete,), None, math.inf)

    actions: list[Action] = []
    if _lists_behind(state, tally):
        eligible = _eligible(state, nodes)
        actions = _bookkeeping(state, eligible, limits, _joiners(state, eligible), nodes)
    wake_at = deadline if deadline is not None else math.inf
    return CoordinatorDecision(tuple(actions), deadline, wake_at)


def workers_of(nodes: Sequence[NodeInfo]) -> tuple[tuple[str, int], ...]:
    """What each of ``nodes`` runs, from its record, for the state; empty when a record
    lacks it or the state cannot hold it (:mod:`coordinator.core.worker_kinds`)."""
    workers = tuple((n.role, n.local_world_size) for n in nodes)
    return workers if pack_workers(workers) is not None else ()


def _joiners(state: RdzvState, eligible: Mapping[str, NodeInfo]) -> list[NodeInfo]:
    target = state.round + 1
    return _order_joiners(state, (n for n in eligible.values() if n.wanted_round == target))


def _lists_behind(state: RdzvState, tally: Tally) -> bool:
    """Whether :func:`_bookkeeping` has anything to record (decided from the counts)."""
    if state.round == 0 or not state.participants:
        return tally.left_draining > 0
    newcomers = tally.unlisted_joiners - tally.unlisted_returning
    returning = tally.unlisted_returning and not tally.waiting_live  # see _bookkeeping
    return bool(
        tally.newly_lost or tally.gone_listed or tally.left_draining or newcomers or returning
    )


def _bookkeeping(
    state: RdzvState,
    nodes: Mapping[str, NodeInfo],
    limits: Limits,
    joiners: list[NodeInfo],
    all_nodes: Mapping[str, NodeInfo],
) -> list[Action]:
    """Keep the lists of a completed round in step with the live nodes (``nodes``: of
    this incarnation and not draining; ``all_nodes``: every live key)."""
    left_draining = tuple(n for n in state.draining if n not in all_nodes)
    if state.round == 0 or not state.participants:
        # Nothing formed yet, or a run started again (or restored) with no round running:
        # everyone is simply joining the next round.
        return [Action(ActionKind.REMOVE_FROM_DRAINING, left_draining)] if left_draining else []
    actions: list[Action] = []
    lost = set(state.lost)
    newly_lost = tuple(p for p in state.participants if p not in nodes and p not in lost)
    if newly_lost:
        actions.append(Action(ActionKind.REMOVE_FROM_PARTICIPANTS, newly_lost))
    gone_waiting = tuple(n for n in state.wait_list if n not in nodes)
    if gone_waiting:
        actions.append(Action(ActionKind.REMOVE_FROM_WAIT_LIST, gone_waiting))
    gone_redundant = tuple(n for n in state.redundancy_list if n not in nodes)
    if gone_redundant:
        actions.append(Action(ActionKind.REMOVE_FROM_REDUNDANCY_LIST, gone_redundant))
    if left_draining:
        actions.append(Action(ActionKind.REMOVE_FROM_DRAINING, left_draining))

    listed = set(state.wait_list) | set(state.redundancy_list)
    participants = set(state.participants)
    # The wait list tells the participants to re-rendezvous (num_nodes_waiting()); once a
    # live node is on it, the others know, and a returning participant joins the next
    # round whether it is listed or not. Listing each as it comes back would cost a state
    # write (and N watch events) per re-joining node: O(N²) events per restart.
    signalled = any(n in nodes for n in state.wait_list)
    unlisted = [
        n.node_id
        for n in joiners
        if n.node_id not in listed and not (signalled and n.node_id in participants)
    ]
    alive_participants = len(state.participants) - len(lost | set(newly_lost))
    full = alive_participants >= limits.max_nodes
    wait = tuple(n for n in unlisted if not full or n in participants)
    redundant = tuple(n for n in unlisted if full and n not in participants)
    if wait:
        actions.append(Action(ActionKind.ADD_TO_WAIT_LIST, wait))
    if redundant:
        actions.append(Action(ActionKind.ADD_TO_REDUNDANCY_LIST, redundant))
    return actions


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


def to_restore(last_good: RdzvState, store_floor: int) -> RdzvState | None:
    """What the coordinator writes back at an absent state key (None: nothing to write,
    a run that never formed a round).

    Args:
        last_good: the last state this node's view decoded (the initial state if none).
        store_floor: the highest round that still has store keys in etcd (0: none).

    Returns:
        ``last_good`` if it is at least as far on as the store shows (every field kept, so
        running participants keep their ranks); else a bare state at ``store_floor``
        (its participants are unknown: that round counts as having none alive, so the
        next round forms from whoever asks for it). Never a round below ``store_floor``:
        a round's store keys must not be reused by a second round of the same number.
    """
    if (last_good.round or last_good.closed) and last_good.round >= store_floor:
        return last_good
    if store_floor > 0:
        return RdzvState(round=store_floor)
    return None
