"""EtcdClient: KV (from ``_KV``), leases and their keep-alives, watches, thread deaths."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from coordinator.core.errors import EtcdConnectionError, LeaseLostError
from coordinator.core.etcd_client._connection import Metadata, _stream_metadata
from coordinator.core.etcd_client._etcdrpc import etcdrpc
from coordinator.core.etcd_client._failover import NOT_FOUND, _status, classify_status
from coordinator.core.etcd_client._keepalive import KeepAlive, OnReachable, OnUnreachable
from coordinator.core.etcd_client._keepalive_stream import _KeepAliveStream
from coordinator.core.etcd_client._kv import _KV, _check_prefix
from coordinator.core.etcd_client._observer import EtcdObserver
from coordinator.core.etcd_client._types import EtcdConfig, WatchEvent, prefix_range_end
from coordinator.core.etcd_client._watch import Watch, _WatchState
from coordinator.core.etcd_client._watcher import _Watcher
from coordinator.core.threads import DeathListener, ThreadDied

T = TypeVar("T")

__all__ = ["EtcdClient"]

log = logging.getLogger("coordinator.core.etcd_client")  # one logger for the whole package

# Lease ids are chosen by the client (see lease_grant) from the OS's randomness, never
# from a client's injected rng: two clients seeded alike must not pick the same ids.
_LEASE_IDS = random.SystemRandom()
_MAX_LEASE_ID = 2**62  # etcd's ids are int64; 0 would mean "etcd, choose one"
_LEASE_EXISTS = "lease already exists"


def earlier_grant_applied(attempt: int, details: str) -> bool:
    """Whether etcd's refusal ``details`` of attempt number ``attempt`` (from 1) of one
    grant of a client-chosen id says an earlier attempt was applied: the lease is ours.

    On the first attempt the same words mean another lease has the id (with random
    62-bit ids, not seen in practice): an error, never somebody else's lease taken.
    """
    return attempt > 1 and _LEASE_EXISTS in details.lower()


class EtcdClient(_KV):
    """A thread-safe etcd v3 client with failover, auth, watches and lease keep-alives.

    One instance may be shared by many threads. Every KV call returns etcd's header
    revision with its result, so callers can watch from exactly the revision they read.

    Background threads (the watch thread, the keep-alive thread) cannot die silently: an
    unexpected exception in one is logged, ends what it served (every open watch gets
    ``on_error``; every lease it kept alive turns FAILED and its ``on_lost`` runs) and is
    handed to every death listener as a ``ThreadDied``.

    Args:
        config: where etcd is and how to authenticate.
        clock: monotonic seconds; injected so tests can drive retry decisions.
        sleep: waits between failover rounds (default: a wait that :meth:`close` cuts short).
        rng: picks the first endpoint (spreading clients over members) and the jitter.
        on_thread_death: a first death listener (see :meth:`add_death_listener`).
        observer: hears of every call, failed attempt, keep-alive and answer (metrics;
            see :class:`~coordinator.core.etcd_client.EtcdObserver`); None: nobody.

    Raises:
        EtcdTLSError: a TLS file cannot be read (names the file).
    """

    def __init__(
        self,
        config: EtcdConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
        rng: random.Random | None = None,
        on_thread_death: DeathListener | None = None,
        observer: EtcdObserver | None = None,
    ) -> None:
        super().__init__(config, clock=clock, sleep=sleep, rng=rng, observer=observer)
        self._keepalives: set[KeepAlive] = set()
        self._keepalive_stream = _KeepAliveStream(self)
        self._lock = threading.Lock()
        self._death_listeners: list[DeathListener] = []
        if on_thread_death is not None:
            self._death_listeners.append(on_thread_death)
        self._watcher = _Watcher(self)

    @property
    def watch_endpoint(self) -> str | None:
        """The endpoint the watch stream last got an answer from (None: no stream)."""
        return self._watcher.endpoint

    # -- thread deaths -------------------------------------------------------------------

    def add_death_listener(self, listener: DeathListener) -> Callable[[], None]:
        """Call ``listener(died)`` when a background thread of this client dies of an
        unexpected exception; returns the function that removes it again.

        It runs on the dying thread and must not block. What died is over by then (its
        watches got ``on_error``, its lease is FAILED); the owner decides what follows
        (e.g. leave and re-join, or stop with ``died`` as the error).
        """
        with self._lock:
            self._death_listeners.append(listener)

        def remove() -> None:
            with self._lock:
                if listener in self._death_listeners:
                    self._death_listeners.remove(listener)

        return remove

    def _thread_died(self, died: ThreadDied) -> None:
        with self._lock:
            listeners = list(self._death_listeners)
        for listener in listeners:
            try:
                listener(died)
            except Exception:
                # One listener's bug must not keep the others from hearing of the death.
                log.exception("the death listener %r of the etcd client failed", listener)

    # -- leases --------------------------------------------------------------------------

    def lease_grant(self, ttl: int) -> int:
        """Grant a lease of ``ttl`` seconds; return its id.

        The id is chosen here, at random, so a retry after an unknown outcome is
        idempotent: if the first attempt was applied after all, etcd answers the retry
        "lease already exists", and that lease is ours (no unused lease is left behind;
        it started counting its TTL no earlier than the first attempt was sent).
        """
        lease_id = _LEASE_IDS.randrange(1, _MAX_LEASE_ID)
        request = etcdrpc.LeaseGrantRequest(TTL=ttl, ID=lease_id)
        attempts = 0

        def grant(stubs: Any, timeout: float, metadata: Metadata) -> int:
            nonlocal attempts
            attempts += 1
            try:
                rsp = stubs.lease.LeaseGrant(request, timeout=timeout, metadata=metadata)
            except grpc.RpcError as exc:
                if earlier_grant_applied(attempts, _status(exc)[1]):
                    return lease_id
                raise
            if rsp.error:
                raise EtcdConnectionError(f"etcd refused a lease of {ttl} s: {rsp.error}")
            return int(rsp.ID)

        return self._unary("lease_grant", grant)

    def lease_grant_if_absent(self, lease_id: int, ttl: int) -> int:
        """Grant lease ``lease_id`` (an id every writer of it computes alike) of ``ttl``
        seconds unless a lease with that id exists.

        Returns:
            The TTL etcd granted (at least its minimum), or 0 when the id exists already
            (somebody's grant, or an earlier attempt of this one whose answer was lost).

        Raises:
            ValueError: ``lease_id`` is not a lease id.
        """
        if not 0 < lease_id < 2**63:
            raise ValueError(f"lease id {lease_id} is not a lease id (1 to 2**63-1)")
        request = etcdrpc.LeaseGrantRequest(TTL=ttl, ID=lease_id)

        def grant(stubs: Any, timeout: float, metadata: Metadata) -> int:
            try:
                rsp = stubs.lease.LeaseGrant(request, timeout=timeout, metadata=metadata)
            except grpc.RpcError as exc:
                if _LEASE_EXISTS in _status(exc)[1].lower():
                    return 0
                raise
            if rsp.error:
                if _LEASE_EXISTS in rsp.error.lower():
                    return 0
                raise EtcdConnectionError(f"etcd refused a lease of {ttl} s: {rsp.error}")
            return int(rsp.TTL)

        return self._unary("lease_grant", grant)

    def lease_refresh(self, lease_id: int, *, budget: float | None = None) -> int:
        """Renew the lease once (one keep-alive on a short stream of its own).

        Returns:
            How long the lease lives from now on (its full TTL), or 0 when etcd has no
            such lease. Through etcd's gRPC proxy, which answers a keep-alive only with
            its own next renewal (a third of the TTL away, for a lease it keeps alive for
            another client already), an answer not there within a second is replaced by
            the lease's time to live, which the proxy's renewals keep up.
        """
        request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)

        def refresh(stubs: Any, timeout: float, metadata: Metadata) -> int:
            answered = threading.Event()

            def requests() -> Iterator[Any]:
                yield request
                # The stream ends only once answered: the proxy drops an unanswered
                # keep-alive at the end of its stream ("context canceled").
                answered.wait(timeout)

            wait = min(1.0, timeout / 2)
            call = stubs.lease.LeaseKeepAlive(
                requests(), timeout=wait, metadata=_stream_metadata(metadata)
            )
            try:
                for rsp in call:
                    return max(0, int(rsp.TTL))
            except grpc.RpcError as exc:
                code, details = _status(exc)
                if "lease not found" in details.lower():
                    return 0
                if code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
            finally:
                answered.set()
                call.cancel()
            ask = etcdrpc.LeaseTimeToLiveRequest(ID=lease_id)
            rsp = stubs.lease.LeaseTimeToLive(ask, timeout=timeout - wait, metadata=metadata)
            return max(0, int(rsp.TTL))

        return self._unary(
            f"lease_refresh of lease {lease_id:x}", refresh, budget=budget, method="lease_refresh"
        )

    def lease_revoke(self, lease_id: int, *, budget: float | None = None) -> None:
        """Revoke the lease and delete its keys. A lease already gone is not an error."""
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        try:
            self._unary(
                f"lease_revoke of lease {lease_id:x}",
                lambda s, t, m: s.lease.LeaseRevoke(request, timeout=t, metadata=m),
                budget=budget,
                method="lease_revoke",
            )
        except LeaseLostError:
            return  # already gone: what revoking wanted
        except EtcdConnectionError as exc:
            if (
                isinstance(exc.__cause__, grpc.RpcError)
                and classify_status(*_status(exc.__cause__)) == NOT_FOUND
            ):
                return
            raise

    def lease_time_to_live(self, lease_id: int) -> int:
        """Seconds the lease has left, or -1 if it expired or was revoked."""
        request = etcdrpc.LeaseTimeToLiveRequest(ID=lease_id)
        rsp = self._unary(
            "lease_time_to_live",
            lambda s, t, m: s.lease.LeaseTimeToLive(request, timeout=t, metadata=m),
        )
        return int(rsp.TTL)

    def keep_alive(
        self,
        lease_id: int,
        ttl: int,
        on_lost: Callable[[], None] | None = None,
        *,
        on_unreachable: OnUnreachable | None = None,
        on_reachable: OnReachable | None = None,
        granted_at: float | None = None,
        first_in: float = 0.0,
    ) -> KeepAlive:
        """Keep the lease alive until closed or lost, on the client's one long-lived
        keep-alive stream (shared by all its leases; the first lease opens it).

        Never gives up while etcd is silent: the lease is lost only when etcd says so
        (:class:`KeepAlive` has the states and what each means for safety). Callbacks
        run once per change, on the keep-alive thread, and must not block:

        * ``on_lost()``: the lease is LOST (etcd said so) or FAILED (the keep-alive
          thread died; also reported to the death listeners);
        * ``on_unreachable(outage)``: no member answered since the lease's guarantee ran
          out (default: a warning naming the endpoints);
        * ``on_reachable(silence_seconds)``: etcd answers again and the lease is alive
          (default: an info line).

        ``granted_at``: monotonic time just before the grant was sent (default: now),
        from which the lease surely lives ``ttl``; its first keep-alive goes out about
        ``ttl / 3`` after it. Without it, ``first_in`` seconds from now (default: at once).
        """
        self._check_open()
        keepalive = KeepAlive(
            self, lease_id, ttl, on_lost,
            on_unreachable=on_unreachable, on_reachable=on_reachable, granted_at=granted_at,
            first_in=first_in,
        )  # fmt: skip
        with self._lock:
            self._keepalives.add(keepalive)
        keepalive._start()
        return keepalive

    def _forget(self, keepalive: KeepAlive) -> None:
        with self._lock:
            self._keepalives.discard(keepalive)

    # -- watches -------------------------------------------------------------------------

    def watch(
        self,
        key: bytes,
        start_revision: int,
        on_events: Callable[[list[WatchEvent], int], None],
        on_compacted: Callable[[int], None],
        *,
        prefix: bool = False,
        prev_kv: bool = False,
        on_error: Callable[[Exception], None] | None = None,
    ) -> Watch:
        """Watch ``key`` (every key under it with ``prefix``) from ``start_revision``.

        ``start_revision`` 0 means "from now". Events arrive in revision order through
        ``on_events(events, header_revision)``; after a broken stream the watch resumes
        from the revision after the last event delivered, so none is lost or repeated.
        When etcd has compacted the revision needed, ``on_compacted(compact_revision)``
        runs once and the watch ends: re-read and watch again. When the watch ends for
        any other reason (etcd cancelled it, one of its callbacks raised, the watch
        thread died), ``on_error(error)`` runs once (default: logged); the module
        docstring of ``_watch`` lists the cases. All callbacks run on the client's single
        watch thread: they must not block (no RPCs, no waiting); hand work to another
        thread instead.

        Creating and cancelling a watch is one message on the shared stream.
        """
        self._check_open()
        if prefix:
            _check_prefix(key)
        state = _WatchState(
            key=key,
            range_end=prefix_range_end(key) if prefix else b"",
            next_rev=start_revision,
            on_events=on_events,
            on_compacted=on_compacted,
            on_error=on_error,
            prev_kv=prev_kv,
        )
        self._watcher.add(state)
        return Watch(self._watcher, state)

    def watch_then_read(
        self,
        key: bytes,
        read: Callable[[], T],
        on_events: Callable[[list[WatchEvent], int], None],
        on_compacted: Callable[[int], None],
        *,
        prefix: bool = False,
        on_error: Callable[[Exception], None] | None = None,
        timeout: float | None = None,
    ) -> tuple[Watch, T]:
        """Watch ``key`` from now, wait for etcd to confirm it, then call ``read()``.

        The way to follow a key whose value is needed too: the read sees at least the
        revision the watch started after, so no change falls between them; events the
        read already reflects may still arrive (before or after it) and the caller drops
        them by revision. Why not read first and watch from the read's revision + 1: see
        :meth:`Watch.wait_created`. Arguments as :meth:`watch`; ``timeout`` bounds the
        wait for the confirmation (default: the retry budget).

        Raises:
            EtcdConnectionError: etcd did not confirm in time, refused the watch, or the
                read failed; the watch is cancelled first.
        """
        watch = self.watch(key, 0, on_events, on_compacted, prefix=prefix, on_error=on_error)
        try:
            watch.wait_created(timeout)
            return watch, read()
        except BaseException:
            watch.cancel()
            raise

    def close(self) -> None:
        """Stop every keep-alive (without revoking), the watch thread and all channels."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            keepalives = list(self._keepalives)
        for keepalive in keepalives:
            keepalive.close(revoke=False)
        self._keepalive_stream.close()
        self._watcher.close()
        self._channels.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
