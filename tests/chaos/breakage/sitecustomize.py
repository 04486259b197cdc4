"""Deliberately broken variants of the agent, to show that the chaos checker catches them.

``scripts/chaos --break NAME`` puts this folder on the agents' ``PYTHONPATH`` and sets
``ETCD_ELASTIC_CHAOS_BREAK=NAME`` in their environment only. The interpreter imports this
file at start-up (``sitecustomize``); it applies the named change and removes the
variable, so the agent's workers (which inherit the path, not the variable) run
unchanged. Never used outside the chaos suite.

Variants (each undoes one guarantee of issue 8):

``lease_timer``
    A lease counts as lost after one TTL without an answer, by the client's own clock
    (as before item 1): an etcd outage longer than the TTL restarts every worker.
``blind_waits``
    The rank exchange and store waits ignore membership (as before item 2): a node lost
    during the exchange stalls the others until the store timeout.
``no_fencing``
    A coordinator's commits are guarded by the state's revision only (as before item 3).
``orphans``
    Workers are started without the parent-death signal (as before item 5): a SIGKILLed
    agent leaves its workers running.
"""

from __future__ import annotations

import os
from typing import Any

_VAR = "ETCD_ELASTIC_CHAOS_BREAK"


def _lease_timer() -> None:
    from coordinator.core.etcd_client import _liveness

    cls: Any = _liveness.Liveness
    original = cls.check

    def check(self: Any, now: float) -> Any:
        if self.state is _liveness.LeaseState.ALIVE and now >= self.alive_until:
            return self._final(
                _liveness.LeaseState.LOST, now - self.last_answer, "no answer within the TTL"
            )
        return original(self, now)

    cls.check = check


def _blind_waits() -> None:
    import importlib

    nothing: Any = lambda *_: None  # noqa: E731
    setattr(importlib.import_module("agent.loop.rounds"), "store_aborter", nothing)  # noqa: B010
    setattr(importlib.import_module("agent.loop.formation"), "formation_changed", nothing)  # noqa: B010


def _no_fencing() -> None:
    from coordinator.core import executor

    original = executor.StateExecutor.commit

    def commit(self: Any, known: Any, actions: Any, **kwargs: Any) -> Any:
        kwargs["fence"] = None
        return original(self, known, actions, **kwargs)

    executor.StateExecutor.commit = commit  # type: ignore[method-assign]


def _orphans() -> None:
    import importlib

    spawn = importlib.import_module("coordinator.core.lifeline.spawn")
    setattr(spawn, "PDEATHSIG_SUPPORTED", False)  # noqa: B010


_VARIANTS = {
    "lease_timer": _lease_timer,
    "blind_waits": _blind_waits,
    "no_fencing": _no_fencing,
    "orphans": _orphans,
}


def _apply() -> None:
    name = os.environ.pop(_VAR, "")
    if name:
        _VARIANTS[name]()


_apply()
