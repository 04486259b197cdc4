"""The agent's blocking phases and when membership ends them (DESIGN §9).

Forming a round is rendezvous, then the rank exchange and the master address through
the round's store; the job's end is the exit barrier. Each runs as a
:class:`~agent.loop.phase.Phase` while the loop watches membership through the handler's
pushed events (ours; torch's handlers push none, and their phases just run to the end):

* during the rank exchange and master resolution, any change (a participant lost, a
  node waiting, this node's own lease lost) ends the wait: the nodes re-form, a
  membership change, not a counted failure;
* at the exit barrier, a participant that left before arriving ends the wait: this
  node's workers succeeded, so it closes and exits 0, naming the node that left.

The departure shows within one lease TTL (etcd deletes the node's key and every agent
hears of it at once), so no wait outlives the departure of a node it waits on by more
than the TTL plus one event.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed import DistStoreError
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousHandler

from agent.config import LaunchConfig
from agent.health.preflight import Preflight
from agent.loop.ending import exit_barrier
from agent.loop.launches import Master, resolve_master
from agent.loop.phase import MembershipChanged, Phase
from agent.loop.ranks import Assignment, RoleInfo, exchange_ranks
from agent.store import Store
from agent.workers.bootstrap import BootstrapStoreError, BootstrapTicket
from agent.workers.group import GroupInfo
from coordinator.torch_adapter.surface import RendezvousSurface

__all__ = [
    "EXCHANGE",
    "HEALTH_CHECK",
    "Formed",
    "MembershipChanged",
    "PhaseAbandoned",
    "RankExchangeError",
    "barrier_changed",
    "barrier_phase",
    "form_round",
    "formation_changed",
    "store_aborter",
]

log = logging.getLogger(__name__)

EXCHANGE = "rank-exchange"
"""The stage of a formation phase once its round completed (see :meth:`Phase.mark`)."""
HEALTH_CHECK = "health-check"
"""The stage of a formation phase while the pre-flight check runs (``--health-check``)."""


class RankExchangeError(RendezvousError):
    """The round formed but its ranks or master address could not be agreed (the store
    timed out with every node still alive, or holds a value no agent writes)."""


@dataclass(frozen=True)
class Formed:
    """A completed round, as this node takes part in it."""

    info: Any  # torch's RendezvousInfo (store, rank, world_size, bootstrap_store_info)
    assignment: Assignment
    master_addr: str
    master_port: int
    use_agent_store: bool

    @property
    def store(self) -> Store:
        store: Store = self.info.store
        return store

    def group_info(self, config: LaunchConfig, restart_count: int, run_id: str) -> GroupInfo:
        """What this node's workers are told about the round (torchrun's variables)."""
        return GroupInfo(
            role=config.role,
            group_rank=self.info.rank,
            group_world_size=self.info.world_size,
            local_world_size=config.nproc_per_node,
            master_addr=self.master_addr,
            master_port=self.master_port,
            restart_count=restart_count,
            max_restarts=config.max_restarts,
            run_id=run_id,
            use_agent_store=self.use_agent_store,
        )


def store_aborter(store: Store) -> Callable[[], None] | None:
    """How to end every wait on ``store`` at once, if it can (ours: ``abort``)."""
    abort: Callable[[str], None] | None = getattr(store, "abort", None)
    if abort is None:
        return None
    return lambda: abort("the membership changed: this node no longer waits on this round")


def form_round(
    handler: RendezvousHandler,
    rdzv: RendezvousSurface,
    config: LaunchConfig,
    phase: Phase[Formed],
    bootstrap: BootstrapTicket,
    preflight: Preflight | None = None,
) -> Formed:
    """Rendezvous, then agree on ranks and the master address, then run the pre-flight
    check if there is one (a phase body). Once the loop abandoned the phase (a stop, a
    membership change), it starts nothing more: no exchange, no bootstrap store (its
    ``bootstrap`` ticket is void by then), no check.

    Raises:
        HealthCheckFailed: a node failed the check (the round re-forms without it).
        PhaseAbandoned: the loop abandoned the phase (nobody reads this).
    """
    info = handler.next_rendezvous()
    store: Store = info.store
    phase.mark(EXCHANGE, store_aborter(store))
    _go_on(phase)
    try:
        assignment = exchange_ranks(
            store,
            RoleInfo(config.role, info.rank, config.nproc_per_node),
            info.world_size,
            rdzv.last_workers,
        )
        _go_on(phase)
        master = resolve_master(
            config, info, store, info.rank, bootstrap, handler_store=bool(handler.use_agent_store)
        )
    except (DistStoreError, ValueError, BootstrapStoreError) as exc:
        text = " ".join(str(exc).split())
        raise RankExchangeError(f"round formed, but the rank exchange failed: {text}") from exc
    if preflight is not None:
        _check(rdzv, phase, preflight, info, store, master, bool(handler.use_agent_store))
    return Formed(info, assignment, master.addr, master.port, use_agent_store=master.agent_store)


class PhaseAbandoned(RuntimeError):
    """The loop abandoned this formation: it stops before its next step."""


def _go_on(phase: Phase[Formed]) -> None:
    if phase.abandoned:
        raise PhaseAbandoned("the formation was abandoned")


def _check(
    rdzv: RendezvousSurface,
    phase: Phase[Formed],
    preflight: Preflight,
    info: Any,
    store: Store,
    master: Master,
    handler_store: bool,
) -> None:
    """The pre-flight check, ended at once (store and check process) on abandon; not
    started at all when the phase was abandoned before it.

    Its results go through the workers' bootstrap store where group rank 0's agent hosts
    it (a new server per round: no etcd write). Where the handler hosts the workers'
    store (``handler_store``: torch's c10d handler; it outlives rounds), through the
    round's store. A wait on the bootstrap store cannot be aborted: it ends when group
    rank 0's agent releases the server (each agent does on abandon, before it forms the
    next round), else at its timeout; the phase's thread is a daemon the loop does not
    wait for, and the check acts on nothing once abandoned."""
    enders = _Enders()
    abort = store_aborter(store)
    if abort is not None:
        enders.add(abort)
    phase.mark(HEALTH_CHECK, enders.end)
    _go_on(phase)  # the check process started ahead stays for the next round's check
    try:
        preflight.check(
            store,
            round_id=max(rdzv.last_round, 0),
            group_rank=info.rank,
            world_size=info.world_size,
            members=rdzv.last_members,
            master=(master.addr, master.port) if master.agent_store else None,
            on_abandon=enders.add,
            exchange_at=(master.addr, master.port)
            if master.agent_store and not handler_store
            else None,
        )
    except (DistStoreError, ValueError, BootstrapStoreError) as exc:
        text = " ".join(str(exc).split())
        raise RankExchangeError(f"round formed, but the pre-flight check failed: {text}") from exc


class _Enders:
    """Ways to end a stage, run once on :meth:`end`; one added after that runs at once
    (a check process handed over just as the phase was abandoned is killed, not left to
    run to its timeout)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._enders: list[Callable[[], None]] = []
        self._ended = False

    def add(self, ender: Callable[[], None]) -> None:
        with self._lock:
            if not self._ended:
                self._enders.append(ender)
                return
        ender()

    def end(self) -> None:
        with self._lock:
            self._ended = True
            enders, self._enders = self._enders, []
        for ender in enders:
            ender()


