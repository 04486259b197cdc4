"""Quarantine: nodes left out of the rounds for a while (``etcdrun --health-check``).

A node that fails the pre-flight check, or is much slower than the others in it, is
recorded in the state's ``quarantined`` list with a reason and an end time. While it is
there the coordinator treats it as a draining node: never a joiner, not alive for the
rounds to come, so the others re-form without it (``num_nodes_waiting()`` counts it while
it is a participant). Its own agent keeps its key and waits, without a join deadline,
until the entry goes; then it asks to join like any newcomer.

Who decides what:

* any node of the round writes the entries (ADD_TO_QUARANTINE through
  :meth:`~coordinator.core.executor.StateExecutor.update`, a guarded write; every node
  computes the same verdict, and an entry already there is not written again: the first
  writer's reason and end time stay);
* only the coordinator removes them (REMOVE_FROM_QUARANTINE, :func:`ended`, part of its
  decision), when the end time has passed **by the coordinator's wall clock** (no other
  clock is compared with it), or when the node's key is gone (it left: nothing to keep
  out).

The end time is the writer's wall clock plus the quarantine's length: a skew between
the writer's clock and the coordinator's lengthens or shortens the quarantine by that
skew (NTP keeps it to milliseconds; a quarantine lasts minutes).

Pure functions of the state and the time they are given.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from coordinator.core.state import Quarantine, RdzvState

__all__ = ["ended", "new_entries", "quarantined_ids", "release_in"]


def quarantined_ids(state: RdzvState) -> frozenset[str]:
    """The node ids of ``state``'s quarantine list."""
    return frozenset(q.node_id for q in state.quarantined)


def new_entries(state: RdzvState, entries: Sequence[Quarantine]) -> tuple[Quarantine, ...]:
    """``entries`` whose node is not quarantined yet (one entry per node)."""
    seen = set(quarantined_ids(state))
    out = []
    for entry in entries:
        if entry.node_id not in seen:
            seen.add(entry.node_id)
            out.append(entry)
    return tuple(out)


def ended(state: RdzvState, live: Collection[str], now_unix_ms: int) -> tuple[str, ...]:
    """Nodes whose quarantine the coordinator ends: the end time has passed by its wall
    clock (``now_unix_ms``), or the node's key is gone (not in ``live``)."""
    return tuple(
        q.node_id
        for q in state.quarantined
        if q.until_unix_ms <= now_unix_ms or q.node_id not in live
    )


def release_in(state: RdzvState, now_unix_ms: int) -> float:
    """Seconds until the next quarantine ends (``math.inf``: none): when the coordinator
    must decide again even if no event comes."""
    ends = [q.until_unix_ms for q in state.quarantined]
    return max(0.0, (min(ends) - now_unix_ms) / 1000) if ends else math.inf
