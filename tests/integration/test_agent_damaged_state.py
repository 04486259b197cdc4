"""A running attempt keeps training while the state key is unreadable (issue 8 item 7).

A real agent trains (a real worker process); an operator's stray ``etcdctl put``
overwrites the run's state key with garbage. The agent must not stop, restart or give up:
its worker keeps running, one error naming the key is logged, and when a valid value is
back nothing has happened to the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.workers.state import WorkerState
from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.etcd_server import EtcdCluster
from tests.agent_helpers import AgentNode
from tests.rdzv_helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SLEEPER = """
    import time
    time.sleep(600)
"""


@pytest.fixture
def node(etcd1: EtcdCluster, run_id: str, tmp_path: Path) -> Iterator[AgentNode]:
    made = AgentNode(etcd1, run_id, tmp_path, SLEEPER, ttl=3, max_nodes=1)
    made.thread.start()
    try:
        yield made
    finally:
        made.stop()


def test_garbage_in_the_state_key_does_not_stop_training(
    node: AgentNode, etcd1: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    wait_until(
        lambda: node.agent.worker_group is not None and bool(node.agent.worker_group.pids),
        60,
        "the agent's worker",
    )
    group = node.agent.worker_group
    assert group is not None
    pids = group.pids
    key = node.handler._keys.state
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as client:
        good, _ = client.get(key)
        assert good is not None
        with caplog.at_level(logging.ERROR):
            client.put(key, b"\x80 an operator's stray put")
            time.sleep(3.0)  # many monitor ticks (0.5 s) and duty wake-ups
        assert node.thread.is_alive(), node.console.getvalue()
        assert node.agent.attempt == 0 and node.agent.worker_group is group
        assert group.pids == pids and group.state() is WorkerState.HEALTHY
        assert node.handler.is_closed() is False
        assert node.handler.num_nodes_waiting() == 0
        errors = [r.getMessage() for r in caplog.records if key.decode() in r.getMessage()]
        assert len(errors) == 1, errors  # logged once, naming the key
        client.put(key, good.value)  # the operator puts it back
        time.sleep(1.0)
    assert node.thread.is_alive()
    assert node.agent.attempt == 0 and group.pids == pids
