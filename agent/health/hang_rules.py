"""Pure rules of hang detection on one node: fold the workers' slots, decide when the
node suspects a hang and what to write or delete, when to retry a declaration, and how
to say it (``docs/hang-detection.md``).

No clock, no file, no etcd: :mod:`agent.health.hang` reads and writes, these decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from coordinator.core.etcd_client import backoff_delay
from coordinator.core.state import Hang

__all__ = [
    "LocalProgress",
    "RecordOp",
    "Suspicion",
    "declare_retry_seconds",
    "fold",
    "hang_line",
    "record_op",
    "suspect_after_ns",
    "suspicion",
    "tick_seconds",
    "track",
]

# Longest time between two reads of the workers' progress file. A step change is seen at
# most one tick late and the stall is judged each tick, so detection lags the timeout by
# at most two ticks (plus a compare-and-swap): within "timeout + 1 s".
_MAX_TICK_S = 0.25
# At most this long between a node's suspicion (its record written) and its timeout.
_SUSPECT_MARGIN_NS = 10_000_000_000
# A declaration that failed (etcd unreachable, the state kept changing) is retried after
# this, doubling up to the cap, until it lands or the round ends.
_RETRY_BASE_S = 0.25
_RETRY_CAP_S = 2.0

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
class Suspicion:
    """What this node's progress record says while it suspects a hang: the round and the
    step it stalled at (no record: the node is not suspected)."""

    round: int
    step: int


def suspect_after_ns(timeout_ns: int) -> int:
    """The silence after which a node writes its progress record: the timeout less a
    margin of half the timeout, at most ``10 s``.

    The margin is the time every stalled node has to get its record into etcd before the
    first of them reaches the timeout and reads the records: in a collective hang the
    nodes stall within a step of each other. Above it, a healthy pause without reports
    (an evaluation, a checkpoint) writes nothing unless it lasts longer than this.
    """
    return timeout_ns - min(timeout_ns // 2, _SUSPECT_MARGIN_NS)


def suspicion(
    round: int, local: LocalProgress | None, silent_ns: int, suspect_ns: int | None
) -> Suspicion | None:
    """The record this node's progress should have in etcd now: one while its running
    workers made no progress for ``suspect_ns`` (None: detection off), else none."""
    if suspect_ns is None or local is None or silent_ns < suspect_ns:
        return None
    return Suspicion(round, local.step)


class RecordOp(Enum):
    """What to do to this node's progress record in etcd (:func:`record_op`)."""

    #: Leave it as it is (nothing changed, or a record of an earlier round).
    KEEP = "keep"
    #: Write the wanted suspicion (a new one, or the step it stalled at changed).
    WRITE = "write"
    #: Delete it: the node made progress again in the round of its record.
    DELETE = "delete"


def record_op(written: Suspicion | None, wanted: Suspicion | None, round: int | None) -> RecordOp:
    """What to do to this node's record, given what it says (``written``) and what it
    should say (``wanted``, from :func:`suspicion`) while the node judges ``round`` (None:
    its workers are being stopped).

    Written only on a change; deleted when the node makes progress again in the round of
    its record, so the node that declares never takes one that recovered for a stalled
    one. A record of an earlier round is left as it is: the rule reads only the current
    round's, ``rdzvctl status`` shows it as that round's, and it goes with the node's
    lease or its next suspicion. So a healthy node writes nothing.
    """
    if wanted is not None:
        return RecordOp.WRITE if wanted != written else RecordOp.KEEP
    if written is not None and written.round == round:
        return RecordOp.DELETE
    return RecordOp.KEEP


def declare_retry_seconds(failures: int, jitter: float) -> float:
    """How long to wait before declaring again after ``failures`` (>= 1) failed attempts
    in a row: from 0.25 s doubling to at most 2 s (``jitter`` in [0, 1) spreads it over its
    upper half). Tried until it lands or the round ends; never while the node progresses."""
    return backoff_delay(failures - 1, jitter, _RETRY_BASE_S, _RETRY_CAP_S)


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
