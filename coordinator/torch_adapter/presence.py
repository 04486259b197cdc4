"""One node's presence in a run: its participation, made and re-made, and its leaving.

The handler (:class:`coordinator.torch_adapter.handler.EtcdRendezvousHandler`) holds one
:class:`RunPresence`. It makes the node's :class:`~coordinator.core.participation.Participation`
(view, duty, key and lease) at the first join, ends it when a background thread dies or
the run's lease is lost (the node leaves at once, so the others see it go, and the next
join makes a new one from scratch), keeps the run's lease and the timeline writer, and
ends them all when the node leaves. A departure is recorded in the timeline before the
lease goes, so the others read ``left`` or ``drained``, not "lease expired".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from coordinator.core.errors import LeaseLostError, NodeLeftError
from coordinator.core.etcd_client import EtcdClient
from coordinator.core.event_log import EventLog, record_event
from coordinator.core.events import Event
from coordinator.core.join_retry import retry_until
from coordinator.core.keys import RunKeys
from coordinator.core.participation import Participation
from coordinator.core.run_lease import RunLease
from coordinator.core.settings import RendezvousSettings
from coordinator.core.threads import ThreadDied
from coordinator.core.transitions import Limits
from coordinator.core.view import StateView

__all__ = ["RunPresence"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class RunPresence:
    """The live participation of one node in one run, and what outlives it.

    Args:
        settings: the run's validated settings.
        node_id: this node.
        limits: min/max nodes and last call, for the duty.
        etcd: the handler's client (made at the first call; never call it under this
            object's lock).
        on_change: told (on a background thread; must not block) when the state or this
            node's lease changes, and when a participation ended.
        incarnation: the incarnation this node belongs to, read when it departs.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        settings: RendezvousSettings,
        node_id: str,
        limits: Limits,
        *,
        etcd: Callable[[], EtcdClient],
        on_change: Callable[[], None],
        incarnation: Callable[[], int],
        clock: Callable[[], float],
    ) -> None:
        self._settings = settings
        self._keys: RunKeys = settings.keys
        self._node_id = node_id
        self._limits = limits
        self._etcd = etcd
        self._on_change = on_change
        self._incarnation = incarnation
        self._clock = clock
        # A leaf lock: it guards the references below and nothing else; no RPC, callback
        # or other lock is taken while it is held (docs/architecture.md, lock order).
        self._lock = threading.Lock()
        self._parts: Participation | None = None
        self._left = False
        # Set when a background thread died: this node left and must re-join (see
        # on_thread_death); nodes_waiting() counts it so the agent re-rendezvouses.
        self._rejoin: str | None = None
        self._events: EventLog | None = None
        # Every key of the run that no node owns hangs on the run's lease (run_lease.py).
        self._run_lease = RunLease(self._keys, settings.retention, settings.lease_ttl)
        # The view of the last participation (kept after it ended): what is_closed() reads.
        self._last_view: StateView | None = None
        self._key_written = threading.Event()  # see key_written()

    @property
    def left(self) -> bool:
        """Whether this node left the run (:meth:`leave`); it never joins again."""
        return self._left

    @property
    def events(self) -> EventLog | None:
        """The run's timeline writer, once made (:meth:`event_log`)."""
        return self._events

    def current(self) -> Participation | None:
        """The live participation (None: not joined yet, ended by a thread death, left)."""
        with self._lock:
            return self._parts

    def last_view(self) -> StateView | None:
        """The view of the last participation, kept after it ended (None: never joined)."""
        with self._lock:
            return self._last_view

    def participation(self) -> Participation:
        """The live participation, a new one if there is none (first join, re-join)."""
        with self._lock:
            if self._left:
                raise NodeLeftError(f"node {self._node_id} has left run {self._keys.run_id}")
            if self._parts is not None:
                return self._parts
        # Start outside the lock (watch, read: RPCs); the first to publish wins.
        parts = Participation(
            self._etcd(), self._keys, self._node_id, self._settings.lease_ttl, self._limits,
            on_change=self._on_change, on_death=self.on_thread_death, clock=self._clock,
            events=self.event_log(), before_commit=self.run_lease_ready,
        )  # fmt: skip
        # No round trip for the run's lease on the way to the node's key: the folder is
        # bound now, the lease kept alive once a state is read on it (or granted by the
        # coordinator before its first commit).
        self._run_lease.bind(self._etcd())
        parts.view.subscribe(lambda: self._follow_run_lease(parts.view))
        try:
            parts.view.start()
        except BaseException:
            parts.close()  # its duty never started and it holds no lease: nothing leaks
            raise
        with self._lock:
            won = self._parts is None and not self._left
            if won:
                self._parts, self._rejoin, self._last_view = parts, None, parts.view
        if not won:
            parts.close()
            return self.participation()  # raises NodeLeftError, or returns the winner's
        parts.duty.start()
        return parts

    def join_participation(self, deadline: float) -> Participation:
        """The live participation (a new one on the first join and after a thread death),
        tried again until ``deadline`` once this node has taken part: etcd may be away
        when a re-join starts (an outage overlapping a restart), and the fault that killed
        one watch thread may kill the next one's first watch too; a node must not give up
        its join for either. A node that never reached etcd gives up after read_timeout,
        naming the endpoints: that is most likely a wrong endpoint (DESIGN §6)."""
        with self._lock:
            reached = self._last_view is not None
        if not reached:
            return self.participation()
        return self.until(deadline, "joining", self.participation)

    def until(
        self, deadline: float, doing: str, call: Callable[[], T], *, unreachable_too: bool = True
    ) -> T:
        """``call()``, tried again until ``deadline`` after etcd was unreachable (unless
        not ``unreachable_too``) or refused a permission this node had: see
        :func:`~coordinator.core.join_retry.retry_until`. Each try is bounded by
        read_timeout, the join by join_timeout."""
        return retry_until(
            call, deadline, doing=f"node {self._node_id}: {doing} run {self._keys.run_id}",
            permitted=self._key_written.is_set, unreachable_too=unreachable_too,
            clock=self._clock,
        )  # fmt: skip

    def key_written(self) -> None:
        """etcd let this node write its key: its role had the permission, so a refusal
        from now on is a permission revoked, which a join waits for."""
        self._key_written.set()

    def session_lost(self) -> bool:
        """Whether the live participation's key is gone (its lease lost, or the key deleted
        under it).

        Called under the view's condition (``wait_newer``'s predicate): takes only the
        leaf lock, never the view's."""
        parts = self.current()
        return parts is not None and parts.key_lost()

    def nodes_waiting(self, last_round: int) -> int:
        """What this node adds to ``num_nodes_waiting()``: the nodes waiting in its watched
        state, plus one if it must rendezvous again although nobody waits (its key is
        gone, a newer round than ``last_round``, its last, completed without it; see
        :meth:`Participation.must_rejoin`) or it left to re-join."""
        with self._lock:
            parts, rejoin = self._parts, self._rejoin
        if parts is None:
            return 1 if rejoin is not None else 0
        return parts.view.peek().num_waiting + int(parts.must_rejoin(last_round))

    def event_log(self) -> EventLog:
        """The run's timeline, written in the background (made at the first use)."""
        client = self._etcd()
        with self._lock:
            if self._events is None:
                self._events = EventLog(
                    client, self._keys, written_by=self._node_id, limit=self._settings.events_limit
                )
            return self._events

    def on_thread_death(self, died: ThreadDied) -> None:
        """A background thread of this node died (already logged with its traceback):
        leave the run (the others see this node go at once) and re-join from scratch on
        the next rendezvous. Runs on the dying thread, so the teardown (RPCs) runs on a
        thread of its own."""
        with self._lock:
            parts, self._parts = self._parts, None
            if self._left or parts is None:
                return
            self._rejoin = str(died)
        log.error("node %s leaves run %s to re-join: %s", self._node_id, self._keys.run_id, died)

        def teardown() -> None:
            self._say_departing(parts)
            parts.close()
            self._on_change()

        threading.Thread(target=teardown, name="rdzv-rejoin", daemon=True).start()

    def run_lease_ready(self, view: StateView) -> None:
        """Before this node writes the run's state: the run's lease exists and this node
        keeps it alive. Followed, without a grant, when ``view`` read a state on it; else
        granted if absent (the coordinator of a new run; a node closing a run that has no
        state yet). No RPC once kept; else RPCs: call it outside any lock."""
        if view.lease() == self._run_lease.id:
            self._run_lease.follow(self._etcd(), self._on_run_lease_lost)
        else:
            self._run_lease.ensure(self._etcd(), self._on_run_lease_lost)

    def _follow_run_lease(self, view: StateView) -> None:
        # A listener of the view (on its watch thread): no RPC, never blocks. A node that
        # read a state on the run's lease keeps the lease alive from then on, so the
        # state cannot vanish under a node of the run.
        if self._run_lease.id and view.lease() == self._run_lease.id:
            self._run_lease.follow(self._etcd(), self._on_run_lease_lost)

    def _on_run_lease_lost(self, error: LeaseLostError) -> None:
        # The run's keys are gone with its lease: leave and join again from scratch.
        self.on_thread_death(ThreadDied(f"etcd-keepalive-{self._run_lease.id:x}", error))

    def leave(self) -> bool:
        """End the participation (revoking its lease), the timeline writer and the run's
        lease. Idempotent; returns whether this call left (False: left already)."""
        with self._lock:
            if self._left:
                return False
            self._left = True
            parts, self._parts = self._parts, None
            events = self._events
        if parts is not None:
            # A commit the duty is making hands its events (a round's) over first: a
            # coordinator leaving right after its commit must not lose them.
            parts.duty.stop()
        if events is not None:
            events.close()
        if parts is not None:
            self._say_departing(parts)
            parts.close()
        self._run_lease.stop()
        return True

    def _say_departing(self, parts: Participation) -> None:
        """Record this node's departure before its lease goes (``left``, or ``drained``
        when an operator asked): the coordinator, seeing the key go, then records nothing
        more (the same event id, first write wins) instead of "lease expired"."""
        me = parts.member.current()
        if me is None or parts.member.lost():
            return  # no key, or the lease ended already: that is what the others see
        if not self._run_lease.writable():
            return  # no state on the run's lease seen (no round to leave), or it is gone
        state = parts.view.peek()
        drained = self._node_id in state.draining
        record_event(
            self._etcd(),
            self._keys,
            Event(
                "departed",
                node_id=self._node_id,
                cause="drained" if drained else "left",
                round=state.round,
                incarnation=self._incarnation(),
                generation=me.create_revision,
            ),
            written_by=self._node_id,
        )
