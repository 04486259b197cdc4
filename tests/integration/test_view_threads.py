"""The view and the duty on real etcd when their watches end or their threads die.

A failed re-watch after a compaction must not freeze the view: it retries with backoff
until it works. A thread that dies of an unexpected exception is reported to ``on_death``
(never silence). The view's client reaches etcd through a TCP fault proxy, so its stream
breaks for real, and etcd's history is compacted for real while it is broken.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from coordinator.core.duty import CoordinatorDuty, Membership
from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import RunKeys
from coordinator.core.state import RdzvState, encode_state
from coordinator.core.threads import ThreadDied
from coordinator.core.transitions import Limits
from coordinator.core.view import StateView
from coordinator.etcd_server import EtcdCluster
from tests.chaos.proxy import Mode, TcpFaultProxy
from tests.integration.coordinator_support import Run, run_fixture  # noqa: F401 (fixture)
from tests.integration.store_support import compact_to_head
from tests.rdzv_helpers import wait_until

pytestmark = pytest.mark.integration


def _state(round_: int) -> bytes:
    return encode_state(RdzvState(round=round_, participants=("node-a",)))


@pytest.fixture
def proxy(etcd1: EtcdCluster) -> Iterator[TcpFaultProxy]:
    with TcpFaultProxy(("127.0.0.1", int(etcd1.endpoints[0].rsplit(":", 1)[1]))) as made:
        yield made


class _Hook(logging.Handler):
    """Runs ``action`` (on the logging thread, before the caller goes on) the first time a
    record containing ``text`` is logged."""

    def __init__(self, text: str, action: Any) -> None:
        super().__init__(logging.DEBUG)
        self._text, self._action, self.fired = text, action, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if not self.fired.is_set() and self._text in record.getMessage():
            self._action()
            self.fired.set()


def _compact_behind_a_broken_stream(
    proxy: TcpFaultProxy, etcd1: EtcdCluster, run: Run, new_value: bytes
) -> None:
    """Break the stream, write ``new_value`` and compact the history, then let the stream
    resume: it asks for a revision etcd no longer has."""
    resets = proxy.stats.reset
    proxy.set_mode(Mode.RESET)
    wait_until(lambda: proxy.stats.reset > resets, 10, "the stream's connection reset")
    run.client.put(run.keys.state, new_value)
    compact_to_head(etcd1.endpoints[0], run.keys.run_prefix + b"scratch")
    proxy.set_mode(Mode.PASS)


def test_a_failed_rewatch_after_compaction_retries_until_it_works(
    etcd1: EtcdCluster, run: Run, proxy: TcpFaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="coordinator.core.view")
    view_log = logging.getLogger("coordinator.core.view")
    deaths: list[ThreadDied] = []
    client = EtcdClient(EtcdConfig(endpoints=(proxy.endpoint,), retry_budget=2))
    view = StateView(client, run.keys.state, on_death=deaths.append)

    def cut() -> None:  # the re-watch about to start will find etcd unreachable
        resets = proxy.stats.reset
        proxy.set_mode(Mode.RESET)
        wait_until(lambda: proxy.stats.reset > resets, 10, "the connection reset")

    compacted = _Hook("compacted at", cut)
    failed = _Hook("re-watch of", lambda: None)
    try:
        run.client.put(run.keys.state, _state(1))
        view.start()
        view_log.addHandler(compacted)
        view_log.addHandler(failed)
        _compact_behind_a_broken_stream(proxy, etcd1, run, _state(2))
        assert compacted.fired.wait(30), "the view never heard of the compaction"
        assert failed.fired.wait(30), "the re-watch did not fail while etcd was cut off"
        proxy.set_mode(Mode.PASS)  # etcd back: the next retry works
        wait_until(lambda: view.peek().round == 2, 30, "the view to re-read")
        run.client.put(run.keys.state, _state(3))  # and it follows the key again
        wait_until(lambda: view.peek().round == 3, 30, "the view to follow the key")
    finally:
        view_log.removeHandler(compacted)
        view_log.removeHandler(failed)
        proxy.set_mode(Mode.PASS)
        view.close()
        client.close()
    assert deaths == [] and view.rewatches == 1
    retries = [r.getMessage() for r in caplog.records if "re-watch of" in r.getMessage()]
    assert retries and all(
        m.startswith(f"re-watch of {run.keys.state.decode()} failed (") and "; retrying in " in m
        for m in retries
    ), retries


class _BrokenRewatch(EtcdClient):
    """A real client with a bug in its second watch_then_read (the view's re-watch)."""

    calls = 0

    def watch_then_read(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("injected bug")
        return super().watch_then_read(*args, **kwargs)


def test_a_view_thread_that_dies_is_reported(
    etcd1: EtcdCluster, run: Run, proxy: TcpFaultProxy
) -> None:
    died = threading.Event()
    deaths: list[ThreadDied] = []

    def on_death(death: ThreadDied) -> None:
        deaths.append(death)
        died.set()

    client = _BrokenRewatch(EtcdConfig(endpoints=(proxy.endpoint,)))
    view = StateView(client, run.keys.state, on_death=on_death)
    try:
        run.client.put(run.keys.state, _state(1))
        view.start()
        _compact_behind_a_broken_stream(proxy, etcd1, run, _state(2))
        assert died.wait(30), "the re-watch thread's death was not reported"
    finally:
        proxy.set_mode(Mode.PASS)
        view.close()
        client.close()
    assert [str(d) for d in deaths] == [
        "background thread 'state-view-rewatch' died: RuntimeError: injected bug"
    ]


def test_a_duty_thread_that_dies_is_reported(etcd1: EtcdCluster, run: Run) -> None:
    died = threading.Event()
    deaths: list[ThreadDied] = []

    def on_death(death: ThreadDied) -> None:
        deaths.append(death)
        died.set()

    def membership() -> Membership | None:
        raise RuntimeError("injected bug")

    client = EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints)))
    view = StateView(client, run.keys.state)
    duty = CoordinatorDuty(client, run.keys, view, Limits(1, 1, 1.0), membership, on_death=on_death)
    try:
        view.start()
        duty.start()
        assert died.wait(30), "the duty thread's death was not reported"
    finally:
        duty.stop()
        view.close()
        client.close()
    assert [str(d) for d in deaths] == [
        "background thread 'rdzv-coordinator' died: RuntimeError: injected bug"
    ]
    assert isinstance(deaths[0].__cause__, RuntimeError)


