"""The job's restart budget on real etcd with real handlers: a round's failure seen by two
nodes is counted once (one write of the state; a node whose view shows it counted makes
no call at all), a counted restart is given back by the completion of a smaller round,
and a fresh node in a leaver's place reads the job's count."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from agent.loop.budget import JobBudget
from coordinator.core.etcd_client import EtcdClient
from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys
from coordinator.core.restart_budget import RestartCount
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler, create_handler
from tests.rdzv_helpers import Joins, wait_until

pytestmark = pytest.mark.integration


class _Calls:
    """Counts a handler's etcd calls by method (an ``EtcdObserver``)."""

    def __init__(self) -> None:
        self.done: Counter[str] = Counter()

    def call_done(self, method: str, seconds: float, failed: bool) -> None:
        self.done[method] += 1

    def attempt_failed(self, method: str, code: str) -> None:
        return None

    def keepalive_answered(self, seconds: float) -> None:
        return None

    def answered(self, at: float) -> None:
        return None


def _handler(
    etcd: EtcdCluster, run_id: str, nodes: tuple[int, int], calls: _Calls | None = None
) -> EtcdRendezvousHandler:
    params = RendezvousParameters(
        "etcd-v3", etcd.endpoint_list, run_id, *nodes, last_call_timeout=0.5, lease_ttl=3
    )
    return create_handler(params, etcd_observer=calls)


def _state_version(client: EtcdClient, run_id: str) -> int:
    kv, _ = client.get(RunKeys(DEFAULT_KEY_PREFIX, run_id).state)
    assert kv is not None
    return kv.version  # etcd counts every put of the key


def test_a_failure_seen_by_two_nodes_is_counted_once(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler], client: EtcdClient
) -> None:
    calls = [_Calls(), _Calls()]
    handlers += [_handler(etcd1, run_id, (2, 2), c) for c in calls]
    Joins(handlers).start().infos(30)
    a, b = handlers
    round = a.last_round
    assert b.last_round == round >= 1
    budgets = [JobBudget(1, h) for h in handlers]
    assert [x.left_for_failure for x in budgets] == [1, 1]
    before = _state_version(client, run_id)
    cas_before = sum(c.done["put_if_mod_revision"] for c in calls)

    # Both nodes saw their workers fail in the same round and count it at the same time,
    # each from a view that does not show the other's count yet.
    go = threading.Barrier(2)
    counts: dict[int, RestartCount] = {}

    def charge(i: int) -> None:
        go.wait(10)
        counts[i] = handlers[i].count_restart(round)

    threads = [threading.Thread(target=charge, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert counts == {0: RestartCount(1, round), 1: RestartCount(1, round)}
    assert _state_version(client, run_id) == before + 1  # one write for the job
    cas = sum(c.done["put_if_mod_revision"] for c in calls) - cas_before
    assert 1 <= cas <= 2, cas  # the loser's try writes nothing and reads the count back
    print(f"two nodes counting round {round} at once: {cas} compare-and-swaps, 1 write")

    # Both views now show the round counted: counting it again costs no call at all.
    wait_until(lambda: b.job_restarts.round == round, 10, "b's view to show the count")
    wait_until(lambda: a.job_restarts.round == round, 10, "a's view to show the count")
    done = [sum(c.done.values()) for c in calls]
    for x in budgets:
        x.charge(2)
    assert [sum(c.done.values()) for c in calls] == done
    assert _state_version(client, run_id) == before + 1
    # Both judge this round's failure as before it was counted: the same verdict.
    assert [(x.used, x.left, x.left_for_failure) for x in budgets] == [(1, 0, 1), (1, 0, 1)]


def test_a_counted_restart_is_given_back_when_the_next_round_is_smaller(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    handlers += [_handler(etcd1, run_id, (2, 3)) for _ in range(3)]
    Joins(handlers).start().infos(30)
    a, b, c = handlers
    failed = a.last_round
    budget = JobBudget(2, a)
    budget.charge(3)  # a's workers failed on a collective c broke
    assert budget.used == 1
    c.leave()  # ... because c went away
    infos = Joins([a, b]).start().infos(30)
    assert [i.world_size for i in infos.values()] == [2, 2]
    # Given back in the commit that completed the smaller round: no write of its own.
    assert a.job_restarts == RestartCount(used=0, round=failed, refunded=True)
    assert budget.settle(2) is True
    assert (budget.used, budget.left) == (0, 2)


def test_a_fresh_node_in_a_leavers_place_reads_the_jobs_count(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    """--max-restarts=1: b's worker fails (counted); b's agent goes and a fresh one takes
    its place; the next failure finds the job's budget used up."""
    handlers += [_handler(etcd1, run_id, (2, 2)) for _ in range(2)]
    Joins(handlers).start().infos(30)
    a, b = handlers
    JobBudget(1, b).charge(2)
    Joins([a, b]).start().infos(30)  # both restart: the same two nodes, nothing given back
    b.leave()
    fresh = _handler(etcd1, run_id, (2, 2))
    handlers.append(fresh)
    infos = Joins([a, fresh]).start().infos(30)
    assert [i.world_size for i in infos.values()] == [2, 2]
    for node in (a, fresh):
        budget = JobBudget(1, node)
        assert (budget.used, budget.left_for_failure) == (1, 0), node.node_id
