"""Every wait of the agent is bounded by membership (issue 8 item 2, DESIGN §9).

A real agent (our loop, our handler, real worker processes) meets a second node that
dies at the worst moment: right after the round completed, before the rank exchange, and
at the exit barrier. The second node is a real handler on real etcd whose lease then
simply stops being kept alive (as a SIGKILLed or frozen process's would), so etcd
expires it after one TTL. The agent must stop waiting within TTL + 1 s of that expiry
(bounds here are generous for a loaded 2-core machine, and the measured time is printed),
re-form without counting a restart, or, at the exit barrier, exit 0 naming the node.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousInfo

from agent.config import LaunchConfig
from agent.loop.launches import resolve_master
from agent.loop.ranks import RoleInfo, exchange_ranks
from agent.workers.bootstrap import BootstrapHost
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.agent_helpers import AgentNode
from tests.rdzv_helpers import make_handler, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTL = 2
# Expiry happens up to one TTL after the last keep-alive; etcd's lease checker and our
# watch add a little; the rest is slack for a loaded machine. The measured time is printed.
BOUND_S = 2 * TTL + 1 + 6


def _lose_lease(handler: EtcdRendezvousHandler) -> float:
    """Stop keeping ``handler``'s lease alive without revoking it (a node that died)."""
    parts = handler._current()
    assert parts is not None
    parts.member.close(revoke=False)
    return time.monotonic()


@pytest.fixture
def nodes() -> Iterator[list[EtcdRendezvousHandler | AgentNode]]:
    made: list[EtcdRendezvousHandler | AgentNode] = []
    yield made
    for node in made:
        if isinstance(node, AgentNode):
            node.stop()
        else:
            node.leave()


def _joined(ghost: EtcdRendezvousHandler) -> Callable[[], RendezvousInfo]:
    box: list[RendezvousInfo] = []
    thread = threading.Thread(target=lambda: box.append(ghost.next_rendezvous()), daemon=True)
    thread.start()

    def info() -> RendezvousInfo:
        thread.join(timeout=60)
        assert box, "the second node did not complete the rendezvous"
        return box[0]

    return info


def _ghost_and_agent(
    cluster: EtcdCluster,
    run_id: str,
    tmp_path: Path,
    nodes: list[EtcdRendezvousHandler | AgentNode],
    script: str,
) -> tuple[EtcdRendezvousHandler, Callable[[], RendezvousInfo], AgentNode]:
    """A second node (a bare handler, joining now) and a real agent running ``script``."""
    ghost = make_handler(cluster, run_id, 1, 2, lease_ttl=TTL, last_call_timeout=30, timeout=60)
    nodes.append(ghost)
    ghost_info = _joined(ghost)
    node = AgentNode(cluster, run_id, tmp_path, script, ttl=TTL)
    nodes.append(node)
    node.thread.start()
    return ghost, ghost_info, node


SLEEPER = """
    import sys, time
    time.sleep(600)
"""


def test_a_node_lost_before_the_rank_exchange_ends_the_wait(
    etcd1: EtcdCluster, run_id: str, tmp_path: Path, nodes: list[EtcdRendezvousHandler | AgentNode]
) -> None:
    ghost, ghost_info, node = _ghost_and_agent(etcd1, run_id, tmp_path, nodes, SLEEPER)
    ghost_info()  # the round formed with both; the ghost never writes its role info
    time.sleep(1.0)  # the agent is now blocked in the rank exchange, waiting on the ghost
    assert node.agent.attempt == -1, "the agent started workers without the second node"
    died = _lose_lease(ghost)
    took = wait_until(
        lambda: node.agent.worker_group is not None, BOUND_S + 30, "the agent's workers"
    )
    since = time.monotonic() - died
    print(f"re-formed and started workers {since:.2f} s after the lease stopped ({took:.2f})")
    assert since < BOUND_S
    assert node.agent.worker_group is not None
    assert node.agent.restart_count == 0  # a membership change, not a counted failure
    assert node.handler.last_members == (node.handler.node_id,)
    # The abandoned rank exchange was ended through the store, not left blocked for the
    # store timeout: no phase thread of the agent is still alive.
    wait_until(
        lambda: not [t for t in threading.enumerate() if t.name == "agent-rendezvous"],
        10,
        "the abandoned rank exchange to end",
    )


FINISHER = """
    import sys
    sys.exit(0)
"""


def test_a_node_lost_before_the_exit_barrier_ends_the_wait(
    etcd1: EtcdCluster, run_id: str, tmp_path: Path, nodes: list[EtcdRendezvousHandler | AgentNode]
) -> None:
    ghost, ghost_info, node = _ghost_and_agent(etcd1, run_id, tmp_path, nodes, FINISHER)
    info = ghost_info()
    # The ghost does its part of the rank exchange (as its agent would), then never
    # reaches the exit barrier: it dies while the agent's workers finish.
    config = LaunchConfig(min_nodes=1, max_nodes=2, nproc_per_node=1, entrypoint=sys.executable)
    exchange_ranks(info.store, RoleInfo("default", info.rank, 1), info.world_size)
    host = BootstrapHost()  # the ghost's: keeps its server (if rank 0) for the test
    resolve_master(config, info, info.store, info.rank, host.next_formation())
    wait_until(lambda: node.agent.worker_group is not None, 60, "the agent's workers")
    time.sleep(1.0)  # its worker exits 0 at once: the agent now waits at the exit barrier
    assert node.thread.is_alive(), "the agent did not wait for the second node"
    died = _lose_lease(ghost)
    node.thread.join(timeout=BOUND_S + 30)
    since = time.monotonic() - died
    print(f"the agent left the exit barrier {since:.2f} s after the lease stopped")
    assert node.code == 0
    assert since < BOUND_S


def test_a_stop_request_during_the_rank_exchange_ends_it_at_once(
    etcd1: EtcdCluster, run_id: str, tmp_path: Path, nodes: list[EtcdRendezvousHandler | AgentNode]
) -> None:
    # A signal at the worst moment: the agent is blocked in the store, waiting on a node
    # that never writes its part. The stop is a flag; the loop ends the phase through the
    # store and exits 128 + SIGTERM without waiting for the store timeout.
    _ghost, ghost_info, node = _ghost_and_agent(etcd1, run_id, tmp_path, nodes, SLEEPER)
    ghost_info()
    time.sleep(1.0)  # the agent is now blocked in the rank exchange
    assert node.agent.attempt == -1
    started = time.monotonic()
    node.agent.request_stop(15)
    node.thread.join(timeout=30)
    took = time.monotonic() - started
    print(f"stopped {took:.2f} s after the request")
    assert node.code == 143
    assert took < 10
    wait_until(
        lambda: not [t for t in threading.enumerate() if t.name == "agent-rendezvous"],
        10,
        "the abandoned rank exchange to end",
    )
