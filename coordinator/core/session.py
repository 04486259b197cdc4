"""A node's liveness in etcd: one lease, kept alive by one stream, revoked on close.

As etcd's ``concurrency.Session``: the session owns the lease; every key the node writes
alone hangs on it, so when the node dies, freezes or is cut off for longer than the TTL,
etcd deletes its keys and every watcher hears of it.

Safety: once :meth:`Session.lost` is true, the node must assume its keys are gone and any
rank it held may belong to someone else; it gets a new session to rejoin.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from coordinator.core.etcd_client import EtcdClient, KeepAlive

__all__ = ["Session"]

log = logging.getLogger(__name__)


class Session:
    """One lease with a live keep-alive stream.

    Args:
        client: the etcd client.
        ttl: lease time-to-live in seconds (keep-alives go out about every ttl/3).
        on_lost: called once, from a background thread, when the lease is lost.
    """

    def __init__(
        self, client: EtcdClient, ttl: int, on_lost: Callable[[], None] | None = None
    ) -> None:
        self._client = client
        self.ttl = ttl
        self._on_lost = on_lost
        self._closed = threading.Event()
        self.lease_id = client.lease_grant(ttl)
        self._keepalive: KeepAlive = client.keep_alive(self.lease_id, ttl, self._lost_cb)

    def _lost_cb(self) -> None:
        if self._closed.is_set():
            return  # our own close revoked it: not a loss
        log.warning("lease %x lost (ttl %d s): this node's keys are gone", self.lease_id, self.ttl)
        if self._on_lost is not None:
            self._on_lost()

    def lost(self) -> bool:
        """Whether etcd has (or must be assumed to have) expired the lease."""
        return self._keepalive.lost()

    def close(self, revoke: bool = True) -> None:
        """Stop the keep-alive and (by default) revoke the lease, deleting its keys now."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._keepalive.close(revoke=revoke)
