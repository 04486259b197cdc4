"""KeepAlive: one long-lived keep-alive stream per lease, on its own thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from etcd3 import etcdrpc

from coordinator.core.errors import EtcdConnectionError
from coordinator.core.etcd_client._connection import Metadata, _stream_metadata
from coordinator.core.etcd_client._failover import (
    REAUTH,
    RETRY,
    _status,
    backoff_delay,
    classify_status,
)

if TYPE_CHECKING:
    from coordinator.core.etcd_client._client import EtcdClient

__all__ = ["KeepAlive"]

log = logging.getLogger("coordinator.core.etcd_client")  # one logger for the whole package


# -- lease keep-alive --------------------------------------------------------------------------


class KeepAlive:
    """One long-lived keep-alive stream for one lease.

    Sends a keep-alive about every ``ttl / 3`` and reads the answers. The lease counts as
    lost when etcd answers TTL 0 (expired or revoked) or when no keep-alive succeeded for
    ``ttl`` seconds (etcd may have expired it meanwhile: assume it did). A broken stream is
    reopened on the next endpoint within that time. Safety: once :meth:`lost` is true, the
    keys on the lease must be assumed gone.
    """

    lease_id: int
    ttl: int

    def __init__(
        self, client: EtcdClient, lease_id: int, ttl: int, on_lost: Callable[[], None] | None
    ) -> None:
        self.lease_id = lease_id
        self.ttl = ttl
        self._client = client
        self._on_lost = on_lost
        self._interval = max(ttl / 3.0, 0.1)
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._last_ok = client._clock()
        # Where the stream last got an answer (None while reconnecting), for diagnostics.
        self.endpoint: str | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-keepalive-{lease_id:x}", daemon=True
        )

    def _start(self) -> None:
        self._thread.start()

    def lost(self) -> bool:
        """Whether the lease is lost (expired, revoked, or not renewed within its TTL)."""
        return self._lost.is_set()

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until the lease is lost or ``timeout`` passes; return :meth:`lost`."""
        return self._lost.wait(timeout)

    def close(self, revoke: bool = True) -> None:
        """Stop the stream and, with ``revoke``, revoke the lease (best effort, bounded)."""
        first = not self._stop.is_set()
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if threading.current_thread() is not self._thread and self._thread.ident is not None:
            self._thread.join()
        self._client._forget(self)
        if first and revoke and not self._lost.is_set() and not self._client._closed.is_set():
            try:
                self._client.lease_revoke(self.lease_id, budget=self._client.config.request_timeout)
            except EtcdConnectionError as exc:
                log.warning("could not revoke lease %x (it expires by TTL): %s", self.lease_id, exc)

    def _declare_lost(self, reason: str) -> None:
        if self._stop.is_set() or self._lost.is_set():
            return
        log.warning("etcd lease %x lost: %s", self.lease_id, reason)
        self._lost.set()
        if self._on_lost is not None:
            try:
                self._on_lost()
            except Exception:
                log.exception("on_lost callback of lease %x failed", self.lease_id)

    def _requests(self, done: threading.Event, pending: list[float]) -> Iterator[Any]:
        """Requests of one stream; runs on gRPC's feeding thread. Cancels a stale stream."""
        clock = self._client._clock
        while not done.is_set():
            with self._lock:
                pending.append(clock())
            yield etcdrpc.LeaseKeepAliveRequest(ID=self.lease_id)
            if done.wait(self._interval):
                return
            with self._lock:
                stale = bool(pending)
                call = self._call
            if stale and call is not None:
                # No answer within an interval: this member is hung; try the next one.
                done.set()
                call.cancel()
                return

    def _run(self) -> None:
        client = self._client
        clock = client._clock
        failures = 0
        while not self._stop.is_set():
            if clock() - self._last_ok >= self.ttl:
                self._declare_lost(f"no keep-alive succeeded for {self.ttl} s")
                return
            index = client._ring.current()
            done = threading.Event()
            pending: list[float] = []
            metadata: Metadata = None
            try:
                # Re-authenticating must not outlast the lease's own deadline.
                metadata = client._metadata(max(0.1, self.ttl - (clock() - self._last_ok)))
                call = client._channels.stubs(index).lease.LeaseKeepAlive(
                    self._requests(done, pending), metadata=_stream_metadata(metadata)
                )
                with self._lock:
                    self._call = call
                if self._stop.is_set():
                    call.cancel()
                for rsp in call:
                    self.endpoint = client.config.endpoints[index]
                    if rsp.TTL <= 0:
                        self._declare_lost("etcd says it expired or was revoked")
                        return
                    with self._lock:
                        pending.clear()
                    self._last_ok = clock()
                    failures = 0
                raise_kind = RETRY  # the server ended the stream: reconnect elsewhere
            except grpc.RpcError as exc:
                code, details = _status(exc)
                raise_kind = RETRY if done.is_set() else classify_status(code, details)
                if not self._stop.is_set():
                    log.info("keep-alive stream of lease %x broke: %s", self.lease_id, details)
            except (EtcdConnectionError, ValueError) as exc:
                raise_kind = RETRY
                log.info("keep-alive of lease %x cannot connect: %s", self.lease_id, exc)
            finally:
                done.set()
                with self._lock:
                    self._call = None
                self.endpoint = None
            if self._stop.is_set():
                return  # closed on purpose: not an endpoint failure
            if raise_kind == REAUTH:
                client._invalidate_token(metadata)
            else:
                client._ring.failed(index)
            failures += 1
            if failures % len(client.config.endpoints) == 0:
                left = self.ttl - (clock() - self._last_ok)
                delay = backoff_delay(
                    failures // len(client.config.endpoints) - 1, client._rng.random()
                )
                self._stop.wait(max(0.0, min(delay, left)))
