"""Writing a run's timeline to etcd: best effort, never in the rendezvous' way.

Two ways in:

* :func:`record_event`: one synchronous write with a short retry budget, for a writer
  that is about to go (a node leaving, ``rdzvctl``, a close). Never raises.
* :class:`EventLog`: a background writer with a bounded queue, for the coordinator (whose
  commits must not wait for an event write) and the agent. :meth:`EventLog.submit` never
  blocks; a full queue drops the event and counts it.

Both write each event at its id (:func:`coordinator.core.events.event_id`) only if that
key is absent, never under a lease (an event outlives the node it is about), in one
transaction per batch (:meth:`EtcdClient.create_many`). The log is bounded: after a batch,
when the count passes ``limit`` by a tenth, the oldest keys (by create revision) go in one
delete. Two writers trimming at once delete the same oldest keys; deleting a key twice is
harmless, so trimming needs no lock. (Events written in one transaction share its
revision: among them, which go first at the limit is etcd's choice.)

Other features record their events through :func:`record_event` (a one-off) or an
:class:`EventLog` they own, e.g. the hang detector::

    record_event(client, keys, Event("departed", node_id=node, cause="hung",
                                     summary="no progress for 300 s"))
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from coordinator.core.errors import CorruptValueError, EtcdElasticError
from coordinator.core.etcd_client import EtcdClient
from coordinator.core.events import Event, decode_event, encode_event, event_id, trim_count
from coordinator.core.keys import RunKeys
from coordinator.core.threads import start_guarded

__all__ = [
    "DEFAULT_EVENTS_LIMIT",
    "EventLog",
    "record_event",
    "round_generations",
    "trim_events",
    "write_events",
]

log = logging.getLogger(__name__)

DEFAULT_EVENTS_LIMIT = 5000
"""Events kept per run by default (``rdzv_conf events_limit``): a 1000-node run's joins
and a few hundred rounds and faults; about 1 MB in etcd at ~200 bytes an event."""
# etcd refuses a transaction of more than 128 operations (--max-txn-ops).
_BATCH = 100
_QUEUE = 20_000
# A writer that is about to go waits at most this long for etcd.
_SHORT_BUDGET = 2.0


def _stamp(event: Event, written_by: str, wall_ms: int) -> Event:
    return replace(
        event,
        unix_ms=event.unix_ms or wall_ms,
        written_by=event.written_by or written_by,
    )


def write_events(
    client: EtcdClient,
    keys: RunKeys,
    events: Sequence[Event],
    *,
    budget: float | None = None,
) -> int:
    """Write ``events`` (each only if its key is absent), in batches; return how many
    were created. Raises what the client raises (``EtcdElasticError``)."""
    created = 0
    for start in range(0, len(events), _BATCH):
        chunk = events[start : start + _BATCH]
        items = {keys.event(event_id(e)): encode_event(e) for e in chunk}
        done, _ = client.create_many(list(items.items()), budget=budget)
        created += sum(done)
    return created


def trim_events(client: EtcdClient, keys: RunKeys, limit: int) -> int:
    """Delete the oldest events beyond ``limit`` (see :func:`trim_count`); return how
    many were deleted. Raises what the client raises."""
    count, _ = client.count_prefix(keys.events_prefix)
    excess = trim_count(count, limit)
    if not excess:
        return 0
    oldest, _ = client.get_prefix(
        keys.events_prefix, sort_by_create=True, limit=excess, keys_only=True
    )
    for start in range(0, len(oldest), _BATCH):
        client.delete_keys([kv.key for kv in oldest[start : start + _BATCH]])
    return len(oldest)


def record_event(
    client: EtcdClient,
    keys: RunKeys,
    event: Event,
    *,
    written_by: str = "",
    budget: float = _SHORT_BUDGET,
    wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
) -> bool:
    """Append ``event`` to the run's timeline now, waiting at most ``budget`` seconds.

    Best effort: a failure is logged, never raised (the timeline must not fail what it
    records). ``unix_ms`` and ``written_by`` are filled in when the event has none.

    Returns:
        Whether this call wrote it (False: it failed, or its id was written already).
    """
    try:
        stamped = _stamp(event, written_by, wall_ms())
        return write_events(client, keys, [stamped], budget=budget) == 1
    except (EtcdElasticError, ValueError) as exc:
        log.warning("run %s: %s event not recorded: %s", keys.run_id, event.kind, exc)
        return False


def round_generations(client: EtcdClient, keys: RunKeys, round_: int) -> dict[str, int]:
    """Each member of round ``round_`` and the create revision of its key then, as the
    round's ``round_completed`` event has them: one get. Empty when the event is not
    there (not written yet, trimmed, a round before the events carried them) or cannot be
    read; best effort like every timeline read on the rendezvous' side."""
    key = keys.event(f"round_completed/{round_}")
    try:
        kv, _ = client.get(key)
        if kv is None:
            return {}
        event = decode_event(key.decode(), kv.value, kv.mod_revision)
    except (EtcdElasticError, CorruptValueError) as exc:
        log.info("run %s: round %d's members not read from the timeline: %s",
                 keys.run_id, round_, exc)  # fmt: skip
        return {}
    return dict(zip(event.members, event.member_generations, strict=False))


