"""Quarantine on real etcd: a node quarantined by its peers is left out of the next
round at once, waits past its join_timeout without failing, is released by the
coordinator when its time is up, and then joins like a newcomer."""

from __future__ import annotations

import time

import pytest

from coordinator.core.state import Quarantine
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.integration.rdzvctl_support import ctl_json
from tests.rdzv_helpers import Joins, make_handler, wait_until

pytestmark = pytest.mark.integration

# Long enough that c waits out its join_timeout (5 s) more than once while quarantined,
# and that its join after the release has those 5 s even on a loaded machine.
QUARANTINE_S = 12.0


def test_a_quarantined_node_is_left_out_then_rejoins_when_its_time_is_up(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    handlers += [make_handler(etcd1, run_id, 2, 3, join_timeout=5) for _ in range(3)]
    first = Joins(handlers).start().infos(30)
    by_rank = sorted(range(3), key=lambda i: first[i].rank)
    a, b, c = (handlers[i] for i in by_rank)
    entry = Quarantine(c.node_id, "matmul 3.0 s", int((time.time() + QUARANTINE_S) * 1000), "h")
    assert a.quarantine([entry]) is True
    assert b.quarantine([entry]) is False  # the same verdict again: nothing to write
    wait_until(lambda: c.node_id in c.quarantined_nodes, 10, "c to see its quarantine")
    wait_until(lambda: a.num_nodes_waiting() > 0, 10, "the others to count it as leaving")
    status = ctl_json(capsys, etcd1, "status", run_id)
    assert [q["node_id"] for q in status["quarantined"]] == [c.node_id]
    assert {n["node_id"]: n["status"] for n in status["nodes"]}[c.node_id] == "quarantined"

    # All three re-join: a and b form the next round at once, without c.
    started = time.monotonic()
    again = Joins([a, b, c]).start([0, 1, 2])
    wait_until(lambda: 0 in again.outcomes and 1 in again.outcomes, 30, "a and b to re-form")
    assert time.monotonic() - started < QUARANTINE_S - 1
    assert [again.outcomes[i].info.world_size for i in (0, 1)] == [2, 2]  # type: ignore[union-attr]
    # c waits past its join_timeout (5 s) without failing, until its quarantine ends;
    # then it asks to join and the others are told (it is on the wait list).
    wait_until(lambda: a.num_nodes_waiting() > 0, QUARANTINE_S + 20, "c to be released")
    assert time.monotonic() - started >= QUARANTINE_S - 1.5
    assert 2 not in again.outcomes, again.outcomes.get(2)
    # c asks to join by its own clock; the coordinator's release of the entry is a commit
    # of its own, which c's view hears of a moment before or after.
    wait_until(lambda: c.quarantined_nodes == frozenset(), 10, "c to see its release")
    rejoin = Joins([a, b]).start()
    infos = rejoin.infos(30)
    assert again.wait(30)[2].error is None
    assert again.outcomes[2].info is not None and again.outcomes[2].info.world_size == 3
    assert {infos[0].rank, infos[1].rank} == {0, 1}  # rank order kept, c follows
    assert again.outcomes[2].info.rank == 2
