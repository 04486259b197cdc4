"""``rdzvctl watch``: one line per change of a run, as it happens.

:class:`Tracker` is pure: it holds what is known of a run (state and node records) and
turns each etcd event into :class:`Change` values (``node vm-1-0 joined (asks for round
3)``, ``round 3 complete: 3 nodes [a b c]``, ``node x lost``, ``run closed (reason)``).
:func:`follow` is the I/O: it watches the run's prefix from now, then reads the run (so
no change is missed, and none waits for etcd's catch-up of a watch that starts in the
past), and hands every change to a callback until asked to stop. The
run's torch Store keys are ignored: they change on every rank exchange and mean nothing
to an operator. A progress key is written only when its node suspects a hang and deleted
when the node makes progress again, so each is a line here (``node x suspects a hang:
...``); a declared hang shows as a change of the state.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coordinator.core.errors import CorruptValueError
from coordinator.core.keys import RunKeys
from coordinator.core.progress import decode_progress
from coordinator.core.state import NodeInfo, RdzvState, decode_state
from coordinator.rdzvctl.model import RunSnapshot, decode_nodes, read_run
from coordinator.rdzvctl.progress_format import hang_text, suspicion_text

if TYPE_CHECKING:
    from coordinator.core.etcd_client import EtcdClient, Watch, WatchEvent

__all__ = ["Change", "Inbox", "Tracker", "diff_states", "follow"]


@dataclass(frozen=True)
class Change:
    """One change of a run, as an operator reads it.

    Attributes:
        revision: the etcd revision of the change.
        kind: node_joined, node_asks, node_rewrote, node_left, round_complete, waiting,
            not_waiting, redundant, not_redundant, lost, closed, state_rewritten,
            state_deleted, foreign_key, corrupt, resync, incarnation (started again),
            draining, hang (a hang was declared: ``nodes`` stopped first), suspects (a
            node's workers made no progress for most of its hang timeout), unsuspects
            (its record went: progress again, or the node left).
        text: the human line (without the time).
        node_id, round, nodes, reason: the facts the text is made of, for ``--json``.
    """

    revision: int
    kind: str
    text: str
    node_id: str = ""
    round: int = 0
    nodes: tuple[str, ...] = ()
    reason: str = ""


def _names(ids: tuple[str, ...]) -> str:
    return "[" + " ".join(ids) + "]"


def _added(old: tuple[str, ...], new: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n for n in new if n not in old)


def diff_states(old: RdzvState, new: RdzvState, revision: int) -> list[Change]:
    """The changes from ``old`` to ``new`` state, in the order an operator expects."""
    out: list[Change] = []
    next_round = new.round + 1
    if new.incarnation != old.incarnation:
        text = f"run started again as incarnation {new.incarnation} (round {new.round})"
        return [Change(revision, "incarnation", text, round=new.round)]
    for node in _added(old.draining, new.draining):
        text = f"node {node} asked to leave (drain)"
        out.append(Change(revision, "draining", text, node_id=node, round=new.round))
    before = {q.node_id for q in old.quarantined}
    for entry in new.quarantined:
        if entry.node_id not in before:
            text = f"node {entry.node_id} quarantined: {entry.reason}"
            out.append(
                Change(revision, "quarantined", text, node_id=entry.node_id, round=new.round,
                       reason=entry.reason)
            )  # fmt: skip
    after = {q.node_id for q in new.quarantined}
    for node in sorted(before - after):
        text = f"node {node} out of quarantine"
        out.append(Change(revision, "released", text, node_id=node, round=new.round))
    if new.round != old.round:
        text = f"round {new.round} complete: {len(new.participants)} nodes"
        text += f" {_names(new.participants)}"
        if new.redundancy_list:
            text += f", redundant {_names(new.redundancy_list)}"
        out.append(
            Change(revision, "round_complete", text, round=new.round, nodes=new.participants)
        )
    else:
        for node in _added(old.lost, new.lost):
            rank = new.rank_of(node)
            out.append(
                Change(revision, "lost", f"node {node} lost (rank {rank} of round {new.round})",
                       node_id=node, round=new.round)
            )  # fmt: skip
        for node in _added(old.wait_list, new.wait_list):
            out.append(
                Change(revision, "waiting", f"node {node} waits for round {next_round}",
                       node_id=node, round=next_round)
            )  # fmt: skip
        for node in _added(new.wait_list, old.wait_list):
            out.append(
                Change(revision, "not_waiting", f"node {node} left the wait list", node_id=node)
            )
        for node in _added(old.redundancy_list, new.redundancy_list):
            text = f"node {node} is redundant (round {new.round} is full)"
            out.append(Change(revision, "redundant", text, node_id=node, round=new.round))
        for node in _added(new.redundancy_list, old.redundancy_list):
            text = f"node {node} left the redundancy list"
            out.append(Change(revision, "not_redundant", text, node_id=node))
    if new.hang is not None and new.hang != old.hang:
        text = f"hang declared in {hang_text(new.hang)}"
        out.append(Change(revision, "hang", text, round=new.hang.round, nodes=new.hang.nodes))
    if new.closed and not old.closed:
        reason = new.closed_reason
        text = f"run closed ({reason})" if reason else "run closed"
        out.append(Change(revision, "closed", text, round=new.round, reason=reason))
    if not out:
        text = f"state rewritten by {new.written_by or 'unknown'} (round {new.round})"
        out.append(Change(revision, "state_rewritten", text, round=new.round))
    return out


class Tracker:
    """What is known of one run, kept current by applying watch events (pure).

    Args:
        snapshot: the run as read; events at or below the revision of the read that
            covered a key are skipped (they are already in the snapshot).
    """

    def __init__(self, snapshot: RunSnapshot) -> None:
        self._keys = snapshot.keys
        self._state = snapshot.effective_state
        self._state_guard = snapshot.state_revision
        self._nodes_guard = snapshot.nodes_revision
        self._nodes: dict[str, NodeInfo] = {n.node_id: n.info for n in snapshot.nodes}

    @property
    def state(self) -> RdzvState:
        return self._state

    @property
    def nodes(self) -> dict[str, NodeInfo]:
        return dict(self._nodes)

    def apply(self, events: list[WatchEvent]) -> list[Change]:
        """The changes that ``events`` (in revision order) make."""
        out: list[Change] = []
        for event in events:
            out.extend(self._apply_one(event))
        return out

    def _apply_one(self, event: WatchEvent) -> list[Change]:
        key, revision = event.kv.key, event.kv.mod_revision
        shown = key.decode("utf-8", "backslashreplace")
        keys = self._keys
        if key == keys.state:
            if revision <= self._state_guard:
                return []
            if event.kind == "delete":
                self._state = RdzvState()
                text = "state key deleted (the run was garbage-collected or reset)"
                return [Change(revision, "state_deleted", text)]
            try:
                new = decode_state(shown, event.kv.value)
            except CorruptValueError as exc:
                return [Change(revision, "corrupt", str(exc))]
            old, self._state = self._state, new
            return diff_states(old, new, revision)
        if key.startswith(keys.nodes_prefix):
            if revision <= self._nodes_guard:
                return []
            return self._node_event(event, revision, shown)
        if key.startswith(keys.progress_prefix):
            # Read after the node keys: what that read held is not news either.
            if revision <= self._nodes_guard:
                return []
            return self._progress_event(event, revision, shown)
        if key.startswith((keys.store_root, keys.events_prefix, keys.turns_prefix)):
            # The Store's keys; the timeline (rdzvctl events --follow); the turn keys,
            # which come and go with the node keys (reported above).
            return []
        text = f"key {shown} {'deleted' if event.kind == 'delete' else 'written'} (not ours)"
        return [Change(revision, "foreign_key", text)]

    def _progress_event(self, event: WatchEvent, revision: int, shown: str) -> list[Change]:
        try:
            node_id = self._keys.node_id_from_progress_key(event.kv.key)
        except CorruptValueError:
            return []
        if event.kind == "delete":
            text = f"node {node_id} no longer suspects a hang (progress again, or it left)"
            return [Change(revision, "unsuspects", text, node_id=node_id)]
        try:
            record = decode_progress(shown, event.kv.value)
        except CorruptValueError as exc:
            return [Change(revision, "corrupt", str(exc))]
        if not record.stalled:
            return []  # an agent of an earlier version writes healthy nodes too
        text = suspicion_text(record)
        return [Change(revision, "suspects", text, node_id=node_id, round=record.round)]

    def _node_event(self, event: WatchEvent, revision: int, shown: str) -> list[Change]:
        if event.kind == "delete":
            try:
                node_id = self._keys.node_id_from_key(event.kv.key)
            except CorruptValueError:
                return []
            if self._nodes.pop(node_id, None) is None:
                return []
            text = f"node {node_id} left (its key is gone: lease revoked or expired)"
            return [Change(revision, "node_left", text, node_id=node_id)]
        decoded, errors = decode_nodes(self._keys, [event.kv])
        if errors:
            return [Change(revision, "corrupt", str(errors[0]))]
        info = decoded[0].info
        old = self._nodes.get(info.node_id)
        self._nodes[info.node_id] = info
        wanted = info.wanted_round
        if old is None:
            text = f"node {info.node_id} joined (asks for round {wanted})"
            return [Change(revision, "node_joined", text, node_id=info.node_id, round=wanted)]
        if old.wanted_round != wanted:
            text = f"node {info.node_id} asks for round {wanted}"
            return [Change(revision, "node_asks", text, node_id=info.node_id, round=wanted)]
        text = f"node {info.node_id} rewrote its record (asks for round {wanted})"
        return [Change(revision, "node_rewrote", text, node_id=info.node_id, round=wanted)]

    def resync(self, snapshot: RunSnapshot) -> list[Change]:
        """Adopt a fresh read (after the watch's history was compacted); returns what
        changed in between, summarised."""
        revision = snapshot.revision
        out = [Change(revision, "resync", f"watch history compacted; re-read at {revision}")]
        fresh = {n.node_id: n.info for n in snapshot.nodes}
        for node_id in self._nodes.keys() - fresh.keys():
            text = f"node {node_id} left (its key is gone: lease revoked or expired)"
            out.append(Change(revision, "node_left", text, node_id=node_id))
        for node_id, info in fresh.items():
            if node_id not in self._nodes:
                text = f"node {node_id} joined (asks for round {info.wanted_round})"
                out.append(
                    Change(revision, "node_joined", text, node_id=node_id, round=info.wanted_round)
                )
        new = snapshot.effective_state
        if new != self._state:
            out.extend(diff_states(self._state, new, revision))
        self._state, self._nodes = new, fresh
        self._state_guard, self._nodes_guard = snapshot.state_revision, snapshot.nodes_revision
        return out


class _Stop:
    """The item :meth:`Inbox.stop` queues."""


class Inbox:
    """What the watch thread hands to :func:`follow`: events, a compaction, an error.

    :meth:`stop` may be called from a signal handler (``SimpleQueue.put`` is reentrant):
    rdzvctl ends a watch on Ctrl-C this way instead of letting KeyboardInterrupt land in
    the middle of the etcd client's thread handling.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[list[WatchEvent] | int | Exception | _Stop] = (
            queue.SimpleQueue()
        )

    def put(self, item: list[WatchEvent] | int | Exception) -> None:
        self._queue.put(item)

    def stop(self) -> None:
        """Make :func:`follow` return at its next wake-up."""
        self._queue.put(_Stop())

    def get(self, timeout: float | None) -> list[WatchEvent] | int | Exception | _Stop:
        """The next item; raises ``queue.Empty`` after ``timeout`` seconds."""
        return self._queue.get(timeout=timeout)


def _watch_then_read(client: EtcdClient, keys: RunKeys, inbox: Inbox) -> tuple[Watch, RunSnapshot]:
    # Watch from now, wait for etcd to confirm, then read: the read covers every revision
    # the watch does not, and the first change arrives at once. (Read, then watch from the
    # read's revision + 1 misses nothing either, but etcd files such a watch as unsynced
    # and delivers its first events on a catch-up pass up to 100 ms later.) Events the
    # read already holds may still be queued; the Tracker drops them by revision.
    return client.watch_then_read(
        keys.run_prefix,
        lambda: read_run(client, keys),
        lambda events, _rev: inbox.put(events),
        inbox.put,
        prefix=True,
        on_error=inbox.put,
    )


def follow(
    client: EtcdClient,
    keys: RunKeys,
    emit: Callable[[Change], None],
    *,
    count: int | None = None,
    timeout: float | None = None,
    on_start: Callable[[RunSnapshot], None] | None = None,
    inbox: Inbox | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Print the run's changes through ``emit`` until ``count`` changes, ``timeout`` s, or
    ``inbox.stop()``.

    Blocks on the watch's events (no polling). If etcd compacted the history a broken
    watch stream had to resume from, the run is watched and read afresh, and what changed
    in between is summarised (:meth:`Tracker.resync`).

    Returns:
        How many changes were emitted.

    Raises:
        EtcdConnectionError: etcd did not answer the first read, or did not confirm or
            cancelled the watch (e.g. no permission).
    """
    # The watch thread only queues what it gets (its callbacks must not block); this
    # thread does the reading and printing.
    inbox = inbox or Inbox()
    deadline = None if timeout is None else clock() + timeout
    watch, snapshot = _watch_then_read(client, keys, inbox)
    emitted = 0
    try:
        if on_start is not None:
            on_start(snapshot)
        tracker = Tracker(snapshot)
        while True:
            left = None if deadline is None else deadline - clock()
            if left is not None and left <= 0:
                return emitted
            try:
                item = inbox.get(timeout=left)
            except queue.Empty:
                return emitted
            if isinstance(item, _Stop):
                return emitted
            if isinstance(item, Exception):
                raise item
            if isinstance(item, int):
                watch.cancel()
                watch, fresh = _watch_then_read(client, keys, inbox)
                changes = tracker.resync(fresh)
            else:
                changes = tracker.apply(item)
            for change in changes:
                emit(change)
                emitted += 1
                if count is not None and emitted >= count:
                    return emitted
    finally:
        watch.cancel()
