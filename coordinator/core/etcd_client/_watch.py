"""Watches: every watch of a client on one multiplexed, resumable gRPC stream."""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import grpc
from etcd3 import etcdrpc

from coordinator.core.errors import EtcdAuthError, EtcdConnectionError
from coordinator.core.etcd_client._connection import Metadata, _stream_metadata
from coordinator.core.etcd_client._failover import (
    AUTH_REQUIRED,
    PERMISSION,
    REAUTH,
    RETRY,
    _status,
    backoff_delay,
    classify_status,
    unreachable,
)
from coordinator.core.etcd_client._types import EtcdConfig, WatchEvent, _kv

if TYPE_CHECKING:
    from coordinator.core.etcd_client._client import EtcdClient

__all__ = ["Watch", "_WatchState", "_Watcher"]

log = logging.getLogger("coordinator.core.etcd_client")  # one logger for the whole package


# -- watches ---------------------------------------------------------------------------------


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
    ) -> None:
        self.key = key
        self.range_end = range_end
        self.next_rev = next_rev
        self.on_events = on_events
        self.on_compacted = on_compacted
        self.on_error = on_error
        self.prev_kv = prev_kv
        self.server_id: int | None = None
        self.cancelled = False
        # Set once etcd has created the watch (or refused it: then ``error`` says why).
        self.created = threading.Event()
        self.created_revision = 0
        self.error: Exception | None = None
        self.auth_retried = False
        # Held while a callback runs, so cancel() from another thread returns only after
        # it: no callback of a cancelled watch starts later. Reentrant for cancel() from
        # inside a callback.
        self.lock = threading.RLock()


class Watch:
    """A running watch; events are delivered on the client's watch thread."""

    def __init__(self, watcher: _Watcher, state: _WatchState) -> None:
        self._watcher = watcher
        self._state = state

    @property
    def next_revision(self) -> int:
        """The revision the watch would resume from (0: not yet created, from now)."""
        return self._state.next_rev

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
            EtcdConnectionError: etcd did not confirm the watch in time.
            EtcdAuthError: etcd refused the watch (the user may not read the key).
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


def _queue_iter(requests: queue.SimpleQueue[Any]) -> Iterator[Any]:
    while True:
        item = requests.get()
        if item is None:
            return
        yield item


