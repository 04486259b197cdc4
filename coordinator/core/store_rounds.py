"""Where each round's torch Store keeps its keys in etcd, which rounds have any, and
deleting a round's keys with its markers.

Layout under a run's store root (``<prefix>/<run>/store/``)::

    <round>/<encoded key>    the Store keys of one round (coordinator.core.keys)
    <round>~ops/<op id>      exactly-once markers of that round's add/append calls

The markers sit beside the round's folder, not in it, so that ``num_keys`` and
``list_keys`` (one range each) see only the Store's own keys; ``~`` never occurs in a
round number, so ``<round>~ops/`` can never be confused with another round's folder. A
round's markers go whenever its keys go (the executor's clean-up two rounds later,
:func:`round_prefixes`, :func:`delete_round` and :func:`delete_rounds_before`, and
``rdzvctl gc``, which removes the whole store root).

The store root is also where a coordinator that never saw the state finds the last round
of a run whose state key was deleted (:func:`highest_store_round`): a round's Store is
written as soon as the round completes (the rank exchange), and kept for two rounds.
"""

from __future__ import annotations

import logging

from coordinator.core.etcd_client import EtcdClient
from coordinator.core.keys import round_store_prefix

__all__ = [
    "OPS_SUFFIX",
    "delete_round",
    "delete_rounds_before",
    "highest_store_round",
    "ops_prefix",
    "round_of_folder",
    "round_prefixes",
]

log = logging.getLogger(__name__)

OPS_SUFFIX = b"~ops"


def ops_prefix(store_prefix: bytes) -> bytes:
    """The folder of the exactly-once markers of the Store at ``store_prefix``.

    Raises:
        ValueError: ``store_prefix`` does not end with ``/``.
    """
    if not store_prefix.endswith(b"/"):
        raise ValueError(f"store prefix {store_prefix!r} must end with '/'")
    return store_prefix[:-1] + OPS_SUFFIX + b"/"


def round_prefixes(store_root: bytes, round: int) -> list[bytes]:
    """Every prefix holding round ``round``'s data: its keys and its markers.

    Raises:
        ValueError: ``round`` is negative or ``store_root`` does not end with ``/``.
    """
    keys = round_store_prefix(store_root, round)
    return [keys, ops_prefix(keys)]


def round_of_folder(folder: bytes) -> int | None:
    """The round of a folder name under the store root (``12`` or ``12~ops``); None if the
    folder is not one of ours (it is then left alone)."""
    digits = folder[: -len(OPS_SUFFIX)] if folder.endswith(OPS_SUFFIX) else folder
    if not digits.isdigit() or digits != str(int(digits)).encode("ascii"):
        return None
    return int(digits)


def highest_store_round(client: EtcdClient, store_root: bytes) -> int:
    """The highest round that has Store keys or markers under ``store_root`` (0: none).

    One range read of key names only; the store root holds at most the last two rounds.

    Raises:
        EtcdConnectionError: etcd did not answer.
    """
    kvs, _ = client.get_prefix(store_root, keys_only=True)
    rounds = {round_of_folder(kv.key[len(store_root) :].split(b"/", 1)[0]) for kv in kvs}
    return max((r for r in rounds if r is not None), default=0)


def delete_round(client: EtcdClient, store_root: bytes, round: int) -> int:
    """Delete every Store key of ``round`` under ``store_root`` (and its exactly-once
    markers); return how many Store keys."""
    keys_prefix, markers = round_prefixes(store_root, round)
    deleted, _ = client.delete_prefix(keys_prefix)
    client.delete_prefix(markers)
    return deleted


def delete_rounds_before(client: EtcdClient, store_root: bytes, round: int) -> int:
    """Delete the Store keys of every round below ``round``; return how many keys.

    Keys under ``store_root`` whose folder is not a round number are left alone (and
    logged): they are not ours to remove.

    Raises:
        ValueError: ``store_root`` does not end with ``/`` or ``round`` is negative.
    """
    round_store_prefix(store_root, round)  # validates both
    kvs, _ = client.get_prefix(store_root, keys_only=True)
    old_rounds: set[int] = set()
    for kv in kvs:
        found = round_of_folder(kv.key[len(store_root) :].split(b"/", 1)[0])
        if found is None:
            log.warning("not deleting foreign key %r under store root %r", kv.key, store_root)
            continue
        if found < round:
            old_rounds.add(found)
    return sum(delete_round(client, store_root, r) for r in sorted(old_rounds))
