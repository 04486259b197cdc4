"""The warm pool around a join: made ready before this node joins, refilled after a start.

A worker started from a warm interpreter skips its torch import (:mod:`agent.workers.warm`).
The agent fills the pool before its first join, so a node that joins a running job does
not make every other node wait for its imports, and refills it at once after each start
by forking the interpreters left, so the next start finds one ready.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence

from agent.workers.launch import WorkerLaunch
from agent.workers.warm import WarmPool
from coordinator.torch_adapter.surface import RendezvousSurface

__all__ = ["prepare_warm_pool", "refill_after_start"]

log = logging.getLogger(__name__)

# How long a starting agent lets its warm interpreters import before it joins anyway.
_WARM_BEFORE_JOIN_S = 60.0


def prepare_warm_pool(
    warm: WarmPool,
    templates: Mapping[int, tuple[Sequence[str], Mapping[str, str]]],
    rdzv: RendezvousSurface,
    interrupted: threading.Event,
    ctx: str,
) -> None:
    """Start the warm pool (one import per local worker, then forks of it for the rest
    of each rank's interpreters) and let it import before this node joins: a node that
    joins a running job makes every other node restart, and they would then wait for
    this node's workers to import torch; and a worker that crashes in its first seconds
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
    warm.refill(templates)
    if warm.enabled and rdzv.needs_nodes():
        log.info(
            "%s: the run waits for nodes to reach min_nodes: joining at once, before the "
            "warm interpreters are ready", ctx,
        )  # fmt: skip
        return
    if not warm.enabled:
        return
    started = time.monotonic()
    full = warm.wait_ready(_WARM_BEFORE_JOIN_S, interrupted, every=warm.depth)
    log.info(
        "%s: warm interpreters %s after %.1f s",
        ctx, "ready" if full else "not all ready", time.monotonic() - started,
    )  # fmt: skip


def refill_after_start(warm: WarmPool, launches: Sequence[WorkerLaunch]) -> None:
    """Replace the interpreters the workers of ``launches`` took, for workers like them:
    at once, by forking the ones left (:meth:`WarmPool.refill`), so the next start, a
    second later or an hour later, finds one ready, and no import competes with the new
    workers for the cores (before the pool forked, a quiet job deferred its imports by
    5 s and a burst of starts did not: the burst then paid imports on its cores)."""
    warm.refill({ln.ranks.local_rank: (ln.argv, ln.env) for ln in launches})
