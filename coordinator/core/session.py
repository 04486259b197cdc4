"""A node's liveness in etcd: one lease, kept alive by one stream, revoked on close.

As etcd's ``concurrency.Session``: the session owns the lease; every key the node writes
alone hangs on it, so when the node dies, freezes or is cut off for longer than the TTL,
etcd deletes its keys and every watcher hears of it.

The lease is lost only when etcd says so (DESIGN §4): while no etcd member answers, the
session is UNREACHABLE, not lost, for as long as the outage lasts; etcd keeps leases
across a restart and a new leader extends them all, so a node whose etcd comes back keeps
its lease and keys. What each :class:`LeaseState` means for safety:

* ALIVE: the lease and the node's keys exist (at least until ``alive_until``);
* UNREACHABLE: unknown either way. Workers may keep training; do nothing that needs the
  lease (no rendezvous writes) until etcd answers: then ALIVE again, or LOST;
* LOST (etcd said so) or FAILED (the keep-alive thread died): :meth:`Session.lost` is
  true; the node must assume its keys are gone and any rank it held may belong to someone
  else; it gets a new session to rejoin;
* CLOSED: :meth:`Session.close` was called.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from coordinator.core.etcd_client import (
    EtcdClient,
    KeepAlive,
    LeaseState,
    OnReachable,
    OnUnreachable,
)

__all__ = ["Session"]

log = logging.getLogger(__name__)


class Session:
    """One lease with a live keep-alive stream.

    Args:
        client: the etcd client.
        ttl: lease time-to-live in seconds (keep-alives go out about every ttl/3).
        on_lost: called once, from a background thread, when the lease is lost (LOST or
            FAILED; not after :meth:`close`).
        on_unreachable: called once per outage, from a background thread, when no etcd
            member answered since the lease's guarantee ran out, with the
            :class:`~coordinator.core.etcd_client.Outage` (its ``message(now)`` is the
            line to log: it names the endpoints). Default: that line is logged as a
            warning.
        on_reachable: called once when etcd answers again after such an outage, with the
            seconds of silence. Default: an info line.

    Callbacks must not block. Raises what :meth:`EtcdClient.lease_grant` raises.
    """

    def __init__(
        self,
        client: EtcdClient,
        ttl: int,
        on_lost: Callable[[], None] | None = None,
        *,
        on_unreachable: OnUnreachable | None = None,
        on_reachable: OnReachable | None = None,
    ) -> None:
        self._client = client
        self.ttl = ttl
        self._on_lost = on_lost
        self._closed = threading.Event()
        # Read before the grant is sent: the lease surely lives ttl from then.
        granted_at = client.clock()
        # The revision etcd was at when it granted the lease (0: not known): where this
        # node's turn key places it among the run's nodes (RunKeys.turn).
        self.lease_id, self.granted_revision = client.lease_grant_at(ttl)
        self._keepalive: KeepAlive = client.keep_alive(
            self.lease_id, ttl, self._lost_cb,
            on_unreachable=on_unreachable, on_reachable=on_reachable, granted_at=granted_at,
        )  # fmt: skip

    def _lost_cb(self) -> None:
        if self._closed.is_set():
            return  # our own close revoked it: not a loss
        if self._on_lost is not None:
            self._on_lost()

    @property
    def state(self) -> LeaseState:
        """What this node may assume about its lease (see the module docstring)."""
        return self._keepalive.state

    @property
    def alive_until(self) -> float:
        """Monotonic time until which the lease surely exists (from etcd's last answer)."""
        return self._keepalive.alive_until

    def lost(self) -> bool:
        """Whether the lease must be replaced: etcd said it is gone, or the keep-alive
        thread died. Never true merely because etcd is silent."""
        return self._keepalive.lost()

    def close(self, revoke: bool = True) -> None:
        """Stop the keep-alive and (by default) revoke the lease, deleting its keys now."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._keepalive.close(revoke=revoke)
