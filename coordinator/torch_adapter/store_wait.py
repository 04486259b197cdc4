"""A blocking wait for one Store key that outlives broken watch streams and compaction.

Never a poll: read; if the key is absent, watch it from now, then read again
(:meth:`EtcdClient.watch_then_read`), and wait for its put. A broken stream resumes by
itself from the revision after the last event. What ends a watch early is handled here:

* **compaction** (the stream broke and, by the time it resumed, etcd had compacted the
  revision it needed): re-read at once and watch again. The key may well have been put
  meanwhile; waiting on would wait out the whole timeout for an event that never comes;
* **the watch ended with a connection error** (etcd cancelled it, or the client's watch
  thread died): re-read and watch again after a short backoff;
* **the user may not read the key** (``EtcdAuthError``): no retry can help; raise.

Every wait is bounded by its deadline, re-reads included.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from coordinator.core.errors import EtcdAuthError, EtcdConnectionError
from coordinator.core.etcd_client import EtcdClient, KeyValue, WatchEvent, backoff_delay

__all__ = ["Aborted", "Cancellation", "wait_for_key"]

log = logging.getLogger(__name__)

_RETRY_BASE_S = 0.05
_RETRY_CAP_S = 1.0


class Aborted(Exception):
    """The wait was ended by :meth:`Cancellation.cancel`; the message says why."""


class Cancellation:
    """Ends every wait that was given it, now and later, from any thread.

    The agent cancels the waits on a round's store when it stops caring about them (the
    round's membership changed, or the agent is stopping), so no thread stays blocked in
    a wait that can no longer succeed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: set[threading.Event] = set()
        self.reason: str | None = None

    def cancel(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
            waiting = list(self._waiting)
        for event in waiting:
            event.set()

    def check(self) -> None:
        """Raise :class:`Aborted` if cancelled."""
        if self.reason is not None:
            raise Aborted(self.reason)

    def register(self, event: threading.Event) -> None:
        with self._lock:
            self._waiting.add(event)
            cancelled = self.reason is not None
        if cancelled:
            event.set()

    def unregister(self, event: threading.Event) -> None:
        with self._lock:
            self._waiting.discard(event)


class _Ending:
    """What ended one watch: the key's put, a compaction, or an error (set once)."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self.event = threading.Event()
        self.kv: KeyValue | None = None
        self.compacted = False
        self.error: Exception | None = None

    def on_events(self, events: list[WatchEvent], _revision: int) -> None:
        for event in events:
            if event.kind == "put" and event.kv.key == self._key:
                self.kv = event.kv
                self.event.set()
                return

    def on_compacted(self, _compact_revision: int) -> None:
        self.compacted = True
        self.event.set()

    def on_error(self, error: Exception) -> None:
        self.error = error
        self.event.set()


def wait_for_key(
    client: EtcdClient,
    key: bytes,
    deadline: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    cancellation: Cancellation | None = None,
) -> KeyValue | None:
    """The key's value once it exists, or None at ``deadline`` (``clock`` seconds).

    Raises:
        Aborted: ``cancellation`` was cancelled (before or during the wait).
        EtcdAuthError: the user may not read or watch the key.
        EtcdConnectionError: etcd did not answer a read, or did not confirm a watch
            before the deadline passed (then None is returned instead).
    """
    rng = rng or random.Random()
    cancellation = cancellation or Cancellation()
    cancellation.check()
    kv, _ = client.get(key)
    failures = 0
    shown = key.decode("utf-8", "backslashreplace")
    while kv is None:
        remaining = deadline - clock()
        if remaining <= 0:
            return None
        cancellation.check()
        ending = _Ending(key)
        try:
            watch, (kv, _) = client.watch_then_read(
                key,
                lambda: client.get(key),
                ending.on_events,
                ending.on_compacted,
                on_error=ending.on_error,
                timeout=remaining,
            )
        except EtcdConnectionError:
            if clock() >= deadline:
                return None  # the watch was not even confirmed by the deadline
            raise
        try:
            if kv is not None:
                return kv
            log.debug("store key %s is absent; waiting for its put", shown)
            cancellation.register(ending.event)
            ending.event.wait(max(deadline - clock(), 0.0))
        finally:
            cancellation.unregister(ending.event)
            watch.cancel()
        if ending.kv is not None:
            return ending.kv
        cancellation.check()
        if ending.compacted:
            log.info("wait for store key %s: its watch was compacted; reading again", shown)
        elif ending.error is not None:
            if isinstance(ending.error, EtcdAuthError):
                raise ending.error
            delay = backoff_delay(failures, rng.random(), _RETRY_BASE_S, _RETRY_CAP_S)
            failures += 1
            log.info(
                "wait for store key %s: its watch ended (%s); reading again in %.2f s",
                shown, ending.error, delay,
            )  # fmt: skip
            threading.Event().wait(min(delay, max(deadline - clock(), 0.0)))
        else:
            return None  # the deadline passed
    return kv
