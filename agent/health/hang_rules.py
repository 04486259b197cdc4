"""Pure rules of hang detection on one node: fold the workers' slots, decide when to
publish, when the node is stalled, and how to say it (``docs/hang-detection.md``).

No clock, no file, no etcd: :mod:`agent.health.hang` reads and writes, these decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.core.state import Hang

__all__ = [
    "LocalProgress",
    "Published",
    "fold",
    "hang_line",
    "publish_due",
    "tick_seconds",
    "track",
]

# Longest time between two reads of the workers' progress file. A step change is seen at
# most one tick late and the stall is judged each tick, so detection lags the timeout by
# at most two ticks (plus a compare-and-swap): within "timeout + 1 s".
_MAX_TICK_S = 0.25

Seen = tuple[int, int, int]
"""A worker's last step, its count of calls, and when the agent saw the count change
(the agent's monotonic ns)."""


@dataclass(frozen=True)
class LocalProgress:
    """This node's progress, folded over its running workers that reported.

    Attributes:
        step: the lowest step they reported.
        last_ns: the oldest of their last reports (monotonic ns): the node is as stalled
            as its most stalled worker.
        reporting: how many running workers reported.
    """

    step: int
    last_ns: int
    reporting: int


def track(
    seen: Sequence[Seen | None], slots: Sequence[tuple[int, int] | None], now_ns: int
) -> list[Seen | None]:
    """Note when each worker last reported: ``now_ns`` when its count of calls changed,
    the old time otherwise, None for a worker that has not reported (the workers write
    a step and a count: no clock read on their side)."""
    out: list[Seen | None] = []
    for rank, slot in enumerate(slots):
        prev = seen[rank] if rank < len(seen) else None
        if slot is None:
            out.append(None)
        elif prev is not None and prev[1] == slot[1]:
            out.append((slot[0], prev[1], prev[2]))
        else:
            out.append((slot[0], slot[1], now_ns))
    return out


def fold(slots: Sequence[Seen | None], running: frozenset[int]) -> LocalProgress | None:
    """Fold the slots of the local ranks in ``running`` (None: no running worker has
    reported yet). A worker that exited (it finished, say) is not judged, and neither is
    one that never reported: the watch starts at a worker's first report."""
    reports = [s for rank, s in enumerate(slots) if s is not None and rank in running]
    if not reports:
        return None
    return LocalProgress(
        step=min(step for step, _, _ in reports),
        last_ns=min(ns for _, _, ns in reports),
        reporting=len(reports),
    )


@dataclass(frozen=True)
class Published:
    """What this node last wrote to etcd, and when (monotonic seconds)."""

    step: int
    stalled: bool
    at: float


def publish_due(
    last: Published | None, step: int, stalled: bool, now: float, interval: float
) -> bool:
    """Whether to write the node's record now: the first report of a round, a change of
    ``stalled`` (at once), or a new step once ``interval`` passed since the last write (so
    a step that changed while the last write was recent goes out on a later tick, and
    etcd sees at most one write per ``interval`` however fast the steps are)."""
    if last is None or stalled != last.stalled:
        return True
    return step != last.step and now - last.at >= interval


def tick_seconds(hang_timeout: float | None) -> float:
    """How often the agent reads its workers' progress: ``timeout / 4``, at most 0.25 s."""
    if hang_timeout is None:
        return _MAX_TICK_S
    return min(_MAX_TICK_S, hang_timeout / 4)


def hang_line(hang: Hang) -> str:
    """The sentence naming the node(s) that stopped first, for logs and reports."""
    nodes = " ".join(hang.nodes)
    if hang.behind:
        why = f"stopped first: behind the others at step {hang.step}"
    else:
        why = (
            f"stopped first: no reporting node is behind the others (all at step "
            f"{hang.step}), and {nodes} reached the timeout first"
        )
    return (
        f"hang in round {hang.round}: node(s) [{nodes}] {why} (declared by "
        f"{hang.declared_by or '?'} after {hang.stalled_ms / 1000:.1f} s without progress)"
    )