class EventLog:
    """A background writer of one run's events.

    Args:
        client: etcd client (not closed here).
        keys: the run's keys.
        written_by: stamped on events that name no writer.
        limit: events kept in etcd (the oldest beyond it are deleted).
        max_queue: events waiting to be written; beyond it new ones are dropped.
        wall_ms: wall-clock milliseconds.
    """

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        *,
        written_by: str,
        limit: int = DEFAULT_EVENTS_LIMIT,
        max_queue: int = _QUEUE,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
    ) -> None:
        self._client = client
        self._keys = keys
        self._written_by = written_by
        self._limit = limit
        self._max_queue = max_queue
        self._wall_ms = wall_ms
        self._queue: deque[Event] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._busy = False
        self._thread: threading.Thread | None = None
        # Joins older than every kept event were trimmed already (or never mattered):
        # a new coordinator that sees old nodes must not write their joins again.
        self._oldest_kept: int | None = None
        self._failing = False
        self._last_ms = 0
        self.dropped = 0
        self.written = 0

    def submit(self, events: Iterable[Event]) -> None:
        """Queue ``events`` for writing; never blocks (a full queue drops them)."""
        now = self._wall_ms()
        with self._cond:
            if self._stopping:
                return
            for event in events:
                if len(self._queue) >= self._max_queue:
                    self.dropped += 1
                    continue
                # Strictly increasing: the events of one batch share their write's
                # revision, and their wall time is what keeps them in submission order.
                self._last_ms = now = max(now, self._last_ms + 1)
                self._queue.append(_stamp(event, self._written_by, now))
            if self._thread is None and self._queue:
                self._thread = start_guarded("rdzv-events", self._run, None)
            self._cond.notify()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the queue to be written; whether it was."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = _SHORT_BUDGET) -> None:
        """Write what is queued (waiting at most ``timeout`` seconds), then stop."""
        self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._queue.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                batch = [self._queue.popleft() for _ in range(min(_BATCH, len(self._queue)))]
                self._busy = True
            try:
                self._write(batch)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _trimmed_below(self) -> int:
        """The create revision below which events may have been trimmed (0: none were).

        Only a log at its limit was ever trimmed (a trim leaves exactly ``limit``, and
        events are only added otherwise): below it, no floor, or an event written before
        this log's first batch (a close recorded at once) would hide the joins queued
        here, which are older facts."""
        count, _ = self._client.count_prefix(self._keys.events_prefix)
        if count < self._limit:
            return 0
        oldest, _ = self._client.get_prefix(
            self._keys.events_prefix, sort_by_create=True, limit=1, keys_only=True
        )
        return oldest[0].create_revision if oldest else 0

    def _write(self, batch: list[Event]) -> None:
        try:
            if self._oldest_kept is None:
                self._oldest_kept = self._trimmed_below()
            floor = self._oldest_kept
            batch = [e for e in batch if not (e.kind == "joined" and e.revision < floor)]
            self.written += write_events(self._client, self._keys, batch)
            if trim_events(self._client, self._keys, self._limit):
                self._oldest_kept = None
            if self._failing:
                log.info("run %s: events are recorded again", self._keys.run_id)
                self._failing = False
        except (EtcdElasticError, ValueError) as exc:
            # Best effort: the batch is lost, the rendezvous goes on. Said once per episode.
            self.dropped += len(batch)
            if not self._failing:
                log.warning(
                    "run %s: %d event(s) not recorded: %s", self._keys.run_id, len(batch), exc
                )
            self._failing = True
