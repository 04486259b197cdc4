"""Many Store keys at once: ``multi_set`` in transactions etcd accepts, ``multi_get`` and
``check`` with one range read instead of one get per key.

* :func:`set_many`: etcd refuses a transaction of more than 128 operations
  (``--max-txn-ops``, default 128), and torch's agent sets one key per node with one
  ``multi_set`` (its rank exchange: ``torchrun`` with our handler). The keys go in
  transactions of at most ``BATCH`` puts: atomic up to ``BATCH`` keys, each batch atomic
  beyond (torch's callers write keys that one reader each reads).
* :func:`read_many`: the keys of one ``multi_get`` mostly share a prefix (torch's
  ``torchelastic/role_info/0`` .. ``N-1``): one range read over their longest common
  prefix finds them all (keys under it that were not asked for are dropped; the read is
  bounded by the round's store), where a get per key cost N round trips.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.core.etcd_client import EtcdClient, KeyValue

__all__ = ["BATCH", "read_many", "set_many"]

BATCH = 100
"""Puts per transaction (etcd's default limit is 128 operations)."""


def set_many(client: EtcdClient, pairs: Sequence[tuple[bytes, bytes]]) -> None:
    """Put every (key, value), ``BATCH`` keys per transaction."""
    for start in range(0, len(pairs), BATCH):
        (first_key, first_value), *rest = pairs[start : start + BATCH]
        # etcd's transactions put unconditionally only behind a compare; guard on the
        # first key's revision and retry with the value the failed transaction read.
        current, _ = client.get(first_key)
        while True:
            result = client.put_if_mod_revision(
                first_key,
                first_value,
                0 if current is None else current.mod_revision,
                also_put=[(k, v, 0) for k, v in rest],
            )
            if result.succeeded:
                break
            current = result.current


def read_many(client: EtcdClient, keys: Sequence[bytes]) -> dict[bytes, KeyValue]:
    """Those of ``keys`` that exist now: one range read (one get for a single key)."""
    if len(keys) <= 1:
        found = [client.get(k)[0] for k in keys]
        return {kv.key: kv for kv in found if kv is not None}
    wanted = set(keys)
    kvs, _ = client.get_prefix(_common_prefix(min(keys), max(keys)))
    return {kv.key: kv for kv in kvs if kv.key in wanted}


def _common_prefix(low: bytes, high: bytes) -> bytes:
    """The longest prefix of every key between ``low`` and ``high`` (byte order)."""
    n = 0
    while n < min(len(low), len(high)) and low[n] == high[n]:
        n += 1
    return low[:n]
