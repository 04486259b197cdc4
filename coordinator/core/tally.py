"""What the coordinator's decision needs to know of the live node keys, as counts.

:func:`~coordinator.core.transitions.decide_coordinator` decides from a handful of counts
taken against the current state (how many nodes ask for the next round, how many
participants of the last round are alive, whether a listed node left, ...). It scans
the node keys themselves only when those counts say a commit is due. This module
defines the counts (:class:`Tally`) and two ways to get them, which must agree:

* :func:`tally_of` counts from scratch: O(N) (the reference, and what the decision
  computes when nobody passes a tally in);
* :class:`TallyIndex` keeps them up to date as node keys change, O(1) per change, and
  re-counts (O(N)) only when the state it counts against changes: a formation of N
  nodes then costs O(N) decision work in all, not O(N) per join.

Both add up one *share* per node id (:meth:`Basis.share`): a node id's share depends
only on its own record (or its absence) and on the state, so a change of one key
changes one share. Pure bookkeeping, no I/O, no clock; not thread-safe (the caller
locks).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, fields

from coordinator.core.state import NodeInfo, RdzvState

__all__ = ["Basis", "Tally", "TallyIndex", "tally_of"]


@dataclass(frozen=True)
class Tally:
    """Counts of the live node keys against one state.

    *Eligible* nodes are live keys of the state's incarnation that are neither being
    drained nor quarantined (the nodes the rounds are formed from).

    Attributes:
        total: live node keys, of any incarnation, drained ones included.
        next_incarnation: live keys of nodes of ``state.incarnation + 1``.
        joiners: eligible nodes asking for ``state.round + 1``.
        live_prev: participants of ``state.round`` that are eligible.
        prev_joined: participants of ``state.round`` that are joiners.
        unlisted_joiners: joiners on neither the wait list nor the redundancy list.
        gone_listed: entries of the wait and redundancy lists whose node is not eligible.
        newly_lost: participants that are not eligible and not yet in ``state.lost``.
        left_draining: entries of ``state.draining`` without any live key.
        unlisted_returning: unlisted joiners that are participants of ``state.round``.
        waiting_live: entries of the wait list whose node is eligible.
    """

    total: int = 0
    next_incarnation: int = 0
    joiners: int = 0
    live_prev: int = 0
    prev_joined: int = 0
    unlisted_joiners: int = 0
    gone_listed: int = 0
    newly_lost: int = 0
    left_draining: int = 0
    unlisted_returning: int = 0
    waiting_live: int = 0


_WIDTH = len(fields(Tally))
_NOTHING = (0,) * _WIDTH


class Basis:
    """The parts of one state that a node id's share depends on, indexed for O(1) look-ups."""

    def __init__(self, state: RdzvState) -> None:
        self.state = state
        self._target = state.round + 1
        self._incarnation = state.incarnation
        self._participants = frozenset(state.participants)
        self._lost = frozenset(state.lost)
        # Multiplicities: a hand-written state may list a node twice; every entry counts.
        self._waiting = Counter(state.wait_list)
        self._listed = self._waiting + Counter(state.redundancy_list)
        self._draining = Counter(state.draining)
        self._quarantined = frozenset(q.node_id for q in state.quarantined)

    def mentioned(self) -> frozenset[str]:
        """Node ids the state names in any list: their share can be non-zero without a key."""
        return self._participants | frozenset(self._listed) | frozenset(self._draining)

    def share(self, node_id: str, node: NodeInfo | None) -> tuple[int, ...]:
        """What ``node_id`` (with its record ``node``, None: no live key) adds to each
        field of :class:`Tally`, in field order."""
        participant = node_id in self._participants
        listed = self._listed.get(node_id, 0)
        draining = self._draining.get(node_id, 0)
        if node is None:
            if not (participant or listed or draining):
                return _NOTHING
            lost = int(participant and node_id not in self._lost)
            return (0, 0, 0, 0, 0, 0, listed, lost, draining, 0, 0)
        eligible = (
            node.incarnation == self._incarnation
            and not draining
            and node_id not in self._quarantined
        )
        joiner = eligible and node.wanted_round == self._target
        return (
            1,
            int(node.incarnation == self._incarnation + 1),
            int(joiner),
            int(participant and eligible),
            int(participant and joiner),
            int(joiner and not listed),
            0 if eligible else listed,
            int(participant and not eligible and node_id not in self._lost),
            0,
            int(joiner and not listed and participant),
            self._waiting.get(node_id, 0) if eligible else 0,
        )


def _add(total: list[int], share: tuple[int, ...], sign: int = 1) -> None:
    for i, value in enumerate(share):
        if value:
            total[i] += sign * value


def _count(basis: Basis, nodes: Mapping[str, NodeInfo]) -> list[int]:
    total = [0] * _WIDTH
    for node_id, node in nodes.items():
        _add(total, basis.share(node_id, node))
    for node_id in basis.mentioned():
        if node_id not in nodes:
            _add(total, basis.share(node_id, None))
    return total


def tally_of(state: RdzvState, nodes: Mapping[str, NodeInfo]) -> Tally:
    """Count ``nodes`` (live records by node id) against ``state``, from scratch: O(N)."""
    return Tally(*_count(Basis(state), nodes))


class TallyIndex:
    """A :class:`Tally` kept current as node keys change (see the module docstring).

    The caller reports every change of its node table (:meth:`changed`) and asks for the
    counts against the state it decides from (:meth:`tally`); a state other than the last
    one asked about (by identity: a new value read or written) re-counts once.
    """

    def __init__(self) -> None:
        self._basis: Basis | None = None
        self._total = [0] * _WIDTH

    def changed(self, node_id: str, old: NodeInfo | None, new: NodeInfo | None) -> None:
        """``node_id``'s record went from ``old`` to ``new`` (None: no live key)."""
        basis = self._basis
        if basis is None or old is new:
            return
        _add(self._total, basis.share(node_id, old), -1)
        _add(self._total, basis.share(node_id, new))

    def forget(self) -> None:
        """Drop the counts (the node table was cleared); the next :meth:`tally` re-counts."""
        self._basis = None

    def tally(self, state: RdzvState, nodes: Mapping[str, NodeInfo]) -> Tally:
        """The counts of ``nodes`` against ``state``; ``nodes`` must be the table whose
        every change since the last call was reported to :meth:`changed`."""
        if self._basis is None or self._basis.state is not state:
            self._basis = Basis(state)
            self._total = _count(self._basis, nodes)
        return Tally(*self._total)
