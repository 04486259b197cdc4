"""The coordinator duty: one elected node watches the joins and commits the round changes.

Why one node: if every node watched every other node's key, a formation of N nodes would
deliver N² watch events and every node would race to rewrite the state. Here each node
writes only its own key (and, in the same transaction, its turn key); the node whose turn
key is the last under ``turns/`` (the one that came first, :meth:`RunKeys.turn`) watches
the node keys and commits each state change with ONE revision-guarded transaction.
Everybody else watches only the state key, and each waits on the first turn key after its
own, its senior, for that key's deletion (so a leader's death wakes exactly one node); a
key written between the two is the new senior, with no new read. That keeps a formation
at O(N) writes and O(N) watch events, and each node's look for its senior at one key of
etcd's index (etcd's election recipe made etcd sort every node key on each look).

A node that came to a running job waits behind the coordinator. Nodes that join together
may land in either order: a leader that sees a turn key appear after its own steps down.

Correctness does not depend on there being exactly one leader: every commit is guarded by
the state key's mod_revision AND fenced by the leader's own node key still having the
create revision it was elected with (:class:`~coordinator.core.executor.Fence`). A leader
that froze past its lease and resumed finds its key gone or re-created: its commit,
decided from a node table that is stale, is refused even when nobody changed the state
meanwhile, and it steps down. A new leader restarts the last-call timer from its own clock
(leader clocks are never compared).

Damaged state (DESIGN §6, §9):

* an unreadable value at the state key: the leader keeps its node watch and waits; it
  never overwrites the value (an operator put it there) and resumes when a valid value
  appears. Said once per episode, not once per event;
* a deleted state key: before deciding anything, the leader writes back the last state
  it knows, so the next rounds continue from there and never form "round 1" again over
  that round's old store keys. What it knows is the view's last good state; if the view
  never saw one (this node started after the delete), the highest round that still has
  store keys in etcd (read once per leadership term while the key is absent; a run that
  never formed has none and starts at round 0 as usual).

The duty's thread is started through :func:`~coordinator.core.threads.start_guarded`:
etcd errors are retried with a pause, anything unexpected ends the thread and is reported
to ``on_death`` (the node would otherwise silently stop coordinating).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.core.actions import Action
from coordinator.core.commit_events import EventRecorder
from coordinator.core.errors import CorruptValueError, EtcdElasticError
from coordinator.core.etcd_client import EtcdClient
from coordinator.core.event_log import EventLog, round_generations
from coordinator.core.executor import Commit, Fence, StateExecutor
from coordinator.core.keys import RunKeys
from coordinator.core.node_watch import NodeWatch
from coordinator.core.state import RdzvState
from coordinator.core.store_rounds import highest_store_round
from coordinator.core.threads import DeathListener, start_guarded
from coordinator.core.transitions import Limits, decide_coordinator, to_restore
from coordinator.core.turns import watch_for_seniors, watch_in_line
from coordinator.core.view import StateView

__all__ = ["CoordinatorDuty", "Membership"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Membership:
    """This node's key as it stands: its create revision fences the commits of its terms;
    its turn key (:meth:`RunKeys.turn`, on the same lease) is its place in the election."""

    node_id: str
    key: bytes
    create_revision: int
    turn: bytes
    lease: int


class _Signal:
    """A wake-up flag that also remembers whether it was raised while nobody waited."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def wait(self, timeout: float | None) -> None:
        self._event.wait(timeout)
        self._event.clear()


@dataclass
class _Term:
    """What one leadership term carries from one pass of its loop to the next."""

    executor: StateExecutor
    fence: Fence  # this node's key as it was elected: every commit is guarded by it
    recorder: EventRecorder
    deadline: float | None = None  # the running last call of round deadline_round
    deadline_round: int = -1
    paused: bool = False  # the state key is unreadable: wait for a valid value
    store_floor: int | None = None  # read once per term, only if the key is absent
    outranked: threading.Event = field(default_factory=threading.Event)  # step down


