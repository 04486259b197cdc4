"""What one node inside ``next_rendezvous()`` does next: :func:`decide_node`.

Pure (``now`` is an argument): ask for the next round (JOIN), wait for an event (SYNC),
return its rank (FINISH), or end (EXIT_GRACEFULLY, ERROR_CLOSED, ERROR_TIMEOUT,
ERROR_SUPERSEDED; the error for each, with its message, is
:func:`coordinator.core.join_outcome.join_error`). A node only ever writes its own key.

Nodes ask for ``state.round + 1``; when a round forms is the coordinator's decision
(:mod:`coordinator.core.transitions`). A node belongs to the incarnation it first asked to
join (:func:`incarnation_to_join`): a closed run admits no node of its own incarnation,
a node that arrives at a closed run asks for ``incarnation + 1`` and waits, and a node of
an older incarnation never joins a newer one (ERROR_SUPERSEDED).
"""

from __future__ import annotations

import enum

from coordinator.core.state import RdzvState

__all__ = ["NodeAction", "decide_node", "incarnation_to_join", "is_spare"]


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
