"""The watched view of a run's state key: the latest state, without a round trip.

Read once, then kept current by a watch from the revision just read, so no change is
missed; on compaction the view re-reads and watches again. Readers wait on a condition
that the watch signals: no polling. Listeners hear of every change (from the watch
thread: they must not block).

A value that does not decode is kept as an error, not retried in a loop: every reader
gets the same :class:`~coordinator.core.errors.CorruptValueError` (naming the key) until a
valid value is written.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from coordinator.core.errors import CorruptValueError
from coordinator.core.etcd_client import EtcdClient, KeyValue, Watch, WatchEvent
from coordinator.core.listeners import Listener, Listeners
from coordinator.core.state import RdzvState, decode_state

__all__ = ["StateView"]

log = logging.getLogger(__name__)


class StateView:
    """Watched copy of the state key.

    Args:
        client: the etcd client.
        key: the state key.
    """

    def __init__(self, client: EtcdClient, key: bytes) -> None:
        self._client = client
        self._key = key
        self._key_text = key.decode(errors="replace")
        self._cond = threading.Condition()
        self._state = RdzvState()
        self._mod_revision = 0
        self._seen_revision = 0  # highest etcd revision reflected (changes or not)
        self._error: CorruptValueError | None = None
        self._listeners = Listeners()
        self._watch: Watch | None = None
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        # Events at or before the read's revision are dropped by _set, in whichever order
        # they come.
        self._watch, (kv, revision) = self._client.watch_then_read(
            self._key, lambda: self._client.get(self._key), self._on_events, self._on_compacted
        )
        self._set(kv, revision)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def _on_events(self, events: list[WatchEvent], revision: int) -> None:
        for event in events:
            if event.kind == "put":
                self._set(event.kv, event.kv.mod_revision)
            else:
                self._set(None, event.kv.mod_revision)

    def _on_compacted(self, compact_revision: int) -> None:
        # Re-reading blocks on a round trip; the watch thread must not, so hand it off.
        log.info("watch of %s compacted at %d; re-reading", self._key_text, compact_revision)
        threading.Thread(target=self._restart, name="state-view-rewatch", daemon=True).start()

    def _restart(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        with self._cond:
            if self._closed:
                return
        self.start()

    # -- updates -----------------------------------------------------------------------

    def _set(self, kv: KeyValue | None, revision: int) -> None:
        with self._cond:
            if revision and revision <= self._seen_revision:
                return  # an old value (e.g. the watch echoing our own write)
            self._seen_revision = revision
            if kv is None:
                self._state, self._mod_revision, self._error = RdzvState(), 0, None
            else:
                try:
                    self._state = decode_state(self._key_text, kv.value)
                    self._error = None
                except CorruptValueError as exc:
                    log.error("%s", exc)
                    self._error = exc
                self._mod_revision = kv.mod_revision
            self._cond.notify_all()
        self._listeners.notify()

    def offer(self, kv: KeyValue | None, revision: int) -> None:
        """Tell the view about a value read or written outside the watch (it may be newer)."""
        self._set(kv, kv.mod_revision if kv is not None else revision)

    def offer_written(self, state: RdzvState, mod_revision: int) -> None:
        """Record a state this process just committed at ``mod_revision``."""
        with self._cond:
            if mod_revision <= self._seen_revision:
                return
            self._seen_revision = mod_revision
            self._state, self._mod_revision, self._error = state, mod_revision, None
            self._cond.notify_all()
        self._listeners.notify()

    # -- reads -------------------------------------------------------------------------

    def snapshot(self) -> tuple[RdzvState, int]:
        """The latest state and its mod_revision (0: key absent).

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

    def peek(self) -> RdzvState:
        """The latest decodable state, never raising (for ``num_nodes_waiting``)."""
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
