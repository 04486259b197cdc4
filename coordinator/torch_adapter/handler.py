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
import logging
import time
from collections.abc import Callable

from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from coordinator.core.errors import EtcdElasticError
from coordinator.core.etcd_client import EtcdClient, EtcdObserver
from coordinator.core.executor import StateExecutor
from coordinator.core.settings import RendezvousSettings
from coordinator.core.state import CloseMode, RdzvState
from coordinator.torch_adapter.errors import torch_errors
from coordinator.torch_adapter.join import Join
from coordinator.torch_adapter.node import RendezvousNode
from coordinator.torch_adapter.store import EtcdStore

__all__ = ["EtcdRendezvousHandler", "create_handler"]

log = logging.getLogger(__name__)


class EtcdRendezvousHandler(RendezvousNode, RendezvousHandler):
    """One node's handle on one run's rendezvous. See the module docstring for the contract.

    torch's contract is here; the node's identity, its client, its presence in the run
    and what our agent asks beyond the contract
    (:class:`~coordinator.torch_adapter.surface.RendezvousSurface`) are its base,
    :class:`~coordinator.torch_adapter.node.RendezvousNode`; the join loop is
    :class:`~coordinator.torch_adapter.join.Join`.

    Args:
        backend_name: what :meth:`get_backend` reports; the others are
            :class:`~coordinator.torch_adapter.node.RendezvousNode`'s (optional here, as
            torch's callers give only the settings).
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
        super().__init__(
            settings, client=client, local_world_size=local_world_size, role=role, clock=clock,
            etcd_observer=etcd_observer,
        )  # fmt: skip
        self._backend_name = backend_name

    def get_backend(self) -> str:
        return self._backend_name

    @property
    def use_agent_store(self) -> bool:
        # Workers bootstrap their own TCPStore from MASTER_ADDR/MASTER_PORT; our store is
        # the agents' (it lives in etcd and is scoped to one round).
        return False

    @torch_errors
    def next_rendezvous(self) -> RendezvousInfo:
        join = Join(self, self._presence, self._settings, self._limits, self._record, self._clock)
        state, rank = join.run()
        self.last_round, self.last_members = state.round, state.participants
        self.last_workers = state.workers
        return self._info(state, rank)

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
        view = self._presence.last_view()
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
        view = self._presence.participation().view
        executor = StateExecutor(
            self._etcd(), self._keys, written_by=self.node_id,
            before_write=lambda: self._presence.run_lease_ready(view),
        )  # fmt: skip
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
    def num_nodes_waiting(self) -> int:
        return self._presence.nodes_waiting(self.last_round)

    def get_run_id(self) -> str:
        return self._keys.run_id

    @torch_errors
    def shutdown(self) -> bool:
        try:
            if not self._presence.left:
                self.set_closed("shutdown by an agent")
            return True
        except EtcdElasticError as exc:
            log.warning("node %s could not close run %s: %s", self.node_id, self.get_run_id(), exc)
            return False
        finally:
            self.leave()


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
