"""Blocking waits for Store keys that outlive broken watch streams and compaction: for
one key (:func:`wait_for_key`), and for a number of keys under a prefix
(:func:`wait_for_prefix`, what a node that gathers the others' values waits with).

Never a poll: read; if the key is absent (too few keys under the prefix), watch it from
now, then read again (:meth:`EtcdClient.watch_then_read`), and fold in the watch's events
until what is there is enough. A broken stream resumes by itself from the revision after
the last event. What ends a watch early is handled here:

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

__all__ = ["Aborted", "Cancellation", "Found", "wait_for_key", "wait_for_prefix"]

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


class _Follow:
    """What one watch heard: its events in order, and whether it ended early (a compaction
    or an error). Filled on the client's watch thread; read by the waiting thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[WatchEvent] = []
        self.wake = threading.Event()
        self.compacted = False
        self.error: Exception | None = None

    def on_events(self, events: list[WatchEvent], _revision: int) -> None:
        with self._lock:
            self._events.extend(events)
        self.wake.set()

    def on_compacted(self, _compact_revision: int) -> None:
        self.compacted = True
        self.wake.set()

    def on_error(self, error: Exception) -> None:
        self.error = error
        self.wake.set()

    @property
    def ended(self) -> bool:
        return self.compacted or self.error is not None

    def take(self) -> list[WatchEvent]:
        with self._lock:
            taken, self._events = self._events, []
        return taken


Found = dict[bytes, KeyValue]
"""The keys a wait found (etcd key -> its current value)."""


def _fold(found: Found, read_revision: int, events: list[WatchEvent]) -> Found:
    """Apply to ``found`` (as read at ``read_revision``; changed in place and returned) the
    events after that read: one the read already reflects is dropped by its revision."""
    for event in events:
        if event.kv.mod_revision <= read_revision:
            continue
        if event.kind == "put":
            found[event.kv.key] = event.kv
        else:
            found.pop(event.kv.key, None)
    return found


def _wait(
    client: EtcdClient,
    key: bytes,
    *,
    prefix: bool,
    done: Callable[[Found], bool],
    deadline: float,
    clock: Callable[[], float],
    rng: random.Random,
    cancellation: Cancellation,
) -> Found:
    """Read ``key`` (every key under it with ``prefix``) until ``done`` holds of what is
    there, or ``deadline``; returns what is there then. One read when ``done`` holds at
    once; else a watch from now, a read, and the watch's events folded in."""

    def read() -> tuple[Found, int]:
        if prefix:
            kvs, revision = client.get_prefix(key)
            return {kv.key: kv for kv in kvs}, revision
        kv, revision = client.get(key)
        return ({} if kv is None else {key: kv}), revision

    shown = key.decode("utf-8", "backslashreplace")
    what = f"store keys under {shown}" if prefix else f"store key {shown}"
    cancellation.check()
    found, _ = read()
    failures = 0
    while not done(found):
        remaining = deadline - clock()
        if remaining <= 0:
            return found
        cancellation.check()
        follow = _Follow()
        try:
            watch, (found, at) = client.watch_then_read(
                key, read, follow.on_events, follow.on_compacted, prefix=prefix,
                on_error=follow.on_error, timeout=remaining,
            )  # fmt: skip
        except EtcdConnectionError:
            if clock() >= deadline:
                return found  # the watch was not even confirmed by the deadline
            raise
        try:
            if prefix:
                log.debug("%s: %d there; waiting for more", what, len(found))
            else:
                log.debug("%s is absent; waiting for its put", what)
            cancellation.register(follow.wake)
            while not done(found) and not follow.ended and cancellation.reason is None:
                left = deadline - clock()
                if left <= 0:
                    break
                follow.wake.wait(left)
                follow.wake.clear()
                found = _fold(found, at, follow.take())
        finally:
            cancellation.unregister(follow.wake)
            watch.cancel()
        found = _fold(found, at, follow.take())
        if done(found):
            return found
        cancellation.check()
        if follow.compacted:
            log.info("wait for %s: its watch was compacted; reading again", what)
        elif follow.error is not None:
            if isinstance(follow.error, EtcdAuthError):
                raise follow.error
            delay = backoff_delay(failures, rng.random(), _RETRY_BASE_S, _RETRY_CAP_S)
            failures += 1
            log.info(
                "wait for %s: its watch ended (%s); reading again in %.2f s",
                what, follow.error, delay,
            )  # fmt: skip
            threading.Event().wait(min(delay, max(deadline - clock(), 0.0)))
        else:
            return found  # the deadline passed
    return found


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
    found = _wait(
        client, key, prefix=False, done=lambda found: key in found, deadline=deadline,
        clock=clock, rng=rng or random.Random(), cancellation=cancellation or Cancellation(),
    )  # fmt: skip
    return found.get(key)


def wait_for_prefix(
    client: EtcdClient,
    prefix: bytes,
    count: int,
    deadline: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    cancellation: Cancellation | None = None,
) -> Found:
    """Every key under ``prefix`` once there are at least ``count`` of them, or those there
    are at ``deadline``. One range read when they are all there already; otherwise one
    watch of the prefix (its events, one per key put, go to this waiter only) and a second
    read: never a read per key.

    Raises:
        as :func:`wait_for_key`.
    """
    return _wait(
        client, prefix, prefix=True, done=lambda found: len(found) >= count,
        deadline=deadline, clock=clock, rng=rng or random.Random(),
        cancellation=cancellation or Cancellation(),
    )  # fmt: skip