def test_a_leader_whose_node_watch_was_compacted_reads_the_joins_again(
    etcd1: EtcdCluster, run: Run, proxy: TcpFaultProxy
) -> None:
    """node-b joins while the leader's stream is broken and the history is compacted: the
    leader's node watch resumes into a compaction, and it must re-read the node keys (else
    it never hears of node-b and round 1 never forms)."""
    a, b = run.node("node-a"), run.node("node-b")
    me = a.join(1)
    client = EtcdClient(EtcdConfig(endpoints=(proxy.endpoint,), retry_budget=5))
    view = StateView(client, run.keys.state)
    duty = CoordinatorDuty(client, run.keys, view, Limits(2, 2, 30.0), lambda: me)
    try:
        view.start()
        duty.start()
        wait_until(lambda: duty.is_leader, 30, "node-a to lead")
        resets = proxy.stats.reset
        proxy.set_mode(Mode.RESET)
        wait_until(lambda: proxy.stats.reset > resets, 10, "the stream's connection reset")
        b.join(1)
        compact_to_head(etcd1.endpoints[0], run.keys.run_prefix + b"scratch")
        proxy.set_mode(Mode.PASS)
        wait_until(lambda: (run.state()[0] or RdzvState()).round == 1, 30, "round 1")
    finally:
        proxy.set_mode(Mode.PASS)
        duty.stop()
        view.close()
        client.close()
    state, _ = run.state()
    assert state is not None and state.participants == ("node-a", "node-b")


def test_a_view_whose_member_was_killed_and_history_compacted_reads_again(
    fresh_cluster3: EtcdCluster, run_id: str
) -> None:
    """The view's client knows one member; it is killed, the state changes and the history
    is compacted through the others, and it comes back: the view's watch resumes into a
    compaction and the view re-reads."""
    keys = RunKeys("/etcd-elastic-test", run_id)
    one = EtcdClient(EtcdConfig(endpoints=(fresh_cluster3.endpoints[0],)))
    others = EtcdClient(EtcdConfig(endpoints=tuple(fresh_cluster3.endpoints[1:])))
    view = StateView(one, keys.state)
    try:
        others.put(keys.state, _state(1))
        view.start()
        assert view.peek().round == 1
        fresh_cluster3.kill(0)
        others.put(keys.state, _state(2))
        compact_to_head(fresh_cluster3.endpoints[1], keys.run_prefix + b"scratch")
        fresh_cluster3.restart(0)
        wait_until(lambda: view.peek().round == 2, 60, "the view to re-read")
        others.put(keys.state, _state(3))
        wait_until(lambda: view.peek().round == 3, 30, "the view to follow the key")
    finally:
        view.close()
        one.close()
        others.close()
    assert view.rewatches == 1
