"""The range requests of the KV reads (pure), and what etcd makes of them.

etcd applies a range's limit while it reads only when the request asks for no sort
order and no revision filter; anything else, even "by key, ascending", makes it read
every key in the range, sort them and cut the result afterwards (1.3 ms of etcd CPU per
read of a folder of 1,000 keys, measured).
"""

from __future__ import annotations

from typing import Any

from coordinator.core.etcd_client._etcdrpc import etcdrpc
from coordinator.core.etcd_client._types import prefix_range_end

__all__ = ["_check_prefix", "_next_key_request", "_prefix_request"]


def _check_prefix(prefix: bytes) -> None:
    if not prefix:
        raise ValueError("an empty key prefix would select the whole keyspace; refusing it")


def _prefix_request(
    prefix: bytes,
    limit: int,
    keys_only: bool,
    max_create_revision: int,
    sort_by_create: bool,
    descending: bool,
) -> Any:
    """The range request of :meth:`_KV.get_prefix` (pure)."""
    request = etcdrpc.RangeRequest(
        key=prefix,
        range_end=prefix_range_end(prefix),
        limit=limit,
        keys_only=keys_only,
        max_create_revision=max_create_revision,
    )
    if sort_by_create or descending:
        # etcd then reads every key under the prefix and sorts them before it applies the
        # limit (so does any revision filter); in key order, no sort asked for (etcd's
        # own), the limit stops its read.
        request.sort_target = (
            etcdrpc.RangeRequest.CREATE if sort_by_create else etcdrpc.RangeRequest.KEY
        )
        request.sort_order = (
            etcdrpc.RangeRequest.DESCEND if descending else etcdrpc.RangeRequest.ASCEND
        )
    return request


def _next_key_request(after: bytes, prefix: bytes) -> Any:
    """The range request of :meth:`_KV.next_key` (pure): from just after ``after`` to the
    end of ``prefix``, a limit of 1, unsorted and unfiltered, so etcd stops at one key."""
    _check_prefix(prefix)
    return etcdrpc.RangeRequest(
        key=max(after + b"\0", prefix), range_end=prefix_range_end(prefix), limit=1,
        keys_only=True,
    )  # fmt: skip
