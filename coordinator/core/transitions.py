"""Pure decisions of the elected coordinator: what it commits, given the state, the live
nodes and the time.

Two deciders, free of I/O and of the clock (``now`` is an argument):

* :func:`decide_coordinator` — what the elected coordinator commits to the state key, as a
  list of actions (:mod:`coordinator.core.actions`) applied by
  :func:`~coordinator.core.actions.apply` and written in ONE revision-guarded
  transaction: ADD_TO_WAIT_LIST, ADD_TO_REDUNDANCY_LIST, REMOVE_FROM_PARTICIPANTS,
  REMOVE_FROM_WAIT_LIST, REMOVE_FROM_REDUNDANCY_LIST, REMOVE_FROM_DRAINING,
  REMOVE_FROM_QUARANTINE, START_INCARNATION, MARK_RENDEZVOUS_COMPLETE (which is where
  ADD_TO_PARTICIPANTS happens: ranks are assigned at completion).
* :func:`to_restore` — what the coordinator writes back at a state key found absent
  (deleted by hand), so the rounds go on from the last one.

What a node does inside ``next_rendezvous()`` is decided apart
(:func:`coordinator.core.join_decision.decide_node`), and so are the changes any node or
an operator asks for (close, drain, a hang, a counted restart, a quarantine:
:mod:`coordinator.core.actions`).

Round rules (DESIGN §4): nodes ask for ``state.round + 1``. A round may form once it is
*open*: it is the first round, or a live participant of the last round asked for it
(it re-rendezvoused), or no participant of the last round is alive. It completes at once
with ``max_nodes`` joiners; with ``min_nodes`` it completes when the last call ends, or
at once when every live participant of the last round has joined (a restart need not
wait out last call). Survivors keep their rank order; newcomers follow by arrival.

Incarnations (a run started again with the same id): once every live node key belongs
to ``incarnation + 1`` (every node of the closed one has left) the coordinator commits
START_INCARNATION: the run is open again, empty, and its round number goes on (no store
key of an old round is ever reused). The coordinator counts only the nodes of the
current incarnation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from coordinator.core.actions import Action, ActionKind, apply
from coordinator.core.quarantine import ended, release_in
from coordinator.core.state import NodeInfo, RdzvState
from coordinator.core.tally import Tally, tally_of
from coordinator.core.worker_kinds import pack_workers

__all__ = [
    "CoordinatorDecision",
    "Limits",
    "decide_coordinator",
    "to_restore",
    "workers_of",
]


@dataclass(frozen=True)
class Limits:
    """The part of the settings the decisions need."""

    min_nodes: int
    max_nodes: int
    last_call_timeout: float


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
