"""Faults at the run's first formation, before the plan's faults (``--opening KIND``).

``coordinator_freeze``: the coordinator of the first formation is frozen while it waits
out ``last_call_timeout`` with every node's key written, for longer than its lease TTL,
then resumed. The others are fewer than ``min_nodes`` without it (run with
``--min-nodes`` equal to ``--agents``), so none of them commits anything meanwhile; the
coordinator wakes up with the state's revision unchanged and a node table that still has
its own key, which etcd has deleted. Only the fence (its key's create revision compared
in the commit's transaction) refuses that commit: ``fenced_commits`` in
:mod:`tests.chaos.etcd_log` catches an agent without it (``--break no_fencing``).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.observe.journal import JournalWriter
from tests.chaos.fleet import Fleet

__all__ = ["OPENINGS", "coordinator_freeze"]

OPENINGS = ("coordinator_freeze",)


def _node_keys(etcdctl: Path, endpoints: str, nodes_prefix: str, user: str) -> list[dict[str, Any]]:
    """The node keys now, oldest first ([] if etcd did not answer)."""
    done = subprocess.run(
        [str(etcdctl), f"--endpoints={endpoints}", "-w", "json", "--command-timeout=3s",
         *([f"--user={user}"] if user else []),
         "get", "--prefix", "--sort-by=CREATE", nodes_prefix],
        capture_output=True, env={**os.environ, "ETCDCTL_API": "3"}, timeout=20, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        return []
    try:
        kvs = json.loads(done.stdout).get("kvs") or []
        return [json.loads(base64.b64decode(kv["value"])) for kv in kvs]
    except (ValueError, KeyError, TypeError):
        return []


def coordinator_freeze(
    fleet: Fleet,
    history: JournalWriter,
    etcdctl: Path,
    run_prefix: str,
    lease_ttl: float,
    agents: int,
    clock: Callable[[], float] = time.monotonic,
    *,
    user: str = "",
) -> bool:
    """Start the first agent, then the others once its key is the oldest; freeze it for
    TTL + 2 s once every agent's key asks for round 1; resume it. True if the freeze
    happened inside that window. ``user`` (``root:PASSWORD``) when etcd has auth."""
    endpoints, nodes = fleet.cluster.endpoint_list, f"{run_prefix}/nodes/"
    first = fleet.add_slot()
    fleet.start(first)
    deadline = clock() + 120  # the agent's interpreter imports torch first
    while len(_node_keys(etcdctl, endpoints, nodes, user)) < 1:
        if clock() > deadline:
            history.record("harness_error", index=-1, what="the first agent never wrote its key")
            return False
        time.sleep(0.05)
    for _ in range(agents - 1):
        fleet.start(fleet.add_slot())
    deadline = clock() + 120
    while True:
        keys = _node_keys(etcdctl, endpoints, nodes, user)
        if len(keys) >= agents and all(str(k.get("wanted_round")) == "1" for k in keys):
            break
        if clock() > deadline:
            history.record("harness_error", index=-1, what="the agents never all asked for round 1")
            return False
        time.sleep(0.02)
    coordinator = keys[0].get("node_id", "?")
    pid = fleet.signal(first, signal.SIGSTOP)
    history.record("opening", kind="coordinator_freeze", agent_pid=pid, coordinator=coordinator)
    time.sleep(lease_ttl + 2.0)
    fleet.signal(first, signal.SIGCONT)
    return True
