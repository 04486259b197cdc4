"""A real agent (our loop, our handler, real worker processes) run as a thread of the
test process, for integration tests that need an agent and direct access to its handler."""

from __future__ import annotations

import io
import textwrap
import threading
from pathlib import Path

from agent.config import LaunchConfig
from agent.loop.agent import Agent
from coordinator.etcd_server import EtcdCluster
from tests.rdzv_helpers import make_handler

__all__ = ["AgentNode"]


class AgentNode:
    """One real agent (a thread of this process) with our handler."""

    def __init__(
        self,
        cluster: EtcdCluster,
        run_id: str,
        tmp_path: Path,
        script: str,
        *,
        ttl: int,
        max_nodes: int = 2,
    ) -> None:
        self.handler = make_handler(
            cluster, run_id, 1, max_nodes, lease_ttl=ttl, last_call_timeout=30, timeout=60
        )
        path = tmp_path / "worker.py"
        path.write_text(textwrap.dedent(script))
        config = LaunchConfig(
            min_nodes=1, max_nodes=max_nodes, nproc_per_node=1, entrypoint=str(path),
            args=(str(tmp_path),), rdzv_backend="etcd-v3", rdzv_id=run_id, max_restarts=0,
            log_dir=str(tmp_path / "logs"), local_addr="127.0.0.1", exit_barrier_timeout=120,
            stop_grace_period=2.0, monitor_interval=0.5,
        )  # fmt: skip
        self.console = io.StringIO()
        self.agent = Agent(config, self.handler, console_err=self.console)
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, name="agent-under-test", daemon=True)

    def _run(self) -> None:
        self.code = self.agent.run()

    def stop(self) -> None:
        self.agent.request_stop(15)
        self.thread.join(timeout=60)
        self.handler.leave()
