"""What an agent may ask of a rendezvous beyond torch's ``RendezvousHandler``: one typed
surface instead of attribute probes.

Our handler (:class:`coordinator.torch_adapter.handler.EtcdRendezvousHandler`) implements
:class:`RendezvousSurface` itself (through its base,
:class:`coordinator.torch_adapter.node.RendezvousNode`); mypy checks it where
:func:`surface_of` returns it. Any
other torch handler (c10d, torch's etcd) gets :class:`ForeignSurface`, which says what
such a backend cannot do: it pushes no events, keeps no timeline, cannot quarantine or
drain, knows no round numbers, and keeps no count of the job's restarts (the agent counts
them per node, as torchrun does). So a typo in a name is a type error, not a feature
silently turned off.

Every property answers from memory (the watched view), never with a round trip, and
never raises; the methods that write (``leave``, ``record_event``, ``quarantine``,
``count_restart``) are documented on the protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from torch.distributed.elastic.rendezvous import RendezvousHandler

from coordinator.core.events import Event
from coordinator.core.restart_budget import RestartCount
from coordinator.core.state import CloseMode, Hang, Quarantine
from coordinator.torch_adapter.handler import EtcdRendezvousHandler

if TYPE_CHECKING:
    from coordinator.core.hang_board import ProgressBoard

__all__ = ["ForeignSurface", "RendezvousSurface", "surface_of"]


class RendezvousSurface(Protocol):
    """The agent's view of a rendezvous beyond torch's contract."""

    @property
    def node_id(self) -> str:
        """This node's id in the run ("?" where the backend has none)."""
        ...

    @property
    def last_round(self) -> int:
        """The round of this node's last completed rendezvous (-1: none, or unknown)."""
        ...

    @property
    def last_members(self) -> tuple[str, ...]:
        """That round's node ids in group-rank order (empty where unknown)."""
        ...

    @property
    def last_workers(self) -> tuple[tuple[str, int], ...]:
        """What each node of that round runs, (role, local world size) by group rank, so
        every agent computes every worker's ranks without a store exchange (empty where
        unknown: the agents then exchange them through the round's store)."""
        ...

    @property
    def incarnation(self) -> int:
        """The incarnation of the run this node belongs to (0: not asked to join yet)."""
        ...

    @property
    def close_mode(self) -> CloseMode:
        """How the run was closed; ``unspecified`` while open or where unknown."""
        ...

    @property
    def drain_requested(self) -> bool:
        """Whether an operator asked this node to leave (``rdzvctl drain``)."""
        ...

    @property
    def declared_hang(self) -> Hang | None:
        """The hang declared in this node's last round, if any."""
        ...

    @property
    def quarantined_nodes(self) -> frozenset[str]:
        """The nodes quarantined now (``--health-check``)."""
        ...

    @property
    def can_quarantine(self) -> bool:
        """Whether :meth:`quarantine` can keep nodes out of the rounds."""
        ...

    @property
    def job_restart_budget(self) -> bool:
        """Whether ``--max-restarts`` is the job's, counted once per round in the
        rendezvous (False: each node counts its own, as torchrun does)."""
        ...

    @property
    def job_restarts(self) -> RestartCount:
        """The job's counted restarts (nothing counted where the backend keeps none)."""
        ...

    def count_restart(self, round: int) -> RestartCount:
        """Count a failure (or hang) of ``round`` once for the job (a guarded write, none
        when it is counted already) and return the job's count; a backend without a
        job's count returns nothing counted."""
        ...

    @property
    def departure_seen_within(self) -> float:
        """Seconds within which every node sees a participant that died or was cut off
        (its lease TTL and a second); 0 where the backend cannot tell."""
        ...

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None] | None:
        """Call ``callback`` (on a background thread; it must not block) whenever
        ``num_nodes_waiting()`` may have changed; returns the unsubscribe function, or
        None where the backend pushes no events (the agent then polls each tick)."""
        ...

    def leave(self) -> None:
        """Leave the run without closing it, so the others see this node go at once.
        Idempotent; a backend that cannot does nothing."""
        ...

    def record_event(self, event: Event) -> None:
        """Append ``event`` to the run's timeline in the background; never blocks, never
        raises; a backend without a timeline drops it."""
        ...

    def quarantine(self, entries: Sequence[Quarantine]) -> bool:
        """Keep ``entries`` out of the rounds until their end time; whether this call
        wrote them (False: already there, closed, or the backend cannot)."""
        ...

    def progress_board(self) -> ProgressBoard | None:
        """This node's hang-detection records in etcd (None: none, or no backend)."""
        ...

    def departed_participants(self) -> list[str]:
        """Nodes of this node's last round whose lease ended since."""
        ...

    def needs_nodes(self) -> bool:
        """Whether the run trained and now waits for nodes: fewer than ``min_nodes`` of
        its nodes are alive, so a node about to join should not make it wait longer.
        May read etcd (once, before this node joins); False where unknown."""
        ...


class ForeignSurface:
    """The surface of a handler that is not ours: the agent runs, without our extras."""

    node_id = "?"
    last_round = -1
    last_members: tuple[str, ...] = ()
    last_workers: tuple[tuple[str, int], ...] = ()
    incarnation = 0
    close_mode: CloseMode = "unspecified"
    drain_requested = False
    declared_hang: Hang | None = None
    quarantined_nodes: frozenset[str] = frozenset()
    can_quarantine = False
    job_restart_budget = False
    job_restarts = RestartCount()

    def count_restart(self, round: int) -> RestartCount:
        return RestartCount()

    departure_seen_within = 0.0

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None] | None:
        return None

    def leave(self) -> None:
        return None

    def record_event(self, event: Event) -> None:
        return None

    def quarantine(self, entries: Sequence[Quarantine]) -> bool:
        return False

    def progress_board(self) -> ProgressBoard | None:
        return None

    def departed_participants(self) -> list[str]:
        return []

    def needs_nodes(self) -> bool:
        return False


def surface_of(handler: RendezvousHandler) -> RendezvousSurface:
    """``handler`` itself when it is ours, else a :class:`ForeignSurface`."""
    if isinstance(handler, EtcdRendezvousHandler):
        return handler
    return ForeignSurface()
