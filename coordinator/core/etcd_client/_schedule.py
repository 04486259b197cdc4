"""What is on a client's keep-alive stream, and when each lease sends its next keep-alive.

Bookkeeping only: no I/O and no clock; every time is passed in (monotonic seconds), so
the pacing is unit-tested with plain numbers (tests/unit/test_keepalive_schedule.py). The
client's one keep-alive stream (``_keepalive_stream``) asks it what is due and tells it
what happened.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Iterable
from typing import Any

__all__ = ["OnStream", "Schedule", "Step", "leases_text", "pace"]

_NAMED = 3  # leases named in a thread name or a log line; the rest are counted


def leases_text(ids: Iterable[int], sep: str = ", ") -> str:
    """``1a``, or ``1a, 2b, 3c and 5 more``: leases named for a log line or thread name."""
    ordered = sorted(ids)
    named = sep.join(f"{lease:x}" for lease in ordered[:_NAMED])
    more = len(ordered) - _NAMED
    return f"{named} and {more} more" if more > 0 else named


class Step(enum.Enum):
    """What is due for a lease."""

    SEND = "send"  # send its next keep-alive
    CHECK = "check"  # its keep-alive has waited an interval unanswered: is the member hung?


def pace(interval: float) -> float:
    """How long after an answer a lease's next keep-alive goes out: a little less than its
    interval (a twentieth, at most 0.1 s: against etcd itself about 5 % more keep-alives
    than one per interval at a TTL of 3-6 s, 1 % at 30 s). Sent a full interval after the
    answer, it would race the gRPC proxy's own renewal, due at the same moment when the
    interval is a whole number of the proxy's 0.5 s ticks (a TTL of 3 s, 6 s, ...); one
    that lands just after it waits for the proxy's next, and the member looks hung."""
    return interval - min(interval / 20, 0.1)


