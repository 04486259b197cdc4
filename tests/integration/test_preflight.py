"""The agent's side of the pre-flight check with real check processes: a check that
answers, one that hangs past ``--health-check-timeout`` (killed, reaped, and its node
quarantined with that reason), and three nodes whose pairs and results run through the
bootstrap TCPStore group rank 0's agent hosts, while the round's store in etcd sees none
of it; a bootstrap store that cannot be reached fails the formation with one line.

Where a round's store is only passed along, it is an in-memory stand-in (the exchange
needs only set/check/wait/multi_get); the e2e test runs the whole thing with agents.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import pytest

from agent.health.check_worker import DELAY_ENV
from agent.health.preflight import HealthCheckFailed, Preflight
from agent.health.verdict import Verdict
from agent.loop.launches import Master
from agent.loop.phase import Phase
from agent.loop.rounds import Formed, RankExchangeError, _check
from agent.store import Store
from agent.workers.bootstrap import BootstrapHost
from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import RunKeys
from coordinator.core.ports import free_port
from coordinator.core.state import Quarantine
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.store import EtcdStore
from coordinator.torch_adapter.surface import ForeignSurface
from tests.e2e.agents import alive

pytestmark = [pytest.mark.timeout(300)]


class MemoryStore:
    """The part of a torch Store the exchange uses, in memory, shared by threads."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self._cond:
            self._data[key] = value.encode()
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        self.wait([key], timedelta(seconds=60))
        return self._data[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def add(self, key: str, value: int) -> int:
        raise NotImplementedError

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        with self._cond:
            if not self._cond.wait_for(
                lambda: all(k in self._data for k in keys), timeout.total_seconds()
            ):
                raise TimeoutError(f"keys {keys} not set within {timeout}")

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)


def _preflight(
    node: str, written: list[Sequence[Quarantine]], timeout: float, env: dict[str, str]
) -> Preflight:
    def record(entries: Sequence[Quarantine]) -> bool:
        written.append(entries)
        return True

    return Preflight(
        timeout=timeout, quarantine_s=120, env={**os.environ, **env}, node_id=node,
        addr="127.0.0.1", quarantine=record, wall=lambda: 1000.0,
    )  # fmt: skip


def _run(
    pf: Preflight,
    store: Store,
    rank: int,
    world: int,
    master: tuple[str, int] | None,
    exchange_at: tuple[str, int] | None = None,
) -> Verdict:
    return pf.check(
        store, round_id=4, group_rank=rank, world_size=world,
        members=[f"n{i}" for i in range(world)], master=master, on_abandon=lambda _end: None,
        exchange_at=exchange_at,
    )  # fmt: skip


def test_one_node_passes_and_its_process_is_gone() -> None:
    written: list[Sequence[Quarantine]] = []
    pf = _preflight("n0", written, 120, {})
    try:
        verdict = _run(pf, MemoryStore(), 0, 1, None)
    finally:
        pf.close()
    assert isinstance(verdict, Verdict) and verdict.failed == ()
    [node] = verdict.nodes
    assert node.result is not None and node.result.devices == "cpu"
    assert node.result.matmul_s is not None and node.result.matmul_s < 5
    assert written == [] and pf.last is verdict


def test_a_check_past_its_timeout_is_killed_and_its_node_quarantined() -> None:
    written: list[Sequence[Quarantine]] = []
    pf = _preflight("n0", written, 3, {DELAY_ENV: "600"})
    pf.prepare()
    proc = pf._next
    assert proc is not None
    started = time.monotonic()
    try:
        with pytest.raises(HealthCheckFailed) as info:
            _run(pf, MemoryStore(), 0, 1, None)
    finally:
        pf.close()
    took = time.monotonic() - started
    assert str(info.value) == (
        "the pre-flight check of round 4 left out node 0 n0 (timed out after 3 s "
        "(--health-check-timeout))"
    )
    assert written == [
        [Quarantine("n0", "timed out after 3 s (--health-check-timeout)", 1_120_000, "127.0.0.1")]
    ]
    assert not alive(proc.pid)
    # The 3 s count from the end of its import (tens of seconds on a loaded host), and the
    # process is killed then, not after the 600 s.
    assert took < 90, took


