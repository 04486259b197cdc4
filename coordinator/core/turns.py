"""Where a node stands in line for the coordinator duty: the watches on the turn keys.

Each node's turn key (:meth:`~coordinator.core.keys.RunKeys.turn`, written with its node
key) places it: the node with the last key under ``turns/`` coordinates; each other node
waits on the first key after its own, its senior. Finding the senior is one range read
with a limit, which etcd answers from its index (:meth:`EtcdClient.next_key`). These are
the watches the duty (:mod:`coordinator.core.duty`) waits on; their callbacks run on the
client's watch thread and only set flags and wake the duty.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.core.etcd_client import EtcdClient, Watch, WatchEvent, prefix_range_end
from coordinator.core.keys import RunKeys

__all__ = ["InLine", "senior_after", "watch_for_seniors", "watch_in_line"]

log = logging.getLogger(__name__)


def senior_after(senior: bytes, events: list[WatchEvent]) -> bytes | None:
    """A waiting node's senior after ``events`` on the turn keys between its own key and
    ``senior``'s (inclusive); None: the senior is gone, look again.

    A key written between the two is a node that came earlier than this one (after its
    senior) whose write was slower: it is the senior now, with no new read or watch (the
    watched range still covers it). Only the current senior's deletion sends the node back
    to etcd: a key beyond it going changes nothing about who is first after this node.
    """
    for event in events:
        key = event.kv.key
        if event.kind == "put" and key < senior:
            senior = key
        elif event.kind == "delete" and key == senior:
            return None
    return senior


@dataclass
class InLine:
    """A waiting node's watches: on the way to its senior (and the senior's key), and on
    its own node key's deletion."""

    watches: list[Watch]
    again: threading.Event = field(default_factory=threading.Event)  # look again
    own_key_deleted: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        for watch in self.watches:
            watch.cancel()


def watch_in_line(
    client: EtcdClient,
    node_key: bytes,
    turn: bytes,
    senior: bytes,
    revision: int,
    wake: Callable[[], None],
) -> InLine:
    """Watch, from ``revision + 1``, every turn key after ``turn`` up to and including the
    ``senior``'s (the senior's deletion: look again; a key that came between is the new
    senior, :func:`senior_after`), and the node's own key ``node_key`` for its deletion.
    From the read's revision on: a change since that read is delivered (etcd catches a
    watch that starts in the past up), with no second read and no wait for etcd's
    confirmation, while the others join."""
    watches: list[Watch] = []
    line = InLine(watches)
    first_after = [senior]  # as the watch knows it; read and moved on the watch thread only

    def look_again() -> None:
        line.again.set()
        wake()

    def on_events(events: list[WatchEvent], _rev: int) -> None:
        now_senior = senior_after(first_after[0], events)
        if now_senior is None:
            look_again()
        else:
            first_after[0] = now_senior

    def on_own_key(_events: list[WatchEvent], _rev: int) -> None:
        line.own_key_deleted.set()
        look_again()

    def on_compacted(_rev: int) -> None:
        look_again()  # nobody knows what came meanwhile: look again from scratch

    def on_error(error: Exception) -> None:
        # The watch ended (etcd cancelled it, or the watch thread died): look again with a
        # new one rather than wait for a change that can no longer come.
        log.info("coordinator duty: a watch of its place in line ended (%s); re-checking", error)
        on_compacted(0)

    way = client.watch(
        turn + b"\0", revision + 1, on_events, on_compacted,
        range_end=senior + b"\0", on_error=on_error,
    )  # fmt: skip
    watches.append(way)
    # The node's own key deleted under its live lease (an operator's etcdctl del) is found
    # here, not only by a leader's fenced commit: a node that waits in line would never
    # hear of it otherwise (its turn key stays). Deletions only: no event per round.
    own = client.watch(
        node_key, revision + 1, on_own_key, on_compacted, no_put=True, on_error=on_error
    )
    watches.append(own)
    return line


def watch_for_seniors(
    client: EtcdClient,
    keys: RunKeys,
    turn: bytes,
    since: int,
    outranked: threading.Event,
    wake: Callable[[], None],
) -> Watch:
    """While a node leads: a turn key written after its ``turn`` since ``since`` (a node
    that came earlier, or joined with it, whose write was slower) outranks it."""

    def on_events(events: list[WatchEvent], _rev: int) -> None:
        if any(event.kind == "put" for event in events):
            outranked.set()
            wake()

    def on_ended(_why: object) -> None:
        # Nobody knows what came meanwhile: step down and look again.
        outranked.set()
        wake()

    return client.watch(
        turn + b"\0", since + 1, on_events, on_ended,
        range_end=prefix_range_end(keys.turns_prefix), on_error=on_ended,
    )  # fmt: skip
