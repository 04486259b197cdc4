"""The pure refund rule of the agent's restart policy: a worker failure followed by a
smaller group is put down to the node that went away, and not counted."""

from __future__ import annotations

import pytest

from agent.policy import restart_refunded


@pytest.mark.parametrize(
    ("failed", "after", "refunded"),
    [
        (3, 2, True),  # a node died: its peers' broken collectives do not count
        (4, 1, True),
        (2, 2, False),  # a genuine failure: same nodes come back
        (2, 3, False),  # a node joined meanwhile: still the same failure
        (1, 1, False),
    ],
)
def test_refund_when_the_group_shrank(failed: int, after: int, refunded: bool) -> None:
    assert restart_refunded(failed, after) is refunded


@pytest.mark.parametrize(("failed", "after"), [(0, 1), (1, 0), (-1, 2)])
def test_sizes_below_one_are_refused(failed: int, after: int) -> None:
    with pytest.raises(ValueError, match=f"group sizes must be >= 1, got {failed} and {after}"):
        restart_refunded(failed, after)
