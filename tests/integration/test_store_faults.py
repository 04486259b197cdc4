"""The Store under faults, on real etcd: exactly-once ``add``/``append`` when a reply is lost,
and blocking reads whose watch stream broke and resumed after a compaction.

Faults are real: a reply is lost by resetting the TCP connection (a fault proxy between
the client and etcd) after etcd committed, or by sending the same transaction again as
the client's failover does; streams break by killing the etcd member the client talks
to, or by resetting its connection, while another client compacts etcd's history.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from coordinator.core.actions import Action, ActionKind
from coordinator.core.etcd_client import EtcdClient, EtcdConfig, TxnResult, WatchEvent
from coordinator.core.executor import StateExecutor
from coordinator.core.keys import RunKeys
from coordinator.core.state import RdzvState
from coordinator.core.store_rounds import delete_round, ops_prefix
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.store import EtcdStore
from tests.chaos.proxy import Mode, TcpFaultProxy
from tests.integration.store_support import compact_to_head
from tests.rdzv_helpers import wait_until

pytestmark = pytest.mark.integration

LONG = timedelta(seconds=60)


@pytest.fixture
def keys(run_id: str) -> RunKeys:
    return RunKeys("/etcd-elastic-test", run_id)


@pytest.fixture
def direct(etcd1: EtcdCluster, keys: RunKeys) -> Iterator[EtcdClient]:
    """A client straight to etcd (no fault in its way); removes the run's keys at the end."""
    client = EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints)))
    try:
        yield client
    finally:
        client.delete_prefix(keys.run_prefix)
        client.close()


# -- exactly once ---------------------------------------------------------------------------


def test_replaying_an_add_or_append_applies_it_once(direct: EtcdClient, keys: RunKeys) -> None:
    store = EtcdStore(direct, keys.store_prefix(1), LONG)
    other = EtcdStore(direct, keys.store_prefix(1), LONG)
    assert store._add("n", 5, "op-a") == 5
    assert other.add("n", 1) == 6  # another writer in between
    # The same operation again, as a retry after a lost reply sends it: nothing is added,
    # and the answer is the one the operation got when it landed.
    assert store._add("n", 5, "op-a") == 5
    assert store.get("n") == b"6"
    store._append("log", "a", "op-b")
    store._append("log", "a", "op-b")
    other.append("log", "b")
    store._append("log", "a", "op-b")
    assert store.get("log") == b"ab"
    # The markers sit beside the round's folder: the Store's own keys are untouched.
    assert sorted(store.list_keys()) == ["log", "n"] and store.num_keys() == 2
    markers, _ = direct.get_prefix(ops_prefix(keys.store_prefix(1)), keys_only=True)
    assert len(markers) == 4
    # Deleting the round takes its markers too.
    assert delete_round(direct, keys.store_root, 1) == 2
    assert direct.get_prefix(keys.store_root, keys_only=True)[0] == []


def test_a_completing_round_removes_the_markers_two_rounds_back(
    direct: EtcdClient, keys: RunKeys
) -> None:
    for round_ in (1, 2):
        assert EtcdStore(direct, keys.store_prefix(round_), LONG).add("n", 1) == 1
    executor = StateExecutor(direct, keys, written_by="test")
    complete = Action(ActionKind.MARK_RENDEZVOUS_COMPLETE, node_ids=("node-a",))
    assert executor.commit((RdzvState(round=2, participants=("node-a",)), 0), [complete]).succeeded
    kvs, _ = direct.get_prefix(keys.store_root, keys_only=True)
    folders = {kv.key[len(keys.store_root) :].split(b"/")[0] for kv in kvs}
    assert folders == {b"2", b"2~ops"}  # round 1's keys and markers went in that commit


class _ResendsEveryWrite(EtcdClient):
    """A real client whose guarded writes reach etcd twice: the first reply is dropped and
    the same transaction is sent again, exactly what its failover does when a reply is
    lost after etcd committed (a member dies mid-call, a connection resets)."""

    def __init__(self, config: EtcdConfig) -> None:
        super().__init__(config)
        self.dropped: list[TxnResult] = []

    def put_if_mod_revision(self, *args: Any, **kwargs: Any) -> TxnResult:
        self.dropped.append(super().put_if_mod_revision(*args, **kwargs))
        return super().put_if_mod_revision(*args, **kwargs)


def test_a_lost_reply_does_not_count_twice(
    etcd1: EtcdCluster, direct: EtcdClient, keys: RunKeys
) -> None:
    client = _ResendsEveryWrite(EtcdConfig(endpoints=tuple(etcd1.endpoints)))
    try:
        store = EtcdStore(client, keys.store_prefix(1), LONG)
        assert [store.add("barrier", 1) for _ in range(3)] == [1, 2, 3]
        store.append("log", "x")
        store.append("log", "y")
        # Every first attempt landed; the resent transaction found it had.
        assert [r.succeeded for r in client.dropped] == [True] * 5
        assert direct.get(keys.store_key(1, "barrier"))[0].value == b"3"  # type: ignore[union-attr]
        assert direct.get(keys.store_key(1, "log"))[0].value == b"xy"  # type: ignore[union-attr]
    finally:
        client.close()


