"""The leader's table of node keys, kept current by one watch of the node keys' prefix.

Each leadership term starts the watch from now and then reads every node key (the
:class:`~coordinator.core.node_table.NodeTable` sorts out the order); from then on each
event is applied under the table's lock and wakes the leader, O(1) per join. A watch that
is compacted, or ends for good, leaves the table stale: the leader then leads again from a
fresh read rather than decide from joins it no longer hears of.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from coordinator.core.etcd_client import EtcdClient, Watch, WatchEvent
from coordinator.core.node_table import NodeTable
from coordinator.core.state import NodeInfo

__all__ = ["NodeWatch"]

# The duty's logger: these lines are the coordinator duty's.
log = logging.getLogger("coordinator.core.duty")


class NodeWatch:
    """The node keys under ``nodes_prefix`` as the leader knows them; ``wake`` is called
    (on the client's watch thread, no lock held) whenever they may have changed.

    Thread-safe: ``_lock`` is a leaf lock, never held across an RPC.
    """

    def __init__(self, client: EtcdClient, nodes_prefix: bytes, wake: Callable[[], None]) -> None:
        self._client = client
        self._prefix = nodes_prefix
        self._wake = wake
        self._table = NodeTable()
        self._lock = threading.Lock()
        self._stale = threading.Event()
        self._watch: Watch | None = None

    def start(self) -> None:
        """Watch the node keys from now, then read them all (RPCs: call it holding no lock)."""
        with self._lock:
            self._table.reset()
        self._watch, (kvs, revision) = self._client.watch_then_read(
            self._prefix,
            lambda: self._client.get_prefix(self._prefix),
            self._on_events,
            self._on_compacted,
            prefix=True,
            on_error=self._on_error,
        )
        with self._lock:
            self._table.load(kvs, revision)
        self._wake()

    def stop(self) -> None:
        """Cancel the watch and forget the table (the term is over)."""
        if self._watch is not None:
            self._watch.cancel()
        with self._lock:
            self._table.reset()

    def take_stale(self) -> bool:
        """Whether the watch lost events since the last call (compacted or ended): the
        table can no longer be trusted and must be read again."""
        if not self._stale.is_set():
            return False
        self._stale.clear()
        return True

    @contextmanager
    def locked(self) -> Iterator[NodeTable]:
        """The table, under its lock: for a decision made from one consistent table."""
        with self._lock:
            yield self._table

    def take_appeared(self) -> dict[str, NodeInfo]:
        """The node keys that appeared since the last call."""
        with self._lock:
            return self._table.take_appeared()

    def live(self, participants: Sequence[str]) -> list[str]:
        """Those of ``participants`` whose node key is in the table, in order."""
        with self._lock:
            table = self._table.nodes
            return [p for p in participants if p in table]

    def _on_events(self, events: list[WatchEvent], _revision: int) -> None:
        with self._lock:
            applied = self._table.apply(events)
        if applied:
            self._wake()

    def _on_compacted(self, _revision: int) -> None:
        # Leading again re-reads every node key and watches from there.
        self._stale.set()
        self._wake()

    def _on_error(self, error: Exception) -> None:
        # The node watch ended for good (etcd cancelled it, or the watch thread died): a
        # leader that kept its table would decide from joins it no longer hears of.
        log.warning("coordinator duty: watch of the node keys ended (%s); re-reading", error)
        self._on_compacted(0)