def _left_during_check(rdzv: RendezvousSurface) -> str | None:
    """During the pre-flight check only a participant that left ends the wait (its result
    may never come). Nodes that wait to join wait for the check to end (it is bounded by
    its timeout): the first node done with its verdict re-joins, which puts it on the wait
    list, and the others must still finish theirs (and their log lines). Participants
    quarantined by this very check are its outcome, not a change."""
    out = rdzv.quarantined_nodes
    gone = [n for n in rdzv.departed_participants() if n not in out]
    return f"{', '.join(gone)} left during the pre-flight check" if gone else None


def formation_changed(
    handler: RendezvousHandler, rdzv: RendezvousSurface
) -> Callable[[Phase[Formed]], str | None]:
    """While ranks are exchanged, any membership change ends the phase."""

    def changed(phase: Phase[Formed]) -> str | None:
        if phase.stage not in (EXCHANGE, HEALTH_CHECK):
            return None  # still joining: nodes waiting to join is what a rendezvous is
        if phase.stage == HEALTH_CHECK:
            return _left_during_check(rdzv)
        waiting = handler.num_nodes_waiting()
        return f"the membership changed ({waiting} waiting or lost)" if waiting else None

    return changed


def barrier_phase(
    store: Store, group_world_size: int, timeout: float, ctx: str, on_change: Callable[[], None]
) -> Phase[bool]:
    """The exit barrier as a phase that an abandon ends through the store (if it can)."""

    def wait(phase: Phase[bool]) -> bool:
        phase.mark("waiting", store_aborter(store))
        return exit_barrier(store, group_world_size, timeout, ctx)

    return Phase("exit-barrier", wait, on_change)


def barrier_changed(
    handler: RendezvousHandler, rdzv: RendezvousSurface
) -> Callable[[Phase[bool]], str | None]:
    """At the exit barrier, a participant that left (and did not close the run) ends it."""

    def changed(_phase: Phase[bool]) -> str | None:
        gone = rdzv.departed_participants()
        # A node that passed the barrier closes the run before it leaves: then the barrier
        # is complete and its own result is on its way.
        if not gone or handler.is_closed():
            return None
        return f"{', '.join(gone)} left before arriving"

    return changed
