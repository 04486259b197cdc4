"""Watch: one watch of a client, as its owner and the watch thread see it.

How a watch ends. Every watch ends in exactly one of these ways, and after it none of its
callbacks starts:

* its owner calls :meth:`Watch.cancel`;
* ``on_compacted(compact_revision)``: etcd compacted a revision the watch still needed
  (at creation, or when it resumed after a broken stream): re-read, then watch again;
* ``on_error(error)``, the watch will get no more events because:

  - etcd cancelled it: ``EtcdAuthError`` if the user may not read the key, else
    ``EtcdConnectionError`` with etcd's reason;
  - one of its own callbacks raised: ``error`` is that exception. The bug is the
    owner's, so it goes back to the owner (rather than being logged while the owner waits
    for events that were dropped); only this watch is cancelled, the others go on;
  - the client's watch thread died of an unexpected exception: ``EtcdConnectionError``
    naming the cause (a ``ThreadDied``, kept as ``__cause__``). Every open watch gets
    one, the client's death listeners hear of it, and the next :meth:`EtcdClient.watch`
    starts a new thread.

  Without ``on_error`` the error is logged. :meth:`Watch.wait_created` raises it, and
  :attr:`Watch.error` keeps it.

A broken stream is not an end: the watch resumes from the revision after the last event
delivered, on the next member that answers, however long that takes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from coordinator.core.errors import EtcdAuthError, EtcdConnectionError, EtcdPermissionError
from coordinator.core.etcd_client._failover import (
    AUTH_REQUIRED,
    PERMISSION,
    REAUTH,
    classify_status,
)
from coordinator.core.etcd_client._types import EtcdConfig, WatchEvent, _kv, key_text

if TYPE_CHECKING:
    from coordinator.core.etcd_client._watcher import _Watcher

__all__ = ["Watch", "_WatchState", "_event", "_watch_error"]

log = logging.getLogger("coordinator.core.etcd_client")  # one logger for the whole package


class _WatchState:
    """One watch as the watch thread sees it; ``next_rev`` is where a resume starts."""

    def __init__(
        self,
        *,
        key: bytes,
        range_end: bytes,
        next_rev: int,
        on_events: Callable[[list[WatchEvent], int], None],
        on_compacted: Callable[[int], None],
        on_error: Callable[[Exception], None] | None,
        prev_kv: bool,
        no_put: bool = False,
    ) -> None:
        self.key = key
        self.no_put = no_put
        self.range_end = range_end
        self.next_rev = next_rev
        self.on_events = on_events
        self.on_compacted = on_compacted
        self.on_error = on_error
        self.prev_kv = prev_kv
        self.server_id: int | None = None
        # True once the watch ended or was cancelled: no callback starts after that.
        self.cancelled = False
        # Set once etcd has created the watch (or it ended before: then ``error`` says why).
        self.created = threading.Event()
        self.created_revision = 0
        self.error: Exception | None = None
        self.auth_retried = False
        # Held while a callback runs, so cancel() from another thread returns only after
        # it: no callback of a cancelled watch starts later. Reentrant for cancel() from
        # inside a callback.
        self.lock = threading.RLock()

    @property
    def key_text(self) -> str:
        return key_text(self.key)

    def run(self, name: str, callback: Callable[[], None]) -> Exception | None:
        """Run one of the owner's callbacks (unless the watch is over); what it raised."""
        with self.lock:
            if self.cancelled:
                return None
            try:
                callback()
            except Exception as exc:
                log.error(
                    "the %s callback of the etcd watch on key %s raised %s: %s; the watch "
                    "is cancelled and the error goes to its on_error",
                    name, self.key_text, type(exc).__name__, exc, exc_info=exc,
                )  # fmt: skip
                return exc
            return None

    def finish(self) -> None:
        """The watch ended normally (its on_compacted ran): nothing more comes."""
        with self.lock:
            self.cancelled = True
            self.created.set()

    def end(self, error: Exception) -> None:
        """The watch gets no more events because of ``error``: tell its owner, once."""
        with self.lock:
            if self.cancelled:
                return  # cancelled by its owner, or already ended
            self.cancelled = True
            self.error = error
            self.created.set()
            if self.on_error is None:
                log.error("%s", error)
                return
            try:
                self.on_error(error)
            except Exception:
                log.exception(
                    "the on_error callback of the etcd watch on key %s failed", self.key_text
                )


class Watch:
    """A running watch; events are delivered on the client's watch thread."""

    def __init__(self, watcher: _Watcher, state: _WatchState) -> None:
        self._watcher = watcher
        self._state = state

    @property
    def next_revision(self) -> int:
        """The revision the watch would resume from (0: not yet created, from now)."""
        return self._state.next_rev

    @property
    def error(self) -> Exception | None:
        """Why the watch ended, if it ended with an error (see the module docstring)."""
        return self._state.error

    def wait_created(self, timeout: float | None = None) -> int:
        """Block until etcd has created the watch; return the revision it was created at.

        A watch from now (start revision 0) reports every change after that revision, so
        a read issued after this returns misses nothing: read, then apply only events
        newer than the read (:meth:`EtcdClient.watch_then_read` does exactly that).
        Reading first and then watching from the read's revision + 1 is
        correct as well, but when anything was written in between, etcd files the watch
        as "unsynced" and delivers its first events only on its next catch-up pass,
        up to 100 ms later.

        Args:
            timeout: seconds; default: the client's retry budget.

        Raises:
            EtcdConnectionError: etcd did not confirm the watch in time, or the watch
                thread died.
            EtcdAuthError: etcd refused the watch (the user may not read the key).
            Exception: the exception one of this watch's callbacks raised, which
                ended the watch.
        """
        state = self._state
        wait = self._watcher.retry_budget() if timeout is None else timeout
        if not state.created.wait(wait):
            raise self._watcher.unconfirmed(state, wait)
        if state.error is not None:
            raise state.error
        return state.created_revision

    def cancel(self) -> None:
        """Stop the watch; no callback of it starts after this returns. Idempotent."""
        self._watcher.cancel(self._state)


def _event(pb: Any) -> WatchEvent:
    prev = _kv(pb.prev_kv) if pb.HasField("prev_kv") and pb.prev_kv.key else None
    kind: Literal["put", "delete"] = "delete" if pb.type == 1 else "put"
    return WatchEvent(kind=kind, kv=_kv(pb.kv), prev_kv=prev)


def _watch_error(config: EtcdConfig, state: _WatchState, reason: str) -> Exception:
    """The error for a watch etcd cancelled with ``reason``."""
    kind = classify_status(None, reason)
    if kind in (PERMISSION, REAUTH, AUTH_REQUIRED):
        # After a token refresh (_retry_after_reauth), "permission denied" is the role's.
        error = EtcdPermissionError if kind == PERMISSION else EtcdAuthError
        return error(
            f"etcd user {config.user!r} may not watch key {state.key_text} ({reason}); "
            "grant the user's role read on the key prefix"
        )
    return EtcdConnectionError(f"etcd cancelled the watch on key {state.key_text}: {reason}")
