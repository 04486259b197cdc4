"""The coordinator's decision as it was before it decided from counts (commit 3f633c3),
kept verbatim as the reference that ``test_tally.py`` checks the counted decision against.

Do not edit: it is the old behaviour, the specification the O(N) formation must keep.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from coordinator.core.actions import Action, ActionKind
from coordinator.core.state import NodeInfo, RdzvState
from coordinator.core.transitions import CoordinatorDecision, Limits, workers_of


def _order_joiners(state: RdzvState, joiners: Iterable[NodeInfo]) -> list[NodeInfo]:
    # Survivors first, in their old rank order (rank 0 stays put while alive), then
    # newcomers by arrival (create revision of their key), then node id for determinism.
    def key(n: NodeInfo) -> tuple[float, int, str]:
        rank = state.rank_of(n.node_id)
        return (math.inf if rank is None else rank, n.create_revision, n.node_id)

    return sorted(joiners, key=key)


def reference_decide(
    state: RdzvState,
    nodes: Mapping[str, NodeInfo],
    limits: Limits,
    now: float,
    last_call_deadline: float | None,
) -> CoordinatorDecision:
    """Decide what the coordinator commits, given every live node key it sees.

    Args:
        state: the current state (as read with its revision).
        nodes: live node records by node id (a key exists = the node's lease is alive).
        limits: min/max nodes and the last-call timeout.
        now: monotonic seconds.
        last_call_deadline: from the previous decision (None at first).
    """
    if state.closed:
        # Started again only when no node of the ended incarnation (or any other) is left.
        restart = bool(nodes) and all(
            n.incarnation == state.incarnation + 1 for n in nodes.values()
        )
        start = (Action(ActionKind.START_INCARNATION),) if restart else ()
        return CoordinatorDecision(start, None, math.inf)
    # A draining node is leaving: it is neither a joiner nor alive for the rounds to come.
    all_nodes = nodes
    nodes = {
        k: n
        for k, n in nodes.items()
        if n.incarnation == state.incarnation and k not in state.draining
    }
    target = state.round + 1
    joiners = _order_joiners(state, (n for n in nodes.values() if n.wanted_round == target))
    joiner_ids = {n.node_id for n in joiners}
    live_prev = [p for p in state.participants if p in nodes]

    reopened = state.round == 0 or not live_prev or any(p in joiner_ids for p in live_prev)
    deadline: float | None = None
    if reopened and len(joiners) >= limits.min_nodes:
        everyone_back = state.round > 0 and bool(live_prev) and joiner_ids.issuperset(live_prev)
        deadline = last_call_deadline
        if deadline is None:
            deadline = now + limits.last_call_timeout
        # max_nodes joiners complete at once, except while a live participant of the last
        # round has not re-joined yet: spares must not take the places of live nodes that
        # are only slower to come back (they are waited for until last call ends).
        full = len(joiners) >= limits.max_nodes and (state.round == 0 or not live_prev)
        if full or everyone_back or now >= deadline:
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

    actions = _bookkeeping(state, nodes, limits, joiners, all_nodes)
    wake_at = deadline if deadline is not None else math.inf
    return CoordinatorDecision(tuple(actions), deadline, wake_at)


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
    newly_lost = tuple(p for p in state.participants if p not in nodes and p not in state.lost)
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
    # A returning participant is listed only while no live node waits yet (the signal).
    signalled = any(n in nodes for n in state.wait_list)
    unlisted = [
        n.node_id
        for n in joiners
        if n.node_id not in listed and not (signalled and state.rank_of(n.node_id) is not None)
    ]
    alive_participants = len(state.participants) - len(set(state.lost) | set(newly_lost))
    full = alive_participants >= limits.max_nodes
    wait = tuple(n for n in unlisted if not full or state.rank_of(n) is not None)
    redundant = tuple(n for n in unlisted if n not in wait)
    if wait:
        actions.append(Action(ActionKind.ADD_TO_WAIT_LIST, wait))
    if redundant:
        actions.append(Action(ActionKind.ADD_TO_REDUNDANCY_LIST, redundant))
    return actions
