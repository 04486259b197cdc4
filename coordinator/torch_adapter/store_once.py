"""Exactly-once read-modify-write of one Store key (``add``, ``append``), under retries.

Why: such a write is a compare-and-swap loop. If etcd commits an attempt but its reply
is lost (a member dies mid-call, a connection resets), the client sends the same
transaction again; its compare now fails, and a plain loop would read the value (with our
write already in it) and apply the operation a second time. The exit barrier counts
arrivals with ``add``: a double count releases it early.

How: every call gets an operation id. The transaction that writes the key also creates a
marker key for that id (:func:`coordinator.core.store_rounds.ops_prefix`, beside the
round's folder) holding the operation's result, and it requires that marker to be absent.
So a write carrying an id lands at most once whatever is replayed, and when an attempt
fails the loop first looks for its marker: present means an earlier attempt landed (its
reply was lost), and the marker's value is that attempt's answer. The common case costs
nothing extra: the marker is written in the same transaction, and read only after a lost
race. Markers live as long as their round's Store.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from coordinator.core.etcd_client import EtcdClient, KeyValue

__all__ = ["new_op_id", "write_once"]

Modify = Callable[[KeyValue | None], tuple[bytes, bytes]]
"""Given the key's current value (None: absent), the new value and the result to keep."""


def new_op_id() -> str:
    """A fresh operation id (128 random bits, hex): unique across every writer of a run."""
    return secrets.token_hex(16)


def write_once(client: EtcdClient, key: bytes, marker: bytes, modify: Modify) -> bytes:
    """Apply ``modify`` to ``key`` exactly once for the operation whose marker is ``marker``.

    Calling it again with the same ``marker`` (what a retry after a lost reply amounts to)
    changes nothing and returns the result the first application recorded.

    Returns:
        the result ``modify`` returned for the attempt that landed.

    Raises:
        whatever ``modify`` raises (nothing is written then); ``EtcdConnectionError`` when
        etcd does not answer within the retry budget (the operation may or may not have
        landed: calling again with the same marker finishes it exactly once).
    """
    current, _ = client.get(key)
    while True:
        value, result = modify(current)
        outcome = client.put_if_mod_revision(
            key,
            value,
            0 if current is None else current.mod_revision,
            also_put=[(marker, result, 0)],
            # Create revision 0 = the marker is absent: the operation has not landed yet.
            fence=(marker, 0),
        )
        if outcome.succeeded:
            return result
        landed, _ = client.get(marker)
        if landed is not None:
            return landed.value  # an earlier attempt landed; its reply was lost
        # Lost a race with another writer: the failed transaction read its value.
        current = outcome.current
