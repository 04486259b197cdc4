"""``EtcdStore``: a ``torch.distributed.Store`` kept in etcd, scoped to one run and round.

Workers and agents use it exactly like torch's ``TCPStore`` (the contract suite in
``tests/integration/test_store.py`` runs against both), but nothing lives inside one
agent: losing any host loses no key. Every Store key sits under one round's folder,
``<key_prefix>/<run_id>/store/<round>/``, percent-encoded by
:func:`coordinator.core.keys.join_store_key` so no key can leave it.

Semantics, case by case (as ``TCPStore`` behaves in torch 2.13):

* ``set(k, v)`` overwrites; ``get(k)`` returns bytes and blocks until ``k`` exists, up to
  the store timeout, then raises ``torch.distributed.DistStoreError``.
* ``add(k, n)`` treats the value as decimal text, creates it with ``n`` when absent and
  returns the new value; atomic (revision-guarded compare-and-swap loop) and exactly once
  under retries (:mod:`coordinator.torch_adapter.store_once`): a reply lost after etcd
  committed never makes it count twice.
* ``compare_set(k, expected, desired)``: if ``k`` holds ``expected`` (or is absent and
  ``expected`` is empty) it becomes ``desired``; returns the value ``k`` then holds, or
  ``expected`` when ``k`` is absent and ``expected`` is not empty.
* ``wait(keys[, timeout])`` / ``multi_get(keys)`` block like ``get`` with one deadline for
  all keys; a zero timeout checks once.
* ``check``, ``delete_key``, ``num_keys`` (keys of this round only), ``multi_set`` (one
  transaction per 100 keys), ``append`` (atomic, exactly once like ``add``; creates),
  ``list_keys``, ``clone``. ``multi_get`` and ``check`` read many keys with one range read.
* Not torch's API: ``gather`` and ``count_keys``, one range read for every key under a
  prefix (how the agents' exchanges read: never one ``get`` per key).
* Not provided: the ``queue_*`` operations (nothing in torch's Python layer uses them).
* Errors are torch's: etcd unreachable (``StoreConnectionError``, a ``DistNetworkError``
  as ``TCPStore`` raises when its server is gone, and a ``DistStoreError``), a user
  without permission on the round's keys (``StoreAuthError``), anything else of the core
  (``StoreFailedError``); see :mod:`coordinator.torch_adapter.errors`. Each is also the
  core's error of the same kind.

Blocking reads never poll: read, and if the key is absent watch exactly that key from
now and read again, so a put between the read and the watch is still seen; a watch that
a compaction or an error ended is re-read and re-made within the same deadline
(:mod:`coordinator.torch_adapter.store_wait`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

from torch.distributed import (  # type: ignore[attr-defined]
    DistStoreError,
    Store,
)

from coordinator.core.etcd_client import EtcdClient, KeyValue
from coordinator.core.keys import decode_store_key, join_store_key
from coordinator.core.store_rounds import ops_prefix
from coordinator.torch_adapter.errors import store_errors
from coordinator.torch_adapter.store_many import read_many, set_many
from coordinator.torch_adapter.store_once import new_op_id, write_once
from coordinator.torch_adapter.store_wait import (
    Aborted,
    Cancellation,
    wait_for_key,
    wait_for_prefix,
)

__all__ = ["EtcdStore"]

log = logging.getLogger(__name__)

Clock = Callable[[], float]


def _to_bytes(what: str, value: str | bytes | bytearray | memoryview) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store {what} must be str or bytes, not {type(value).__name__}")


class EtcdStore(Store):
    """A torch Store over etcd, holding the keys of one run's round.

    Args:
        client: an open :class:`~coordinator.core.etcd_client.EtcdClient`; shared, not owned.
        prefix: the round's folder, ``RunKeys.store_prefix(round)`` (ends with ``/``).
        timeout: default timeout of blocking ``get``/``wait``/``multi_get``
            (``set_timeout`` changes it).
        clock: monotonic seconds; injected so tests can reason about deadlines.

    Raises:
        ValueError: ``prefix`` does not end with ``/``.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: bytes,
        timeout: timedelta,
        *,
        clock: Clock = time.monotonic,
        cancellation: Cancellation | None = None,
    ) -> None:
        super().__init__()  # the pybind trampoline needs the C++ base initialised
        if not prefix.endswith(b"/"):
            raise ValueError(f"store prefix {prefix!r} must end with '/'")
        self._client = client
        self._prefix = prefix
        self._clock = clock
        self._cancellation = cancellation or Cancellation()
        self.set_timeout(timeout)

    @property
    def prefix(self) -> bytes:
        """The etcd folder of this store."""
        return self._prefix

    def abort(self, reason: str) -> None:
        """End every blocking read of this store (and its clones), now and later, with a
        ``DistStoreError`` saying ``reason``. Thread-safe; for a caller that no longer
        waits on this round (its membership changed, or the agent stops)."""
        self._cancellation.cancel(reason)

    def _key(self, key: str | bytes) -> bytes:
        return join_store_key(self._prefix, key)

    # -- writes ------------------------------------------------------------------------

    @store_errors
    def set(self, key: str | bytes, value: str | bytes) -> None:
        """Store ``value`` under ``key``, replacing any value."""
        self._client.put(self._key(key), _to_bytes("value", value))

    @store_errors
    def add(self, key: str | bytes, amount: int) -> int:
        """Add ``amount`` to the decimal counter at ``key`` (absent: 0) and return the sum.

        Exactly once: if etcd commits the increment but the reply is lost, the client's
        retry finds this call's marker and returns the sum it recorded, without adding
        again (see :mod:`coordinator.torch_adapter.store_once`).

        Raises:
            DistStoreError: the key holds something that is not a decimal integer.
        """
        return self._add(key, amount, new_op_id())

    def _add(self, key: str | bytes, amount: int, op_id: str) -> int:
        """:meth:`add` as the operation ``op_id``: calling it again with the same id (what
        a retry after a lost reply does) adds nothing and returns the same sum."""

        def modify(current: KeyValue | None) -> tuple[bytes, bytes]:
            base = 0 if current is None else self._as_int(key, current.value)
            total = str(base + int(amount)).encode("ascii")
            return total, total

        return int(write_once(self._client, self._key(key), self._marker(op_id), modify))

    @store_errors
    def append(self, key: str | bytes, value: str | bytes) -> None:
        """Append ``value`` to the bytes at ``key``, creating it when absent (atomic).

        Exactly once, like :meth:`add`.
        """
        self._append(key, value, new_op_id())

    def _append(self, key: str | bytes, value: str | bytes, op_id: str) -> None:
        """:meth:`append` as the operation ``op_id`` (see :meth:`_add`)."""
        tail = _to_bytes("value", value)

        def modify(current: KeyValue | None) -> tuple[bytes, bytes]:
            return (b"" if current is None else current.value) + tail, b""

        write_once(self._client, self._key(key), self._marker(op_id), modify)

    @store_errors
    def compare_set(
        self, key: str | bytes, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``; see module doc.

        Returns:
            the value ``key`` holds afterwards (``expected_value`` if ``key`` is absent and
            ``expected_value`` is not empty: torch's TCPStore answers so).
        """
        etcd_key = self._key(key)
        expected = _to_bytes("expected value", expected_value)
        desired = _to_bytes("desired value", desired_value)
        current, _ = self._client.get(etcd_key)
        while True:
            if current is None and expected:
                return expected
            if current is not None and current.value != expected:
                return current.value
            result = self._client.put_if_mod_revision(
                etcd_key, desired, self._mod_revision(current)
            )
            if result.succeeded:
                return desired
            current = result.current

    @store_errors
    def multi_set(self, keys: Sequence[str | bytes], values: Sequence[str | bytes]) -> None:
        """Set every ``keys[i]`` to ``values[i]``: one etcd transaction per 100 keys
        (:func:`~coordinator.torch_adapter.store_many.set_many`).

        A key given twice takes its last value, as with repeated ``set``.

        Raises:
            DistStoreError: ``keys`` and ``values`` differ in length.
        """
        if len(keys) != len(values):
            raise DistStoreError(
                f"multi_set got {len(keys)} keys and {len(values)} values; give one value per key"
            )
        pairs = {self._key(k): _to_bytes("value", v) for k, v in zip(keys, values, strict=True)}
        set_many(self._client, list(pairs.items()))

    @store_errors
    def delete_key(self, key: str | bytes) -> bool:
        """Delete ``key``; return whether it existed."""
        deleted, _ = self._client.delete(self._key(key))
        return deleted > 0

    # -- reads -------------------------------------------------------------------------

    @store_errors
    def get(self, key: str | bytes) -> bytes:
        """Return the value of ``key``, waiting up to the store timeout for it to appear.

        Raises:
            DistStoreError: the key did not appear in time.
        """
        return self._wait_all([key], self._deadline(None))[0].value

    @store_errors
    def multi_get(self, keys: Sequence[str | bytes]) -> list[bytes]:
        """Return the values of ``keys`` in order, waiting for each like :meth:`get`: one
        range read when they are all there (:func:`~.store_many.read_many`)."""
        found = read_many(self._client, [self._key(k) for k in keys])
        missing = [k for k in keys if self._key(k) not in found]
        for key, kv in zip(missing, self._wait_all(missing, self._deadline(None)), strict=True):
            found[self._key(key)] = kv
        return [found[self._key(k)].value for k in keys]

    @store_errors
    def wait(self, keys: Sequence[str | bytes], timeout: timedelta | None = None) -> None:
        """Block until every key exists, up to ``timeout`` (default: the store timeout).

        Raises:
            DistStoreError: some key did not appear in time.
        """
        self._wait_all(keys, self._deadline(timeout))

    @store_errors
    def check(self, keys: Sequence[str | bytes]) -> bool:
        """Return whether every key exists now (no waiting; one read)."""
        found = read_many(self._client, [self._key(k) for k in keys])
        return all(self._key(k) in found for k in keys)

    @store_errors
    def num_keys(self) -> int:
        """Number of keys in this store (this round only)."""
        count, _ = self._client.count_prefix(self._prefix)
        return count

    @store_errors
    def list_keys(self) -> list[str]:
        """The keys of this store (this round only), decoded; bytes that are not UTF-8
        are shown as ``\\xNN``."""
        kvs, _ = self._client.get_prefix(self._prefix, keys_only=True)
        return list(self._user_keys([kv.key for kv in kvs]).values())

    @store_errors
    def gather(
        self, key_prefix: str | bytes, count: int, timeout: timedelta | None = None
    ) -> dict[str, bytes]:
        """Every key that starts with ``key_prefix`` and its value, once there are at least
        ``count``, waiting up to ``timeout`` (default: the store timeout); at the deadline,
        those there are. One range read when they are all there, else one prefix watch
        (its events reach this caller only) and a second read; never a get per key.

        Raises:
            DistStoreError: the wait was aborted (:meth:`abort`).
        """
        etcd_prefix = self._key(key_prefix)
        try:
            found = wait_for_prefix(
                self._client, etcd_prefix, count, self._deadline(timeout),
                clock=self._clock, cancellation=self._cancellation,
            )  # fmt: skip
        except Aborted as exc:
            raise DistStoreError(f"wait for store keys {key_prefix!r}* aborted: {exc}") from None
        return {key: found[k].value for k, key in self._user_keys(sorted(found)).items()}

    @store_errors
    def count_keys(self, key_prefix: str | bytes) -> int:
        """How many keys of this store start with ``key_prefix`` (one count-only read)."""
        count, _ = self._client.count_prefix(self._key(key_prefix))
        return count

    def _user_keys(self, etcd_keys: Sequence[bytes]) -> dict[bytes, str]:
        """etcd key -> the Store key it holds, decoded (bytes that are not UTF-8 shown as
        ``\\xNN``); a foreign key is logged and left out."""
        out = {}
        for key in etcd_keys:
            try:
                raw = decode_store_key(key[len(self._prefix) :])
            except ValueError:
                log.warning("ignoring foreign key %r in store %r", key, self._prefix)
                continue
            out[key] = raw.decode("utf-8", "backslashreplace")
        return out

    def clone(self) -> EtcdStore:
        """A new handle on the same store (same client, prefix, timeout and clock).

        torch clones stores to give each thread its own; ours are thread-safe already.
        """
        timeout: timedelta = self.timeout  # type: ignore[attr-defined]
        return EtcdStore(
            self._client, self._prefix, timeout, clock=self._clock, cancellation=self._cancellation
        )

    def has_extended_api(self) -> bool:
        """``True``: ``append``, ``multi_get`` and ``multi_set`` are supported."""
        return True

    # -- blocking ----------------------------------------------------------------------

    def _deadline(self, timeout: timedelta | None) -> float:
        # ``timeout`` is the base class's property (set_timeout); torch's stub omits it.
        default: timedelta = self.timeout  # type: ignore[attr-defined]
        span = default if timeout is None else timeout
        return self._clock() + span.total_seconds()

    def _wait_all(self, keys: Sequence[str | bytes], deadline: float) -> list[KeyValue]:
        start = self._clock()
        found = []
        for key in keys:
            try:
                kv = self._wait_one(self._key(key), deadline)
            except Aborted as exc:
                raise DistStoreError(
                    f"wait for store keys {', '.join(repr(k) for k in keys)} aborted: {exc}"
                ) from None
            if kv is None:
                waited_ms = round((self._clock() - start) * 1000)
                shown = ", ".join(repr(k) for k in keys)
                raise DistStoreError(
                    f"wait timeout after {waited_ms}ms, keys: {shown} (etcd store "
                    f"{self._prefix.decode('utf-8', 'backslashreplace')}); raise the store "
                    "timeout (rdzv_conf timeout=SECONDS) or check that the process that "
                    "sets these keys is alive"
                )
            found.append(kv)
        return found

    def _wait_one(self, etcd_key: bytes, deadline: float) -> KeyValue | None:
        """The key's value once it exists, or None at ``deadline``."""
        return wait_for_key(
            self._client, etcd_key, deadline, clock=self._clock, cancellation=self._cancellation
        )

    # -- helpers -----------------------------------------------------------------------

    def _marker(self, op_id: str) -> bytes:
        return ops_prefix(self._prefix) + op_id.encode("ascii")

    @staticmethod
    def _mod_revision(current: KeyValue | None) -> int:
        # etcd compares mod_revision 0 as "the key does not exist".
        return 0 if current is None else current.mod_revision

    def _as_int(self, key: str | bytes, value: bytes) -> int:
        try:
            return int(value.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise DistStoreError(
                f"add on store key {key!r}: its value {value[:40]!r} is not a decimal "
                "integer; use a key that only add() writes"
            ) from None
