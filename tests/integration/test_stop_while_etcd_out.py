"""A stopping agent signals its workers first and leaves the run meanwhile (issue 21,
item 8): leaving (event flush, departure event, lease revoke) can take 20 s and more
while etcd does not answer, and under a scheduler's 30 s grace that wait came out of the
workers' time to checkpoint on SIGTERM.

Worst moment: every etcd member frozen (SIGSTOP: its sockets stay open, nothing
answers, so each call runs to its deadline), then SIGTERM. The check is an order, not a
time: the worker had its SIGTERM before the agent's leave returned.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from coordinator.etcd_server import EtcdCluster
from tests.agent_helpers import AgentNode
from tests.rdzv_helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORKER = """
    import os, signal, sys, time

    out = sys.argv[1]

    def on_term(signum, frame):
        with open(os.path.join(out, "sigterm"), "w") as f:
            f.write("checkpointed")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    open(os.path.join(out, "running"), "w").close()
    while True:
        time.sleep(0.05)
"""


def test_a_stop_while_etcd_is_out_signals_the_workers_before_leaving(
    etcd_binary: Path, run_id: str, tmp_path: Path
) -> None:
    with EtcdCluster(1, binary=etcd_binary, no_fsync=True, stop_grace=1.0) as cluster:
        node = AgentNode(cluster, run_id, tmp_path, WORKER, ttl=3, max_nodes=1)
        left: list[bool] = []
        real_leave = node.handler.leave

        def leave() -> None:
            try:
                real_leave()
            finally:
                left.append((tmp_path / "sigterm").exists())

        node.handler.leave = leave  # type: ignore[method-assign]
        node.thread.start()
        try:
            wait_until(lambda: (tmp_path / "running").exists(), 120, "the worker to run")
            cluster.freeze(0)
            try:
                node.agent.request_stop(signal.SIGTERM)
                node.thread.join(timeout=240)
            finally:
                cluster.thaw(0)
            assert not node.thread.is_alive(), "the agent did not stop"
        finally:
            node.stop()
    assert node.code == 128 + signal.SIGTERM
    assert (tmp_path / "sigterm").read_text() == "checkpointed"
    assert left[:1] == [True], "the workers got SIGTERM only after the agent left the run"