def test_three_nodes_measure_their_pairs_and_exchange_off_etcd_and_the_slow_one_is_named(
    etcd1: EtcdCluster, run_id: str
) -> None:
    host = BootstrapHost()  # as group rank 0's agent hosts the round's workers' store
    port = host.next_formation().serve("127.0.0.1", None)
    client = EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints)))
    keys = RunKeys("/etcd-elastic-test", run_id)
    store = EtcdStore(client, keys.store_prefix(4), timedelta(seconds=60))  # the round's
    written: list[Sequence[Quarantine]] = []
    nodes = [
        _preflight(f"n{r}", written, 120, {DELAY_ENV: "2"} if r == 1 else {}) for r in range(3)
    ]
    outcomes: dict[int, object] = {}
    master = ("127.0.0.1", port)

    def run(rank: int) -> None:
        try:
            outcomes[rank] = _run(nodes[rank], store, rank, 3, master, exchange_at=master)
        except Exception as exc:
            outcomes[rank] = exc
        if rank == 0:
            host.release()  # what its agent does at once: re-form, a new server

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        in_etcd, _ = client.get_prefix(keys.run_prefix)
    finally:
        for pf in nodes:
            pf.close()
        host.release()
        client.close()
    # The rank-0 server went as soon as its check returned: the others had read the verdict.
    assert all(isinstance(o, HealthCheckFailed) for o in outcomes.values()), outcomes
    assert in_etcd == [], [kv.key for kv in in_etcd]  # no result, no verdict: not one key
    verdict = nodes[0].last
    assert verdict is not None
    assert [n.passed for n in verdict.nodes] == [True, False, True]
    assert verdict.nodes[1].reason.startswith("matmul 2.")
    for n in verdict.nodes:
        assert n.result is not None and len(n.result.pairs) == 2
        assert all(p.seconds is not None for p in n.result.pairs), n.result
    # Every node reached group rank 0's verdict; it alone quarantined (one write).
    for pf in nodes[1:]:
        theirs = pf.last
        assert theirs is not None and not pf.last_judged
        assert [n.passed for n in theirs.nodes] == [True, False, True]
        assert theirs.nodes[1] == verdict.nodes[1]  # the failed node, with its measures
    assert nodes[0].last_judged
    assert [[e.node_id for e in entries] for entries in written] == [["n1"]]


def test_a_bootstrap_store_out_of_reach_fails_the_formation_in_one_line() -> None:
    class Rdzv(ForeignSurface):
        last_round = 4

    port = free_port("127.0.0.1")  # nothing listens there
    # A short check (its pair groups wait timeout / 4 for the same absent store): the
    # exchange's error is what this pins, not the check's own wait.
    pf = _preflight("n1", [], 8, {})
    pf.connect_s = 1.0
    phase: Phase[Formed] = Phase("rendezvous", lambda _p: None, lambda: None)  # type: ignore[arg-type,return-value]
    info = type("Info", (), {"rank": 1, "world_size": 2})()
    try:
        with pytest.raises(RankExchangeError) as caught:
            _check(Rdzv(), phase, pf, info, MemoryStore(), Master("127.0.0.1", port, True), False)
    finally:
        pf.close()
    text = str(caught.value)
    assert text.startswith(
        "round formed, but the pre-flight check failed: cannot reach the workers' bootstrap "
        f"store at 127.0.0.1:{port} within 1 s: "
    ), text
    assert text.endswith(
        "check that group rank 0's host is reachable at that address (--master-addr, --local-addr)"
    ), text
    assert "\n" not in text
