"""What the agent needs of a round's ``torch.distributed.Store``, shared by its wings.

Ours (``coordinator.torch_adapter.store.EtcdStore``) and torch's own stores (``TCPStore``
of the c10d rendezvous) both fit; the rank exchange, the pre-flight check's result
exchange and the exit barrier use nothing else.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

__all__ = ["Store"]


class Store(Protocol):
    """The part of ``torch.distributed.Store`` the agent uses (any torch store fits)."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def add(self, key: str, value: int) -> int: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...
    def check(self, keys: list[str]) -> bool: ...
