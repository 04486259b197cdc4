"""The watch thread: every watch of a client on one multiplexed, resumable gRPC stream."""

from __future__ import annotations

import functools
import queue
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

import grpc

from coordinator.core.errors import EtcdAuthError, EtcdConnectionError, EtcdTLSError
from coordinator.core.etcd_client._connection import Metadata, StreamEnd, _stream_metadata
from coordinator.core.etcd_client._etcdrpc import etcdrpc
from coordinator.core.etcd_client._failover import (
    PERMISSION,
    REAUTH,
    RETRY,
    _code_name,
    _status,
    backoff_delay,
    classify_status,
)
from coordinator.core.etcd_client._observer import NO_ANSWER, STREAM_ENDED
from coordinator.core.etcd_client._watch import _event, _watch_error, _WatchState
from coordinator.core.etcd_client._watch_outage import StreamOutage
from coordinator.core.etcd_client._watch_probe import Prober
from coordinator.core.threads import ThreadDied, start_guarded

if TYPE_CHECKING:
    from coordinator.core.etcd_client._client import EtcdClient

__all__ = ["_Watcher"]


class _Watcher:
    """One watch stream per client, multiplexing every watch; one guarded thread reads it.

    etcd answers create requests of one stream in order, so the watch a ``created``
    response belongs to is the oldest create still pending on that stream. The stream is
    reopened on the next member whenever it breaks, for as long as any watch is open.
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
        self._outage = StreamOutage(client.config)  # what a watch not confirmed reports
        # Seconds the stream's member had said nothing when the stream left it as hung
        # (set by the request side, read by the thread when the cancelled call ends).
        self._hung_after: float | None = None
        self._prober = Prober(client)  # probes a silent member (_watch_probe)

    # -- what Watch and EtcdClient call ---------------------------------------------------

    def add(self, state: _WatchState) -> None:
        with self._cond:
            if self._closed:
                raise EtcdConnectionError("the etcd client is closed; create a new one")
            self._watches.add(state)
            if self._requests is not None:
                self._send_create(state, self._requests)
            if self._thread is None:
                # Recorded only once started: close() must never join an unstarted thread
                # (a KeyboardInterrupt can land inside start()).
                self._thread = start_guarded("etcd-watch", self._run, self._died)
            self._cond.notify_all()

    def retry_budget(self) -> float:
        return self._client.config.retry_budget

    def unconfirmed(self, state: _WatchState, waited: float) -> EtcdConnectionError:
        """The error for a watch etcd did not confirm within ``waited`` seconds."""
        return self._outage.unconfirmed(state.key_text, waited)

    def cancel(self, state: _WatchState) -> None:
        with state.lock:
            state.cancelled = True
        with self._cond:
            self._forget(state)

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

    # -- the stream's bookkeeping (under self._cond) --------------------------------------

    def _send_create(self, state: _WatchState, requests: queue.SimpleQueue[Any]) -> None:
        create = etcdrpc.WatchCreateRequest(
            key=state.key,
            range_end=state.range_end,
            start_revision=state.next_rev,
            prev_kv=state.prev_kv,
            filters=[etcdrpc.WatchCreateRequest.NOPUT] if state.no_put else [],
        )
        requests.put(etcdrpc.WatchRequest(create_request=create))
        self._pending.append(state)

    def _send_cancel(self, server_id: int) -> None:
        if self._requests is not None:
            cancel = etcdrpc.WatchCancelRequest(watch_id=server_id)
            self._requests.put(etcdrpc.WatchRequest(cancel_request=cancel))

    def _forget(self, state: _WatchState, *, tell_etcd: bool = True) -> None:
        """Drop the watch from this stream; with ``tell_etcd``, cancel it in etcd too
        (not for a watch etcd itself ended: compacted or cancelled)."""
        self._watches.discard(state)
        if state.server_id is not None:
            self._by_id.pop(state.server_id, None)
            if tell_etcd:
                self._send_cancel(state.server_id)
            state.server_id = None

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        client = self._client
        endpoints = len(client.config.endpoints)
        failures = 0
        while self._wait_for_watches():
            index = client._ring.current()
            attempt = self._stream(index)
            if self._closed:
                return  # closed on purpose: not an endpoint failure
            if attempt.answered:
                failures = 0
            if attempt.kind == REAUTH:
                client._invalidate_token(attempt.metadata)
            elif attempt.kind == RETRY:
                client._ring.failed(index)
            failures += 1
            if failures % endpoints == 0:
                client._sleep(backoff_delay(failures // endpoints - 1, client._rng.random()))

    def _wait_for_watches(self) -> bool:
        """Block while there is nothing to watch; False once the client is closed."""
        with self._cond:
            while not self._closed and not self._watches:
                self._cond.wait()
            return not self._closed

    def _stream(self, index: int) -> StreamEnd:
        """Open one stream on endpoint ``index``, (re)create every watch, read it to its end."""
        client = self._client
        name = client.config.endpoints[index]
        requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        metadata: Metadata = None
        answered = False
        call: Any = None
        try:
            metadata = client._metadata()
            sends = self._prober.requests(index, requests, metadata, self._leave_hung)
            call = client._channels.stubs(index).watch.Watch(
                sends, metadata=_stream_metadata(metadata)
            )
            self._opened(call, requests)
            observed = client._observed
            for response in call:
                self._prober.heard(index, response)
                if not answered:
                    answered = True
                    self._answered(name)
                self._handle(response, metadata)
            self._broke(name, "the member ended the stream")
            if not self._closed:
                observed.attempt_failed("watch", STREAM_ENDED)
            return StreamEnd(RETRY, metadata, answered)
        except grpc.RpcError as exc:
            return StreamEnd(self._call_ended(name, exc), metadata, answered)
        except EtcdAuthError as exc:
            # The credentials are refused: no retry can help these watches.
            self._fail_all(exc)
            return StreamEnd(RETRY, metadata, answered)
        except EtcdTLSError as exc:
            # Authenticating (a user is configured) met a TLS mismatch, judged as the
            # stream's own failures are: a watch waiting for confirmation hears it now.
            self._broke(name, str(exc))
            self._end_unconfirmed(exc)
            return StreamEnd(RETRY, metadata, answered)
        except (EtcdConnectionError, ValueError) as exc:
            self._broke(name, f"cannot connect: {exc}")
            return StreamEnd(RETRY, metadata, answered)
        finally:
            requests.put(None)
            if call is not None:
                call.cancel()  # a no-op once it ended; frees it if this thread is dying
            self._closed_stream()

    def _call_ended(self, name: str, exc: grpc.RpcError) -> str:
        """The failure kind of a stream whose call ended with ``exc``: left as hung (no
        answer) or failed with a gRPC status."""
        observed = self._client._observed
        with self._cond:
            hung_after, self._hung_after = self._hung_after, None
        if hung_after is not None and not self._closed:
            observed.attempt_failed("watch", NO_ANSWER)
            self._broke(name, f"no answer for {hung_after:.1f} s, not to a progress request either")
            return RETRY
        code, details = _status(exc)
        if not self._closed:
            observed.attempt_failed("watch", _code_name(code))
        self._failed(name, code, details)
        return classify_status(code, details)

    def _closed_stream(self) -> None:
        """Forget the stream that ended: no call, no pending create, no server ids."""
        with self._cond:
            self._call = self._requests = self.endpoint = None
            self._pending.clear()
            self._by_id.clear()
            for state in self._watches:
                state.server_id = None

    def _leave_hung(self, requests: queue.SimpleQueue[Any], silent_for: float) -> bool:
        """Cancel the call of the stream fed by ``requests``: its member is hung. False if
        that call is not (or no longer) the open one."""
        with self._cond:
            call = self._call
            if call is None or self._requests is not requests or self._closed:
                return False
            self._hung_after = silent_for
        call.cancel()
        return True

    def _opened(self, call: Any, requests: queue.SimpleQueue[Any]) -> None:
        with self._cond:
            if self._closed:
                call.cancel()
            self._call, self._requests = call, requests
            for state in self._watches:
                self._send_create(state, requests)

    def _answered(self, name: str) -> None:
        with self._cond:
            self.endpoint = name
        self._outage.answered(name)

    def _failed(self, name: str, code: Any, details: str) -> None:
        refused = self._outage.failed(name, code, details)
        self._broke(name, f"{_code_name(code)}: {details}")
        if refused is not None:
            # Every member refuses the handshake for a reason a retry cannot fix: a watch
            # still waiting for etcd's confirmation hears it now, not after its budget.
            # Watches already running keep retrying (a member may get its certificate
            # fixed under a running job).
            self._end_unconfirmed(refused)

    def _end_unconfirmed(self, error: Exception) -> None:
        """End every watch still waiting for etcd's confirmation with ``error``."""
        with self._cond:
            waiting = [state for state in self._watches if not state.created.is_set()]
            for state in waiting:
                self._forget(state, tell_etcd=False)
        for state in waiting:
            state.end(error)

    def _broke(self, name: str, why: str) -> None:
        if not self._closed:  # closed on purpose: nothing broke
            self._outage.broke(name, why)

    # -- one response ---------------------------------------------------------------------

    def _handle(self, rs: Any, metadata: Metadata) -> None:
        """Route one response of the stream to its watch."""
        with self._cond:
            state = self._created(rs) if rs.created else self._by_id.get(rs.watch_id)
            if state is None:
                return
            if rs.compact_revision or rs.canceled:
                self._forget(state, tell_etcd=False)
                if self._retry_after_reauth(state, rs, metadata):
                    return
            elif not rs.events:
                return
        self._dispatch(state, rs)

    def _created(self, rs: Any) -> _WatchState | None:
        """The watch a ``created`` response is for; registered unless etcd refused it."""
        state = self._pending.popleft() if self._pending else None
        if state is None or rs.canceled or rs.compact_revision or rs.watch_id < 0:
            return state  # refused at creation: ended by the caller
        if state.cancelled or state not in self._watches:
            self._send_cancel(rs.watch_id)  # cancelled while etcd was creating it
            return None
        state.server_id = rs.watch_id
        self._by_id[rs.watch_id] = state
        if state.next_rev == 0:
            state.next_rev = int(rs.header.revision) + 1
        if not state.created.is_set():
            state.created_revision = int(rs.header.revision)
            state.created.set()
        return state

    def _retry_after_reauth(self, state: _WatchState, rs: Any, metadata: Metadata) -> bool:
        """etcd reports an expired token on a watch as "permission denied": authenticate
        again and recreate every watch on a new stream (once per watch)."""
        retry = (
            not rs.compact_revision
            and metadata is not None
            and not state.auth_retried
            and classify_status(None, rs.cancel_reason) in (PERMISSION, REAUTH)
        )
        if retry:
            state.auth_retried = True
            self._watches.add(state)
            self._client._invalidate_token(metadata)
            if self._call is not None:
                self._call.cancel()
        return retry

    def _dispatch(self, state: _WatchState, rs: Any) -> None:
        """Run the watch's callback for one response (outside the stream's lock)."""
        if rs.compact_revision:
            compacted = functools.partial(state.on_compacted, int(rs.compact_revision))
            failed = state.run("on_compacted", compacted)
            if failed is None:
                state.finish()
            else:
                state.end(failed)
        elif rs.canceled:
            state.end(_watch_error(self._client.config, state, rs.cancel_reason))
        else:
            events = [_event(ev) for ev in rs.events]
            state.next_rev = events[-1].kv.mod_revision + 1
            delivered = functools.partial(state.on_events, events, int(rs.header.revision))
            failed = state.run("on_events", delivered)
            if failed is not None:
                with self._cond:
                    self._forget(state)
                state.end(failed)

    # -- endings --------------------------------------------------------------------------

    def _fail_all(self, error: Exception) -> None:
        with self._cond:
            states = list(self._watches)
            self._watches.clear()
        for state in states:
            state.end(error)

    def _died(self, died: ThreadDied) -> None:
        """The thread died of an unexpected exception: every open watch ends with an
        error saying so, the client's death listeners hear of it, and the next watch
        starts a new thread."""
        with self._cond:
            states = list(self._watches)
            self._watches.clear()
            self._thread = None
        for state in states:
            error = EtcdConnectionError(
                f"no more events for the etcd watch on key {state.key_text}: the client's "
                f"watch thread died ({died.__cause__!r}); watch again (a new thread serves it)"
            )
            error.__cause__ = died
            state.end(error)
        self._client._thread_died(died)
