"""The warm pool around a join: made ready before this node joins, refilled after a start.

A worker started from a warm interpreter skips its torch import (:mod:`agent.workers.warm`).
The agent fills the pool before its first join, so a node that joins a running job does
not make every other node wait for its imports, and refills it after each start without
competing for the cores the new workers load their checkpoint on.
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
# After a start from the pool, how long the imports that replace the interpreters taken
# wait while another one is still ready: the new workers load their checkpoint and take
# their first step without a torch import competing for the same cores.
_REFILL_DEFER_S = 5.0


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


def refill_after_start(warm: WarmPool, launches: Sequence[WorkerLaunch]) -> None:
    """Replace the interpreters the workers of ``launches`` took, for workers like them;
    the imports of ranks that still have one ready wait a few seconds (the new workers
    load their checkpoint meanwhile)."""
    warm.refill({ln.ranks.local_rank: (ln.argv, ln.env) for ln in launches}, defer=_REFILL_DEFER_S)
