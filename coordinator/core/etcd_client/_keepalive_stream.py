"""The keep-alive thread: every lease of a client on one long-lived gRPC stream.

As etcd's Go client does: one ``LeaseKeepAlive`` stream per client, whatever the number
of leases, so a process that holds many leases (a benchmark simulating a thousand nodes,
a host running several agents on one client) costs one stream and one thread, not one
each per lease. What one lease sees is :class:`KeepAlive`; the pacing is ``_schedule``;
the rules about silence are ``_liveness``.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc

from coordinator.core.errors import EtcdConnectionError
from coordinator.core.etcd_client._connection import Metadata, StreamEnd, _stream_metadata
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
from coordinator.core.etcd_client._keepalive import KeepAlive
from coordinator.core.etcd_client._observer import NO_ANSWER, STREAM_ENDED
from coordinator.core.etcd_client._schedule import OnStream, Step, leases_text
from coordinator.core.threads import ThreadDied, start_guarded

if TYPE_CHECKING:
    from coordinator.core.etcd_client._client import EtcdClient

__all__ = ["_KeepAliveStream"]

log = logging.getLogger("coordinator.core.etcd_client")  # one logger for the whole package


class _KeepAliveStream:
    """Every keep-alive of one client on one stream, read by one guarded thread.

    The thread runs while the client has leases; with none, the stream is closed and the
    thread waits. A stream failure (a broken stream, a member left as hung, a refused
    token) moves every lease on it to the next endpoint together. Lock order: a lease's
    ``_busy`` (held while the thread acts for it, callbacks included), this stream's
    ``_cond``, a lease's leaf ``_lock``; no RPC under any.
    """

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._cond = threading.Condition()
        # Every KeepAlive by a number of its own: two owners may keep one lease alive
        # (each agent simulated in a process keeps its run's lease), each with its own.
        self._leases: dict[int, KeepAlive] = {}
        self._slots = itertools.count(1)
        self._open: OnStream | None = None
        self._pending: Any = None  # the call or probe now in flight (close() cancels it)
        self._thread: threading.Thread | None = None
        self._closed = False
        # "lease not found" ended a stream of several leases: etcd did not say which, so
        # the next stream asks about each one before it opens.
        self._probe_all = False
        self._quiet = False  # a failure was logged since the last answer: the rest at debug

    # -- what KeepAlive and EtcdClient call -----------------------------------------------

    def add(self, keepalive: KeepAlive) -> None:
        """Keep ``keepalive``'s lease alive too: on the open stream at once, if any."""
        with self._cond:
            if self._closed:
                raise EtcdConnectionError("the etcd client is closed; create a new one")
            keepalive._slot = next(self._slots)
            self._leases[keepalive._slot] = keepalive
            if self._open is not None and not self._open.done:
                self._join(self._open, keepalive, self._client._clock())
            if self._thread is None:
                self._thread = start_guarded(self._name(), self._run, self._died)
            self._thread.name = self._name()
            self._cond.notify_all()

    def remove(self, keepalive: KeepAlive) -> None:
        """Stop keeping ``keepalive``'s lease alive; the stream ends if it was the last."""
        with self._cond:
            self._drop(keepalive)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            pending, thread = self._pending, self._thread
            if self._open is not None:
                self._open.done = True
            self._cond.notify_all()
        if pending is not None:
            pending.cancel()
        if (
            thread is not None
            and thread.ident is not None
            and thread is not threading.current_thread()
        ):
            thread.join()

    # -- bookkeeping (under self._cond) ---------------------------------------------------

    def _name(self) -> str:
        ids = {ka.lease_id for ka in self._leases.values()}
        return f"etcd-keepalive-{leases_text(ids, ',')}".rstrip("-")

    def _drop(self, keepalive: KeepAlive) -> None:
        if self._leases.get(keepalive._slot) is not keepalive:
            return
        del self._leases[keepalive._slot]
        if self._thread is not None:
            self._thread.name = self._name()
        op = self._open
        if op is not None:
            op.leave(keepalive._slot)
            if not self._leases and not op.done:
                # Nothing left to keep alive: end the stream (not a failure of the member).
                op.done = op.emptied = True
                if op.call is not None:
                    op.call.cancel()
        self._cond.notify_all()

    @staticmethod
    def _join(op: OnStream, keepalive: KeepAlive, now: float) -> None:
        op.join(keepalive._slot, keepalive._joined(), keepalive.interval, keepalive._due(now))

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        client = self._client
        endpoints = len(client.config.endpoints)
        failures = 0
        while self._wait_for_leases():
            index = client._ring.current()
            attempt = self._attempt(index)
            if self._closed:
                return  # closed on purpose: not an endpoint failure
            if not attempt.kind:
                continue  # no lease left on it (closed or lost): not a failure either
            if attempt.answered:
                failures = 0
            if attempt.kind == REAUTH:
                client._invalidate_token(attempt.metadata)
            else:
                client._ring.failed(index)
            failures += 1
            self._check_all()
            if failures % endpoints == 0:
                # Every member failed in a row: back off (≤ about 1 s), waking in time to
                # report UNREACHABLE when a lease's guarantee runs out.
                self._back_off(backoff_delay(failures // endpoints - 1, client._rng.random()))

    def _wait_for_leases(self) -> bool:
        """Block while there is no lease to keep alive; False once the client is closed."""
        with self._cond:
            while not self._closed and not self._leases:
                self._cond.wait()
            return not self._closed

    def _back_off(self, delay: float) -> None:
        clock = self._client._clock
        end = clock() + delay
        while (now := clock()) < end:
            with self._cond:
                if self._closed:
                    return
                wake = [ka.alive_until for ka in self._leases.values() if ka.alive_until > now]
                self._cond.wait(min([*wake, end]) - now)
            self._check_all()

    def _check_all(self) -> None:
        with self._cond:
            leases = list(self._leases.values())
        for keepalive in leases:
            with keepalive._busy:
                if not keepalive._stop.is_set():
                    keepalive._check()

    def _attempt(self, index: int) -> StreamEnd:
        """Probe, then open one stream on endpoint ``index`` and read it until it ends."""
        client = self._client
        op = OnStream(index, client.config.endpoints[index])
        metadata: Metadata = None
        answered = False
        try:
            with self._cond:
                intervals = [ka.interval for ka in self._leases.values()] or [1.0]
            # Authenticating (with its own failover) is bounded like one interval's wait.
            metadata = client._metadata(min(intervals))
            if not self._probe(op, metadata):
                return StreamEnd("", metadata, True)
            with self._cond:
                if self._closed or not self._leases:
                    return StreamEnd("", metadata, True)
                now = client._clock()
                for keepalive in self._leases.values():
                    self._join(op, keepalive, now)
                self._open = op
            call = client._channels.stubs(index).lease.LeaseKeepAlive(
                self._requests(op), metadata=_stream_metadata(metadata)
            )
            with self._cond:
                op.call = self._pending = call
                if self._closed or op.done:
                    call.cancel()
            for rsp in call:
                answered = True
                self._answer(op, rsp)
            if op.emptied or self._closed:
                return StreamEnd("", metadata, answered)
            self._broke(op.name, "the member ended the stream")
            client._observed.attempt_failed("lease_keepalive", STREAM_ENDED)
            return StreamEnd(RETRY, metadata, answered)
        except grpc.RpcError as exc:
            if op.emptied or self._closed:
                return StreamEnd("", metadata, answered)
            return self._stream_failed(op, exc, metadata, answered)
        except grpc.FutureCancelledError:
            return StreamEnd("", metadata, answered)  # close() cancelled the probe
        except (EtcdConnectionError, ValueError) as exc:
            self._broke(op.name, str(exc))
            return StreamEnd(RETRY, metadata, answered)
        finally:
            with self._cond:
                op.done = True
                self._open = self._pending = None
                self._cond.notify_all()
                leases = list(self._leases.values())
            if op.call is not None:
                op.call.cancel()  # a no-op once it ended; frees it if this thread is dying
            for keepalive in leases:
                keepalive.endpoint = None
                keepalive._probe_next = True

    def _stream_failed(
        self, op: OnStream, exc: grpc.RpcError, metadata: Metadata, answered: bool
    ) -> StreamEnd:
        client = self._client
        code, details = _status(exc)
        kind = RETRY if op.hung else classify_status(code, details)
        client._observed.attempt_failed(
            "lease_keepalive", NO_ANSWER if op.hung else _code_name(code)
        )
        if kind != RETRY:
            client._answered_by(op.index)  # an error status, from etcd
        if kind == NOT_FOUND and "lease not found" in details.lower():
            with self._cond:
                on_it = [self._leases[i] for i in op.numbers if i in self._leases]
                self._probe_all = len(on_it) != 1
            if len(on_it) == 1:  # then it is about that lease
                with on_it[0]._busy:
                    on_it[0]._not_found(details)
                self.remove(on_it[0])
        with self._cond:
            if not self._leases:
                return StreamEnd("", metadata, answered)  # its only lease is gone
        self._broke(op.name, op.hung or f"{_code_name(code)}: {details}")
        return StreamEnd(kind, metadata, answered)

    def _probe(self, op: OnStream, metadata: Metadata) -> bool:
        """Ask etcd about the most urgent lease that needs it (every lease after an
        unattributed "lease not found"); False once no lease is left to keep alive."""
        with self._cond:
            leases = list(self._leases.values())
            every = self._probe_all
        if every:
            targets = leases
        else:
            waiting = [ka for ka in leases if ka._probe_next]
            targets = [min(waiting, key=lambda ka: ka.alive_until)] if waiting else []
        for keepalive in targets:
            self._probe_one(op, keepalive, metadata)
        with self._cond:
            self._probe_all = self._probe_all and not every
            return bool(self._leases)

    def _probe_one(self, op: OnStream, keepalive: KeepAlive, metadata: Metadata) -> None:
        client = self._client
        request = etcdrpc.LeaseTimeToLiveRequest(ID=keepalive.lease_id)
        sent_at = client._clock()
        future = client._channels.stubs(op.index).lease.LeaseTimeToLive.future(
            request, timeout=keepalive.interval, metadata=_stream_metadata(metadata)
        )
        with self._cond:
            self._pending = future  # close() cancels it like a stream
            if self._closed:
                future.cancel()
        rsp = future.result()
        now = client._answered_by(op.index)
        with keepalive._busy:
            if keepalive._stop.is_set():
                return
            keepalive.endpoint = op.name
            alive = keepalive._probed(now, sent_at, int(rsp.TTL))
        with self._cond:
            self._quiet = False
            if not alive:
                self._drop(keepalive)

    def _requests(self, op: OnStream) -> Iterator[Any]:
        """The requests of one stream, each lease's when its schedule says; runs on gRPC's
        request thread of the call. A lease whose member is hung cancels the stream."""
        client = self._client
        while True:
            sends: list[int] = []
            with self._cond:
                if op.done:
                    return
                now = client._clock()
                for slot, step in op.schedule.due(now):
                    keepalive = self._leases.get(slot)
                    if keepalive is None:
                        continue
                    if step is Step.SEND:
                        keepalive._sent(op.numbers[slot], now)
                        op.schedule.sent(slot, now)
                        op.sent(keepalive.lease_id, slot)
                        sends.append(keepalive.lease_id)
                    elif keepalive._hung(now, client.last_heard(op.index)):
                        # This member answered nothing since the keep-alive went out (or
                        # the lease runs out of guarantee): every lease tries the next.
                        op.done = True
                        op.hung = f"no answer within {keepalive.interval:.1f} s"
                        break
                    else:
                        op.schedule.not_hung(slot, now)
                if not sends and not op.done:
                    next_at = op.schedule.next_at()
                    self._cond.wait(None if next_at is None else max(0.0, next_at - now))
                    continue
            if op.done:
                if op.call is not None:
                    op.call.cancel()
                return
            for lease_id in sends:
                yield etcdrpc.LeaseKeepAliveRequest(ID=lease_id)

    def _answer(self, op: OnStream, rsp: Any) -> None:
        """One keep-alive answer of the stream: to its lease, and its next keep-alive."""
        with self._cond:
            slot = op.answered(rsp.ID)
            keepalive = None if slot is None else self._leases.get(slot)
            self._quiet = False
        if keepalive is None:
            self._client._answered_by(op.index)  # for a lease closed meanwhile
            return
        with keepalive._busy:
            if keepalive._stop.is_set():
                return
            keepalive.endpoint = op.name
            alive = keepalive._on_answer(op.index, rsp)
        with self._cond:
            if not alive:
                self._drop(keepalive)
            else:
                op.schedule.answered(keepalive._slot, self._client._clock(), keepalive.interval)
                self._cond.notify_all()

    def _broke(self, endpoint: str, error: str) -> None:
        """An attempt on ``endpoint`` failed: every lease notes it; one line for all."""
        with self._cond:
            leases = list(self._leases.values())
            quiet, self._quiet = self._quiet, True
        if not leases or self._closed:
            return
        for keepalive in leases:
            keepalive._failed(endpoint, error)
        which = leases_text(ka.lease_id for ka in leases)
        # The first failure after an answer at info, the rest of an outage at debug: the
        # outage itself is reported once per lease, as UNREACHABLE.
        (log.debug if quiet else log.info)(
            "keep-alive of lease%s %s on %s: %s; trying the next member",
            "s" if len(leases) > 1 else "", which, endpoint, error,
        )  # fmt: skip

    def _died(self, died: ThreadDied) -> None:
        """The thread died of an unexpected exception: nobody renews the leases on it any
        more. Each turns FAILED, the client's death listeners hear of it (once, naming the
        thread after its leases), and the next lease starts a new thread."""
        with self._cond:
            leases = list(self._leases.values())
            self._leases.clear()
            self._thread = None
        name = threading.current_thread().name
        cause = died.__cause__ or died
        changes = []
        for keepalive in leases:
            with keepalive._busy:
                changes.append((keepalive, keepalive._thread_died(cause)))
        self._client._thread_died(died if died.name == name else ThreadDied(name, cause))
        for keepalive, change in changes:
            with keepalive._busy:
                keepalive._report(change)
