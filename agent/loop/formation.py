"""How the agent's loop forms a round, tried again after each membership change.

Each try is one formation phase (:func:`agent.loop.rounds.form_round`: rendezvous, the
rank exchange, the master address, the pre-flight check) that the loop waits on beside
its stop requests. A membership change during the exchange, or a node that failed the
check, ends the try: not a counted restart, this node joins the next round. The
workers' bootstrap store (on group rank 0) is one server at a time, released before each
formation so a fixed ``--master-port`` is free for the next round.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from torch.distributed.elastic.rendezvous import RendezvousHandler

from agent.config import LaunchConfig
from agent.health.preflight import HealthCheckFailed, Preflight
from agent.loop.phase import MembershipChanged, Phase, PhaseWaiter
from agent.loop.rounds import Formed, form_round, formation_changed
from agent.observe.recording import RoundRecorder
from agent.workers.bootstrap import BootstrapHost, BootstrapTicket
from coordinator.torch_adapter.surface import RendezvousSurface

__all__ = ["Formation"]

log = logging.getLogger(__name__)


class Formation:
    """Forms this node's rounds, and hosts the workers' bootstrap store.

    Args:
        handler, rdzv: the rendezvous and our surface of it.
        config: the launch configuration.
        preflight: the pre-flight check each formation runs (None: ``--health-check`` off).
        phases: what the loop waits on a phase with (it ends the wait on a stop request).
        wake: wakes the loop (a phase's end).
        history: records each formation's check results.
    """

    def __init__(
        self,
        handler: RendezvousHandler,
        rdzv: RendezvousSurface,
        config: LaunchConfig,
        preflight: Preflight | None,
        phases: PhaseWaiter,
        wake: Callable[[], None],
        history: RoundRecorder,
    ) -> None:
        self._handler = handler
        self._rdzv = rdzv
        self._config = config
        self._preflight = preflight
        self._phases = phases
        self._wake = wake
        self._history = history
        self._bootstrap = BootstrapHost()

    def form(self, ctx: str, *, watch: bool) -> Formed | None:
        """Rendezvous until a round forms whose ranks this node agreed; None if stopped.

        Args:
            ctx: run, node and attempt, for the log lines.
            watch: whether the handler pushes events (ours): then a membership change
                ends a try (torch's handlers push none: each try runs to its end).
        """
        while True:
            log.info("%s: joining the next rendezvous round", ctx)
            # The last round's workers are stopped: its server goes, and only this
            # formation may host the next one.
            ticket = self._bootstrap.next_formation()
            phase: Phase[Formed] = Phase(
                "rendezvous", functools.partial(self._body, ticket=ticket), self._wake
            )
            changed = formation_changed(self._handler, self._rdzv) if watch else None
            try:
                formed = self._phases.run(phase, changed)
                if formed is None:
                    self._bootstrap.release()  # stopped: nothing abandoned may bind now
                return formed
            except MembershipChanged as exc:
                where = "" if isinstance(exc, HealthCheckFailed) else " during the rank exchange"
                log.info("%s: %s%s; joining the next round (not counted)", ctx, exc, where)
            finally:
                self._history.health(self._preflight)

    def _body(self, phase: Phase[Formed], *, ticket: BootstrapTicket) -> Formed:
        return form_round(self._handler, self._rdzv, self._config, phase, ticket, self._preflight)

    def release(self) -> None:
        """Stop the bootstrap store, if this node hosts one (the agent is ending)."""
        self._bootstrap.release()
