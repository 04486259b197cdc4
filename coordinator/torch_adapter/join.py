"""The join loop of ``next_rendezvous()``: from asking for the next round to a rank.

One :class:`Join` per call. Each pass reads the watched state and takes one named step:
follow a new participation (a background thread died), hold while quarantined, decide
(:func:`~coordinator.core.join_decision.decide_node`), and then finish with a rank, end
with the error :func:`~coordinator.core.join_outcome.join_error` names, ask for the next
round (this node's key, the only thing a node writes), or wait for the next event. A
node only ever waits on its watched view: no polling, no sleep but the back-off of a
failed write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from coordinator.core.join_decision import (
    NodeAction,
    decide_node,
    incarnation_to_join,
    is_spare,
)
from coordinator.core.join_outcome import JoinContext, join_error
from coordinator.core.participation import Participation
from coordinator.core.settings import RendezvousSettings
from coordinator.core.state import NodeInfo, RdzvState
from coordinator.core.transitions import Limits
from coordinator.torch_adapter.presence import RunPresence

__all__ = ["Join", "Joiner"]

log = logging.getLogger(__name__)


class Joiner(Protocol):
    """What a join reads and sets on its node (the handler)."""

    node_id: str
    incarnation: int
    """Taken at the first join (:func:`incarnation_to_join`) and kept."""

    def leave(self) -> None:
        """Leave the run (the join ends with an error that calls for it)."""
        ...


class Join:
    """One ``next_rendezvous()``: join the next round and wait until it completes with
    this node.

    Args:
        node: the joining node; its incarnation is set at its first join.
        presence: its participation (made again after a thread death).
        settings: ``join_timeout`` bounds the join (a quarantine starts it again).
        limits: ``min_nodes``, for the timeout's message.
        record: this node's record asking for a round, given the round and its lease.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        node: Joiner,
        presence: RunPresence,
        settings: RendezvousSettings,
        limits: Limits,
        record: Callable[[int, int], NodeInfo],
        clock: Callable[[], float],
    ) -> None:
        self._node = node
        self._presence = presence
        self._run_id = settings.keys.run_id
        self._join_timeout = settings.join_timeout
        self._min_nodes = limits.min_nodes
        self._record = record
        self._clock = clock
        self._start = clock()
        self._deadline = self._start + self._join_timeout
        self._wanted = 0  # the round this node's key asks for (0: none yet in this join)
        self._quarantined = 0  # the end time of this node's quarantine last logged

    def run(self) -> tuple[RdzvState, int]:
        """Join until a round completes with this node; returns that state and its rank.

        Raises:
            The error :func:`~coordinator.core.join_outcome.join_error` names (the run is
            closed, the join timed out, the node was drained or superseded), or an etcd
            error a retry did not outlast.
        """
        parts = self._presence.join_participation(self._deadline)
        log.info("node %s joining run %s", self._node.node_id, self._run_id)
        while True:
            parts = self._follow(parts)
            state, _, seen = parts.view.read()
            self._hold_while_quarantined(state)
            action = self._decide(state)
            rank = state.rank_of(self._node.node_id)
            if action is NodeAction.FINISH and rank is not None:
                self._finish(state, rank)
                return state, rank
            self._raise_if_ended(action, state)
            if action is NodeAction.JOIN:
                self._ask(parts, state)
                continue
            self._wait(parts, state, seen)

    def _follow(self, parts: Participation) -> Participation:
        if self._presence.current() is parts:
            return parts
        # A background thread died and this node left: join again from scratch.
        self._wanted = 0
        return self._presence.join_participation(self._deadline)

    def _hold_while_quarantined(self, state: RdzvState) -> None:
        """Kept out for a while (failed the pre-flight check): the node waits without a
        deadline, which starts again when the quarantine ends; said once per quarantine."""
        entry = state.quarantine_of(self._node.node_id)
        if entry is None:
            return
        self._deadline = self._clock() + self._join_timeout
        if entry.until_unix_ms == self._quarantined:
            return
        self._quarantined = entry.until_unix_ms
        left = max(0.0, entry.until_unix_ms / 1000 - time.time())
        log.warning(
            "node %s is quarantined in run %s for about %.0f s more (%s): it waits outside "
            "the rounds, then asks to join again",
            self._node.node_id, self._run_id, left, entry.reason,
        )  # fmt: skip

    def _decide(self, state: RdzvState) -> NodeAction:
        action = self._decide_once(state)
        if action is not NodeAction.FINISH and self._wanted and self._presence.session_lost():
            # Our key is gone before our round completed: ask again with a new lease.
            # (Had the round completed with us, the rank is ours; the loss then shows
            # in num_nodes_waiting() and the agent re-rendezvouses.)
            self._wanted = 0
            action = self._decide_once(state)
        return action

    def _decide_once(self, state: RdzvState) -> NodeAction:
        node = self._node
        now = self._clock()
        return decide_node(state, node.node_id, self._wanted, now, self._deadline, node.incarnation)

    def _finish(self, state: RdzvState, rank: int) -> None:
        log.info(
            "node %s: run %s round %d complete: rank %d of %d (%.3f s)",
            self._node.node_id, self._run_id, state.round, rank, len(state.participants),
            self._clock() - self._start,
        )  # fmt: skip

    def _raise_if_ended(self, action: NodeAction, state: RdzvState) -> None:
        node = self._node
        ctx = JoinContext(
            self._run_id, node.node_id, node.incarnation, self._wanted, self._join_timeout,
            self._min_nodes,
        )  # fmt: skip
        ended = join_error(action, state, ctx)
        if ended is not None:
            error, leave_first = ended
            if leave_first:
                node.leave()
            raise error

    def _ask(self, parts: Participation, state: RdzvState) -> None:
        """Write this node's key asking for the round after ``state``'s, taking the
        incarnation to join first if the node has none yet."""
        node = self._node
        self._wanted = wanted = state.round + 1
        if not node.incarnation:
            node.incarnation = incarnation_to_join(state)
            if state.closed:
                log.info(
                    "node %s: run %s is closed (%s); asking to start it again as "
                    "incarnation %d once every node of incarnation %d has left",
                    node.node_id, self._run_id, state.closed_reason or "closed",
                    node.incarnation, state.incarnation,
                )  # fmt: skip

        def write() -> None:
            if self._presence.current() is not parts:
                return  # ended while a try failed: no lease nor key for a dead participation
            parts.member.write(lambda lease_id: self._record(wanted, lease_id))
            self._presence.key_written()
            parts.duty.poke()

        self._presence.until(self._deadline, f"asking for round {wanted} of", write)

    def _wait(self, parts: Participation, state: RdzvState, seen: int) -> None:
        # A listed spare waits for events only, without a deadline (past join_timeout
        # a timeout of 0 would make this loop spin).
        spare = is_spare(state, self._node.node_id)
        timeout = None if spare else max(self._deadline - self._clock(), 0.0)
        parts.view.wait_newer(seen, timeout, self._presence.session_lost)