class Schedule:
    """The keep-alives of the leases on one stream, each paced by etcd's answers.

    A lease's first keep-alive goes out at once; each next one about ``interval`` (its
    own, ttl/3) after the answer to the previous one (:func:`pace`), so at most one
    keep-alive per lease is in flight. One left unanswered for ``interval`` is due for a
    CHECK (the stream's owner asks ``Liveness.member_hung``), and, if the member was not
    hung, again every half interval until the answer comes.

    Why paced by answers and not by the clock: etcd's gRPC proxy answers a keep-alive with
    its own next renewal of that lease, which it sends on its own clock (ttl/3 after its
    last one, rounded up to its 0.5 s tick). Keep-alives sent on a fixed cadence of ttl/3
    run ahead of those renewals, wait a little longer each time, and after a few rounds
    one waits more than an interval: the stream was left as hung every 8 s at a TTL of
    5 s (and at a TTL of 1 s the lease expired). Paced by answers, and sent a little
    before the proxy's next renewal (:func:`pace`), a keep-alive waits at most one tick of
    the proxy. Against etcd itself a lease is renewed about as often as before.
    """

    def __init__(self) -> None:
        # (time, sequence, lease); an entry whose sequence is no longer the lease's
        # current one was replaced, and is dropped when it comes up.
        self._heap: list[tuple[float, int, int]] = []
        self._next: dict[int, tuple[float, Step, int]] = {}  # lease -> (time, step, sequence)
        self._intervals: dict[int, float] = {}
        self._sequence = itertools.count()

    def __len__(self) -> int:
        return len(self._next)

    def __contains__(self, lease: object) -> bool:
        return lease in self._next

    def add(self, lease: int, interval: float, now: float) -> None:
        """``lease`` joins the stream; its first keep-alive is due at ``now`` (the join, or
        for a lease granted just before, a pace after its grant: ``KeepAlive._due``)."""
        self._intervals[lease] = interval
        self._set(lease, now, Step.SEND)

    def remove(self, lease: int) -> None:
        """``lease`` leaves the stream (closed or lost): nothing more is due for it."""
        self._next.pop(lease, None)
        self._intervals.pop(lease, None)

    def sent(self, lease: int, now: float) -> None:
        """A keep-alive of ``lease`` went out at ``now``: checked an interval later."""
        current = self._next.get(lease)
        if current is not None and current[1] is Step.SEND:
            self._set(lease, now + self._intervals[lease], Step.CHECK)

    def not_hung(self, lease: int, now: float) -> None:
        """The check found the member slow, not hung: check again in half an interval."""
        current = self._next.get(lease)
        if current is not None and current[1] is Step.CHECK:
            self._set(lease, now + self._intervals[lease] / 2, Step.CHECK)

    def answered(self, lease: int, now: float, interval: float | None = None) -> None:
        """etcd answered the keep-alive of ``lease`` at ``now``: the next is due an
        interval later (``interval``: the lease's from now on, e.g. a third of the TTL
        etcd answered). An answer nothing was waiting for changes only the interval."""
        if lease not in self._next:
            return
        if interval is not None:
            self._intervals[lease] = interval
        current = self._next[lease]
        if current[1] is Step.CHECK:
            self._set(lease, now + pace(self._intervals[lease]), Step.SEND)

    def due(self, now: float) -> list[tuple[int, Step]]:
        """Every step due at ``now``, earliest first; each is handed out once (the owner
        reports what it did with :meth:`sent`, :meth:`not_hung` or :meth:`answered`)."""
        steps: list[tuple[int, Step]] = []
        while self._heap and self._heap[0][0] <= now:
            _, sequence, lease = heapq.heappop(self._heap)
            current = self._next.get(lease)
            if current is not None and current[2] == sequence:
                steps.append((lease, current[1]))
                # Nothing is due for it until the owner says what happened.
                self._next[lease] = (float("inf"), current[1], -1)
        return steps

    def next_at(self) -> float | None:
        """When the next step is due (None: nothing is scheduled)."""
        while self._heap:
            when, sequence, lease = self._heap[0]
            current = self._next.get(lease)
            if current is not None and current[2] == sequence:
                return when
            heapq.heappop(self._heap)  # replaced or removed
        return None

    def _set(self, lease: int, when: float, step: Step) -> None:
        sequence = next(self._sequence)
        self._next[lease] = (when, step, sequence)
        heapq.heappush(self._heap, (when, sequence, lease))


class OnStream:
    """One stream on one member: the keep-alives on it (each by its slot: one lease may
    have several owners), their schedule, and how it ends. Not thread-safe: the
    keep-alive stream's lock guards it."""

    def __init__(self, index: int, name: str) -> None:
        self.index = index  # the endpoint's index in the client's config
        self.name = name  # the endpoint
        self.schedule = Schedule()
        self.numbers: dict[int, int] = {}  # slot -> its stream number (Liveness.sent)
        # Per lease id, the slots whose keep-alives wait for an answer, oldest first:
        # etcd answers a stream's requests in order, naming only the lease.
        self._waiting: dict[int, deque[int]] = {}
        self.call: Any = None  # the gRPC call, once open
        self.done = False  # the stream is over: its requests stop
        self.hung = ""  # why the request side left the member as hung ("" if it did not)
        self.emptied = False  # ended because no lease was left: not a failure

    def join(self, slot: int, number: int, interval: float, now: float) -> None:
        """Keep-alive ``slot`` (number ``number`` of its own streams) is here from now."""
        self.numbers[slot] = number
        self.schedule.add(slot, interval, now)

    def leave(self, slot: int) -> None:
        self.numbers.pop(slot, None)
        self.schedule.remove(slot)

    def sent(self, lease: int, slot: int) -> None:
        """Keep-alive ``slot`` sent a request for ``lease``."""
        self._waiting.setdefault(lease, deque()).append(slot)

    def answered(self, lease: int) -> int | None:
        """etcd answered a request for ``lease``: the slot that sent it (None: none did,
        or it left the stream since; its answer goes to nobody)."""
        waiting = self._waiting.get(lease)
        if not waiting:
            return None
        slot = waiting.popleft()
        return slot if slot in self.numbers else None
