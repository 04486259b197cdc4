"""to_restore: what the coordinator writes back at a state key found absent (deleted by
hand), so that the rounds go on from the last one instead of "round 1" again."""

from __future__ import annotations

import pytest

from coordinator.core.actions import apply
from coordinator.core.state import NodeInfo, RdzvState
from coordinator.core.transitions import Limits, decide_coordinator, to_restore

LIM = Limits(min_nodes=2, max_nodes=4, last_call_timeout=10.0)


def _nodes(wanted: int, names: str) -> dict[str, NodeInfo]:
    return {
        n: NodeInfo(n, wanted, addr=f"host-{n}", create_revision=10 + i)
        for i, n in enumerate(names)
    }


_ROUND_2 = RdzvState(round=2, participants=("a", "b"), master_addr="host-a", written_by="a")
_CLOSED_EARLY = RdzvState(closed=True, closed_reason="done")


@pytest.mark.parametrize(
    ("last_good", "store_floor", "expected"),
    [
        (RdzvState(), 0, None),
        (_ROUND_2, 0, _ROUND_2),
        (_ROUND_2, 2, _ROUND_2),
        (_ROUND_2, 1, _ROUND_2),
        (_ROUND_2, 3, RdzvState(round=3)),
        (RdzvState(), 5, RdzvState(round=5)),
        (_CLOSED_EARLY, 0, _CLOSED_EARLY),
    ],
    ids=[
        "never formed: nothing",
        "the last state the view saw",
        "store at the same round",
        "store behind (round 1 kept as history)",
        "store ahead of what this view saw",
        "a view that never saw a state: the store's round",
        "closed before any round: stays closed",
    ],
)
def test_to_restore(last_good: RdzvState, store_floor: int, expected: RdzvState | None) -> None:
    assert to_restore(last_good, store_floor) == expected


def test_a_restored_bare_round_reopens_for_whoever_asks() -> None:
    """Written back without participants (unknown), the round counts as having none alive:
    the next forms with the nodes that ask for it, numbered on from the store's round."""
    restored = to_restore(RdzvState(), 5)
    assert restored is not None
    decision = decide_coordinator(restored, _nodes(6, "ab"), LIM, 0.0, None)
    assert decision.last_call_deadline == 10.0  # min_nodes reached: last call, for round 6
    done = decide_coordinator(restored, _nodes(6, "abcd"), LIM, 0.0, None)
    assert apply(restored, done.actions).round == 6
