"""A join outlasts an etcd outage that ends within join_timeout (issue 21 item 3).

Each etcd call gives up after read_timeout; a join must not. When etcd goes away just
before nodes re-join (a restart overlapping an outage), the join keeps trying its node
key (and, after a thread death, its first watch) for as long as join_timeout allows and
completes once etcd is back. Here read_timeout is 2 s, join_timeout 20 s and the outage
lasts OUTAGE_S, begun before the join: every single call of the join fails at least
twice over, so only a join that retries within its own deadline completes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from coordinator.core.errors import EtcdConnectionError
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.rdzv_helpers import Joins, make_handler

pytestmark = pytest.mark.integration

OUTAGE_S = 6.0
SHORT = {"read_timeout": 2, "join_timeout": 20, "lease_ttl": 5}


@pytest.fixture
def own_etcd() -> Iterator[EtcdCluster]:
    """A single member of this test's own, stopped and started again."""
    with EtcdCluster(1, no_fsync=True, stop_grace=1.0) as cluster:
        yield cluster


def _outage_during(cluster: EtcdCluster, joins: Joins) -> None:
    """etcd is down (killed before ``joins`` started) for OUTAGE_S, then back."""
    joins.start()
    time.sleep(OUTAGE_S)  # the outage's length: what the joins must outlast
    cluster.restart(0)


def test_a_restart_overlapping_an_outage_joins_once_etcd_is_back(
    own_etcd: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    handlers += [make_handler(own_etcd, run_id, 2, 2, **SHORT) for _ in range(2)]
    first = Joins(handlers).start().infos()
    assert sorted(info.rank for info in first.values()) == [0, 1]
    round1 = handlers[0].last_round

    own_etcd.kill(0)  # etcd goes away, then both nodes re-rendezvous (a restart)
    joins = Joins(handlers)
    _outage_during(own_etcd, joins)
    second = joins.infos(60)
    assert sorted(info.rank for info in second.values()) == [0, 1]
    assert handlers[0].last_round == handlers[1].last_round == round1 + 1


def test_a_node_that_never_reached_etcd_gives_up_after_read_timeout(
    own_etcd: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    # Nothing tells an outage at a node's very first call from a wrong endpoint; the
    # latter is the likelier, and DESIGN §6 wants it said after bounded retries, not after
    # join_timeout (tests/e2e/test_agent_scenarios.py, scenario 9, for the agent).
    handlers.append(make_handler(own_etcd, run_id, 2, 2, **SHORT))
    own_etcd.kill(0)
    outcome = Joins(handlers).start().wait(60)[0]
    assert isinstance(outcome.error, EtcdConnectionError), outcome.error
    assert str(outcome.error).startswith("no etcd member answered "), outcome.error
    assert f"within 2 s; tried {own_etcd.endpoints[0]};" in str(outcome.error)
    assert outcome.seconds < SHORT["join_timeout"]