def test_an_add_whose_reply_a_connection_reset_lost_counts_once(
    etcd1: EtcdCluster, direct: EtcdClient, keys: RunKeys
) -> None:
    """A real lost reply: the add's transaction reaches etcd through a proxy that holds
    every byte for a while; as soon as etcd has committed it, the proxy resets the
    connection, so the reply (still held) never arrives and the client retries."""
    counter = keys.store_key(1, "exit_barrier/count")
    committed = threading.Event()

    def on_events(events: list[WatchEvent], _revision: int) -> None:
        if any(e.kind == "put" for e in events):
            proxy.set_mode(Mode.RESET)  # before the held reply can leave the proxy
            committed.set()

    with TcpFaultProxy(("127.0.0.1", int(etcd1.endpoints[0].rsplit(":", 1)[1]))) as proxy:
        config = EtcdConfig(endpoints=(proxy.endpoint,), request_timeout=10, retry_budget=60)
        client = EtcdClient(config)
        watch = direct.watch(counter, 0, on_events, lambda _rev: None)
        result: list[int] = []
        adder = threading.Thread(
            target=lambda: result.append(EtcdStore(client, keys.store_prefix(1), LONG).add(
                "exit_barrier/count", 1
            ))
        )  # fmt: skip
        try:
            watch.wait_created()
            client.get(counter)  # connected: the next request is the add's
            proxy.set_mode(Mode.DELAY, delay=3.0)
            adder.start()
            assert committed.wait(30), "the add never reached etcd"
            wait_until(lambda: proxy.stats.reset >= 1, 10, "the reset of the reply's connection")
            # The client retries; hold the fault until one of its reconnections was refused
            # too, so the retry really comes after the reply was lost.
            wait_until(lambda: proxy.stats.refused >= 1, 30, "a reconnection attempt")
            proxy.set_mode(Mode.PASS)
            adder.join(60)
            assert not adder.is_alive()
        finally:
            proxy.set_mode(Mode.PASS)
            if adder.ident is not None:
                adder.join(60)
            watch.cancel()
            client.close()
    assert result == [1]
    assert direct.get(counter)[0].value == b"1"  # type: ignore[union-attr]


# -- blocking reads across broken streams and compaction -----------------------------------


class _Waiter:
    """A blocking ``get`` on its own thread; always joined by the test."""

    def __init__(self, store: EtcdStore, key: str) -> None:
        self.value: bytes | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(store, key), daemon=True)
        self._thread.start()

    def _run(self, store: EtcdStore, key: str) -> None:
        start = time.monotonic()
        try:
            self.value = store.get(key)
        except BaseException as exc:  # asserted on by the test
            self.error = exc
        self.seconds = time.monotonic() - start

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the get still waits after {timeout} s"


def _compactions_seen(caplog: pytest.LogCaptureFixture) -> int:
    return sum("its watch was compacted; reading again" in r.getMessage() for r in caplog.records)


def _waiting(caplog: pytest.LogCaptureFixture, key: str) -> bool:
    """Whether a get is past its read and waits on its watch (the fault must come then)."""
    text = f"store key {key} is absent; waiting for its put"
    return any(text in r.getMessage() for r in caplog.records)


def test_get_finishes_after_its_stream_resumes_past_a_compaction(
    etcd1: EtcdCluster, direct: EtcdClient, keys: RunKeys, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="coordinator.torch_adapter.store_wait")
    port = int(etcd1.endpoints[0].rsplit(":", 1)[1])
    with TcpFaultProxy(("127.0.0.1", port)) as proxy:
        client = EtcdClient(EtcdConfig(endpoints=(proxy.endpoint,), retry_budget=5))
        try:
            store = EtcdStore(client, keys.store_prefix(1), LONG)
            waiter = _Waiter(store, "master_addr")
            shown = keys.store_key(1, "master_addr").decode()
            wait_until(lambda: _waiting(caplog, shown), 30, "the get's watch")
            proxy.set_mode(Mode.RESET)  # the stream breaks and cannot come back for now
            wait_until(lambda: proxy.stats.reset >= 1, 10, "the stream's connection reset")
            EtcdStore(direct, keys.store_prefix(1), LONG).set("master_addr", "10.0.0.1")
            compact_to_head(etcd1.endpoints[0], keys.run_prefix + b"scratch")
            proxy.set_mode(Mode.PASS)  # it resumes from a revision etcd no longer has
            waiter.join(30)
        finally:
            proxy.set_mode(Mode.PASS)
            client.close()
    assert waiter.error is None and waiter.value == b"10.0.0.1"
    assert waiter.seconds < 30  # not the store timeout (60 s)
    assert _compactions_seen(caplog) == 1


def test_get_finishes_after_its_member_is_killed_and_history_compacted(
    fresh_cluster3: EtcdCluster, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The waiter's client knows one member only; that member is killed, the key is set
    and the history compacted through the others, and the member comes back: its watch
    resumes from a revision etcd compacted meanwhile."""
    caplog.set_level(logging.DEBUG, logger="coordinator.torch_adapter.store_wait")
    keys = RunKeys("/etcd-elastic-test", run_id)
    one = EtcdClient(EtcdConfig(endpoints=(fresh_cluster3.endpoints[0],), retry_budget=60))
    others = EtcdClient(EtcdConfig(endpoints=tuple(fresh_cluster3.endpoints[1:])))
    try:
        waiter = _Waiter(EtcdStore(one, keys.store_prefix(2), LONG), "rank0")
        shown = keys.store_key(2, "rank0").decode()
        wait_until(lambda: _waiting(caplog, shown), 30, "the get's watch")
        fresh_cluster3.kill(0)
        EtcdStore(others, keys.store_prefix(2), LONG).set("rank0", "host-a")
        compact_to_head(fresh_cluster3.endpoints[1], keys.run_prefix + b"scratch")
        restarted = time.monotonic()
        fresh_cluster3.restart(0)
        waiter.join(60)
        after_restart = time.monotonic() - restarted
    finally:
        one.close()
        others.close()
    assert waiter.error is None and waiter.value == b"host-a"
    assert after_restart < 45  # well inside the 60 s store timeout
    assert _compactions_seen(caplog) == 1
