"""What the agent needs of a round's ``torch.distributed.Store``, shared by its wings, and
how it gathers many nodes' values from one.

Ours (``coordinator.torch_adapter.store.EtcdStore``) and torch's own stores (``TCPStore``
of the c10d rendezvous) both fit; the rank exchange, the pre-flight check's result
exchange and the exit barrier use nothing else. Where the store is ours, a node that
gathers the others' values reads them with one range read (:func:`gather`), never one
``get`` per key (DESIGN §10); on torch's stores ``multi_get`` is one request already.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

from torch.distributed import DistStoreError

from coordinator.torch_adapter.store import EtcdStore

__all__ = ["Store", "gather", "gather_all"]


class Store(Protocol):
    """The part of ``torch.distributed.Store`` the agent uses (any torch store fits)."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def add(self, key: str, value: int) -> int: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...
    def check(self, keys: list[str]) -> bool: ...


def _indexed(prefix: str, count: int, found: dict[str, bytes]) -> dict[int, bytes]:
    out = {}
    for key, value in found.items():
        tail = key[len(prefix) :]
        if tail.isdigit() and str(int(tail)) == tail and int(tail) < count:
            out[int(tail)] = value
    return out


def gather(store: Store, prefix: str, count: int, timeout: timedelta) -> dict[int, bytes]:
    """The values at ``prefix + "0"`` .. ``prefix + str(count - 1)``, by index: all of them
    as soon as they are there, else those there after ``timeout``.

    Ours: one range read, and while some are missing one watch of the prefix (its events
    reach this caller only) and a second range read: O(1) requests whatever ``count``.
    torch's stores: ``wait``, then ``multi_get`` of those there.

    Raises:
        DistStoreError: our store's wait was aborted (the membership changed).
    """
    if isinstance(store, EtcdStore):
        return _indexed(prefix, count, store.gather(prefix, count, timeout))
    keys = [f"{prefix}{i}" for i in range(count)]
    try:
        store.wait(keys, timeout)
    except Exception:  # timed out: some never came (the caller judges them missing)
        keys = [k for k in keys if store.check([k])]
    values = store.multi_get(keys) if keys else []
    return {int(k[len(prefix) :]): v for k, v in zip(keys, values, strict=True)}


def gather_all(store: Store, prefix: str, count: int) -> list[bytes]:
    """Every value at ``prefix + "0"`` .. ``prefix + str(count - 1)``, in order, waiting
    up to the store's own timeout (as ``multi_get`` does); see :func:`gather` for the cost.

    Raises:
        DistStoreError: some did not come in time (named), or the wait was aborted.
    """
    if not isinstance(store, EtcdStore):
        return store.multi_get([f"{prefix}{i}" for i in range(count)])
    found = _indexed(prefix, count, store.gather(prefix, count))
    missing = [i for i in range(count) if i not in found]
    if missing:
        shown = ", ".join(f"{prefix}{i}" for i in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise DistStoreError(
            f"store keys {shown}{more} did not appear within the store timeout; check that "
            "the nodes that set them are alive, or raise it (rdzv_conf timeout=SECONDS)"
        )
    return [found[i] for i in range(count)]
