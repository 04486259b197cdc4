"""The agent's side of the pre-flight check with real check processes: a check that
answers, one that hangs past ``--health-check-timeout`` (killed, reaped, and its node
quarantined with that reason), and three nodes whose pairs run through a real TCPStore.

The round's store is an in-memory stand-in for the agents' store (the exchange needs only
set/check/wait/multi_get); the e2e test runs the whole thing with etcd.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import pytest
from torch._C._distributed_c10d import TCPStore

from agent.health.check_worker import DELAY_ENV
from agent.health.preflight import HealthCheckFailed, Preflight
from agent.health.verdict import Verdict
from coordinator.core.state import Quarantine
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


def _run(pf: Preflight, store: MemoryStore, rank: int, world: int, master: tuple[str, int] | None):
    return pf.check(
        store, round_id=4, group_rank=rank, world_size=world,
        members=[f"n{i}" for i in range(world)], master=master, on_abandon=lambda _end: None,
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


def test_three_nodes_measure_their_pairs_and_the_slow_one_is_named() -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=60))  # fmt: skip
    store = MemoryStore()
    written: list[Sequence[Quarantine]] = []
    nodes = [
        _preflight(f"n{r}", written, 120, {DELAY_ENV: "2"} if r == 1 else {}) for r in range(3)
    ]
    outcomes: dict[int, object] = {}

    def run(rank: int) -> None:
        try:
            outcomes[rank] = _run(nodes[rank], store, rank, 3, ("127.0.0.1", server.port))
        except Exception as exc:
            outcomes[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
    finally:
        for pf in nodes:
            pf.close()
    assert all(isinstance(o, HealthCheckFailed) for o in outcomes.values()), outcomes
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
