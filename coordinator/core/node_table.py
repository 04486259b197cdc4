"""The coordinator's table of node keys: one full read, then the watch's events.

Pure bookkeeping, no I/O: the coordinator watches the node keys from *now*, then reads
them all (see ``Watch.wait_created`` for why not the other way round). Events can then
arrive before the read is applied, and events the read already reflects can arrive
after it. The table holds events until it has a read, and from then on applies only
events newer than the read, so each change counts once and in revision order.

The table also keeps the counts the coordinator decides from (:meth:`NodeTable.tally`,
a :class:`~coordinator.core.tally.TallyIndex`) current with each change, so deciding
after a join costs O(1), not a scan of every node.
Not thread-safe: the caller locks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from coordinator.core.errors import ConfigError, CorruptValueError
from coordinator.core.etcd_client import KeyValue, WatchEvent
from coordinator.core.keys import validate_node_id
from coordinator.core.state import NodeInfo, RdzvState, decode_node
from coordinator.core.tally import Tally, TallyIndex

__all__ = ["NodeTable"]

log = logging.getLogger(__name__)


class NodeTable:
    """Node id -> record, as of the last read plus the newer watch events."""

    def __init__(self) -> None:
        self._nodes: dict[str, NodeInfo] = {}
        self._node_id_by_key: dict[bytes, str] = {}
        self._read_at: int | None = None  # None: no read yet; events are held
        self._held: list[WatchEvent] = []
        self._index = TallyIndex()
        self._view = MappingProxyType(self._nodes)
        self._appeared: dict[str, NodeInfo] = {}  # new keys since take_appeared()

    @property
    def read_at(self) -> int | None:
        """The revision of the read applied (None while waiting for one)."""
        return self._read_at

    def reset(self) -> None:
        """Forget everything; hold events until the next :meth:`load`."""
        self._nodes.clear()
        self._node_id_by_key.clear()
        self._index.forget()
        self._read_at = None
        self._held = []
        self._appeared.clear()

    def load(self, kvs: Iterable[KeyValue], revision: int) -> None:
        """Apply a full read made at ``revision``, then the held events newer than it."""
        self._nodes.clear()
        self._node_id_by_key.clear()
        self._index.forget()
        for kv in kvs:
            self._put(kv.key, kv.value, kv.create_revision)
        self._read_at = revision
        held, self._held = self._held, []
        self.apply(held)

    def apply(self, events: Iterable[WatchEvent]) -> bool:
        """Apply watch events (held until the first read); whether they were applied."""
        if self._read_at is None:
            self._held.extend(events)
            return False
        for event in events:
            if event.kv.mod_revision <= self._read_at:
                continue  # the read already has it
            if event.kind == "put":
                self._put(event.kv.key, event.kv.value, event.kv.create_revision)
            else:
                self._drop_key(event.kv.key)
        return True

    def snapshot(self) -> dict[str, NodeInfo]:
        """A copy of the table: O(N), for tests and operators, not for each decision."""
        return dict(self._nodes)

    @property
    def nodes(self) -> Mapping[str, NodeInfo]:
        """The table itself, read-only and live (valid while the caller holds its lock)."""
        return self._view

    def take_appeared(self) -> dict[str, NodeInfo]:
        """The node keys created since the last call (by node id; a key re-created
        under the same id is there again with its new create revision): O(changes), for
        the run's timeline (joins)."""
        appeared, self._appeared = self._appeared, {}
        return appeared

    def tally(self, state: RdzvState) -> Tally:
        """The decision's counts of this table against ``state``: O(1) when ``state`` is
        the one asked about last time, else one O(N) count."""
        return self._index.tally(state, self._nodes)

    def _drop_key(self, key: bytes) -> None:
        node_id = self._node_id_by_key.pop(key, None)
        if node_id is not None:
            self._remove(node_id)

    def _remove(self, node_id: str) -> None:
        old = self._nodes.pop(node_id, None)
        if old is not None:
            self._index.changed(node_id, old, None)
        self._appeared.pop(node_id, None)

    def _put(self, key: bytes, value: bytes, create_revision: int) -> None:
        shown = key.decode(errors="replace")
        try:
            node = decode_node(shown, value, create_revision)
            # The key names the node: its lease is what ends the node's part. A value
            # naming another node (a foreign or copied record) would keep that node
            # alive in this table after its own key went, or replace its record.
            if node.node_id != _id_of(key):
                raise CorruptValueError(
                    shown, f"node_id {node.node_id!r} in the value differs from the key"
                )
        except CorruptValueError as exc:
            log.warning("ignoring node key: %s", exc)
            return
        old = self._nodes.get(node.node_id)
        self._nodes[node.node_id] = node
        self._node_id_by_key[key] = node.node_id
        self._index.changed(node.node_id, old, node)
        if old is None or old.create_revision != node.create_revision:
            self._appeared[node.node_id] = node


def _id_of(key: bytes) -> str:
    """The node id a node key names (its last part), or "" when it names none."""
    try:
        return validate_node_id(key.rsplit(b"/", 1)[-1].decode("ascii"))
    except (UnicodeDecodeError, ConfigError):
        return ""