class _Watcher:
    """One watch stream per client, multiplexing every watch; one thread reads it.

    etcd answers create requests of one stream in order, so the watch a ``created``
    response belongs to is the oldest create still pending on that stream.
    """

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._cond = threading.Condition()
        self._watches: set[_WatchState] = set()
        self._by_id: dict[int, _WatchState] = {}
        self._pending: deque[_WatchState] = deque()
        self._requests: queue.SimpleQueue[Any] | None = None
        self._call: Any = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self.endpoint: str | None = None
        # Endpoints that failed since the stream last got an answer, and the last failure
        # (endpoint, status code, details): what a watch not confirmed in time reports.
        self._tried: list[str] = []
        self._last_failure: tuple[str, Any, str] | None = None

    def add(self, state: _WatchState) -> None:
        with self._cond:
            if self._closed:
                raise EtcdConnectionError("the etcd client is closed; create a new one")
            self._watches.add(state)
            if self._requests is not None:
                self._send_create(state, self._requests)
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="etcd-watch", daemon=True)
                thread.start()
                # Recorded only once started: close() must never join an unstarted thread
                # (a KeyboardInterrupt can land inside start()).
                self._thread = thread
            self._cond.notify_all()

    def retry_budget(self) -> float:
        return self._client.config.retry_budget

    def unconfirmed(self, state: _WatchState, waited: float) -> EtcdConnectionError:
        """The error for a watch etcd did not confirm within ``waited`` seconds."""
        with self._cond:
            tried, failure = list(self._tried), self._last_failure
        what = f"watch on key {state.key!r}"
        if failure is None:
            return EtcdConnectionError(f"etcd did not confirm the {what} within {waited:g} s")
        return unreachable(what, waited, tried, *failure)

    def cancel(self, state: _WatchState) -> None:
        with state.lock:
            state.cancelled = True
        with self._cond:
            self._watches.discard(state)
            if state.server_id is not None:
                self._by_id.pop(state.server_id, None)
                self._send_cancel(state.server_id)
                state.server_id = None

    def _send_create(self, state: _WatchState, requests: queue.SimpleQueue[Any]) -> None:
        create = etcdrpc.WatchCreateRequest(
            key=state.key,
            range_end=state.range_end,
            start_revision=state.next_rev,
            prev_kv=state.prev_kv,
        )
        requests.put(etcdrpc.WatchRequest(create_request=create))
        self._pending.append(state)

    def _send_cancel(self, server_id: int) -> None:
        if self._requests is not None:
            cancel = etcdrpc.WatchCancelRequest(watch_id=server_id)
            self._requests.put(etcdrpc.WatchRequest(cancel_request=cancel))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            call, thread = self._call, self._thread
            for state in self._watches:
                if not state.created.is_set():
                    state.error = EtcdConnectionError("the etcd client was closed")
                    state.created.set()
            self._cond.notify_all()
        if call is not None:
            call.cancel()
        if (
            thread is not None
            and thread.ident is not None
            and thread is not threading.current_thread()
        ):
            thread.join()

    def _run(self) -> None:
        client = self._client
        failures = 0
        while True:
            with self._cond:
                while not self._closed and not self._watches:
                    self._cond.wait()
                if self._closed:
                    return
            index = client._ring.current()
            metadata: Metadata = None
            kind = RETRY
            requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
            try:
                metadata = client._metadata()
                call = client._channels.stubs(index).watch.Watch(
                    _queue_iter(requests), metadata=_stream_metadata(metadata)
                )
                with self._cond:
                    if self._closed:
                        call.cancel()
                    self._call, self._requests = call, requests
                    for state in self._watches:
                        self._send_create(state, requests)
                for response in call:
                    failures = 0
                    self.endpoint = client.config.endpoints[index]
                    if self._last_failure is not None:
                        with self._cond:
                            self._tried, self._last_failure = [], None
                    self._handle(response, metadata)
            except grpc.RpcError as exc:
                code, details = _status(exc)
                kind = classify_status(code, details)
                name = client.config.endpoints[index]
                with self._cond:
                    if name not in self._tried:
                        self._tried.append(name)
                    self._last_failure = (name, code, details)
                if not self._closed:
                    log.info("etcd watch stream to %s broke: %s", self.endpoint, details)
            except EtcdAuthError as exc:
                # The credentials are refused: no retry can help these watches.
                self._fail_all(exc)
            except (EtcdConnectionError, ValueError) as exc:
                log.warning("etcd watch stream cannot connect: %s", exc)
            finally:
                requests.put(None)
                with self._cond:
                    self._call = self._requests = self.endpoint = None
                    self._pending.clear()
                    self._by_id.clear()
                    for state in self._watches:
                        state.server_id = None
            if self._closed:
                return  # closed on purpose: not an endpoint failure
            if kind == REAUTH:
                client._invalidate_token(metadata)
            elif kind == RETRY:
                client._ring.failed(index)
            failures += 1
            if failures % len(client.config.endpoints) == 0:
                client._sleep(
                    backoff_delay(
                        failures // len(client.config.endpoints) - 1, client._rng.random()
                    )
                )

    def _fail_all(self, error: Exception) -> None:
        with self._cond:
            states = list(self._watches)
            self._watches.clear()
        for state in states:
            state.error = error
            state.created.set()
            self._deliver(state, functools.partial(_report, state, error))

    def _handle(self, rs: Any, metadata: Metadata) -> None:
        with self._cond:
            if rs.created:
                state = self._pending.popleft() if self._pending else None
                if state is None:
                    return
                if not (rs.canceled or rs.compact_revision or rs.watch_id < 0):
                    if state.cancelled or state not in self._watches:
                        self._send_cancel(rs.watch_id)
                        return
                    state.server_id = rs.watch_id
                    self._by_id[rs.watch_id] = state
                    if state.next_rev == 0:
                        state.next_rev = int(rs.header.revision) + 1
                    if not state.created.is_set():
                        state.created_revision = int(rs.header.revision)
                        state.created.set()
                    if not rs.events:
                        return
            else:
                state = self._by_id.get(rs.watch_id)
                if state is None:
                    return
            if rs.compact_revision or rs.canceled:
                self._watches.discard(state)
                self._by_id.pop(rs.watch_id, None)
                state.server_id = None
                retry = (
                    not rs.compact_revision
                    and metadata is not None
                    and not state.auth_retried
                    and classify_status(None, rs.cancel_reason) in (PERMISSION, REAUTH)
                )
                if retry:
                    # etcd reports an expired token on a watch as "permission denied":
                    # authenticate again and recreate every watch on a new stream.
                    state.auth_retried = True
                    self._watches.add(state)
                    self._client._invalidate_token(metadata)
                    if self._call is not None:
                        self._call.cancel()
                    return
        if rs.compact_revision:
            state.created.set()
            self._deliver(state, lambda: state.on_compacted(int(rs.compact_revision)))
        elif rs.canceled:
            error = _watch_error(self._client.config, state, rs.cancel_reason)
            state.error = error
            state.created.set()
            self._deliver(state, lambda: _report(state, error))
        elif rs.events:
            events = [_event(ev) for ev in rs.events]
            state.next_rev = events[-1].kv.mod_revision + 1
            self._deliver(state, lambda: state.on_events(events, int(rs.header.revision)))

    @staticmethod
    def _deliver(state: _WatchState, callback: Callable[[], None]) -> None:
        with state.lock:
            if state.cancelled:
                return
            try:
                callback()
            except Exception:
                log.exception("etcd watch callback for key %r failed", state.key)


def _watch_error(config: EtcdConfig, state: _WatchState, reason: str) -> Exception:
    if classify_status(None, reason) in (PERMISSION, REAUTH, AUTH_REQUIRED):
        return EtcdAuthError(
            f"etcd user {config.user!r} may not watch key {state.key!r} ({reason}); "
            "grant the user's role read on the key prefix"
        )
    return EtcdConnectionError(f"etcd cancelled the watch on key {state.key!r}: {reason}")


def _report(state: _WatchState, error: Exception) -> None:
    if state.on_error is not None:
        state.on_error(error)
    else:
        log.error("%s", error)
