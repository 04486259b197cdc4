"""The rendezvous against real etcd: one member and a three-member cluster on loopback."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import RunKeys
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.rdzv_helpers import Joins, make_handler

pytestmark = pytest.mark.integration


def _changed_event(h: EtcdRendezvousHandler, predicate: object) -> threading.Event:
    event = threading.Event()

    def check() -> None:
        if predicate(h):  # type: ignore[operator]
            event.set()

    h.subscribe(check)
    check()
    return event


@pytest.mark.parametrize("n", [2, 5, 16])
def test_nodes_form_with_ranks_0_to_n(
    etcd_any: EtcdCluster, run_id: str, n: int, handlers: list[EtcdRendezvousHandler]
) -> None:
    handlers += [make_handler(etcd_any, run_id, n, n) for _ in range(n)]
    infos = Joins(handlers).start().infos()
    assert sorted(i.rank for i in infos.values()) == list(range(n))
    assert {i.world_size for i in infos.values()} == {n}
    boot = {
        (i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
        for i in infos.values()
        if i.bootstrap_store_info is not None
    }
    assert len(boot) == 1 and next(iter(boot))[1] > 0


def test_min_below_max_completes_after_last_call(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    handlers += [make_handler(etcd1, run_id, 2, 4, last_call_timeout=1.5) for _ in range(2)]
    outcomes = Joins(handlers).start().wait()
    assert all(o.info is not None and o.info.world_size == 2 for o in outcomes.values())
    # Last call is waited out (generous upper bound: this is not a timing test).
    assert min(o.seconds for o in outcomes.values()) >= 1.4
    assert max(o.seconds for o in outcomes.values()) < 20


def test_late_node_waits_is_counted_and_joins_next_round(
    etcd_any: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    handlers += [make_handler(etcd_any, run_id, 2, 3) for _ in range(3)]
    first = Joins(handlers).start([0, 1]).infos()
    ranks = {i: info.rank for i, info in first.items()}
    seen = [_changed_event(handlers[i], lambda h: h.num_nodes_waiting() == 1) for i in (0, 1)]

    late = Joins(handlers).start([2])
    for event in seen:
        assert event.wait(20), "num_nodes_waiting() never reported the late node"

    # The participants re-rendezvous (as an agent would) and all three form at once.
    again = Joins(handlers).start([0, 1]).infos()
    latecomer = late.infos()
    assert latecomer[2].world_size == 3 and latecomer[2].rank == 2
    assert {i: again[i].rank for i in (0, 1)} == ranks  # survivors keep their ranks
    assert all(h.num_nodes_waiting() == 0 for h in handlers)


_NODE_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from tests.rdzv_helpers import make_handler
    h = make_handler(
        sys.argv[1], sys.argv[2], 2, 3, lease_ttl=int(sys.argv[3]), last_call_timeout=30
    )
    info = h.next_rendezvous()
    print("rank", info.rank, flush=True)
    time.sleep(600)
    """
)


