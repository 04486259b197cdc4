"""The one module that talks to etcd (v3 gRPC API). INTERFACE SKELETON — being implemented.

Everything else in the project uses only the names in ``__all__``; swapping the client
library must touch this module only. gRPC errors become ``coordinator.errors`` types here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "EtcdClient",
    "EtcdConfig",
    "KeepAlive",
    "KeyValue",
    "TxnResult",
    "Watch",
    "WatchEvent",
]


@dataclass(frozen=True)
class EtcdConfig:
    """How to reach etcd. Built from validated settings; never from raw user strings."""

    endpoints: tuple[str, ...]  # "host:port" each, at least one
    protocol: Literal["http", "https"] = "http"
    ca_cert: str | None = None
    cert: str | None = None
    cert_key: str | None = None
    user: str | None = None
    password: str | None = None
    # Upper bound for one unary RPC attempt, and for all retries/failover of one call.
    request_timeout: float = 5.0
    retry_budget: float = 30.0


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    kv: KeyValue  # for "delete": key set, value b"", mod_revision = revision of the delete
    prev_kv: KeyValue | None


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int  # header revision after the transaction
    current: KeyValue | None  # the guarded key's value when the compare failed (None: absent)


class Watch:
    """A running watch; events are delivered on the client's watch thread."""

    def cancel(self) -> None: ...


class KeepAlive:
    """One long-lived keep-alive stream for one lease."""

    lease_id: int
    ttl: int

    def lost(self) -> bool: ...
    def wait_lost(self, timeout: float | None = None) -> bool: ...
    def close(self, revoke: bool = True) -> None: ...


class EtcdClient:
    def __init__(self, config: EtcdConfig) -> None: ...

    # KV
    def get(self, key: bytes) -> tuple[KeyValue | None, int]: ...
    def get_prefix(
        self,
        prefix: bytes,
        *,
        sort_by_create: bool = False,
        descending: bool = False,
        limit: int = 0,
        max_create_revision: int = 0,
        keys_only: bool = False,
    ) -> tuple[list[KeyValue], int]: ...
    def count_prefix(self, prefix: bytes) -> tuple[int, int]: ...
    def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int: ...
    def delete(self, key: bytes) -> tuple[int, int]: ...
    def delete_prefix(self, prefix: bytes) -> tuple[int, int]: ...
    def put_if_mod_revision(
        self,
        key: bytes,
        value: bytes,
        mod_revision: int,
        *,
        lease: int = 0,
        also_put: Sequence[tuple[bytes, bytes, int]] = (),
        also_delete_prefixes: Sequence[bytes] = (),
    ) -> TxnResult: ...
    def delete_if_mod_revision(self, key: bytes, mod_revision: int) -> TxnResult: ...

    # Leases
    def lease_grant(self, ttl: int) -> int: ...
    def lease_revoke(self, lease_id: int) -> None: ...
    def lease_time_to_live(self, lease_id: int) -> int: ...
    def keep_alive(
        self, lease_id: int, ttl: int, on_lost: Callable[[], None] | None = None
    ) -> KeepAlive: ...

    # Watches
    def watch(
        self,
        key: bytes,
        start_revision: int,
        on_events: Callable[[list[WatchEvent], int], None],
        on_compacted: Callable[[int], None],
        *,
        prefix: bool = False,
    ) -> Watch: ...

    def close(self) -> None: ...
