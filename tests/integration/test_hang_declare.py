"""Hang detection's writes on real etcd: a suspicion is written once and withdrawn on
progress, and a declaration that fails is tried again until it lands (issue 21, item 4).

Two real handlers of one run on the session's etcd; the node under test reaches etcd
through a TCP fault proxy, and its :class:`HangWatch` runs on a fake monotonic clock the
test moves, so "the timeout passed" happens exactly when the test says. Its one worker is
a child process that calls the real ``report_progress`` when the test tells it to.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.health.hang import HangWatch
from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys
from coordinator.core.progress import decode_progress
from coordinator.core.state import Hang, RdzvState, decode_state
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from etcd_elastic.progress import PROGRESS_FILE_ENV
from tests.chaos.proxy import Mode, TcpFaultProxy
from tests.rdzv_helpers import Joins, make_handler, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
S = 1_000_000_000  # ns
TIMEOUT = 3.0  # --hang-timeout: a node suspects after 1.5 s of silence


class FakeClock:
    def __init__(self) -> None:
        self.ns = 1000 * S

    def __call__(self) -> int:
        return self.ns

    def advance(self, seconds: float) -> None:
        self.ns += int(seconds * S)


_WORKER = """\
import sys
from etcd_elastic import report_progress
for line in sys.stdin:
    report_progress(int(line))
    print("reported", flush=True)
"""


class Worker:
    """One worker process that calls ``report_progress(step)`` for each step the test
    sends it (its count of calls grows, as a training worker's does)."""

    def __init__(self, path: str) -> None:
        env = {**os.environ, PROGRESS_FILE_ENV: path, "LOCAL_RANK": "0"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER], env=env, cwd=ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip

    def report(self, step: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{step}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "reported\n"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


class Node:
    """The node under test: its handler (through the proxy), its hang watch on a fake
    clock, and what the watch told it."""

    def __init__(self, handler: EtcdRendezvousHandler) -> None:
        self.handler = handler
        self.clock = FakeClock()
        self.steps: list[int] = []
        self.hangs: list[Hang] = []
        self.seen = threading.Event()
        self.watch: HangWatch = HangWatch(
            TIMEOUT, 1, handler, lambda: frozenset({0}), lambda: None,
            on_hang=self.hangs.append, on_step=self._stepped, clock_ns=self.clock,
            jitter=lambda: 0.0,
        )  # fmt: skip
        self.worker = Worker(self.watch.env[PROGRESS_FILE_ENV])

    def _stepped(self, step: int) -> None:
        self.steps.append(step)
        self.seen.set()

    def report(self, step: int) -> None:
        """A worker reports ``step`` and the watch has read it (on the clock's now)."""
        self.seen.clear()
        self.worker.report(step)
        wait_until(lambda: self.seen.is_set() and self.steps[-1] == step, 30, f"step {step} read")


@pytest.fixture
def proxy(etcd1: EtcdCluster) -> Iterator[TcpFaultProxy]:
    with TcpFaultProxy(("127.0.0.1", int(etcd1.endpoints[0].rsplit(":", 1)[1]))) as made:
        yield made


@pytest.fixture
def node(
    etcd1: EtcdCluster,
    run_id: str,
    proxy: TcpFaultProxy,
    handlers: list[EtcdRendezvousHandler],
) -> Iterator[Node]:
    """The node under test and a peer (straight to etcd) in round 1 of ``run_id``."""
    # read_timeout: a call through the cut proxy gives up after 2 s; lease_ttl: the cut is
    # far shorter than the lease, which etcd keeps meanwhile.
    handlers.append(make_handler(proxy.endpoint, run_id, 2, 2, read_timeout=2, lease_ttl=15))
    handlers.append(make_handler(etcd1, run_id, 2, 2))
    Joins(handlers).start().infos()
    made = Node(handlers[0])
    made.watch.begin(handlers[0].last_round)
    try:
        yield made
    finally:
        made.worker.stop()
        made.watch.close()


def _read(client: EtcdClient, keys: RunKeys, node_id: str) -> tuple[RdzvState, bool]:
    """The run's state, and whether ``node_id`` has a progress record."""
    kv, _ = client.get(keys.state)
    assert kv is not None
    state = decode_state(keys.state.decode(), kv.value)
    record, _ = client.get(keys.progress(node_id))
    return state, record is not None


def test_a_declaration_that_fails_is_retried_until_etcd_is_back(
    etcd1: EtcdCluster,
    run_id: str,
    node: Node,
    proxy: TcpFaultProxy,
    handlers: list[EtcdRendezvousHandler],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="agent.health.hang")
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    me, peer = node.handler.node_id, handlers[1].node_id
    round_ = node.handler.last_round
    with EtcdClient(EtcdConfig(tuple(etcd1.endpoints))) as client:
        node.report(7)
        # Silent past the suspicion (1.5 s), not the timeout: the record is written.
        node.clock.advance(2.0)
        wait_until(lambda: _read(client, keys, me)[1], 30, "the node's suspicion in etcd")
        # The worst moment: etcd becomes unreachable after the suspicion, just before
        # the timeout, so the declaration's first attempt fails.
        proxy.set_mode(Mode.RESET)
        node.clock.advance(1.5)
        wait_until(lambda: "could not write to etcd" in caplog.text, 60, "a failed attempt")
        state, _ = _read(client, keys, me)
        assert state.hang is None and node.hangs == []
        proxy.set_mode(Mode.PASS)
        node.clock.advance(5.0)  # past the backoff (0.125 s after one failure)
        wait_until(lambda: _read(client, keys, me)[0].hang is not None, 60, "the hang recorded")
        state, _ = _read(client, keys, me)
        kv, _ = client.get(keys.progress(me))
        assert kv is not None
        record = decode_progress(keys.progress(me).decode(), kv.value)
    hang = state.hang
    assert hang is not None
    # The peer never wrote a suspicion (it is not stalled): this node is behind it.
    assert (hang.round, hang.nodes, hang.step, hang.behind) == (round_, (me,), 7, True)
    assert hang.declared_by == me and hang.stalled_ms >= TIMEOUT * 1000
    assert (record.round, record.step, record.stalled) == (round_, 7, True)
    # The hook runs on the hang watch's thread once the write returned: it may come a
    # moment after etcd shows the hang.
    wait_until(lambda: node.hangs != [], 30, "the declaring node's hook told of the hang")
    assert node.hangs == [hang]
    assert "declared a hang of round" in caplog.text
    wait_until(lambda: handlers[1].declared_hang == hang, 30, "the peer seeing the hang")
    assert peer not in hang.nodes


def test_a_node_that_recovers_withdraws_its_suspicion_and_writes_nothing_more(
    etcd1: EtcdCluster, run_id: str, node: Node
) -> None:
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    me = node.handler.node_id
    with EtcdClient(EtcdConfig(tuple(etcd1.endpoints))) as client:
        node.report(3)
        node.clock.advance(2.0)
        wait_until(lambda: _read(client, keys, me)[1], 30, "the node's suspicion in etcd")
        node.report(4)  # progress again, before the timeout
        wait_until(lambda: not _read(client, keys, me)[1], 30, "the suspicion withdrawn")
        _, revision = client.get(keys.state)
        for step in range(5, 8):  # healthy training: one report each second or so
            node.clock.advance(1.0)
            node.report(step)
        _, after = client.get(keys.state)
        state, has_record = _read(client, keys, me)
    assert after == revision  # nothing written while it made progress
    assert state.hang is None and not has_record and node.hangs == []
