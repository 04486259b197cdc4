"""The watched view of a run's state key: the latest state, without a round trip.

Read once, then kept current by a watch started before the read, so no change is missed.
Readers wait on a condition that the watch signals: no polling. Listeners hear of every
change (from the watch thread: they must not block).

When the watch ends (etcd compacted the history it needed after a broken stream, or it
ended with an error), a guarded background thread re-reads and watches again, retrying
with backoff until that works or the view is closed: the view never freezes, and a bug
in that thread is reported to ``on_death`` instead of ending it silently.

What the view answers while the stored value is not a state this node can use:

* **unreadable** (a foreign or corrupt value): :attr:`error` holds the
  :class:`~coordinator.core.errors.CorruptValueError` naming the key, logged once when the
  value turns bad (not once per event) and once when it is readable again.
  :meth:`snapshot` and :meth:`read` raise it, so a NEW rendezvous fails at once with that
  one line; :meth:`peek` keeps answering from the last good state, so a running attempt
  (``num_nodes_waiting``, ``is_closed``) keeps training. The coordinator waits for a valid
  value (it never overwrites a value it cannot read: an operator put it there).
* **deleted**: the view keeps the last good state and reports it at mod_revision 0
  (absent), so every decision continues from the last round instead of "round 1" over
  that round's old store keys; the coordinator writes it back (see
  :mod:`coordinator.core.duty`). Where the last round is remembered: in this view's last
  good state, for as long as this process watches the run; a coordinator whose view never
  saw a state (it started after the delete) takes the highest round that still has store
  keys in etcd (:func:`coordinator.core.store_rounds.highest_store_round`).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable

from coordinator.core.errors import CorruptValueError, EtcdElasticError
from coordinator.core.etcd_client import EtcdClient, KeyValue, Watch, WatchEvent, backoff_delay
from coordinator.core.listeners import Listener, Listeners
from coordinator.core.state import RdzvState, decode_state
from coordinator.core.threads import DeathListener, start_guarded

__all__ = ["StateView"]

log = logging.getLogger(__name__)

# Re-watch backoff: etcd may be down for a while; waits grow to a few seconds, jittered.
_REWATCH_BASE_S = 0.1
_REWATCH_CAP_S = 5.0
# How long one re-watch waits for etcd to confirm it: short, so that close() (which joins
# the re-watch thread) never waits out a whole retry budget during an outage.
_REWATCH_CONFIRM_S = 5.0
# The re-watch jitter's source, shared: a Random of each view's own is seeded from the
# OS (a system call and about 40 us on every join's path, for a jitter rarely drawn).
_JITTER = random.Random()


class StateView:
    """Watched copy of the state key.

    Args:
        client: the etcd client.
        key: the state key.
        on_death: told if the view's re-watch thread dies of an unexpected exception
            (the view then no longer follows the key: its owner must stop using it).
        rng: jitter of the re-watch backoff.
    """

    def __init__(
        self,
        client: EtcdClient,
        key: bytes,
        *,
        on_death: DeathListener | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._client = client
        self._key = key
        self._key_text = key.decode(errors="replace")
        self._on_death = on_death
        self._rng = rng or _JITTER
        self._cond = threading.Condition()
        self._state = RdzvState()  # the last good state (kept while unreadable or deleted)
        self._mod_revision = 0  # 0: the key is absent now
        self._lease = 0  # the lease of the value last read or watched (0: none, absent)
        self._seen_revision = 0  # highest etcd revision reflected (changes or not)
        self._error: CorruptValueError | None = None
        self._listeners = Listeners()
        self._watch: Watch | None = None
        self._closed = False
        self._closing = threading.Event()  # cuts a re-watch backoff short
        self._resync_wanted = False
        self._resync_thread: threading.Thread | None = None
        self.rewatches = 0  # re-reads after a watch ended (for operators and tests)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Read the key and start watching it.

        Raises:
            EtcdConnectionError: etcd did not answer (the view is not started).
        """
        self._watch_and_read(None)

    def _watch_and_read(self, confirm_timeout: float | None) -> None:
        # Events at or before the read's revision are dropped by _set, in whichever order
        # they come.
        watch, (kv, revision) = self._client.watch_then_read(
            self._key,
            lambda: self._client.get(self._key),
            self._on_events,
            self._on_compacted,
            on_error=self._on_watch_error,
            timeout=confirm_timeout,
        )
        # Cancel outside the view's lock: a watch callback holds the watch's lock while it
        # waits for the view's (lock order: watch, then view).
        with self._cond:
            closed = self._closed
            old = None if closed else self._watch
            if not closed:
                self._watch = watch
        if closed:
            watch.cancel()
            return
        if old is not None:
            old.cancel()
        self._set(kv, revision)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            watch, self._watch = self._watch, None
            thread = self._resync_thread
            self._cond.notify_all()
        self._closing.set()
        if watch is not None:
            watch.cancel()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def _on_events(self, events: list[WatchEvent], revision: int) -> None:
        for event in events:
            if event.kind == "put":
                self._set(event.kv, event.kv.mod_revision)
            else:
                self._set(None, event.kv.mod_revision)

    def _on_compacted(self, compact_revision: int) -> None:
        log.info("watch of %s compacted at %d; re-reading", self._key_text, compact_revision)
        self._resync()

    def _on_watch_error(self, error: Exception) -> None:
        with self._cond:
            starting = self._watch is None and not self._closed
        if starting:
            return  # the first watch, not confirmed: start() raises this very error
        log.warning("watch of %s ended (%s); re-reading", self._key_text, error)
        self._resync()

    def _resync(self) -> None:
        """Re-read and watch again, on a thread of its own: the watch thread must not block
        on a round trip. One such thread at a time; a request while it runs makes it go
        round once more."""
        with self._cond:
            if self._closed:
                return
            self._resync_wanted = True
            if self._resync_thread is not None:
                return
            self._resync_thread = start_guarded(
                "state-view-rewatch", self._resync_loop, self._on_death
            )

    def _resync_loop(self) -> None:
        failures = 0
        while True:
            with self._cond:
                # Deciding to stop and saying so happen under one lock: a request that
                # comes later starts a new thread instead of being lost.
                if self._closed or not self._resync_wanted:
                    self._resync_thread = None
                    return
                self._resync_wanted = False
            try:
                self._watch_and_read(_REWATCH_CONFIRM_S)
            except EtcdElasticError as exc:
                # etcd unreachable or refusing for now: the view keeps its last state and
                # tries again; it must not stop following the key for good.
                delay = backoff_delay(failures, self._rng.random(), _REWATCH_BASE_S, _REWATCH_CAP_S)
                log.warning(
                    "re-watch of %s failed (%s); retrying in %.1f s", self._key_text, exc, delay
                )
                failures += 1
                with self._cond:
                    self._resync_wanted = True
                self._closing.wait(delay)
                continue
            failures = 0
            with self._cond:
                self.rewatches += 1

    # -- updates -----------------------------------------------------------------------

    def _set(self, kv: KeyValue | None, revision: int) -> None:
        with self._cond:
            if revision and revision <= self._seen_revision:
                return  # an old value (e.g. the watch echoing our own write)
            self._seen_revision = revision
            if kv is None:
                if self._mod_revision and (self._state.round or self._state.closed):
                    log.warning(
                        "state key %s was deleted; keeping its last state (round %d) for "
                        "the coordinator to write back",
                        self._key_text, self._state.round,
                    )  # fmt: skip
                self._mod_revision = self._lease = 0
                self._clear_error()
            else:
                self._mod_revision, self._lease = kv.mod_revision, kv.lease
                try:
                    state = decode_state(self._key_text, kv.value)
                except CorruptValueError as exc:
                    self._set_error(exc)
                else:
                    self._state = state
                    self._clear_error()
            self._cond.notify_all()
        self._listeners.notify()

    def _set_error(self, exc: CorruptValueError) -> None:
        # Logged once when the value turns bad, not once per event: every agent of the run
        # would otherwise repeat it for every write an operator tries.
        if self._error is None:
            log.error(
                "%s; keeping the last good state (round %d): running workers go on, a new "
                "rendezvous fails until a valid value is written",
                exc, self._state.round,
            )  # fmt: skip
        else:
            log.debug("still unreadable: %s", exc)
        self._error = exc

    def _clear_error(self) -> None:
        if self._error is not None:
            log.info("state key %s is readable again", self._key_text)
        self._error = None

    def offer(self, kv: KeyValue | None, revision: int) -> None:
        """Tell the view about a value read or written outside the watch (it may be newer)."""
        self._set(kv, kv.mod_revision if kv is not None else revision)

    def offer_written(self, state: RdzvState, mod_revision: int) -> None:
        """Record a state this process just committed at ``mod_revision``."""
        with self._cond:
            if mod_revision <= self._seen_revision:
                return
            self._seen_revision = mod_revision
            self._state, self._mod_revision = state, mod_revision
            self._clear_error()
            self._cond.notify_all()
        self._listeners.notify()

    # -- reads -------------------------------------------------------------------------

    @property
    def error(self) -> CorruptValueError | None:
        """Why the stored value cannot be used now (None: it can, or the key is absent)."""
        with self._cond:
            return self._error

    def snapshot(self) -> tuple[RdzvState, int]:
        """The latest state and its mod_revision (0: the key is absent; the state is then
        the last one this view saw, or the initial state).

        Raises:
            CorruptValueError: the key holds a value we cannot read.
        """
        with self._cond:
            if self._error is not None:
                raise self._error
            return self._state, self._mod_revision

    def read(self) -> tuple[RdzvState, int, int]:
        """The latest state, its mod_revision and the revision the view has reached, read
        together: pass the last to :meth:`wait_newer` so no change between the read and
        the wait is missed.

        Raises:
            CorruptValueError: the key holds a value we cannot read.
        """
        with self._cond:
            if self._error is not None:
                raise self._error
            return self._state, self._mod_revision, self._seen_revision

    def lease(self) -> int:
        """The lease the state key was on when etcd last showed it to this view (read or
        watched; not changed by :meth:`offer_written`); 0: absent, or on no lease."""
        with self._cond:
            return self._lease

    def peek(self) -> RdzvState:
        """The last good state, never raising (for ``num_nodes_waiting`` and ``is_closed``
        of a running attempt)."""
        with self._cond:
            return self._state

    def wait_newer(
        self,
        seen_revision: int,
        timeout: float | None,
        interrupt: Callable[[], bool] | None = None,
    ) -> bool:
        """Block until the view moves past ``seen_revision``, ``interrupt()`` is true (checked
        whenever :meth:`wake` is called), the timeout passes, or the view closes.

        Returns whether it moved.
        """

        def ready() -> bool:
            return (
                self._seen_revision > seen_revision
                or self._closed
                or (interrupt is not None and interrupt())
            )

        with self._cond:
            self._cond.wait_for(ready, timeout)
            return self._seen_revision > seen_revision

    def wake(self) -> None:
        """Wake every waiter (e.g. the session was lost)."""
        with self._cond:
            self._cond.notify_all()

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` after every change; returns the function that unsubscribes."""
        return self._listeners.subscribe(listener)
