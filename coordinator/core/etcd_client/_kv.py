"""KV reads and writes and revision-guarded transactions: the ``_KV`` layer of EtcdClient.

Also where a write's lease is chosen: a write that names no lease of its own goes on the
lease bound to the longest prefix of its key (:meth:`_KV.bind_prefix`). A run binds its
folder to the run's lease, so every key of the run that no node owns (the state, the
Store's rounds, the timeline) is deleted by etcd when that lease expires, whichever
module wrote it (``coordinator.core.run_lease``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from coordinator.core.etcd_client._connection import _Connection
from coordinator.core.etcd_client._etcdrpc import etcdrpc
from coordinator.core.etcd_client._ranges import _check_prefix, _next_key_request, _prefix_request
from coordinator.core.etcd_client._types import (
    KeyValue,
    TxnResult,
    _kv,
    key_text,
    prefix_range_end,
)

__all__ = ["_KV"]


class _Binding(NamedTuple):
    prefix: bytes
    lease: int


class _KV(_Connection):
    """Every KV call of :class:`EtcdClient`; each returns etcd's header revision with its
    result, so callers can watch from exactly the revision they read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Replaced whole under the lock, read without it (one attribute read per write).
        self._bindings: tuple[_Binding, ...] = ()
        self._bindings_lock = threading.Lock()

    def bind_prefix(self, prefix: bytes, lease: int) -> Callable[[], None]:
        """From now on, put every key under ``prefix`` that is written without a lease of
        its own (``lease=0``) on ``lease``; returns the function that ends this binding.

        The longest bound prefix of a key wins; among equal prefixes, the latest binding.
        Writes that name a lease keep it (a node's key stays on the node's lease).

        Raises:
            ValueError: ``prefix`` is empty or ``lease`` is not a lease id.
        """
        _check_prefix(prefix)
        if lease <= 0:
            raise ValueError(f"lease {lease} is not a lease id")
        binding = _Binding(prefix, lease)
        with self._bindings_lock:
            self._bindings = (*self._bindings, binding)

        def unbind() -> None:
            with self._bindings_lock:
                kept = list(self._bindings)
                if binding in kept:
                    # The latest equal binding goes: bindings of one prefix nest.
                    del kept[len(kept) - 1 - kept[::-1].index(binding)]
                self._bindings = tuple(kept)

        return unbind

    def _lease_of(self, key: bytes, lease: int) -> int:
        """The lease a write of ``key`` goes on: its own, else the bound prefix's, else 0."""
        if lease:
            return lease
        best: _Binding | None = None
        for binding in self._bindings:
            if key.startswith(binding.prefix) and (
                best is None or len(binding.prefix) >= len(best.prefix)
            ):
                best = binding
        return 0 if best is None else best.lease

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
        request = _prefix_request(
            prefix, limit, keys_only, max_create_revision, sort_by_create, descending
        )
        rsp = self._range("get_prefix", request, prefix)
        return [_kv(kv) for kv in rsp.kvs], int(rsp.header.revision)

    def next_key(self, after: bytes, prefix: bytes) -> tuple[bytes | None, int]:
        """The first key under ``prefix`` after ``after`` in key order (None: none), and
        the header revision. One range read with a limit of 1: etcd reads one key of its
        index, however many the prefix holds.

        Raises:
            ValueError: ``prefix`` is empty.
        """
        rsp = self._range("next_key", _next_key_request(after, prefix), prefix)
        return (bytes(rsp.kvs[0].key) if rsp.kvs else None), int(rsp.header.revision)

    def count_prefix(self, prefix: bytes) -> tuple[int, int]:
        """Return how many keys are under ``prefix`` and the header revision."""
        request = etcdrpc.RangeRequest(
            key=prefix, range_end=prefix_range_end(prefix), count_only=True
        )
        rsp = self._range("count_prefix", request, prefix)
        return int(rsp.count), int(rsp.header.revision)

    def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Write ``key`` (bound to ``lease`` if non-zero, else to its prefix's lease, see
        :meth:`bind_prefix`); return the header revision."""
        request = etcdrpc.PutRequest(key=key, value=value, lease=self._lease_of(key, lease))
        rsp = self._unary("put", lambda s, t, m: s.kv.Put(request, timeout=t, metadata=m), key=key)
        return int(rsp.header.revision)

    def put_created(
        self,
        key: bytes,
        value: bytes,
        *,
        lease: int = 0,
        also_put: Sequence[tuple[bytes, bytes]] = (),
    ) -> int:
        """Write ``key`` as :meth:`put` does; return the key's create revision.

        One round trip: etcd returns the previous value, whose create revision the key
        keeps; with no previous value the key was created by this put, at its revision.
        Each ``(key, value)`` of ``also_put`` is written in the same transaction, on the
        same lease (one raft proposal in all).

        Raises:
            ValueError: a key is written twice.
        """
        lease = self._lease_of(key, lease)
        put = etcdrpc.PutRequest(key=key, value=value, lease=lease, prev_kv=True)
        if not also_put:
            rsp = self._unary("put", lambda s, t, m: s.kv.Put(put, timeout=t, metadata=m), key=key)
            prev, revision = rsp.prev_kv, int(rsp.header.revision)
        else:
            _check_txn_ops([key, *(k for k, _ in also_put)], ())
            ops = [etcdrpc.RequestOp(request_put=put)] + [
                etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=k, value=v, lease=lease))
                for k, v in also_put
            ]
            request = etcdrpc.TxnRequest(success=ops)
            txn = self._unary(
                "put", lambda s, t, m: s.kv.Txn(request, timeout=t, metadata=m), key=key
            )
            prev, revision = txn.responses[0].response_put.prev_kv, int(txn.header.revision)
        return int(prev.create_revision) if prev.key else revision

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
            etcdrpc.RequestOp(
                request_put=etcdrpc.PutRequest(key=k, value=v, lease=self._lease_of(k, lease_id))
            )
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

    def create_many(
        self, items: Sequence[tuple[bytes, bytes]], *, budget: float | None = None
    ) -> tuple[list[bool], int]:
        """Put each ``(key, value)`` only if the key is absent, in one transaction.

        Each put is a nested transaction of its own (etcd >= 3.3), so one key that exists
        does not stop the others. No lease of the writer's: the keys outlive it (they go
        on their prefix's lease, if one is bound: :meth:`bind_prefix`). ``budget``
        bounds the retries (default: the client's ``retry_budget``); a retry after an
        unknown outcome is safe, the keys it wrote are simply not written again.

        Returns:
            For each item, whether this call created it; and the header revision.
        """
        _check_txn_ops([k for k, _ in items], ())
        success = [
            etcdrpc.RequestOp(
                request_txn=etcdrpc.TxnRequest(
                    compare=[
                        etcdrpc.Compare(
                            key=k,
                            target=etcdrpc.Compare.VERSION,
                            result=etcdrpc.Compare.EQUAL,
                            version=0,
                        )
                    ],
                    success=[
                        etcdrpc.RequestOp(
                            request_put=etcdrpc.PutRequest(
                                key=k, value=v, lease=self._lease_of(k, 0)
                            )
                        )
                    ],
                )
            )
            for k, v in items
        ]
        request = etcdrpc.TxnRequest(success=success)
        first = items[0][0] if items else None
        rsp = self._unary(
            "create_many",
            lambda s, t, m: s.kv.Txn(request, timeout=t, metadata=m),
            key=first,
            budget=budget,
        )
        created = [bool(r.response_txn.succeeded) for r in rsp.responses]
        return created, int(rsp.header.revision)

    def delete_keys(self, keys: Sequence[bytes], *, budget: float | None = None) -> int:
        """Delete each of ``keys`` (absent ones are skipped) in one transaction; return
        the header revision."""
        success = [
            etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=k)) for k in keys
        ]
        request = etcdrpc.TxnRequest(success=success)
        rsp = self._unary(
            "delete_keys",
            lambda s, t, m: s.kv.Txn(request, timeout=t, metadata=m),
            key=keys[0] if keys else None,
            budget=budget,
        )
        return int(rsp.header.revision)

    def delete_if_mod_revision(self, key: bytes, mod_revision: int) -> TxnResult:
        """Delete ``key`` only if its mod_revision is still ``mod_revision``."""
        success = [etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=key))]
        return self._guarded_txn("delete_if_mod_revision", key, mod_revision, success)


def _check_txn_ops(put_keys: Sequence[bytes], delete_prefixes: Sequence[bytes]) -> None:
    seen: set[bytes] = set()
    for key in put_keys:
        if key in seen:
            raise ValueError(f"key {key_text(key)} is written twice in one transaction")
        seen.add(key)
        for prefix in delete_prefixes:
            _check_prefix(prefix)
            if key.startswith(prefix):
                raise ValueError(
                    f"key {key_text(key)} is put and deleted (prefix {key_text(prefix)}) "
                    "in one transaction"
                )
    for prefix in delete_prefixes:
        _check_prefix(prefix)
