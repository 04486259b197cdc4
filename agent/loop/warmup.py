"""The warm pool around a join: made ready before this node joins, refilled after a start.

A worker started from a warm interpreter skips its torch import (:mod:`agent.workers.warm`).
The agent fills the pool before its first join, so a node that joins a running job does
not make every other node wait for its imports, and refills it after each start: after
a start that follows a quiet spell, without competing for the cores the new workers load
their checkpoint on; in a burst of starts, at once, so the next start finds one ready.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence

from agent.workers.launch import WorkerLaunch
from agent.workers.warm import WarmPool
from coordinator.torch_adapter.surface import RendezvousSurface

__all__ = ["Refill", "prepare_warm_pool", "refill_defer"]

log = logging.getLogger(__name__)

# How long a starting agent lets its warm interpreters import before it joins anyway.
_WARM_BEFORE_JOIN_S = 60.0
# After a start from the pool, how long the imports that replace the interpreters taken
# wait while another one is still ready: the new workers load their checkpoint and take
# their first step without a torch import competing for the same cores.
_REFILL_DEFER_S = 5.0
# A start this soon after the one before is part of a burst (a node lost, then back; a
# re-formation right after a formation; a second crash): the next start may come before a
# deferred import would be done, and it would find no interpreter ready.
_BURST_S = 20.0


def prepare_warm_pool(
    warm: WarmPool,
    templates: Mapping[int, tuple[Sequence[str], Mapping[str, str]]],
    rdzv: RendezvousSurface,
    interrupted: threading.Event,
    ctx: str,
) -> None:
    """Start the whole warm pool (every interpreter of every local worker at once: no
    worker runs yet) and let it import before this node joins: a node that joins a
    running job makes every other node restart, and they would then wait for this
    node's workers to import torch; and a worker that crashes in its first seconds
    finds a spare ready, as a late crash does. The wait is at most
    ``_WARM_BEFORE_JOIN_S``; ``interrupted`` (a stop request or a membership event)
    ends it. A run that trained and now lacks nodes (fewer than ``min_nodes`` alive) is
    not kept waiting: this node joins at once and its first workers take the
    interpreters as they become ready.

    Args:
        warm: the pool.
        templates: per local rank, the command and environment of its workers
            (:func:`agent.loop.launches.warm_templates`).
        rdzv: asked whether the run waits for nodes (one read, only with a pool).
        interrupted: the agent's wake-up event.
        ctx: run, node and attempt, for the log lines.
    """
    if warm.enabled and rdzv.needs_nodes():
        # One import per worker first, as a refill does: the spares importing beside
        # them would slow the imports the first workers wait for.
        warm.refill(templates)
        log.info(
            "%s: the run waits for nodes to reach min_nodes: joining at once, before the "
            "warm interpreters are ready", ctx,
        )  # fmt: skip
        return
    warm.refill(templates, at_once=True)
    if not warm.enabled:
        return
    started = time.monotonic()
    full = warm.wait_ready(_WARM_BEFORE_JOIN_S, interrupted, every=warm.depth)
    log.info(
        "%s: warm interpreters %s after %.1f s",
        ctx, "ready" if full else "not all ready", time.monotonic() - started,
    )  # fmt: skip


def refill_defer(now: float, previous_start: float | None) -> float:
    """How long the imports replacing what a start at ``now`` took wait while their local
    rank still has a ready interpreter: ``_REFILL_DEFER_S`` after a quiet spell (the
    new workers load their checkpoint and take their first step meanwhile), none when
    the start before was less than ``_BURST_S`` earlier. Pure.

    Why a burst refills at once: with the default two interpreters per local rank, the
    first start of a burst takes one and defers the replacement; the second takes the
    last, and its replacement only then begins, so a third start within one import of the
    second waited for that import (seconds of CPU per worker on a busy node), where an
    import begun at the first start would have been ready.
    """
    if previous_start is not None and now - previous_start < _BURST_S:
        return 0.0
    return _REFILL_DEFER_S


class Refill:
    """Replaces the interpreters each worker start of this agent takes from the pool."""

    def __init__(self, warm: WarmPool) -> None:
        self._warm = warm
        self._previous: float | None = None  # monotonic time of the last start

    def after_start(self, launches: Sequence[WorkerLaunch], now: float) -> None:
        """Replace the interpreters the workers of ``launches`` took, started at ``now``
        (monotonic seconds), for workers like them (:func:`refill_defer` says when)."""
        defer = refill_defer(now, self._previous)
        self._previous = now
        self._warm.refill({ln.ranks.local_rank: (ln.argv, ln.env) for ln in launches}, defer=defer)
