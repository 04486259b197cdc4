"""One node of a run as our agent sees it: what it asks beyond torch's contract.

:class:`RendezvousNode` is the base of our handler
(:class:`coordinator.torch_adapter.handler.EtcdRendezvousHandler`, which adds torch's
``RendezvousHandler`` contract): the node's identity and etcd client, its presence in the
run (:class:`~coordinator.torch_adapter.presence.RunPresence`), and every member of
:class:`~coordinator.torch_adapter.surface.RendezvousSurface`: pushed events, leaving,
the timeline, quarantine, the job's restart count, drain and hang, the round it is in.

Every property answers from the watched view, without a round trip, and never raises;
the writes (``quarantine``, ``count_restart``) are one revision-guarded transaction each
through the state's one writer, and like every public method that may raise, they raise
torch's error types (``@torch_errors``).
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence

from coordinator.core.actions import Action, count_restart, quarantine
from coordinator.core.errors import EtcdElasticError
from coordinator.core.etcd_client import EtcdClient, EtcdObserver
from coordinator.core.events import Event
from coordinator.core.executor import StateExecutor
from coordinator.core.hang_board import ProgressBoard
from coordinator.core.keys import make_node_id
from coordinator.core.listeners import Listeners
from coordinator.core.participation import Participation
from coordinator.core.ports import free_port
from coordinator.core.quarantine import quarantined_ids
from coordinator.core.restart_budget import RestartCount
from coordinator.core.settings import RendezvousSettings
from coordinator.core.state import CloseMode, Hang, NodeInfo, Quarantine, RdzvState, decode_state
from coordinator.core.transitions import Limits
from coordinator.core.view import StateView
from coordinator.torch_adapter.errors import torch_errors
from coordinator.torch_adapter.presence import RunPresence

__all__ = ["RendezvousNode"]

log = logging.getLogger(__name__)

_node_counter = itertools.count()
# Random per process: host name and pid repeat across containers (all pid 1, one name on
# the host's network), so they alone do not make node ids unique.
_PROCESS_TAG = secrets.token_hex(3)


class RendezvousNode:
    """This node's identity, client and presence in one run, and our surface over them.

    Args:
        settings: validated settings.
        client: an etcd client to share (the caller keeps ownership); by default the node
            makes and closes its own.
        local_world_size, role: recorded in this node's key for operators.
        clock: monotonic seconds (tests pass a fake).
        etcd_observer: hears of every etcd call the node's own client makes (the
            agent's metrics); ignored with a shared ``client``, which has its own.
    """

    def __init__(
        self,
        settings: RendezvousSettings,
        *,
        client: EtcdClient | None,
        local_world_size: int,
        role: str,
        clock: Callable[[], float],
        etcd_observer: EtcdObserver | None,
    ) -> None:
        self._settings = settings
        self._etcd_observer = etcd_observer
        self._keys = settings.keys
        self._own_client = client is None
        self._client = client
        self._clock = clock
        self._hostname = socket.gethostname()
        self._addr = settings.local_addr or socket.getfqdn()
        self.node_id = make_node_id(self._hostname, os.getpid(), next(_node_counter), _PROCESS_TAG)
        self.local_world_size = local_world_size
        self.role = role
        self._limits = Limits(settings.min_nodes, settings.max_nodes, settings.last_call_timeout)
        # A leaf lock: it guards the client's references below and nothing else; no RPC,
        # callback or other lock is taken while it is held (docs/architecture.md).
        self._lock = threading.Lock()
        self._unlisten: Callable[[], None] | None = None
        self._listeners = Listeners()
        self._presence = RunPresence(
            settings, self.node_id, self._limits, etcd=self._etcd,
            on_change=self._listeners.notify, incarnation=lambda: self.incarnation, clock=clock,
        )  # fmt: skip
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
                    on_thread_death=self._presence.on_thread_death,
                    observer=self._etcd_observer,
                )
            elif self._unlisten is None and not self._own_client:
                self._unlisten = self._client.add_death_listener(self._presence.on_thread_death)
            return self._client

    def _current(self) -> Participation | None:
        return self._presence.current()

    def _record(self, wanted_round: int, lease_id: int) -> NodeInfo:
        """This node's key asking for ``wanted_round``, on the lease ``lease_id``."""
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

    def _write(
        self, view: StateView, decide: Callable[[RdzvState], tuple[Action, ...]]
    ) -> RdzvState | None:
        """Commit ``decide``'s actions in one guarded write, decided from ``view`` (a lost
        race decides again from the winner's value); the state written, or None when the
        decision wrote nothing."""
        executor = StateExecutor(
            self._etcd(), self._keys, written_by=self.node_id,
            before_write=lambda: self._presence.run_lease_ready(view),
        )  # fmt: skip
        commit = executor.update(decide, known=view.snapshot(), on_conflict=view.offer)
        if commit is None:
            return None
        view.offer_written(commit.state, commit.revision)
        return commit.state

    # -- events, leaving, the timeline ---------------------------------------------------

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` whenever ``num_nodes_waiting()`` may have changed."""
        return self._listeners.subscribe(callback)

    @torch_errors
    def leave(self) -> None:
        """Leave the run without closing it: stop watching, revoke the lease. Idempotent."""
        if not self._presence.leave():
            return
        if self._unlisten is not None:
            self._unlisten()
        if self._own_client and self._client is not None:
            self._client.close()

    def record_event(self, event: Event) -> None:
        """Append ``event`` to the run's timeline in the background (never blocks, never
        raises). The agent records its counted restarts with it."""
        try:
            self._presence.event_log().submit([event])
        except EtcdElasticError as exc:
            log.warning("node %s: event not recorded: %s", self.node_id, exc)

    @property
    def is_coordinator(self) -> bool:
        """Whether this node currently holds the coordinator duty."""
        parts = self._current()
        return parts is not None and parts.duty.is_leader

    # -- quarantine (coordinator/core/quarantine.py) ------------------------------------

    @torch_errors
    def quarantine(self, entries: Sequence[Quarantine]) -> bool:
        """Leave ``entries`` out of the rounds until their end time (a guarded write; see
        :mod:`coordinator.core.quarantine`). Returns whether this call wrote them (False:
        they were there already, or the run is closed)."""
        view = self._presence.participation().view
        return self._write(view, lambda state: quarantine(state, entries)) is not None

    can_quarantine = True
    """Ours keeps quarantined nodes out of the rounds (:meth:`quarantine`)."""

    @property
    def quarantined_nodes(self) -> frozenset[str]:
        """The nodes quarantined now (``etcdrun --health-check``), from the watched view."""
        parts = self._current()
        return quarantined_ids(parts.view.peek()) if parts is not None else frozenset()

    # -- the job's restart budget (coordinator/core/restart_budget.py) -----------------

    job_restart_budget = True
    """Ours counts restarts once for the job, in the state (:meth:`count_restart`)."""

    @torch_errors
    def count_restart(self, round: int) -> RestartCount:
        """Count a failure (or hang) of ``round`` against the job's ``--max-restarts``,
        once for the job: nothing is written when the watched state shows it counted, and
        a lost race decides again from the winner's value. Returns the job's count.

        One etcd call as the agent sees it: etcd away is retried by the client for
        read_timeout, and a permission this node had, refused (an operator's RBAC
        change), is waited for as long."""

        def count() -> RestartCount:
            view = self._presence.participation().view
            written = self._write(view, lambda state: count_restart(state, round, self.incarnation))
            return view.peek().restarts if written is None else written.restarts

        deadline = self._clock() + self._settings.read_timeout
        doing = f"counting a restart of round {round} in"
        return self._presence.until(deadline, doing, count, unreachable_too=False)

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

    def departed_participants(self) -> list[str]:
        """Nodes of this node's last round whose lease ended since (from the watched view)."""
        parts = self._current()
        if parts is None or self.last_round < 0:
            return []
        state = parts.view.peek()
        if state.round != self.last_round:
            return []
        return [node for node in state.lost if node != self.node_id]

    # -- drain, hangs, how the run was closed --------------------------------------------

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
    def close_mode(self) -> CloseMode:
        """How the run was closed (``unspecified`` while it is open), from the watched view."""
        parts = self._current()
        return parts.view.peek().close_mode if parts is not None else "unspecified"

    @property
    def closed_reason(self) -> str:
        """Why the run was closed ("" while it is open), from the watched view."""
        parts = self._current()
        return parts.view.peek().closed_reason if parts is not None else ""

    # -- before joining ------------------------------------------------------------------

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
            # The join that follows meets the same error and reports it, once (a TLS
            # mismatch or a refused password is one line, not two).
            log.debug("node %s: could not tell whether run %s waits for nodes: %s",
                     self.node_id, self._keys.run_id, exc)  # fmt: skip
            return False
        return alive < self._limits.min_nodes
