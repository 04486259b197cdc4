"""A run that trained and now lacks nodes does not wait for a newcomer's warm pool
(issue 21, item 12): a node that starts while fewer than ``min_nodes`` nodes are alive
joins at once; its first workers take the warm interpreters as they become ready.

Worst moment: the newcomer's warm import does not finish at all until the test lets it,
so a node that waits for its pool before joining (up to a minute) is seen not joining.
"""

from __future__ import annotations

import io
import os
import textwrap
import threading
from pathlib import Path

import pytest

from agent.config import LaunchConfig
from agent.loop.agent import Agent
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.rdzv_helpers import Joins, make_handler, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCKED_IMPORT = """
import os, time
deadline = time.monotonic() + 120
while not os.path.exists(os.environ["RELEASE_WARM"]) and time.monotonic() < deadline:
    time.sleep(0.02)
"""


def _trained_run(
    cluster: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> EtcdRendezvousHandler:
    """A run (min_nodes 2) whose round 1 formed with two nodes, one of which then left:
    the survivor is returned."""
    pair = [make_handler(cluster, run_id, 2, 3, lease_ttl=3) for _ in range(2)]
    handlers.extend(pair)
    Joins(pair).start().infos()
    pair[1].leave()
    return pair[0]


def test_needs_nodes_is_a_trained_run_below_min_nodes(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    fresh = make_handler(etcd1, run_id, 2, 3)
    handlers.append(fresh)
    assert not fresh.needs_nodes()  # nothing trained yet: the first formation
    survivor = _trained_run(etcd1, run_id, handlers)
    newcomer = make_handler(etcd1, run_id, 2, 3)
    handlers.append(newcomer)
    assert newcomer.needs_nodes()  # one node alive, two needed
    assert survivor.needs_nodes()


def test_a_node_the_run_waits_for_joins_before_its_warm_pool_is_ready(
    etcd1: EtcdCluster, run_id: str, tmp_path: Path, handlers: list[EtcdRendezvousHandler]
) -> None:
    _trained_run(etcd1, run_id, handlers)
    (tmp_path / "preload").mkdir()
    (tmp_path / "preload" / "blocked_import.py").write_text(BLOCKED_IMPORT)
    release = tmp_path / "release"
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("import sys\nsys.exit(0)\n"))
    handler = make_handler(etcd1, run_id, 2, 3, lease_ttl=3, last_call_timeout=30)
    handlers.append(handler)
    config = LaunchConfig(
        min_nodes=2, max_nodes=3, nproc_per_node=1, entrypoint=str(script),
        rdzv_backend="etcd-v3", rdzv_id=run_id, max_restarts=0, log_dir=str(tmp_path / "logs"),
        local_addr="127.0.0.1", stop_grace_period=2.0, monitor_interval=0.5,
        warm_modules=("blocked_import",),
    )  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path / "preload"),
        "RELEASE_WARM": str(release),
    }
    agent = Agent(config, handler, base_env=env, console_err=io.StringIO())
    thread = threading.Thread(target=agent.run, name="agent-under-test", daemon=True)
    thread.start()
    try:
        key = handler._keys.node(handler.node_id)
        wait_until(
            lambda: handler._etcd().get(key)[0] is not None,
            30,
            "the newcomer to join while its warm import is still blocked",
        )
        assert not release.exists()
    finally:
        release.write_text("")
        agent.request_stop(15)
        thread.join(timeout=60)
    assert not thread.is_alive()