class CoordinatorDuty:
    """Background thread: wins the election when its turn comes, then coordinates.

    Args:
        client: etcd client.
        keys: the run's keys.
        view: the watched state view (shared with the handler).
        limits: min/max nodes and last call.
        membership: returns this node's current key (None while it has none).
        clock: monotonic seconds.
        wall_ms: wall-clock milliseconds, recorded in the state for operators only.
        on_death: told if the duty's thread dies of an unexpected exception (the node no
            longer coordinates: its owner should leave and re-join, or stop).
        events: where a leader's joins, rounds and departures go (the run's timeline;
            written in the background, never waited for). None: not recorded.
        on_key_gone: told (must not block) when its key was deleted under a live lease.
        before_commit: called as a term starts and before each commit (the run's lease).
    """

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        view: StateView,
        limits: Limits,
        membership: Callable[[], Membership | None],
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        on_death: DeathListener | None = None,
        events: EventLog | None = None,
        on_key_gone: Callable[[Membership], None] = lambda _me: None,
        before_commit: Callable[[], None] = lambda: None,
    ) -> None:
        self._events, self._on_key_gone, self._before_commit = events, on_key_gone, before_commit
        self._client, self._keys, self._view = client, keys, view
        self._limits, self._membership = limits, membership
        self._clock, self._wall_ms = clock, wall_ms
        self._stop = threading.Event()
        self._signal = _Signal()
        self._nodes = NodeWatch(client, keys.nodes_prefix, self._signal.set)
        self._on_death = on_death
        self.is_leader = False
        self.commits = 0
        self.failed_commits = 0
        self.fenced_out = 0  # commits refused because this node's key was gone or new
        self.terms = 0  # leadership terms begun (a node that came earlier may end one)
        self._thread: threading.Thread | None = None
        self._unsubscribe = view.subscribe(self._signal.set)

    def start(self) -> None:
        self._thread = start_guarded("rdzv-coordinator", self._run, self._on_death)

    def poke(self) -> None:
        """Re-check now (e.g. this node's key changed)."""
        self._signal.set()

    def stop(self) -> None:
        self._stop.set()
        self._signal.set()
        self._unsubscribe()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    # -- the loop ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                me = self._membership()
                if me is None:
                    self._signal.wait(None)
                    continue
                since = self._wait_for_turn(me)
                if since is not None and self._lead(me, since):
                    self._await_new_key(me)
            except EtcdElasticError as exc:
                # etcd unreachable for the whole retry budget, or similar: try again after
                # a pause rather than die; the handler surfaces errors to its caller.
                # Anything else is a bug: it ends the thread and reaches on_death.
                log.warning("coordinator duty: %s; retrying", exc)
                self._stop.wait(1.0)
        self.is_leader = False

    def _await_new_key(self, me: Membership) -> None:
        """Fenced out although this node's key, as it knows it, is unchanged: the key was
        deleted (or written by someone else) under a live lease, e.g. by ``etcdctl del``.
        Say so (the node re-joins, writing its key anew, whose create revision is its
        fence), then wait for that write or the lease's loss: the old key is fenced out
        forever, and with every key deleted no coordinator is left to see nodes go."""
        if self._membership() == me:
            self._on_key_gone(me)
        while not self._stop.is_set() and self._membership() == me:
            self._signal.wait(None)

    def _wait_for_turn(self, me: Membership) -> int | None:
        """Block until no turn key comes after ours; return the revision that was read at
        (None: re-check)."""
        senior, revision = self._client.next_key(me.turn, self._keys.turns_prefix)
        if senior is None:
            return revision
        line = watch_in_line(self._client, me.key, me.turn, senior, revision, self._signal.set)
        try:
            while not (self._stop.is_set() or line.again.is_set()):
                current = self._membership()
                if current is None or current.create_revision != me.create_revision:
                    break
                self._signal.wait(None)
        finally:
            line.cancel()
        if line.own_key_deleted.is_set() and self._client.lease_time_to_live(me.lease) > 0:
            self._await_new_key(me)  # a lease that ended tells the node itself
        return None

    def _lead(self, me: Membership, since: int) -> bool:
        """Coordinate until this node must step down; whether a commit was fenced out.

        Each pass: check this node still holds the key it was elected with, read the
        state (pausing while it is unreadable), write back a deleted state, decide, then
        commit what was decided or sleep until the decision's wake-up time or an event.
        """
        log.info("node %s coordinates run %s", me.node_id, self._keys.run_id)
        executor = StateExecutor(
            self._client, self._keys, written_by=me.node_id, wall_ms=self._wall_ms,
            before_write=self._before_commit,
        )  # fmt: skip
        recorder = EventRecorder(
            me.node_id, self._wall_ms,
            lambda round_: round_generations(self._client, self._keys, round_),
        )  # fmt: skip
        term = _Term(executor, Fence(me.key, me.create_revision), recorder)
        self.terms += 1
        seniors = watch_for_seniors(
            self._client, self._keys, me.turn, since, term.outranked, self._signal.set
        )
        try:
            self._before_commit()  # off the joins' path: a new run's lease, granted early
            self._nodes.start()
        except BaseException:
            seniors.cancel()
            raise
        self.is_leader = True
        try:
            while not self._stop.is_set() and self._still_elected(me, term):
                read = self._readable_state(term)
                if read is None:
                    self._signal.wait(None)  # until a valid value appears
                    continue
                state, mod_revision = read
                restored = self._restore(term, state) if mod_revision == 0 else None
                if restored is not None:
                    if self._settle(me, restored, ()):
                        return True
                    continue
                self._record_appeared(term, state)
                now = self._clock()
                actions, wake_at = self._decide(term, state, now)
                if actions:
                    if self._settle(me, self._commit(term, state, mod_revision, actions), actions):
                        return True
                    continue
                self._flush_events(term)
                timeout = None if wake_at == math.inf else max(wake_at - now, 0.0)
                self._signal.wait(timeout)
            return False
        finally:
            self.is_leader = False
            seniors.cancel()
            self._nodes.stop()

    def _still_elected(self, me: Membership, term: _Term) -> bool:
        """Whether this node may go on leading with the key and table it has."""
        current = self._membership()
        if current is None or current.create_revision != me.create_revision:
            return False  # our key is gone (lease lost): step down, re-elect
        if term.outranked.is_set():
            log.info(
                "node %s: a node that came earlier joined run %s; it coordinates now",
                me.node_id, self._keys.run_id,
            )  # fmt: skip
            return False
        # A node watch that lost events: lead again from a fresh read.
        return not self._nodes.take_stale()

    def _readable_state(self, term: _Term) -> tuple[RdzvState, int] | None:
        """The view's state and its mod revision; None while the state key is unreadable
        (said once per episode)."""
        try:
            read = self._view.snapshot()
        except CorruptValueError as exc:
            if not term.paused:
                # The view logs the error with the key once; this says what the duty does
                # about it, without repeating it.
                log.error(
                    "run %s: not coordinating while the state key is unreadable (%s)",
                    self._keys.run_id,
                    exc.reason,
                )
            term.paused = True
            return None
        if term.paused:
            log.info("run %s: the state key is readable again", self._keys.run_id)
            term.paused = False
        return read

    def _restore(self, term: _Term, state: RdzvState) -> Commit | None:
        """The state key is absent: write back the last state known (the view's, else the
        highest round with Store keys); None if there is none to restore."""
        if term.store_floor is None:
            term.store_floor = highest_store_round(self._client, self._keys.store_root)
        known = to_restore(state, term.store_floor)
        if known is None:
            return None
        result = term.executor.commit((known, 0), (), fence=term.fence)
        if result.succeeded:
            log.warning(
                "run %s: the state key was gone; wrote back round %d",
                self._keys.run_id, known.round,
            )  # fmt: skip
        return result

    def _decide(
        self, term: _Term, state: RdzvState, now: float
    ) -> tuple[tuple[Action, ...], float]:
        """What to commit now (maybe nothing) and when to decide again; keeps the term's
        last-call deadline."""
        if term.deadline_round != state.round:
            # Another coordinator moved the run on: a last call belongs to the round it was
            # started for.
            term.deadline, term.deadline_round = None, state.round
        with self._nodes.locked() as table:
            # Decided under the table's lock from its running counts: O(1) per join; the
            # table is scanned only to build a commit (pure, no RPC).
            decision = decide_coordinator(
                state,
                table.nodes,
                self._limits,
                now,
                term.deadline,
                now_unix_ms=self._wall_ms(),
                tally=table.tally(state),
            )
        term.deadline = decision.last_call_deadline
        return decision.actions, decision.wake_at

    def _commit(
        self, term: _Term, state: RdzvState, mod_revision: int, actions: tuple[Action, ...]
    ) -> Commit:
        """Commit ``actions`` over ``state`` (fenced) and record what a success did."""
        result = term.executor.commit((state, mod_revision), actions, fence=term.fence)
        if self._events is not None and result.succeeded:
            live = self._nodes.live(state.participants)
            term.recorder.committed(state, result.state, actions, result.revision, live)
            self._events.submit(term.recorder.take())
        return result

    def _record_appeared(self, term: _Term, state: RdzvState) -> None:
        """Note the node keys that appeared since the last pass (the timeline's joins)."""
        if self._events is not None:
            term.recorder.appeared(state, self._nodes.take_appeared())

    def _flush_events(self, term: _Term) -> None:
        """Hand over what the term recorded that no commit carried (best effort)."""
        if self._events is not None and term.recorder.pending:
            self._events.submit(term.recorder.take())

    def _settle(self, me: Membership, result: Commit, actions: tuple[Action, ...]) -> bool:
        """Record a commit's outcome in the view; whether this node must step down."""
        if result.succeeded:
            self.commits += 1
            if actions:
                log.info(
                    "run %s: committed %s (round %d)",
                    self._keys.run_id,
                    ", ".join(a.kind.value for a in actions),
                    result.state.round,
                )
            self._view.offer_written(result.state, result.revision)
            return False
        self.failed_commits += 1
        self._view.offer(result.current, result.revision)
        if not result.fenced_out:
            return False
        self.fenced_out += 1
        log.warning(
            "node %s: no longer coordinates run %s: its key is gone or new; a commit "
            "decided from what it saw before was refused",
            me.node_id, self._keys.run_id,
        )  # fmt: skip
        return True
