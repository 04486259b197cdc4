"""EtcdClient: KV (from ``_KV``), lease calls (``_Leases``), keep-alives, watches, thread
deaths."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from coordinator.core.etcd_client._keepalive import KeepAlive, OnReachable, OnUnreachable
from coordinator.core.etcd_client._keepalive_stream import _KeepAliveStream
from coordinator.core.etcd_client._leases import _Leases
from coordinator.core.etcd_client._observer import EtcdObserver
from coordinator.core.etcd_client._ranges import _check_prefix
from coordinator.core.etcd_client._types import EtcdConfig, WatchEvent, key_text, prefix_range_end
from coordinator.core.etcd_client._watch import Watch, _WatchState
from coordinator.core.etcd_client._watcher import _Watcher
from coordinator.core.threads import DeathListener, ThreadDied

T = TypeVar("T")

__all__ = ["EtcdClient"]

log = logging.getLogger("coordinator.core.etcd_client")  # one logger for the whole package


class EtcdClient(_Leases):
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

    # -- keep-alives (the lease calls are _Leases') -------------------------------------

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
        range_end: bytes = b"",
        prev_kv: bool = False,
        no_put: bool = False,
        on_error: Callable[[Exception], None] | None = None,
    ) -> Watch:
        """Watch ``key`` (every key under it with ``prefix``; every key from it up to, not
        including, ``range_end`` with that) from ``start_revision``; only its deletions
        with ``no_put`` (etcd filters the puts out).

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
            range_end = prefix_range_end(key)
        elif range_end and range_end <= key:
            raise ValueError(f"watch range {key_text(key)} to {key_text(range_end)} is empty")
        state = _WatchState(
            key=key,
            range_end=range_end,
            next_rev=start_revision,
            on_events=on_events,
            on_compacted=on_compacted,
            on_error=on_error,
            prev_kv=prev_kv,
            no_put=no_put,
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
