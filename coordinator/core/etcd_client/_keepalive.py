"""KeepAlive: one long-lived keep-alive stream per lease, on its own guarded thread.

A lease is lost only when etcd says so; silence makes it UNREACHABLE, never LOST (see
``_liveness``, which holds the rules and the states).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc

from coordinator.core.errors import EtcdConnectionError
from coordinator.core.etcd_client._connection import Metadata, _stream_metadata
from coordinator.core.etcd_client._etcdrpc import etcdrpc
from coordinator.core.etcd_client._failover import (
    NOT_FOUND,
    REAUTH,
    RETRY,
    _code_name,
    _status,
    backoff_delay,
    classify_status,
)
from coordinator.core.etcd_client._liveness import Change, LeaseState, Liveness, Outage
from coordinator.core.etcd_client._observer import NO_ANSWER, STREAM_ENDED
from coordinator.core.threads import ThreadDied, start_guarded

if TYPE_CHECKING:
    from coordinator.core.etcd_client._client import EtcdClient

__all__ = ["KeepAlive", "OnReachable", "OnUnreachable"]

log = logging.getLogger("coordinator.core.etcd_client")  # one logger for the whole package

OnUnreachable = Callable[[Outage], None]
OnReachable = Callable[[float], None]


class _Attempt(NamedTuple):
    """How one attempt at a stream ended."""

    kind: str  # a failure kind of _failover (RETRY, REAUTH, ...)
    metadata: Metadata  # the token it used (to invalidate on REAUTH)
    answered: bool  # etcd answered at least once (resets the backoff)


class KeepAlive:
    """One long-lived keep-alive stream for one lease.

    Sends a keep-alive about every ``ttl / 3`` and reads the answers. A keep-alive left
    unanswered for an interval makes the member hung, and the stream is reopened on the
    next endpoint, if the member answered nothing else on this client since it went out
    or the lease's guarantee runs out within an interval (``Liveness.member_hung``): an
    overloaded member that answers late is not left, since reopening adds load and, under
    a thousand nodes joining at once, turned slow answers into expired leases. Before each
    reopen, one time-to-live request bounded by the interval asks etcd whether the lease
    still exists (a stream on a channel still connecting would block unnoticed; and its
    answer is etcd's word on the lease); the first stream after a grant skips it.

    **Never gives up on a timer.** While no member answers it keeps trying, failing over
    between endpoints with a backoff of at most about a second, for as long as it takes;
    the state (:class:`LeaseState`) says what the owner may assume meanwhile:

    * ALIVE → UNREACHABLE once the last answer's guarantee (:attr:`alive_until`) ran
      out: ``on_unreachable(outage)`` runs once (default: one warning naming the
      endpoints, :meth:`Outage.message`);
    * UNREACHABLE → ALIVE when etcd answers with the lease alive: ``on_reachable(silence
      seconds)`` runs once (default: one info line);
    * → LOST when etcd answers TTL ≤ 0 or "lease not found"; → FAILED when this thread
      dies of an unexpected exception (also reported to the client's death listeners);
      either way :meth:`lost` turns true and ``on_lost()`` runs once.

    Callbacks run on this keep-alive thread and must not block. One that raises is
    logged and the keep-alive goes on: a bug of the owner must not cost the lease.

    The client's observer hears each answer's round trip (``keepalive_answered``), each
    answer (``answered``) and each broken stream (``attempt_failed`` with method
    ``lease_keepalive``).
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
    ) -> None:
        self.lease_id = lease_id
        self.ttl = ttl
        self._client = client
        self._on_lost = on_lost
        self._on_unreachable = on_unreachable
        self._on_reachable = on_reachable
        self._interval = max(ttl / 3.0, 0.1)
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._lock = threading.Lock()
        self._liveness = Liveness(
            lease_id, ttl, client._clock() if granted_at is None else granted_at
        )
        self._call: Any = None
        # Whether the next stream opens with a probe: every one but the first after a
        # grant, whose answer is etcd's fresh word on the lease over a channel that works.
        self._probe_next = granted_at is None
        self._quiet = False  # a failure was logged since the last answer: log the rest at debug
        self._thread: threading.Thread | None = None
        # Where the stream last got an answer (None while reconnecting), for diagnostics.
        self.endpoint: str | None = None

    def _start(self) -> None:
        self._thread = start_guarded(f"etcd-keepalive-{self.lease_id:x}", self._run, self._died)

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
        """Stop the stream and, with ``revoke``, revoke the lease (best effort, bounded)."""
        first = not self._stop.is_set()
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            gone = self._liveness.state is LeaseState.LOST
            self._liveness.end(LeaseState.CLOSED, self._client._clock(), "closed")
        self._client._forget(self)
        if first and revoke and not gone and not self._client._closed.is_set():
            try:
                self._client.lease_revoke(self.lease_id, budget=self._client.config.request_timeout)
            except EtcdConnectionError as exc:
                log.warning("could not revoke lease %x (it expires by TTL): %s", self.lease_id, exc)

    # -- reporting ------------------------------------------------------------------------

    def _report(self, change: Change | None) -> None:
        """Tell the owner about a change of state (on this thread, once per change)."""
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

    def _died(self, died: ThreadDied) -> None:
        """The thread died of an unexpected exception: nobody renews the lease any more."""
        with self._lock:
            change = self._liveness.end(
                LeaseState.FAILED,
                self._client._clock(),
                f"its keep-alive thread died ({died.__cause__!r}); nothing renews it, so "
                "etcd expires it after its TTL",
            )
        self._client._thread_died(died)
        self._report(change)

    # -- the stream -----------------------------------------------------------------------

    def _requests(self, stream: int, index: int, done: threading.Event) -> Iterator[Any]:
        """Requests of one stream; runs on gRPC's feeding thread. Cancels a stale stream."""
        clock = self._client._clock
        while not done.is_set():
            with self._lock:
                self._liveness.sent(stream, clock())
            yield etcdrpc.LeaseKeepAliveRequest(ID=self.lease_id)
            if done.wait(self._interval):
                return
            heard_at = self._client.last_heard(index)
            with self._lock:
                hung = self._liveness.member_hung(clock(), self._interval, heard_at)
                call = self._call
            if hung and call is not None:
                # This member answered nothing since our keep-alive went out: try the next.
                done.set()
                call.cancel()
                return

    def _on_answer(self, index: int, rsp: Any) -> bool:
        """One keep-alive answer; False once the lease is lost (the stream is done)."""
        now = self._client._answered_by(index)
        with self._lock:
            sent_at = self._liveness.oldest_unanswered()
            change = self._liveness.answered(now, int(rsp.TTL))
            self._quiet = False
        observed = self._client._observed
        if sent_at is not None:
            observed.keepalive_answered(now - sent_at)
        self._report(change)
        return not self._lost.is_set()

    def _probe(self, index: int, metadata: Metadata) -> bool:
        """Ask etcd whether the lease still exists; False once it said it does not."""
        clock = self._client._clock
        request = etcdrpc.LeaseTimeToLiveRequest(ID=self.lease_id)
        sent_at = clock()
        future = self._client._channels.stubs(index).lease.LeaseTimeToLive.future(
            request, timeout=self._interval, metadata=_stream_metadata(metadata)
        )
        with self._lock:
            self._call = future  # close() cancels it like a stream
        if self._stop.is_set():
            future.cancel()
        rsp = future.result()
        now = self._client._answered_by(index)
        with self._lock:
            change = self._liveness.probed(now, sent_at, int(rsp.TTL))
            self._quiet = False
            self.endpoint = self._client.config.endpoints[index]
        self._report(change)
        return not self._lost.is_set()

    def _attempt(self, index: int) -> _Attempt:
        """Probe, then open one stream on endpoint ``index`` and read it until it ends."""
        client = self._client
        name = client.config.endpoints[index]
        done = threading.Event()
        metadata: Metadata = None
        answered = False
        with self._lock:
            stream = self._liveness.new_stream()
        try:
            # Authenticating (with its own failover) is bounded like one interval's wait.
            metadata = client._metadata(self._interval)
            probe, self._probe_next = self._probe_next, True
            if probe and not self._probe(index, metadata):
                return _Attempt(RETRY, metadata, True)
            call = client._channels.stubs(index).lease.LeaseKeepAlive(
                self._requests(stream, index, done), metadata=_stream_metadata(metadata)
            )
            with self._lock:
                self._call = call
            if self._stop.is_set():
                call.cancel()
            for rsp in call:
                self.endpoint = name
                answered = True
                if not self._on_answer(index, rsp):
                    return _Attempt(RETRY, metadata, True)
            self._failed(name, "the member ended the stream")
            client._observed.attempt_failed("lease_keepalive", STREAM_ENDED)
            return _Attempt(RETRY, metadata, answered)
        except grpc.RpcError as exc:
            code, details = _status(exc)
            kind = RETRY if done.is_set() else classify_status(code, details)
            if not self._stop.is_set():
                client._observed.attempt_failed(
                    "lease_keepalive", NO_ANSWER if done.is_set() else _code_name(code)
                )
                if kind != RETRY:
                    client._answered_by(index)  # an error status, from etcd
            if kind == NOT_FOUND and "lease not found" in details.lower():
                with self._lock:
                    change = self._liveness.not_found(client._clock(), details)
                self._report(change)
            elif done.is_set():
                self._failed(name, f"no answer within {self._interval:.1f} s")
            elif not self._stop.is_set():
                self._failed(name, f"{_code_name(code)}: {details}")
            return _Attempt(kind, metadata, answered)
        except grpc.FutureCancelledError:
            return _Attempt(RETRY, metadata, answered)  # close() cancelled the probe
        except (EtcdConnectionError, ValueError) as exc:
            self._failed(name, str(exc))
            return _Attempt(RETRY, metadata, answered)
        finally:
            done.set()
            with self._lock:
                self._call = None
            self.endpoint = None

    def _failed(self, endpoint: str, error: str) -> None:
        with self._lock:
            self._liveness.failed(endpoint, error)
            quiet, self._quiet = self._quiet, True
        # The first failure after an answer at info, the rest of an outage at debug: the
        # outage itself is reported once, as UNREACHABLE.
        (log.debug if quiet else log.info)(
            "keep-alive of lease %x on %s: %s; trying the next member",
            self.lease_id, endpoint, error,
        )  # fmt: skip

    def _check(self) -> None:
        with self._lock:
            change = self._liveness.check(self._client._clock())
        self._report(change)

    def _run(self) -> None:
        client = self._client
        endpoints = len(client.config.endpoints)
        failures = 0
        while not (self._stop.is_set() or self._lost.is_set()):
            index = client._ring.current()
            attempt = self._attempt(index)
            if self._stop.is_set() or self._lost.is_set():
                return  # closed on purpose, or etcd said the lease is gone
            if attempt.answered:
                failures = 0
            if attempt.kind == REAUTH:
                client._invalidate_token(attempt.metadata)
            else:
                client._ring.failed(index)
            failures += 1
            self._check()
            if failures % endpoints == 0:
                # Every member failed in a row: back off (≤ about 1 s), waking in time to
                # report UNREACHABLE when the lease's guarantee runs out.
                delay = backoff_delay(failures // endpoints - 1, client._rng.random())
                until_unsure = self.alive_until - client._clock()
                if 0 < until_unsure < delay:
                    self._stop.wait(until_unsure)
                    self._check()
                    delay -= until_unsure
                self._stop.wait(delay)
                self._check()
