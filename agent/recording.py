"""What the agent tells the run's history (``ETCD_ELASTIC_HISTORY``, see :mod:`agent.history`).

The chaos suite's checker reads these events to verify its invariants (one membership
per round, rounds never go back, no restart without a node lost, ...). Without the
variable every call costs one attribute test. With a handler that is not ours (no node
id, no round number) the round is recorded as -1, which the checker refuses for real
runs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch.distributed.elastic.rendezvous import RendezvousHandler

from agent.ending import record_health
from agent.history import HISTORY_ENV, NODE_ENV, ROUND_ENV, HistoryWriter
from agent.preflight import Preflight

__all__ = ["RoundRecorder"]

log = logging.getLogger(__name__)


class RoundRecorder:
    """Records one agent's rounds, worker groups and exit."""

    def __init__(self, handler: RendezvousHandler, env: Mapping[str, str]) -> None:
        self._handler = handler
        try:
            self._writer = HistoryWriter.from_env("agent", env)
        except OSError as exc:
            # A history is a diagnostic: a path it cannot write must not stop training.
            log.warning("%s=%s cannot be written (%s); no history is recorded", HISTORY_ENV,
                        env.get(HISTORY_ENV), exc)  # fmt: skip
            self._writer = HistoryWriter(None)
        self._round = -1
        self._verdict: object = None  # the last verdict recorded

    @property
    def node(self) -> str:
        return str(getattr(self._handler, "node_id", "?"))

    def formed(self, group_rank: int, group_world: int) -> dict[str, str]:
        """Record the round just formed; returns what the workers' environment adds."""
        self._round = int(getattr(self._handler, "last_round", -1))
        members: tuple[str, ...] = tuple(getattr(self._handler, "last_members", ()))
        self._writer.record(
            "round",
            node=self.node,
            round=self._round,
            group_rank=group_rank,
            group_world=group_world,
            members=list(members),
            run=self._handler.get_run_id(),
        )
        return {ROUND_ENV: str(self._round), NODE_ENV: self.node}

    def health(self, preflight: Preflight | None) -> None:
        """Record the verdict of the last pre-flight check once (``health_check``
        {node, round, took_s, nodes: one record per node, see
        :meth:`agent.health.Verdict.events`})."""
        verdict = preflight.last if preflight is not None else None
        if verdict is None or verdict is self._verdict:
            return
        self._verdict = verdict
        round_id = int(getattr(self._handler, "last_round", -1))
        node_id = str(getattr(self._handler, "node_id", ""))
        for result in verdict.nodes:
            if result.node_id == node_id:
                record_health(self._handler, node_id, round_id, result.line())
        self._writer.record(
            "health_check",
            node=self.node,
            round=round_id,
            took_s=round(preflight.last_took_s, 3) if preflight else 0.0,
            nodes=verdict.events(),
        )

    def started(self, pids: Mapping[int, int], restart_count: int) -> None:
        self._writer.record(
            "workers_started",
            node=self.node,
            round=self._round,
            pids=[pids[lr] for lr in sorted(pids)],
            restart_count=restart_count,
        )

    def stopped(self, reason: str) -> None:
        self._writer.record("workers_stopped", node=self.node, round=self._round, reason=reason)

    def exited(self, code: int) -> None:
        self._writer.record("agent_exit", node=self.node, code=code)
        self._writer.close()
