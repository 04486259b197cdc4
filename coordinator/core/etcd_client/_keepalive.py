"""KeepAlive: the keep-alive of one lease, on its client's one keep-alive stream.

A lease is lost only when etcd says so; silence makes it UNREACHABLE, never LOST (see
``_liveness``, which holds the rules and the states). The stream, its thread, failover and
pacing are in ``_keepalive_stream``; this is what the owner of one lease sees, and what
the stream tells it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from coordinator.core.errors import EtcdConnectionError
from coordinator.core.etcd_client._liveness import Change, LeaseState, Liveness, Outage
from coordinator.core.etcd_client._schedule import pace

if TYPE_CHECKING:
    from coordinator.core.etcd_client._client import EtcdClient

__all__ = ["KeepAlive", "OnReachable", "OnUnreachable"]

log = logging.getLogger("coordinator.core.etcd_client")  # one logger for the whole package

OnUnreachable = Callable[[Outage], None]
OnReachable = Callable[[float], None]


class KeepAlive:
    """The keep-alive of one lease.

    Every lease of a client is kept alive on the client's one long-lived keep-alive stream
    (as etcd's Go client does), read by one guarded thread: a lease's next keep-alive goes
    out about ``ttl / 3`` after etcd answered the previous one (its first, about ``ttl / 3``
    after its grant when ``granted_at`` is given; else at once). A keep-alive left
    unanswered for an interval makes the member hung, and the stream, with every lease on
    it, is reopened on the next endpoint, if the member answered nothing else on this
    client since it went out or the lease's guarantee runs out within an interval
    (``Liveness.member_hung``): an overloaded member that answers late is not left, since
    reopening adds load and, under a thousand nodes joining at once, turned slow answers
    into expired leases. Before each reopen, one time-to-live request bounded by the
    interval asks etcd whether the most urgent lease still exists (a stream on a channel
    still connecting would block unnoticed; and its answer is etcd's word on that lease);
    the first stream after a grant skips it. Adding or closing a lease sends or stops its
    keep-alives on the open stream and disturbs no other lease.

    **Never gives up on a timer.** While no member answers it keeps trying, failing over
    between endpoints with a backoff of at most about a second, for as long as it takes;
    the state (:class:`LeaseState`) says what the owner may assume meanwhile:

    * ALIVE → UNREACHABLE once the last answer's guarantee (:attr:`alive_until`) ran
      out: ``on_unreachable(outage)`` runs once (default: one warning naming the
      endpoints, :meth:`Outage.message`);
    * UNREACHABLE → ALIVE when etcd answers with the lease alive: ``on_reachable(silence
      seconds)`` runs once (default: one info line);
    * → LOST when etcd answers TTL ≤ 0 or "lease not found"; → FAILED when the stream's
      thread dies of an unexpected exception (every lease on it fails; the death is also
      reported to the client's death listeners); either way :meth:`lost` turns true and
      ``on_lost()`` runs once.

    Callbacks run on the keep-alive thread and must not block. One that raises is logged
    and the keep-alive goes on: a bug of the owner must not cost the lease.

    The client's observer hears each answer's round trip (``keepalive_answered``), each
    answer (``answered``) and each broken stream (``attempt_failed`` with method
    ``lease_keepalive``, once per stream, whatever the number of leases on it).
    """

    lease_id: int
    ttl: int

    def __init__(
        self,
        client: EtcdClient,
        lease_id: int,
        ttl: int,
        on_lost: Callable[[], None] | None,
        *,
        on_unreachable: OnUnreachable | None = None,
        on_reachable: OnReachable | None = None,
        granted_at: float | None = None,
        first_in: float = 0.0,
    ) -> None:
        self.lease_id = lease_id
        self.ttl = ttl
        self._client = client
        self._on_lost = on_lost
        self._on_unreachable = on_unreachable
        self._on_reachable = on_reachable
        self.interval = max(ttl / 3.0, 0.1)
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._lock = threading.Lock()  # guards _liveness (a leaf lock)
        # Held by the stream's thread while it acts for this lease (its callbacks too), so
        # that close() can wait until none runs any more; reentrant for a callback that
        # closes its own lease.
        self._busy = threading.RLock()
        self._liveness = Liveness(
            lease_id, ttl, client._clock() if granted_at is None else granted_at
        )
        # Whether the next stream must probe before it opens: every one but the first after
        # a grant, whose answer is etcd's fresh word on the lease over a channel that works.
        self._probe_next = granted_at is None
        # The grant renewed the lease: its first keep-alive is due a pace after the grant,
        # as after an answer (at once, a formation of N nodes would renew N leases etcd
        # granted a moment before); else ``first_in`` from now; on any later stream, at
        # once (_due).
        if granted_at is not None:
            self._fresh_until = granted_at + pace(self.interval)
        else:
            self._fresh_until = client._clock() + first_in if first_in > 0 else 0.0
        # Where this lease last got an answer (None while reconnecting), for diagnostics.
        self.endpoint: str | None = None
        self._slot = 0  # its number on the client's keep-alive stream (set when added)

    def _start(self) -> None:
        self._client._keepalive_stream.add(self)

    # -- what the owner sees --------------------------------------------------------------

    @property
    def state(self) -> LeaseState:
        """The lease's state as this client knows it (see :class:`LeaseState`)."""
        with self._lock:
            return self._liveness.state

    @property
    def alive_until(self) -> float:
        """Monotonic time until which the lease surely exists (etcd's last answer)."""
        with self._lock:
            return self._liveness.alive_until

    @property
    def lost_reason(self) -> str:
        """Why the lease is LOST or FAILED ("" while it is not)."""
        with self._lock:
            return self._liveness.lost_reason

    def lost(self) -> bool:
        """Whether the lease must be replaced: etcd said it is gone (LOST), or nobody
        renews it any more because the keep-alive thread died (FAILED)."""
        return self._lost.is_set()

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until :meth:`lost` or ``timeout`` passes; return :meth:`lost`."""
        return self._lost.wait(timeout)

    def close(self, revoke: bool = True) -> None:
        """Stop this lease's keep-alives and, with ``revoke``, revoke the lease (best
        effort, bounded). The other leases of the client go on undisturbed. No callback
        of this lease runs once it returns (unless it is called from one)."""
        first = not self._stop.is_set()
        self._stop.set()
        self._client._keepalive_stream.remove(self)
        with self._busy:
            pass  # a callback of this lease in progress has returned
        with self._lock:
            gone = self._liveness.state is LeaseState.LOST
            self._liveness.end(LeaseState.CLOSED, self._client._clock(), "closed")
        self._client._forget(self)
        if first and revoke and not gone and not self._client._closed.is_set():
            try:
                self._client.lease_revoke(self.lease_id, budget=self._client.config.request_timeout)
            except EtcdConnectionError as exc:
                log.warning("could not revoke lease %x (it expires by TTL): %s", self.lease_id, exc)

    # -- what the stream tells it (on the stream's threads) -------------------------------

    def _due(self, now: float) -> float:
        """When its first keep-alive is due on the stream it joins at ``now``."""
        with self._lock:
            due, self._fresh_until = max(now, self._fresh_until), 0.0
        return due

    def _joined(self) -> int:
        """The lease joins a new stream; its number there, for :meth:`_sent`."""
        with self._lock:
            return self._liveness.new_stream()

    def _sent(self, stream: int, now: float) -> None:
        with self._lock:
            self._liveness.sent(stream, now)

    def _hung(self, now: float, member_heard_at: float) -> bool:
        with self._lock:
            return self._liveness.member_hung(now, self.interval, member_heard_at)

    def _on_answer(self, index: int, rsp: Any) -> bool:
        """One keep-alive answer; False once the lease is lost (it leaves the stream)."""
        now = self._client._answered_by(index)
        with self._lock:
            sent_at = self._liveness.oldest_unanswered()
            change = self._liveness.answered(now, int(rsp.TTL))
        if rsp.TTL > 0:
            # A third of the TTL etcd keeps, which may exceed the one asked for (etcd's
            # minimum is 2 s by default): what etcd's gRPC proxy renews the lease by too.
            self.interval = max(rsp.TTL / 3.0, 0.1)
        if sent_at is not None:
            self._client._observed.keepalive_answered(now - sent_at)
        self._report(change)
        return not self._lost.is_set()

    def _probed(self, now: float, sent_at: float, remaining: int) -> bool:
        """etcd answered a time-to-live request sent at ``sent_at``; False once lost."""
        with self._lock:
            change = self._liveness.probed(now, sent_at, remaining)
        self._report(change)
        return not self._lost.is_set()

    def _not_found(self, details: str) -> None:
        """etcd ended this lease's stream with "lease not found": LOST."""
        with self._lock:
            change = self._liveness.not_found(self._client._clock(), details)
        self._report(change)

    def _failed(self, endpoint: str, error: str) -> None:
        """An attempt on ``endpoint`` ended without an answer (for the outage's line)."""
        with self._lock:
            self._liveness.failed(endpoint, error)
        self.endpoint = None

    def _check(self) -> None:
        """Report UNREACHABLE if the last answer's guarantee has run out."""
        with self._lock:
            change = self._liveness.check(self._client._clock())
        self._report(change)

    def _thread_died(self, cause: BaseException | None) -> Change | None:
        """The stream's thread died: nobody renews the lease any more (FAILED). Returns
        the change for :meth:`_report`, which the stream runs once the client's death
        listeners have heard of the death."""
        with self._lock:
            return self._liveness.end(
                LeaseState.FAILED,
                self._client._clock(),
                f"its keep-alive thread died ({cause!r}); nothing renews it, so etcd "
                "expires it after its TTL",
            )

    # -- reporting ------------------------------------------------------------------------

    def _report(self, change: Change | None) -> None:
        """Tell the owner about a change of state (on the stream's thread, once each)."""
        if change is None:
            return
        now = self._client._clock()
        if change.state is LeaseState.UNREACHABLE:
            with self._lock:
                outage = self._liveness.outage()
            if self._on_unreachable is None:
                log.warning("%s", outage.message(now))
            else:
                self._callback("on_unreachable", functools.partial(self._on_unreachable, outage))
        elif change.state is LeaseState.ALIVE:
            if self._on_reachable is None:
                log.info(
                    "etcd answers again (%s) after %.1f s of silence: lease %x is alive",
                    self.endpoint or "a member", change.silence, self.lease_id,
                )  # fmt: skip
            else:
                self._callback(
                    "on_reachable", functools.partial(self._on_reachable, change.silence)
                )
        elif change.state in (LeaseState.LOST, LeaseState.FAILED):
            log.warning("etcd lease %x lost: %s", self.lease_id, self.lost_reason)
            self._lost.set()
            if self._on_lost is not None:
                self._callback("on_lost", self._on_lost)

    def _callback(self, name: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception:
            log.exception("the %s callback of lease %x failed", name, self.lease_id)
