"""EtcdClient: KV reads and writes, revision-guarded transactions, leases, watches."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from etcd3 import etcdrpc

from coordinator.core.errors import EtcdConnectionError, LeaseLostError
from coordinator.core.etcd_client._connection import _Connection
from coordinator.core.etcd_client._failover import NOT_FOUND, _status, classify_status
from coordinator.core.etcd_client._keepalive import KeepAlive
from coordinator.core.etcd_client._types import (
    EtcdConfig,
    KeyValue,
    TxnResult,
    WatchEvent,
    _kv,
    prefix_range_end,
)
from coordinator.core.etcd_client._watch import Watch, _Watcher, _WatchState

T = TypeVar("T")

__all__ = ["EtcdClient"]


# -- the client ------------------------------------------------------------------------------


class EtcdClient(_Connection):
    """A thread-safe etcd v3 client with failover, auth, watches and lease keep-alives.

    One instance may be shared by many threads. Every KV call returns etcd's header
    revision with its result, so callers can watch from exactly the revision they read.

    Args:
        config: where etcd is and how to authenticate.
        clock: monotonic seconds; injected so tests can drive retry decisions.
        sleep: waits between failover rounds (default: a wait that :meth:`close` cuts short).
        rng: picks the first endpoint (spreading clients over members) and the jitter.

    Raises:
        EtcdTLSError: a TLS file cannot be read (names the file).
    """

    def __init__(
        self,
        config: EtcdConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(config, clock=clock, sleep=sleep, rng=rng)
        self._keepalives: set[KeepAlive] = set()
        self._lock = threading.Lock()
        self._watcher = _Watcher(self)

    @property
    def watch_endpoint(self) -> str | None:
        """The endpoint the watch stream last got an answer from (None: no stream)."""
        return self._watcher.endpoint

    # -- KV ----------------------------------------------------------------------------

    def _range(self, what: str, request: Any, key: bytes) -> Any:
        return self._unary(
            what, lambda s, t, m: s.kv.Range(request, timeout=t, metadata=m), key=key
        )

    def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        """Return the key (None if absent) and the header revision."""
        rsp = self._range("get", etcdrpc.RangeRequest(key=key), key)
        return (_kv(rsp.kvs[0]) if rsp.kvs else None), int(rsp.header.revision)

    def get_prefix(
        self,
        prefix: bytes,
        *,
        sort_by_create: bool = False,
        descending: bool = False,
        limit: int = 0,
        max_create_revision: int = 0,
        keys_only: bool = False,
    ) -> tuple[list[KeyValue], int]:
        """Return the keys under ``prefix`` and the header revision.

        Sorted by key, or by create revision with ``sort_by_create``; ``limit`` 0 is no
        limit; ``max_create_revision`` > 0 keeps keys created at or before it.
        """
        request = etcdrpc.RangeRequest(
            key=prefix,
            range_end=prefix_range_end(prefix),
            limit=limit,
            keys_only=keys_only,
            max_create_revision=max_create_revision,
            sort_target=etcdrpc.RangeRequest.CREATE if sort_by_create else etcdrpc.RangeRequest.KEY,
            sort_order=etcdrpc.RangeRequest.DESCEND if descending else etcdrpc.RangeRequest.ASCEND,
        )
        rsp = self._range("get_prefix", request, prefix)
        return [_kv(kv) for kv in rsp.kvs], int(rsp.header.revision)

    def count_prefix(self, prefix: bytes) -> tuple[int, int]:
        """Return how many keys are under ``prefix`` and the header revision."""
        request = etcdrpc.RangeRequest(
            key=prefix, range_end=prefix_range_end(prefix), count_only=True
        )
        rsp = self._range("count_prefix", request, prefix)
        return int(rsp.count), int(rsp.header.revision)

    def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Write ``key`` (bound to ``lease`` if non-zero); return the header revision."""
        request = etcdrpc.PutRequest(key=key, value=value, lease=lease)
        rsp = self._unary("put", lambda s, t, m: s.kv.Put(request, timeout=t, metadata=m), key=key)
        return int(rsp.header.revision)

    def put_created(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Write ``key`` as :meth:`put` does; return the key's create revision.

        One round trip: etcd returns the previous value, whose create revision the key
        keeps; with no previous value the key was created by this put, at its revision.
        """
        request = etcdrpc.PutRequest(key=key, value=value, lease=lease, prev_kv=True)
        rsp = self._unary("put", lambda s, t, m: s.kv.Put(request, timeout=t, metadata=m), key=key)
        if rsp.HasField("prev_kv") and rsp.prev_kv.key:
            return int(rsp.prev_kv.create_revision)
        return int(rsp.header.revision)

    def _delete_range(self, what: str, key: bytes, range_end: bytes) -> tuple[int, int]:
        request = etcdrpc.DeleteRangeRequest(key=key, range_end=range_end)
        rsp = self._unary(
            what, lambda s, t, m: s.kv.DeleteRange(request, timeout=t, metadata=m), key=key
        )
        return int(rsp.deleted), int(rsp.header.revision)

    def delete(self, key: bytes) -> tuple[int, int]:
        """Delete ``key``; return how many keys were deleted (0 or 1) and the revision."""
        return self._delete_range("delete", key, b"")

    def delete_prefix(self, prefix: bytes) -> tuple[int, int]:
        """Delete every key under ``prefix``; return the count deleted and the revision.

        Raises:
            ValueError: ``prefix`` is empty (that would wipe the whole keyspace).
        """
        _check_prefix(prefix)
        return self._delete_range("delete_prefix", prefix, prefix_range_end(prefix))

    def _guarded_txn(
        self,
        what: str,
        key: bytes,
        mod_revision: int,
        success: list[Any],
        fence: tuple[bytes, int] | None = None,
    ) -> TxnResult:
        if mod_revision == 0:
            # Revision 0 means "the key must not exist": an absent key has version 0.
            compare = etcdrpc.Compare(
                key=key, target=etcdrpc.Compare.VERSION, result=etcdrpc.Compare.EQUAL, version=0
            )
        else:
            compare = etcdrpc.Compare(
                key=key,
                target=etcdrpc.Compare.MOD,
                result=etcdrpc.Compare.EQUAL,
                mod_revision=mod_revision,
            )
        compares = [compare]
        # A lost race reads the winner's value in the same round trip.
        failure = [etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key))]
        if fence is not None:
            # The writer's own key must still be the one it was elected with (etcd's
            # election recipe): a key that is gone has create revision 0 and fails too.
            fence_key, create_revision = fence
            compares.append(
                etcdrpc.Compare(
                    key=fence_key,
                    target=etcdrpc.Compare.CREATE,
                    result=etcdrpc.Compare.EQUAL,
                    create_revision=create_revision,
                )
            )
            failure.append(
                etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=fence_key, keys_only=True))
            )
        request = etcdrpc.TxnRequest(compare=compares, success=success, failure=failure)
        # Retrying after an unknown outcome (a timeout, a member dying mid-call) is safe:
        # if the first attempt committed, the key's mod_revision moved, so the retry's
        # compare fails and returns the current value, which the caller re-examines (it
        # sees its own write) instead of the write being applied twice.
        rsp = self._unary(what, lambda s, t, m: s.kv.Txn(request, timeout=t, metadata=m), key=key)
        current = None
        fenced_out = False
        if not rsp.succeeded and rsp.responses:
            kvs = rsp.responses[0].response_range.kvs
            current = _kv(kvs[0]) if kvs else None
            if fence is not None:
                fence_kvs = rsp.responses[1].response_range.kvs
                fenced_out = not fence_kvs or int(fence_kvs[0].create_revision) != fence[1]
        return TxnResult(bool(rsp.succeeded), int(rsp.header.revision), current, fenced_out)

    def put_if_mod_revision(
        self,
        key: bytes,
        value: bytes,
        mod_revision: int,
        *,
        lease: int = 0,
        also_put: Sequence[tuple[bytes, bytes, int]] = (),
        also_delete_prefixes: Sequence[bytes] = (),
        fence: tuple[bytes, int] | None = None,
    ) -> TxnResult:
        """Put ``key`` only if its mod_revision is still ``mod_revision`` (0: absent).

        On success also puts each ``(key, value, lease)`` of ``also_put`` and deletes
        each prefix of ``also_delete_prefixes``, all in one transaction. On failure the
        result carries the key's current value. With ``fence=(key, create_revision)``
        the write also requires that key to exist with that create revision; a failure
        because it does not sets ``fenced_out``.

        Raises:
            ValueError: a key is written twice, or a put falls under a deleted prefix
                (etcd refuses such a transaction).
        """
        puts = [(key, value, lease), *also_put]
        _check_txn_ops([k for k, _, _ in puts], also_delete_prefixes)
        success = [
            etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=k, value=v, lease=lease_id))
            for k, v, lease_id in puts
        ] + [
            etcdrpc.RequestOp(
                request_delete_range=etcdrpc.DeleteRangeRequest(
                    key=p, range_end=prefix_range_end(p)
                )
            )
            for p in also_delete_prefixes
        ]
        return self._guarded_txn("put_if_mod_revision", key, mod_revision, success, fence)

    def delete_if_mod_revision(self, key: bytes, mod_revision: int) -> TxnResult:
        """Delete ``key`` only if its mod_revision is still ``mod_revision``."""
        success = [etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=key))]
        return self._guarded_txn("delete_if_mod_revision", key, mod_revision, success)

    # -- leases --------------------------------------------------------------------------

    def lease_grant(self, ttl: int) -> int:
        """Grant a lease of ``ttl`` seconds; return its id.

        A retry after an unknown outcome may leave an unused lease behind; it expires
        after ``ttl`` on its own.
        """
        request = etcdrpc.LeaseGrantRequest(TTL=ttl)
        rsp = self._unary(
            "lease_grant", lambda s, t, m: s.lease.LeaseGrant(request, timeout=t, metadata=m)
        )
        if rsp.error:
            raise EtcdConnectionError(f"etcd refused a lease of {ttl} s: {rsp.error}")
        return int(rsp.ID)

    def lease_revoke(self, lease_id: int, *, budget: float | None = None) -> None:
        """Revoke the lease and delete its keys. A lease already gone is not an error."""
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        try:
            self._unary(
                f"lease_revoke of lease {lease_id:x}",
                lambda s, t, m: s.lease.LeaseRevoke(request, timeout=t, metadata=m),
                budget=budget,
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

    def keep_alive(
        self, lease_id: int, ttl: int, on_lost: Callable[[], None] | None = None
    ) -> KeepAlive:
        """Keep the lease alive on one long-lived stream until closed or lost.

        ``on_lost`` runs once, on the keep-alive thread, when the lease is lost; it must
        not block.
        """
        self._check_open()
        keepalive = KeepAlive(self, lease_id, ttl, on_lost)
        with self._lock:
            self._keepalives.add(keepalive)
        keepalive._start()
        return keepalive

    def _forget(self, keepalive: KeepAlive) -> None:
        with self._lock:
            self._keepalives.discard(keepalive)

    # -- watches -------------------------------------------------------------------------

    def watch(
        self,
        key: bytes,
        start_revision: int,
        on_events: Callable[[list[WatchEvent], int], None],
        on_compacted: Callable[[int], None],
        *,
        prefix: bool = False,
        prev_kv: bool = False,
        on_error: Callable[[Exception], None] | None = None,
    ) -> Watch:
        """Watch ``key`` (every key under it with ``prefix``) from ``start_revision``.

        ``start_revision`` 0 means "from now". Events arrive in revision order through
        ``on_events(events, header_revision)``; after a broken stream the watch resumes
        from the revision after the last event delivered, so none is lost or repeated.
        When etcd has compacted the revision needed, ``on_compacted(compact_revision)``
        runs once and the watch ends: re-read and watch again. When etcd cancels the watch
        for another reason (e.g. no permission), ``on_error(error)`` runs once (default:
        logged). All callbacks run on the client's single watch thread: they must not
        block (no RPCs, no waiting); hand work to another thread instead.

        Creating and cancelling a watch is one message on the shared stream.
        """
        self._check_open()
        if prefix:
            _check_prefix(key)
        state = _WatchState(
            key=key,
            range_end=prefix_range_end(key) if prefix else b"",
            next_rev=start_revision,
            on_events=on_events,
            on_compacted=on_compacted,
            on_error=on_error,
            prev_kv=prev_kv,
        )
        self._watcher.add(state)
        return Watch(self._watcher, state)

    def watch_then_read(
        self,
        key: bytes,
        read: Callable[[], T],
        on_events: Callable[[list[WatchEvent], int], None],
        on_compacted: Callable[[int], None],
        *,
        prefix: bool = False,
        on_error: Callable[[Exception], None] | None = None,
        timeout: float | None = None,
    ) -> tuple[Watch, T]:
        """Watch ``key`` from now, wait for etcd to confirm it, then call ``read()``.

        The way to follow a key whose value is needed too: the read sees at least the
        revision the watch started after, so no change falls between them; events the
        read already reflects may still arrive (before or after it) and the caller drops
        them by revision. Why not read first and watch from the read's revision + 1: see
        :meth:`Watch.wait_created`. Arguments as :meth:`watch`; ``timeout`` bounds the
        wait for the confirmation (default: the retry budget).

        Raises:
            EtcdConnectionError: etcd did not confirm in time, refused the watch, or the
                read failed; the watch is cancelled first.
        """
        watch = self.watch(key, 0, on_events, on_compacted, prefix=prefix, on_error=on_error)
        try:
            watch.wait_created(timeout)
            return watch, read()
        except BaseException:
            watch.cancel()
            raise

    def close(self) -> None:
        """Stop every keep-alive (without revoking), the watch thread and all channels."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            keepalives = list(self._keepalives)
        for keepalive in keepalives:
            keepalive.close(revoke=False)
        self._watcher.close()
        self._channels.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_prefix(prefix: bytes) -> None:
    if not prefix:
        raise ValueError("an empty key prefix would select the whole keyspace; refusing it")


def _check_txn_ops(put_keys: Sequence[bytes], delete_prefixes: Sequence[bytes]) -> None:
    seen: set[bytes] = set()
    for key in put_keys:
        if key in seen:
            raise ValueError(f"key {key!r} is written twice in one transaction")
        seen.add(key)
        for prefix in delete_prefixes:
            _check_prefix(prefix)
            if key.startswith(prefix):
                raise ValueError(
                    f"key {key!r} is put and deleted (prefix {prefix!r}) in one transaction"
                )
    for prefix in delete_prefixes:
        _check_prefix(prefix)