def test_sigkilled_node_is_noticed_after_its_lease_ttl(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    ttl = 2
    # A long last call: the first round forms when the third node (a process) arrives.
    handlers += [
        make_handler(etcd1, run_id, 2, 3, lease_ttl=ttl, last_call_timeout=30) for _ in range(2)
    ]
    joins = Joins(handlers).start()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-c", _NODE_SCRIPT, etcd1.endpoint_list, run_id, str(ttl)],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("rank"), line
        infos = joins.infos()
        assert {i.world_size for i in infos.values()} == {3}
        lost = [_changed_event(h, lambda h: h.num_nodes_waiting() > 0) for h in handlers]
        killed_at = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        for event in lost:
            assert event.wait(ttl + 10), "survivors were never told of the lost node"
        noticed = time.monotonic() - killed_at
        assert noticed < ttl + 5  # etcd expires a lease within about its TTL
        again = Joins(handlers).start().infos()
        assert sorted(i.rank for i in again.values()) == [0, 1]
        assert {i.world_size for i in again.values()} == {2}
    finally:
        proc.kill()
        proc.wait(10)


def test_closed_run_refuses_new_nodes(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    handlers += [make_handler(etcd1, run_id, 2, 2) for _ in range(2)]
    Joins(handlers).start().infos()
    handlers[0].set_closed()
    closed = _changed_event(handlers[1], lambda h: h.is_closed())
    assert closed.wait(10)
    # A node of the closed run that re-rendezvouses (a newcomer would wait for these
    # nodes to leave, then start the run again: test_run_lifecycle.py).
    with pytest.raises(RendezvousClosedError) as err:
        handlers[1].next_rendezvous()
    assert str(err.value) == (
        f"run {run_id!r} is closed (closed by an agent): it admits no more nodes; start the "
        "job again (same --rdzv-id) once every node of this run has left"
    )


@pytest.mark.parametrize(
    "value",
    [b"\x80\x03not json at all", b'{"round": "x"}', b"{}", pickle.dumps({"round": 1})],
    ids=["binary", "wrong-type", "no-version", "pickle"],
)
def test_corrupt_state_raises_state_error_naming_the_key(
    etcd1: EtcdCluster, run_id: str, value: bytes, handlers: list[EtcdRendezvousHandler]
) -> None:
    keys = RunKeys("/etcd-elastic", run_id)
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as client:
        client.put(keys.state, value)
    h = make_handler(etcd1, run_id, 1, 1)
    handlers.append(h)
    start = time.monotonic()
    with pytest.raises(RendezvousStateError) as err:
        h.next_rendezvous()
    assert f"corrupt value at etcd key '/etcd-elastic/{run_id}/state'" in str(err.value)
    assert time.monotonic() - start < 10  # fails at once: no crash loop, no hang


def test_join_times_out(etcd1: EtcdCluster, run_id: str) -> None:
    h = make_handler(etcd1, run_id, 2, 2, join_timeout=1)
    try:
        with pytest.raises(RendezvousTimeoutError) as err:
            h.next_rendezvous()
        assert "within join_timeout=1 s (min_nodes=2" in str(err.value)
    finally:
        h.leave()


def test_killing_one_etcd_member_mid_rendezvous_still_completes(
    fresh_cluster3: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    handlers += [make_handler(fresh_cluster3, run_id, 3, 3) for _ in range(3)]
    joins = Joins(handlers).start([0, 1])
    # The first endpoint is where every client starts: kill it while two nodes wait.
    fresh_cluster3.kill(0)
    joins.start([2])
    infos = joins.infos(timeout=60)
    assert sorted(i.rank for i in infos.values()) == [0, 1, 2]


def test_freezing_one_etcd_member_mid_rendezvous_still_completes_in_seconds(
    fresh_cluster3: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    """A SIGSTOPped member (a paused VM) keeps its sockets open and answers nothing. The
    waiting nodes' watches must leave it to see the third node and the completing commit:
    before watches probed a silent member, this took over 20 s (TTL 3 s)."""
    handlers += [make_handler(fresh_cluster3, run_id, 3, 3) for _ in range(3)]
    joins = Joins(handlers).start([0, 1])
    nodes = f"/etcd-elastic/{run_id}/nodes/".encode()
    with EtcdClient(EtcdConfig(endpoints=tuple(fresh_cluster3.endpoints))) as client:
        deadline = time.monotonic() + 30
        while client.count_prefix(nodes)[0] < 2:  # both wait, watching
            assert time.monotonic() < deadline, "two nodes did not join in 30 s"
            time.sleep(0.05)
    fresh_cluster3.freeze(0)
    try:
        frozen_at = time.monotonic()
        joins.start([2])
        infos = joins.infos(timeout=60)
        took = time.monotonic() - frozen_at
    finally:
        fresh_cluster3.thaw(0)
    print(f"\nmember frozen -> the round complete on every node: {took:.2f} s")
    assert sorted(i.rank for i in infos.values()) == [0, 1, 2]
    # About two request timeouts (1.5 s at TTL 3) to leave the member, once per client.
    assert took < 15, f"the round completed {took:.1f} s after the member froze"


def test_old_store_rounds_are_removed_when_a_round_completes(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    handlers += [make_handler(etcd1, run_id, 2, 2) for _ in range(2)]
    keys = RunKeys("/etcd-elastic", run_id)
    for _ in range(4):
        infos = Joins(handlers).start().infos()
        infos[0].store.set("k", "v")
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as client:
        kvs, _ = client.get_prefix(keys.store_root)
    rounds = sorted({kv.key[len(keys.store_root) :].split(b"/")[0] for kv in kvs})
    assert rounds == [b"3", b"4"]  # rounds 1 and 2 cleaned up by the completing commits
