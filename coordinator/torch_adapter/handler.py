"""torch's ``RendezvousHandler`` over etcd v3: what our agent and stock torchrun call.

Registered for ``torchrun --rdzv-backend=etcd-v3`` through the ``torchrun.handlers`` entry
point (torch owns the name ``etcd-v2`` for its v2-API backend; our ``etcdrun`` accepts both
names). Contract, case by case:

* ``next_rendezvous()`` joins the next round (exiting the one this node was in) and
  blocks until that round completes with this node, then returns its group rank, the
  group size, a store scoped to the round, and the bootstrap address (rank 0's address
  and a port it found free). Raises ``RendezvousClosedError`` if the run is closed,
  ``RendezvousTimeoutError`` after ``join_timeout``, ``RendezvousConnectionError`` when no
  etcd member answers within the retry budget, ``RendezvousStateError`` when the state
  key holds a value we cannot read (naming the key; nothing in it is executed).
* ``num_nodes_waiting()`` answers from the watched state, without a round trip: nodes
  waiting for the next round plus participants whose lease ended (so any agent, torch's
  included, re-rendezvouses at once after a node loss), plus one if this node's own
  lease was lost.
* ``subscribe(callback)`` (ours): the callback runs (on a background thread; it must not
  block) whenever that number may have changed, so an agent can wait on events, not poll.
* ``set_closed()`` closes the run for everyone; ``is_closed()`` reads the watched state.
* ``shutdown()`` closes the run, as torch's handlers do, and leaves; ``leave()`` (ours)
  only leaves: the node's lease is revoked so the others see it go at once.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from coordinator.core.actions import count_restart, quarantine
from coordinator.core.errors import (
    EtcdAuthError,
    EtcdConnectionError,
    EtcdElasticError,
    EtcdTLSError,
    LeaseLostError,
    NodeLeftError,
)
from coordinator.core.etcd_client import EtcdClient, EtcdObserver, backoff_delay
from coordinator.core.event_log import EventLog, record_event
from coordinator.core.events import Event
from coordinator.core.executor import StateExecutor
from coordinator.core.hang_board import ProgressBoard
from coordinator.core.join_decision import NodeAction, decide_node, incarnation_to_join, is_spare
from coordinator.core.join_outcome import JoinContext, join_error
from coordinator.core.keys import make_node_id
from coordinator.core.listeners import Listeners
from coordinator.core.participation import Participation
from coordinator.core.ports import free_port
from coordinator.core.quarantine import quarantined_ids
from coordinator.core.restart_budget import RestartCount
from coordinator.core.run_lease import RunLease
from coordinator.core.settings import RendezvousSettings
from coordinator.core.state import (
    CloseMode,
    Hang,
    NodeInfo,
    Quarantine,
    RdzvState,
    decode_state,
)
from coordinator.core.threads import ThreadDied
from coordinator.core.transitions import Limits
from coordinator.core.view import StateView
from coordinator.torch_adapter.errors import torch_errors
from coordinator.torch_adapter.store import EtcdStore

__all__ = ["EtcdRendezvousHandler", "create_handler"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_node_counter = itertools.count()
# Random per process: host name and pid repeat across containers (all pid 1, one name on
# the host's network), so they alone do not make node ids unique.
_PROCESS_TAG = secrets.token_hex(3)


class EtcdRendezvousHandler(RendezvousHandler):
    """One node's handle on one run's rendezvous. See the module docstring for the contract.

    Args:
        settings: validated settings.
        client: an etcd client to share (the caller keeps ownership); by default the handler
            makes and closes its own.
        backend_name: what :meth:`get_backend` reports.
        local_world_size, role: recorded in this node's key for operators.
        clock: monotonic seconds (tests pass a fake).
        etcd_observer: hears of every etcd call the handler's own client makes (the
            agent's metrics); ignored with a shared ``client``, which has its own.
    """

    def __init__(
        self,
        settings: RendezvousSettings,
        *,
        client: EtcdClient | None = None,
        backend_name: str = "etcd-v3",
        local_world_size: int = 0,
        role: str = "",
        clock: Callable[[], float] = time.monotonic,
        etcd_observer: EtcdObserver | None = None,
    ) -> None:
        self._settings = settings
        self._etcd_observer = etcd_observer
        self._keys = settings.keys
        self._backend_name = backend_name
        self._own_client = client is None
        self._client = client
        self._clock = clock
        self._hostname = socket.gethostname()
        self._addr = settings.local_addr or socket.getfqdn()
        self.node_id = make_node_id(self._hostname, os.getpid(), next(_node_counter), _PROCESS_TAG)
        self.local_world_size = local_world_size
        self.role = role
        self._limits = Limits(settings.min_nodes, settings.max_nodes, settings.last_call_timeout)
        # A leaf lock: it guards the references below and nothing else; no RPC, callback
        # or other lock is taken while it is held (docs/architecture.md, lock order).
        self._lock = threading.Lock()
        self._parts: Participation | None = None
        self._listeners = Listeners()
        self._left = False
        # Set when a background thread died: this node left and must re-join (see
        # _on_thread_death); num_nodes_waiting() counts it so the agent re-rendezvouses.
        self._rejoin: str | None = None
        self._unlisten: Callable[[], None] | None = None
        self._events: EventLog | None = None
        # Every key of the run that no node owns hangs on the run's lease (run_lease.py).
        self._run_lease = RunLease(self._keys, settings.retention, settings.lease_ttl)
        # The view of the last participation (kept after it ended): what is_closed() reads.
        self._last_view: StateView | None = None
        self._started_ms = int(time.time() * 1000)
        self.last_round = -1
        """The round of this node's last completed rendezvous (-1: none yet)."""
        self.last_members: tuple[str, ...] = ()
        """That round's node ids in group-rank order."""
        self.last_workers: tuple[tuple[str, int], ...] = ()
        """What each node of that round runs, (role, local world size) by group rank, as
        the coordinator copied it from the node records (empty: not known)."""
        self.incarnation = 0
        """The incarnation of the run this node belongs to (0: it has not asked to join
        yet). Taken at the first join and kept: a node never joins another incarnation."""

    # -- plumbing ----------------------------------------------------------------------

    def _etcd(self) -> EtcdClient:
        with self._lock:
            if self._client is None:
                # Construction does no I/O (the first call connects).
                self._client = EtcdClient(
                    self._settings.etcd_config(),
                    on_thread_death=self._on_thread_death,
                    observer=self._etcd_observer,
                )
            elif self._unlisten is None and not self._own_client:
                self._unlisten = self._client.add_death_listener(self._on_thread_death)
            return self._client

    def _participation(self) -> Participation:
        """The live participation, a new one if there is none (first join, re-join)."""
        with self._lock:
            if self._left:
                raise NodeLeftError(f"node {self.node_id} has left run {self._keys.run_id}")
            if self._parts is not None:
                return self._parts
        # Start outside the lock (watch, read: RPCs); the first to publish wins.
        parts = Participation(
            self._etcd(), self._keys, self.node_id, self._settings.lease_ttl, self._limits,
            on_change=self._notify, on_death=self._on_thread_death, clock=self._clock,
            events=self._event_log(),
        )  # fmt: skip
        try:
            self._run_lease.start(self._etcd(), self._on_run_lease_lost)
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
            return self._participation()  # raises NodeLeftError, or returns the winner's
        parts.duty.start()
        return parts

    def _join_participation(self, deadline: float) -> Participation:
        """The live participation (a new one on the first join and after a thread death),
        tried again until ``deadline`` once this node has taken part: etcd may be away
        when a re-join starts (an outage overlapping a restart), and the fault that killed
        one watch thread may kill the next one's first watch too; a node must not give up
        its join for either. A node that never reached etcd gives up after read_timeout,
        naming the endpoints: that is most likely a wrong endpoint (DESIGN §6)."""
        with self._lock:
            reached = self._last_view is not None
        if not reached:
            return self._participation()
        return self._until(deadline, "joining", self._participation)

    def _until(self, deadline: float, doing: str, call: Callable[[], T]) -> T:
        """``call()``, tried again after an etcd connection error until ``deadline`` (the
        join's): each try is bounded by read_timeout, the join by join_timeout."""
        failures = 0
        while True:
            try:
                return call()
            except (EtcdAuthError, EtcdTLSError):
                raise  # a wrong credential does not heal by waiting
            except EtcdConnectionError as exc:
                left = deadline - self._clock()
                if left <= 0:
                    raise
                delay = min(left, backoff_delay(failures, secrets.randbelow(1000) / 1000))
                log.warning(
                    "node %s: %s run %s failed (%s); trying again in %.1f s",
                    self.node_id, doing, self._keys.run_id, exc, delay,
                )  # fmt: skip
                failures += 1
                time.sleep(delay)

    def _current(self) -> Participation | None:
        with self._lock:
            return self._parts

    def _event_log(self) -> EventLog:
        """The run's timeline, written in the background (made at the first use)."""
        client = self._etcd()
        with self._lock:
            if self._events is None:
                self._events = EventLog(
                    client, self._keys, written_by=self.node_id, limit=self._settings.events_limit
                )
            return self._events

    def _say_departing(self, parts: Participation) -> None:
        """Record this node's departure before its lease goes (``left``, or ``drained``
        when an operator asked): the coordinator, seeing the key go, then records nothing
        more (the same event id, first write wins) instead of "lease expired"."""
        me = parts.member.current()
        if me is None or parts.member.lost():
            return  # no key, or the lease ended already: that is what the others see
        state = parts.view.peek()
        drained = self.node_id in state.draining
        record_event(
            self._etcd(),
            self._keys,
            Event(
                "departed",
                node_id=self.node_id,
                cause="drained" if drained else "left",
                round=state.round,
                incarnation=self.incarnation,
                generation=me.create_revision,
            ),
            written_by=self.node_id,
        )

    def record_event(self, event: Event) -> None:
        """Append ``event`` to the run's timeline in the background (never blocks, never
        raises). The agent records its counted restarts with it."""
        try:
            self._event_log().submit([event])
        except EtcdElasticError as exc:
            log.warning("node %s: event not recorded: %s", self.node_id, exc)

    def _notify(self) -> None:
        self._listeners.notify()

    def _on_thread_death(self, died: ThreadDied) -> None:
        """A background thread of this node died (already logged with its traceback):
        leave the run (the others see this node go at once) and re-join from scratch on
        the next rendezvous. Runs on the dying thread, so the teardown (RPCs) runs on a
        thread of its own."""
        with self._lock:
            parts, self._parts = self._parts, None
            if self._left or parts is None:
                return
            self._rejoin = str(died)
        log.error("node %s leaves run %s to re-join: %s", self.node_id, self._keys.run_id, died)

        def teardown() -> None:
            self._say_departing(parts)
            parts.close()
            self._notify()

        threading.Thread(target=teardown, name="rdzv-rejoin", daemon=True).start()

    def _on_run_lease_lost(self, error: LeaseLostError) -> None:
        # The run's keys are gone with its lease: leave and join again from scratch.
        self._on_thread_death(ThreadDied(f"etcd-keepalive-{self._run_lease.id:x}", error))

    def _node_writer(self, parts: Participation, wanted_round: int) -> Callable[[], None]:
        """Writes this node's key asking for ``wanted_round``, with a live lease; does
        nothing once ``parts`` has ended (the join loop then starts over on a new one)."""

        def record(lease_id: int) -> NodeInfo:
            return NodeInfo(
                node_id=self.node_id,
                wanted_round=wanted_round,
                addr=self._addr,
                hostname=self._hostname,
                pid=os.getpid(),
                local_world_size=self.local_world_size,
                role=self.role,
                lease_id=lease_id,
                started_at_unix_ms=self._started_ms,
                free_port=free_port(""),
                incarnation=self.incarnation,
            )

        def write() -> None:
            if self._current() is not parts:
                return  # ended while a try failed: no lease nor key for a dead participation
            parts.member.write(record)
            parts.duty.poke()

        return write

    def _session_lost(self) -> bool:
        # Called under the view's condition (wait_newer's predicate): takes only the leaf
        # lock, never the view's.
        parts = self._current()
        return parts is not None and parts.member.lost()

    # -- RendezvousHandler -------------------------------------------------------------

    def get_backend(self) -> str:
        return self._backend_name

    @property
    def use_agent_store(self) -> bool:
        # Workers bootstrap their own TCPStore from MASTER_ADDR/MASTER_PORT; our store is
        # the agents' (it lives in etcd and is scoped to one round).
        return False

    @torch_errors
    def next_rendezvous(self) -> RendezvousInfo:
        run_id = self._keys.run_id
        start = self._clock()
        deadline = start + self._settings.join_timeout
        parts = self._join_participation(deadline)
        wanted = 0
        quarantined = 0  # the end time of this node's quarantine last logged
        log.info("node %s joining run %s", self.node_id, run_id)
        while True:
            if self._current() is not parts:
                # A background thread died and this node left: join again from scratch.
                parts, wanted = self._join_participation(deadline), 0
            view = parts.view
            state, _, seen = view.read()
            if state.quarantine_of(self.node_id) is not None:
                # Kept out for a while (failed the pre-flight check): it waits without a
                # deadline, which starts again when the quarantine ends.
                deadline = self._clock() + self._settings.join_timeout
                quarantined = self._note_quarantine(state, quarantined)
            action = decide_node(
                state, self.node_id, wanted, self._clock(), deadline, self.incarnation
            )
            if action is not NodeAction.FINISH and wanted and self._session_lost():
                # Our key is gone before our round completed: ask again with a new lease.
                # (Had the round completed with us, the rank is ours; the loss then shows
                # in num_nodes_waiting() and the agent re-rendezvouses.)
                wanted = 0
                action = decide_node(
                    state, self.node_id, wanted, self._clock(), deadline, self.incarnation
                )
            rank = state.rank_of(self.node_id)
            if action is NodeAction.FINISH and rank is not None:
                log.info(
                    "node %s: run %s round %d complete: rank %d of %d (%.3f s)",
                    self.node_id, run_id, state.round, rank, len(state.participants),
                    self._clock() - start,
                )  # fmt: skip
                self.last_round, self.last_members = state.round, state.participants
                self.last_workers = state.workers
                return self._info(state, rank)
            ctx = JoinContext(
                run_id, self.node_id, self.incarnation, wanted, self._settings.join_timeout,
                self._limits.min_nodes,
            )  # fmt: skip
            ended = join_error(action, state, ctx)
            if ended is not None:
                error, leave_first = ended
                if leave_first:
                    self.leave()
                raise error
            if action is NodeAction.JOIN:
                wanted = state.round + 1
                if not self.incarnation:
                    self.incarnation = incarnation_to_join(state)
                    if state.closed:
                        log.info(
                            "node %s: run %s is closed (%s); asking to start it again as "
                            "incarnation %d once every node of incarnation %d has left",
                            self.node_id, run_id, state.closed_reason or "closed",
                            self.incarnation, state.incarnation,
                        )  # fmt: skip
                ask = self._node_writer(parts, wanted)
                self._until(deadline, f"asking for round {wanted} of", ask)
                continue
            # A listed spare waits for events only, without a deadline (past join_timeout
            # a timeout of 0 would make this loop spin).
            timeout = None if is_spare(state, self.node_id) else deadline - self._clock()
            view.wait_newer(
                seen, None if timeout is None else max(timeout, 0.0), self._session_lost
            )

    def _note_quarantine(self, state: RdzvState, logged: int) -> int:
        entry = state.quarantine_of(self.node_id)
        if entry is None or entry.until_unix_ms == logged:
            return logged
        left = max(0.0, entry.until_unix_ms / 1000 - time.time())
        log.warning(
            "node %s is quarantined in run %s for about %.0f s more (%s): it waits outside "
            "the rounds, then asks to join again",
            self.node_id, self._keys.run_id, left, entry.reason,
        )  # fmt: skip
        return entry.until_unix_ms

    def _info(self, state: RdzvState, rank: int) -> RendezvousInfo:
        store = EtcdStore(
            self._etcd(),
            self._keys.store_prefix(state.round),
            timeout=datetime.timedelta(seconds=self._settings.store_timeout),
        )
        bootstrap = RendezvousStoreInfo(
            master_addr=state.master_addr, master_port=state.master_port
        )
        return RendezvousInfo(store, rank, len(state.participants), bootstrap)

    @torch_errors
    def is_closed(self) -> bool:
        # From memory and never raising: a running agent asks this every tick, and an
        # unreadable state (an operator's stray put) must not end its training. After a
        # thread death the participation is gone until the next join; the state its view
        # last saw answers, for building a new one here would make RPCs on the agent's
        # loop (and raise while etcd is away). Before any join: not known to be closed
        # (the join finds out).
        with self._lock:
            view = self._last_view
        return view is not None and self._closed_for_me(view.peek())

    def _closed_for_me(self, state: RdzvState) -> bool:
        # Closed for this node: its incarnation is closed or over. A node waiting to start
        # the run again (incarnation + 1) is not in a closed run.
        mine = self.incarnation or state.incarnation
        return mine < state.incarnation or (state.closed and mine == state.incarnation)

    @torch_errors
    def set_closed(self, reason: str = "closed by an agent", mode: CloseMode = "finished") -> None:
        """Close the run for everyone (torch's contract), saying why and how.

        Args:
            reason: shown to every node that finds the run closed.
            mode: ``finished`` (all done), ``failed`` (this node gave up: the others stop
                and exit non-zero) or ``drain`` (finish the current attempt, then exit 0).
        """
        view = self._participation().view
        executor = StateExecutor(self._etcd(), self._keys, written_by=self.node_id)
        outcome = executor.close(
            reason,
            mode=mode,
            timeout=self._settings.close_timeout,
            known=view.snapshot(),
            on_conflict=view.offer,
            clock=self._clock,
            incarnation=self.incarnation,
        )
        if outcome.changed:
            view.offer_written(outcome.state, outcome.mod_revision)
            log.info("node %s closed run %s (%s)", self.node_id, self._keys.run_id, mode)

    @torch_errors
    def quarantine(self, entries: Sequence[Quarantine]) -> bool:
        """Leave ``entries`` out of the rounds until their end time (a guarded write; see
        :mod:`coordinator.core.quarantine`). Returns whether this call wrote them (False:
        they were there already, or the run is closed)."""
        view = self._participation().view
        executor = StateExecutor(self._etcd(), self._keys, written_by=self.node_id)
        commit = executor.update(
            lambda state: quarantine(state, entries), known=view.snapshot(), on_conflict=view.offer
        )
        if commit is None:
            return False
        view.offer_written(commit.state, commit.revision)
        return True

    can_quarantine = True
    """Ours keeps quarantined nodes out of the rounds (:meth:`quarantine`)."""

    # -- the job's restart budget (coordinator/core/restart_budget.py) -----------------

    job_restart_budget = True
    """Ours counts restarts once for the job, in the state (:meth:`count_restart`)."""

    @torch_errors
    def count_restart(self, round: int) -> RestartCount:
        """Count a failure (or hang) of ``round`` against the job's ``--max-restarts``,
        once for the job: nothing is written when the watched state shows it counted, and
        a lost race decides again from the winner's value. Returns the job's count."""
        view = self._participation().view
        executor = StateExecutor(self._etcd(), self._keys, written_by=self.node_id)
        commit = executor.update(
            lambda state: count_restart(state, round, self.incarnation),
            known=view.snapshot(),
            on_conflict=view.offer,
        )
        if commit is None:
            return view.peek().restarts
        view.offer_written(commit.state, commit.revision)
        return commit.state.restarts

    @property
    def job_restarts(self) -> RestartCount:
        """The job's counted restarts, from the watched view (none before the first join)."""
        parts = self._current()
        return parts.view.peek().restarts if parts is not None else RestartCount()

    @property
    def departure_seen_within(self) -> float:
        """A participant that died is in the state's ``lost`` list within its lease TTL
        and a second (the watch and the coordinator's commit)."""
        return self._settings.lease_ttl + 1.0

    @property
    def drain_requested(self) -> bool:
        """Whether an operator asked this node to leave (``rdzvctl drain``), from the
        watched view: the agent then stops its workers gracefully and exits 0."""
        parts = self._current()
        return parts is not None and self.node_id in parts.view.peek().draining

    @property
    def declared_hang(self) -> Hang | None:
        """The hang declared in this node's last round (``--hang-timeout``), from the
        watched view; None while there is none."""
        parts = self._current()
        hang = parts.view.peek().hang if parts is not None else None
        return hang if hang is not None and hang.round == self.last_round else None

    def progress_board(self) -> ProgressBoard | None:
        """This node's progress records and hang declarations in the current
        participation (None when it has none: not joined yet, or left)."""
        parts = self._current()
        if parts is None:
            return None
        return ProgressBoard(
            self._etcd(), self._keys, self.node_id, parts.member.lease_id, parts.view,
            clock=self._clock,
        )  # fmt: skip

    @property
    def quarantined_nodes(self) -> frozenset[str]:
        """The nodes quarantined now (``etcdrun --health-check``), from the watched view."""
        parts = self._current()
        return quarantined_ids(parts.view.peek()) if parts is not None else frozenset()

    @property
    def close_mode(self) -> CloseMode:
        """How the run was closed (``unspecified`` while it is open), from the watched view."""
        parts = self._current()
        return parts.view.peek().close_mode if parts is not None else "unspecified"

    @property
    def closed_reason(self) -> str:
        """Why the run was closed ("" while it is open), from the watched view."""
        parts = self._current()
        return parts.view.peek().closed_reason if parts is not None else ""

    @torch_errors
    def num_nodes_waiting(self) -> int:
        with self._lock:
            parts, rejoin = self._parts, self._rejoin
        if parts is None:
            return 1 if rejoin is not None else 0
        return parts.view.peek().num_waiting + (1 if parts.member.lost() else 0)

    def get_run_id(self) -> str:
        return self._keys.run_id

    @torch_errors
    def shutdown(self) -> bool:
        try:
            if not self._left:
                self.set_closed("shutdown by an agent")
            return True
        except EtcdElasticError as exc:
            log.warning("node %s could not close run %s: %s", self.node_id, self.get_run_id(), exc)
            return False
        finally:
            self.leave()

    # -- ours --------------------------------------------------------------------------

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` whenever ``num_nodes_waiting()`` may have changed."""
        return self._listeners.subscribe(callback)

    @property
    def is_coordinator(self) -> bool:
        """Whether this node currently holds the coordinator duty."""
        parts = self._current()
        return parts is not None and parts.duty.is_leader

    @torch_errors
    def leave(self) -> None:
        """Leave the run without closing it: stop watching, revoke the lease. Idempotent."""
        with self._lock:
            if self._left:
                return
            self._left = True
            parts, self._parts = self._parts, None
            events = self._events
        if events is not None:
            events.close()
        if parts is not None:
            self._say_departing(parts)
            parts.close()
        self._run_lease.stop()
        if self._unlisten is not None:
            self._unlisten()
        if self._own_client and self._client is not None:
            self._client.close()

    def needs_nodes(self) -> bool:
        """Whether the run trained (a round completed) and fewer than ``min_nodes`` of
        its nodes hold a key now: it cannot go on until nodes join, so a node about to
        join should join at once. Two reads (the state key, a count of the node keys),
        made once by an agent before it joins; False when etcd does not answer or the
        state is unreadable (the agent then prepares as it would anyway)."""
        try:
            client = self._etcd()
            kv, _ = client.get(self._keys.state)
            if kv is None:
                return False
            state = decode_state(self._keys.state.decode(), kv.value)
            if state.round < 1 or state.closed:
                return False
            alive, _ = client.count_prefix(self._keys.nodes_prefix)
        except EtcdElasticError as exc:
            log.info("node %s: could not tell whether run %s waits for nodes: %s",
                     self.node_id, self._keys.run_id, exc)  # fmt: skip
            return False
        return alive < self._limits.min_nodes

    def departed_participants(self) -> list[str]:
        """Nodes of this node's last round whose lease ended since (from the watched view)."""
        parts = self._current()
        if parts is None or self.last_round < 0:
            return []
        state = parts.view.peek()
        if state.round != self.last_round:
            return []
        return [node for node in state.lost if node != self.node_id]


def create_handler(
    params: RendezvousParameters,
    *,
    client: EtcdClient | None = None,
    local_world_size: int = 0,
    role: str = "",
    etcd_observer: EtcdObserver | None = None,
) -> EtcdRendezvousHandler:
    """Build a handler from torch's parameters (validated; errors name the setting)."""
    settings = RendezvousSettings.from_parameters(params)
    return EtcdRendezvousHandler(
        settings,
        client=client,
        backend_name=params.backend,
        local_world_size=local_world_size,
        role=role,
        etcd_observer=etcd_observer,
    )
