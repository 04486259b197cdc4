"""What a keep-alive knows about its lease: the state, and the pure bookkeeping behind it.

No I/O and no clock here: every time is passed in (monotonic seconds), so the rules are
unit-tested with plain numbers (tests/unit/test_keepalive_liveness.py). :class:`KeepAlive`
feeds it what the stream does and reports the changes it returns.

The rule it encodes (DESIGN §4, §9): **a lease is lost only when etcd says so** (a
keep-alive answered with TTL ≤ 0, or "lease not found"). Silence proves nothing: while
etcd has no leader its leases do not run down, a restarted cluster keeps them, and a new
leader extends every lease by its TTL. So silence only ever moves the state to
UNREACHABLE, which ends as soon as a member answers, either way.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

__all__ = ["Change", "LeaseState", "Liveness", "Outage", "Probe", "watch_probe"]


class LeaseState(enum.Enum):
    """The state of a kept-alive lease, as its owner should act on it (kazoo's CONNECTED,
    SUSPENDED and LOST, for an etcd lease).

    Transitions: ALIVE ⇄ UNREACHABLE; ALIVE or UNREACHABLE → LOST, FAILED or CLOSED,
    which are final.
    """

    ALIVE = "alive"
    """etcd answered a recent keep-alive with TTL > 0. Safe: the lease, and every key on
    it, exists at least until :attr:`Liveness.alive_until`."""

    UNREACHABLE = "unreachable"
    """No member has answered since the last answer's guarantee ran out. Assume neither
    way: if etcd is down the lease and its keys survive (etcd keeps leases across a
    restart and a new leader extends them); if only this node is cut off, etcd may have
    expired it and the other nodes may have re-formed without it. Do nothing that needs
    the lease (no rendezvous writes, no new round); workers may keep training. Keep-alives
    go on, failing over between endpoints, until a member answers."""

    LOST = "lost"
    """etcd said the lease is gone (TTL ≤ 0 or "lease not found"): its keys are deleted
    and any rank this node held may belong to someone else. Take a new lease to rejoin."""

    FAILED = "failed"
    """The keep-alive thread died of an unexpected exception (a bug, reported to the
    client's death listeners): nobody renews the lease any more, so etcd expires it after
    its TTL. Treat it as lost: take a new lease."""

    CLOSED = "closed"
    """The owner closed the keep-alive (and revoked the lease, unless asked not to)."""


FINAL = (LeaseState.LOST, LeaseState.FAILED, LeaseState.CLOSED)


@dataclass(frozen=True)
class Outage:
    """Why the keep-alive of one lease has no answer: what its warning line says.

    Attributes:
        lease_id: the lease.
        since: monotonic time of the last answer (or of the grant, if none came yet).
        tried: every endpoint that failed since then, in order of first failure.
        last_error: the last failure, ``"<endpoint>: <code>: <details>"`` ("" if none).
    """

    lease_id: int
    since: float
    tried: tuple[str, ...]
    last_error: str

    def message(self, now: float) -> str:
        """One line for the log: what is wrong, for how long, and what happens next."""
        tried = ", ".join(self.tried) if self.tried else "no endpoint yet"
        last = f"; last error from {self.last_error}" if self.last_error else ""
        return (
            f"etcd unreachable: no member answered the keep-alive of lease "
            f"{self.lease_id:x} for {now - self.since:.1f} s (tried {tried}{last}); "
            "workers keep running and keep-alives go on; the lease counts as lost only "
            "if etcd says so when it answers"
        )


@dataclass(frozen=True)
class Change:
    """A change of state to report: the new state and how long etcd had been silent."""

    state: LeaseState
    silence: float  # seconds from the last answer before this change to this change


class Liveness:
    """The bookkeeping of one lease's keep-alive stream. Not thread-safe: the owner locks.

    Args:
        lease_id: the lease (for messages).
        ttl: the lease's TTL in seconds.
        granted_at: monotonic time just before the grant was sent; the lease surely
            exists until ``granted_at + ttl``.
    """

    def __init__(self, lease_id: int, ttl: float, granted_at: float) -> None:
        self.lease_id = lease_id
        self.ttl = ttl
        self.state = LeaseState.ALIVE
        self.alive_until = granted_at + ttl
        self.last_answer = granted_at
        self.lost_reason = ""
        # Send times of this stream's unanswered requests, oldest first: etcd answers a
        # stream's keep-alives in order, so an answer renews from its request's send time.
        self._unanswered: deque[float] = deque()
        self._stream = 0
        self._tried: list[str] = []
        self._last_error = ""

    # -- what the stream did --------------------------------------------------------------

    def new_stream(self) -> int:
        """A new stream is opening; return its number for :meth:`sent`. Requests of the
        old one will never be answered."""
        self._stream += 1
        self._unanswered.clear()
        return self._stream

    def sent(self, stream: int, now: float) -> None:
        """Stream ``stream`` sent a keep-alive at ``now`` (ignored if it is not the current
        one: a request generator may outlive its stream by a moment)."""
        if stream == self._stream:
            self._unanswered.append(now)

    def oldest_unanswered(self) -> float | None:
        """Send time of the oldest request still waiting for its answer (None: none)."""
        return self._unanswered[0] if self._unanswered else None

    def member_hung(self, now: float, interval: float, member_heard_at: float) -> bool:
        """Whether the stream's member must be taken as hung and the stream reopened on
        the next one.

        Only when a keep-alive has waited a whole ``interval`` and either the member
        answered nothing on this client since that keep-alive was sent
        (``member_heard_at``: a member that answers other calls is slow, not hung, and
        reopening would only add load) or the lease's guarantee runs out within an
        interval (then another member is worth a try even if this one is only slow).
        """
        sent_at = self.oldest_unanswered()
        if sent_at is None or now - sent_at < interval:
            return False
        return member_heard_at < sent_at or self.alive_until - now < interval

    def answered(self, now: float, ttl: int) -> Change | None:
        """etcd answered the stream's oldest request with ``ttl``; the change to report.

        ``ttl`` ≤ 0 is etcd saying the lease is gone: LOST. Otherwise the lease was
        renewed no earlier than that request was sent, so it lives at least ``ttl`` from
        then; an UNREACHABLE lease is ALIVE again.
        """
        sent_at = self._unanswered.popleft() if self._unanswered else self.last_answer
        return self._heard(now, sent_at, ttl, gone=ttl <= 0)

    def probed(self, now: float, sent_at: float, remaining: int) -> Change | None:
        """etcd answered a time-to-live request sent at ``sent_at``; the change to report.

        ``remaining`` is -1 for a lease etcd does not have (LOST); else the whole seconds
        left, rounded down (0: under a second, but alive).
        """
        return self._heard(now, sent_at, remaining, gone=remaining < 0)

    def _heard(self, now: float, sent_at: float, ttl: int, *, gone: bool) -> Change | None:
        if self.state in FINAL:
            return None
        silence = now - self.last_answer
        self.last_answer = now
        self._tried, self._last_error = [], ""
        if gone:
            return self._final(LeaseState.LOST, silence, "etcd says it expired or was revoked")
        self.alive_until = max(self.alive_until, sent_at + ttl)
        if self.state is LeaseState.UNREACHABLE:
            self.state = LeaseState.ALIVE
            return Change(LeaseState.ALIVE, silence)
        return None

    def not_found(self, now: float, details: str) -> Change | None:
        """etcd answered "lease not found" (an error instead of TTL 0): LOST."""
        if self.state in FINAL:
            return None
        return self._final(LeaseState.LOST, now - self.last_answer, f"etcd says {details}")

    def failed(self, endpoint: str, error: str) -> None:
        """An attempt on ``endpoint`` ended without an answer (``error``: code and details)."""
        if endpoint not in self._tried:
            self._tried.append(endpoint)
        self._last_error = f"{endpoint}: {error}"

    def check(self, now: float) -> Change | None:
        """Whether silence has reached the point of UNREACHABLE; the change, if so.

        Only the guarantee of the last answer running out counts: before that the lease
        surely exists, whatever the stream does (a member restart or a leader change that
        is over within it costs nothing, not even a log line).
        """
        if self.state is LeaseState.ALIVE and now >= self.alive_until:
            self.state = LeaseState.UNREACHABLE
            return Change(LeaseState.UNREACHABLE, now - self.last_answer)
        return None

    def outage(self) -> Outage:
        """The current silence, for the UNREACHABLE warning."""
        return Outage(self.lease_id, self.last_answer, tuple(self._tried), self._last_error)

    def end(self, state: LeaseState, now: float, reason: str) -> Change | None:
        """The keep-alive stopped (FAILED or CLOSED); the change, unless already final."""
        if self.state in FINAL:
            return None
        return self._final(state, now - self.last_answer, reason)

    def _final(self, state: LeaseState, silence: float, reason: str) -> Change:
        self.state = state
        self.lost_reason = reason
        self._unanswered.clear()
        return Change(state, silence)


class Probe(enum.Enum):
    """What a watch stream does about a silent member (:func:`watch_probe`)."""

    WAIT = "wait"
    SEND = "send"  # a progress request: etcd answers it at once with its revision
    HUNG = "hung"  # leave the member: reopen the stream on the next one


def watch_probe(now: float, heard: float, probe_sent: float | None, interval: float) -> Probe:
    """The rule that keeps a watch stream off a frozen member.

    A watch stream is silent while nothing changes, so silence alone proves nothing; a
    member that is stopped (a paused VM, a SIGSTOP) keeps its sockets open and would hold
    every watch of the client, unnoticed until gRPC's keepalive gives up many seconds
    later. So once the member has said nothing on this client for ``interval`` (since
    ``heard``: any answer counts, a keep-alive's too), the stream sends a progress request;
    if nothing comes back within another ``interval`` either, the member is hung.

    Args:
        now: the current time.
        heard: when the member last answered anything on this client (or the stream
            opened, if later).
        probe_sent: when the last progress request went out (None: none yet).
        interval: how long a member may stay silent, each time.
    """
    if probe_sent is not None and heard < probe_sent:
        return Probe.HUNG if now - probe_sent >= interval else Probe.WAIT
    return Probe.SEND if now - heard >= interval else Probe.WAIT
