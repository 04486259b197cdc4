"""The lease calls of the client: grant (at a client-chosen id), grant if absent,
refresh once, revoke, time to live. The keep-alive streams are ``_client``'s."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from coordinator.core.errors import EtcdConnectionError, LeaseLostError
from coordinator.core.etcd_client._connection import Metadata, _stream_metadata
from coordinator.core.etcd_client._etcdrpc import etcdrpc
from coordinator.core.etcd_client._failover import NOT_FOUND, _status, classify_status
from coordinator.core.etcd_client._kv import _KV

__all__ = ["_Leases", "earlier_grant_applied"]

# Lease ids are chosen by the client (see lease_grant) from the OS's randomness, never
# from a client's injected rng: two clients seeded alike must not pick the same ids.
_LEASE_IDS = random.SystemRandom()
_MAX_LEASE_ID = 2**62  # etcd's ids are int64; 0 would mean "etcd, choose one"
_LEASE_EXISTS = "lease already exists"


def earlier_grant_applied(attempt: int, details: str) -> bool:
    """Whether etcd's refusal ``details`` of attempt number ``attempt`` (from 1) of one
    grant of a client-chosen id says an earlier attempt was applied: the lease is ours.

    On the first attempt the same words mean another lease has the id (with random
    62-bit ids, not seen in practice): an error, never somebody else's lease taken.
    """
    return attempt > 1 and _LEASE_EXISTS in details.lower()


class _Leases(_KV):
    """Lease calls, one round trip each (with failover, as every unary call)."""

    def lease_grant(self, ttl: int) -> int:
        """Grant a lease of ``ttl`` seconds; return its id (see :meth:`lease_grant_at`)."""
        return self.lease_grant_at(ttl)[0]

    def lease_grant_at(self, ttl: int) -> tuple[int, int]:
        """Grant a lease of ``ttl`` seconds; return its id and etcd's revision when it
        was granted (0: not known, the grant was an earlier attempt's, see below).

        The id is chosen here, at random, so a retry after an unknown outcome is
        idempotent: if the first attempt was applied after all, etcd answers the retry
        "lease already exists", and that lease is ours (no unused lease is left behind;
        it started counting its TTL no earlier than the first attempt was sent).
        """
        lease_id = _LEASE_IDS.randrange(1, _MAX_LEASE_ID)
        request = etcdrpc.LeaseGrantRequest(TTL=ttl, ID=lease_id)
        attempts = 0

        def grant(stubs: Any, timeout: float, metadata: Metadata) -> tuple[int, int]:
            nonlocal attempts
            attempts += 1
            try:
                rsp = stubs.lease.LeaseGrant(request, timeout=timeout, metadata=metadata)
            except grpc.RpcError as exc:
                if earlier_grant_applied(attempts, _status(exc)[1]):
                    return lease_id, 0
                raise
            if rsp.error:
                raise EtcdConnectionError(f"etcd refused a lease of {ttl} s: {rsp.error}")
            return int(rsp.ID), int(rsp.header.revision)

        return self._unary("lease_grant", grant)

    def lease_grant_if_absent(self, lease_id: int, ttl: int) -> int:
        """Grant lease ``lease_id`` (an id every writer of it computes alike) of ``ttl``
        seconds unless a lease with that id exists.

        Returns:
            The TTL etcd granted (at least its minimum), or 0 when the id exists already
            (somebody's grant, or an earlier attempt of this one whose answer was lost).

        Raises:
            ValueError: ``lease_id`` is not a lease id.
        """
        if not 0 < lease_id < 2**63:
            raise ValueError(f"lease id {lease_id} is not a lease id (1 to 2**63-1)")
        request = etcdrpc.LeaseGrantRequest(TTL=ttl, ID=lease_id)

        def grant(stubs: Any, timeout: float, metadata: Metadata) -> int:
            try:
                rsp = stubs.lease.LeaseGrant(request, timeout=timeout, metadata=metadata)
            except grpc.RpcError as exc:
                if _LEASE_EXISTS in _status(exc)[1].lower():
                    return 0
                raise
            if rsp.error:
                if _LEASE_EXISTS in rsp.error.lower():
                    return 0
                raise EtcdConnectionError(f"etcd refused a lease of {ttl} s: {rsp.error}")
            return int(rsp.TTL)

        return self._unary("lease_grant", grant)

    def lease_refresh(self, lease_id: int, *, budget: float | None = None) -> int:
        """Renew the lease once (one keep-alive on a short stream of its own).

        Returns:
            How long the lease lives from now on (its full TTL), or 0 when etcd has no
            such lease. Through etcd's gRPC proxy, which answers a keep-alive only with
            its own next renewal (a third of the TTL away, for a lease it keeps alive for
            another client already), an answer not there within a second is replaced by
            the lease's time to live, which the proxy's renewals keep up.
        """
        request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)

        def refresh(stubs: Any, timeout: float, metadata: Metadata) -> int:
            answered = threading.Event()

            def requests() -> Iterator[Any]:
                yield request
                # The stream ends only once answered: the proxy drops an unanswered
                # keep-alive at the end of its stream ("context canceled").
                answered.wait(timeout)

            wait = min(1.0, timeout / 2)
            call = stubs.lease.LeaseKeepAlive(
                requests(), timeout=wait, metadata=_stream_metadata(metadata)
            )
            try:
                for rsp in call:
                    return max(0, int(rsp.TTL))
            except grpc.RpcError as exc:
                code, details = _status(exc)
                if "lease not found" in details.lower():
                    return 0
                if code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
            finally:
                answered.set()
                call.cancel()
            ask = etcdrpc.LeaseTimeToLiveRequest(ID=lease_id)
            rsp = stubs.lease.LeaseTimeToLive(ask, timeout=timeout - wait, metadata=metadata)
            return max(0, int(rsp.TTL))

        return self._unary(
            f"lease_refresh of lease {lease_id:x}", refresh, budget=budget, method="lease_refresh"
        )

    def lease_revoke(self, lease_id: int, *, budget: float | None = None) -> None:
        """Revoke the lease and delete its keys. A lease already gone is not an error."""
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        try:
            self._unary(
                f"lease_revoke of lease {lease_id:x}",
                lambda s, t, m: s.lease.LeaseRevoke(request, timeout=t, metadata=m),
                budget=budget,
                method="lease_revoke",
            )
        except LeaseLostError:
            return  # already gone: what revoking wanted
        except EtcdConnectionError as exc:
            if (
                isinstance(exc.__cause__, grpc.RpcError)
                and classify_status(*_status(exc.__cause__)) == NOT_FOUND
            ):
                return
            raise

    def lease_time_to_live(self, lease_id: int) -> int:
        """Seconds the lease has left, or -1 if it expired or was revoked."""
        request = etcdrpc.LeaseTimeToLiveRequest(ID=lease_id)
        rsp = self._unary(
            "lease_time_to_live",
            lambda s, t, m: s.lease.LeaseTimeToLive(request, timeout=t, metadata=m),
        )
        return int(rsp.TTL)
