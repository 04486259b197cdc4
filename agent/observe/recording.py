"""What the agent tells the agent journal (``ETCD_ELASTIC_JOURNAL``; :mod:`agent.observe.journal`).

The chaos suite's checker reads these events to verify its invariants (one membership
per round, rounds never go back, no restart without a node lost, ...). Without the
variable every call costs one attribute test. With a handler that is not ours (no node
id, no round number) the round is recorded as -1, which the checker refuses for real
runs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from agent.health.preflight import Preflight
from agent.observe.journal import JOURNAL_ENV, NODE_ENV, ROUND_ENV, JournalWriter
from agent.observe.timeline import record_health
from coordinator.torch_adapter.surface import RendezvousSurface

__all__ = ["RoundRecorder"]

log = logging.getLogger(__name__)


class RoundRecorder:
    """Records one agent's rounds, worker groups and exit."""

    def __init__(self, rdzv: RendezvousSurface, run_id: str, env: Mapping[str, str]) -> None:
        self._rdzv = rdzv
        self._run_id = run_id
        try:
            self._writer = JournalWriter.from_env("agent", env)
        except OSError as exc:
            # A history is a diagnostic: a path it cannot write must not stop training.
            log.warning("%s=%s cannot be written (%s); no history is recorded", JOURNAL_ENV,
                        env.get(JOURNAL_ENV), exc)  # fmt: skip
            self._writer = JournalWriter(None)
        self._round = -1
        self._verdict: object = None  # the last verdict recorded

    @property
    def node(self) -> str:
        return self._rdzv.node_id

    def formed(self, group_rank: int, group_world: int) -> dict[str, str]:
        """Record the round just formed; returns what the workers' environment adds."""
        self._round = self._rdzv.last_round
        members = self._rdzv.last_members
        self._writer.record(
            "round",
            node=self.node,
            round=self._round,
            group_rank=group_rank,
            group_world=group_world,
            members=list(members),
            run=self._run_id,
        )
        return {ROUND_ENV: str(self._round), NODE_ENV: self.node}

    def health(self, preflight: Preflight | None) -> None:
        """Record the verdict of the last pre-flight check once (``health_check``
        {node, round, took_s, nodes: one record per node, see
        :meth:`agent.health.verdict.Verdict.events`})."""
        verdict = preflight.last if preflight is not None else None
        if verdict is None or verdict is self._verdict:
            return
        self._verdict = verdict
        round_id = self._rdzv.last_round
        if preflight is not None and preflight.last_judged:
            record_health(self._rdzv, round_id, verdict.summary())
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
