"""coordinator.core.etcd_client's watches against real etcd: delivery, watch-then-read,
confirmation, the shared stream, compaction and resuming after a member dies."""

from __future__ import annotations

import logging
import re
import threading
import time

import grpc
import pytest
from etcd3 import etcdrpc

from coordinator.core.errors import EtcdConnectionError
from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.etcd_server import EtcdCluster, free_port
from tests.integration.etcd_client_support import (
    Recorder,
    _client,
    _eventually,
)

# Every thread a test's clients started is gone once they are closed.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("threads_reaped")]


# -- watches ------------------------------------------------------------------------------


def test_watch_delivers_puts_and_deletes_from_the_start_revision(
    etcd1: EtcdCluster, prefix: bytes
) -> None:
    with _client(etcd1.endpoints) as client:
        start = client.put(prefix + b"a", b"1")  # before the watch exists
        client.put(prefix + b"b", b"2")
        client.delete(prefix + b"a")
        rec = Recorder()
        watch = client.watch(
            prefix, start, rec.on_events, rec.on_compacted, prefix=True, prev_kv=True
        )
        rec.wait(lambda r: len(r.events) == 3)
        assert [(e.kind, e.kv.key[-1:]) for e in rec.events] == [
            ("put", b"a"),
            ("put", b"b"),
            ("delete", b"a"),
        ]
        assert rec.events[2].prev_kv is not None and rec.events[2].prev_kv.value == b"1"
        assert rec.events[2].kv.mod_revision > rec.events[1].kv.mod_revision

        one = Recorder()
        now = client.watch(prefix + b"b", 0, one.on_events, one.on_compacted)  # one key
        created_at = now.wait_created()
        # Created at the present revision: nothing older comes, the next write does.
        assert created_at >= rec.events[2].kv.mod_revision
        assert now.next_revision == created_at + 1
        written = client.put(prefix + b"b", b"3")
        one.wait(lambda r: bool(r.events))
        assert [(e.kv.value, e.kv.mod_revision) for e in one.events] == [(b"3", written)]

        watch.cancel()
        watch.cancel()
        seen = len(rec.events)  # no callback of a cancelled watch starts after cancel()
        client.put(prefix + b"c", b"after cancel")
        one_more = client.put(prefix + b"b", b"4")
        one.wait(lambda r: r.events[-1].kv.mod_revision == one_more)
        assert len(rec.events) == seen


def test_watch_then_read_misses_nothing_while_a_writer_races(
    etcd1: EtcdCluster, prefix: bytes
) -> None:
    """The pattern the view, the coordinator and the store use: watch from now, wait for
    etcd to create it, read, then apply only events newer than the read."""
    key = prefix + b"counter"
    with _client(etcd1.endpoints) as client:
        stop = threading.Event()

        def write() -> None:
            n = 0
            while not stop.is_set() and n < 2000:
                n += 1
                client.put(key, b"%d" % n)

        writer = threading.Thread(target=write)
        writer.start()
        try:
            rec = Recorder()
            time.sleep(0.05)
            watch = client.watch(key, 0, rec.on_events, rec.on_compacted)
            created_at = watch.wait_created()
            kv, read_at = client.get(key)
            assert kv is not None and read_at >= created_at
            time.sleep(0.2)
        finally:
            stop.set()
            writer.join(30)
        last, _ = client.get(key)
        assert last is not None
        rec.wait(lambda r: bool(r.events) and r.events[-1].kv.mod_revision == last.mod_revision)
        newer = [e.kv.mod_revision for e in rec.events if e.kv.mod_revision > read_at]
        # Every write after the read arrived, once and in order, with no gap.
        assert newer == list(range(read_at + 1, last.mod_revision + 1))
        assert all(e.kv.mod_revision > created_at for e in rec.events)
        watch.cancel()


def test_wait_created_raises_when_no_member_confirms_or_the_client_closes() -> None:
    dead = f"127.0.0.1:{free_port('127.0.0.1')}"
    client = EtcdClient(EtcdConfig(endpoints=(dead,), request_timeout=0.2, retry_budget=0.5))
    try:
        watch = client.watch(b"/k", 0, lambda _e, _r: None, lambda _r: None)
        with pytest.raises(EtcdConnectionError) as info:
            watch.wait_created(0.5)
        # The same words as a unary call that found no member: every endpoint, last error.
        assert re.fullmatch(
            rf"no etcd member answered watch on key /k within 0.5 s; tried {dead}; last "
            rf"error from {dead}: UNAVAILABLE: .+\. Check that etcd runs and is reachable "
            "at these endpoints",
            str(info.value),
        ), str(info.value)
        threading.Timer(0.2, client.close).start()
        with pytest.raises(EtcdConnectionError, match=r"^the etcd client was closed$"):
            watch.wait_created(30)
    finally:
        client.close()


def test_many_short_watches_share_one_stream_and_thread(etcd1: EtcdCluster, prefix: bytes) -> None:
    with _client(etcd1.endpoints) as client:
        rev = client.put(prefix + b"seed", b"")
        threads_before = threading.active_count()
        recs = [Recorder() for _ in range(200)]
        watches = [
            client.watch(prefix + b"k%d" % i, rev + 1, r.on_events, r.on_compacted)
            for i, r in enumerate(recs)
        ]
        assert threading.active_count() - threads_before <= 3  # watch thread + gRPC's
        for i in range(0, 200, 20):
            client.put(prefix + b"k%d" % i, b"v")
        for i in range(0, 200, 20):
            recs[i].wait(lambda r: len(r.events) == 1)
        for watch in watches:
            watch.cancel()
        assert [t.name for t in threading.enumerate()].count("etcd-watch") == 1


def test_watch_reports_compaction_and_restarts_from_the_compact_revision(
    etcd1: EtcdCluster, prefix: bytes
) -> None:
    with _client(etcd1.endpoints) as client:
        first = client.put(prefix + b"k", b"0")
        revs = [client.put(prefix + b"k", b"%d" % i) for i in range(1, 4)]
        compact_at = revs[-1]
        # Compaction of history only (current values stay): other tests read at or after
        # their own revisions, which are newer.
        channel = grpc.insecure_channel(etcd1.endpoints[0])
        try:
            etcdrpc.KVStub(channel).Compact(
                etcdrpc.CompactionRequest(revision=compact_at, physical=True), timeout=10
            )
        finally:
            channel.close()
        rec = Recorder()
        client.watch(prefix + b"k", first, rec.on_events, rec.on_compacted)
        rec.wait(lambda r: bool(r.compacted))
        assert rec.compacted == [compact_at] and rec.events == []

        again = Recorder()
        client.watch(prefix + b"k", compact_at, again.on_events, again.on_compacted)
        again.wait(lambda r: bool(r.events))
        assert again.events[0].kv.mod_revision == compact_at and again.compacted == []


def test_watch_resumes_without_loss_or_duplicates_after_its_member_is_killed(
    fresh_cluster3: EtcdCluster, prefix: bytes
) -> None:
    cluster = fresh_cluster3
    with _client(cluster.endpoints) as client:
        start = client.put(prefix + b"k00", b"0")
        rec = Recorder()
        client.watch(prefix, start, rec.on_events, rec.on_compacted, prefix=True)
        rec.wait(lambda r: len(r.events) == 1)
        lease = client.lease_grant(5)
        keepalive = client.keep_alive(lease, 5)
        _eventually(lambda: keepalive.endpoint is not None)
        victim = client.watch_endpoint
        assert victim is not None and keepalive.endpoint == victim
        others = [e for e in cluster.endpoints if e != victim]
        with _client(others, retry_budget=20.0) as writer:
            for i in range(1, 10):
                writer.put(prefix + b"k%02d" % i, b"%d" % i)
            cluster.kill(cluster.endpoints.index(victim))
            for i in range(10, 30):
                writer.put(prefix + b"k%02d" % i, b"%d" % i)
        rec.wait(lambda r: len(r.events) >= 30, timeout=30)
        keys = [e.kv.key for e in rec.events]
        assert keys == [prefix + b"k%02d" % i for i in range(30)]
        revisions = [e.kv.mod_revision for e in rec.events]
        assert revisions == sorted(set(revisions))
        assert client.watch_endpoint in others
        assert keepalive.endpoint in (*others, None)  # reconnected elsewhere (or in between)
        assert not keepalive.lost()
        assert client.lease_time_to_live(lease) > 0
        keepalive.close()
        assert client.lease_time_to_live(lease) == -1


def test_a_watch_leaves_a_frozen_member_without_a_keepalive_to_tell_it(
    fresh_cluster3: EtcdCluster, prefix: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A SIGSTOPped member keeps its sockets open and answers nothing: the watch stream
    asks it for progress, hears nothing, and resumes on the next member, long before
    gRPC's own keepalive (15 s + 5 s) would notice. This client has no lease, so no
    keep-alive on another member tells it anything."""
    caplog.set_level(logging.INFO, "coordinator.core.etcd_client")
    cluster = fresh_cluster3
    interval = 1.0
    with _client(cluster.endpoints, request_timeout=interval) as client:
        start = client.put(prefix + b"k0", b"0")
        rec = Recorder()
        client.watch(prefix, start, rec.on_events, rec.on_compacted, prefix=True)
        rec.wait(lambda r: len(r.events) == 1)
        victim = client.watch_endpoint
        assert victim is not None
        others = [e for e in cluster.endpoints if e != victim]
        cluster.freeze(cluster.endpoints.index(victim))
        try:
            frozen_at = time.monotonic()
            with _client(others, retry_budget=20.0) as writer:
                writer.put(prefix + b"k1", b"1")  # after a new election if it led
            rec.wait(lambda r: len(r.events) == 2, timeout=20)
            took = time.monotonic() - frozen_at
            moved_to = client.watch_endpoint
        finally:
            cluster.thaw(cluster.endpoints.index(victim))
        print(f"\nfrozen member -> the event through another member: {took:.2f} s")
        # A put the writer retried (its first attempt hung on the frozen leader, then was
        # applied) is two events of k1: nothing is lost or delivered twice.
        assert {e.kv.key for e in rec.events} == {prefix + b"k0", prefix + b"k1"}
        revisions = [e.kv.mod_revision for e in rec.events]
        assert revisions == sorted(set(revisions))
        assert moved_to in others
        # Silent for an interval, asked, silent for one more: about 2-3 intervals.
        assert took < 4 * interval + 2, f"the watch left the frozen member after {took:.1f} s"
        assert f"etcd watch stream to {victim} broke: no answer for" in caplog.text
        assert "not to a progress request either; resuming on the next member" in caplog.text


class _Heard:
    """An observer that counts what the client heard and which streams broke."""

    def __init__(self) -> None:
        self.answers = 0
        self.failed: list[tuple[str, str]] = []

    def call_done(self, method: str, seconds: float, failed: bool) -> None:
        pass

    def attempt_failed(self, method: str, code: str) -> None:
        self.failed.append((method, code))

    def keepalive_answered(self, seconds: float) -> None:
        pass

    def answered(self, at: float) -> None:
        self.answers += 1


def test_an_idle_watch_on_a_live_member_is_probed_and_stays_put(
    etcd1: EtcdCluster, prefix: bytes
) -> None:
    """A watch with nothing to report for ten intervals: etcd answers every progress
    request, and the stream stays where it is (no break, no lost event)."""
    heard = _Heard()
    config = EtcdConfig(endpoints=tuple(etcd1.endpoints), request_timeout=0.3)
    with EtcdClient(config, observer=heard) as client:
        rec = Recorder()
        watch = client.watch(prefix, 0, rec.on_events, rec.on_compacted, prefix=True)
        watch.wait_created()
        before = heard.answers
        threading.Event().wait(3.0)  # ten intervals of silence
        probes_answered = heard.answers - before
        client.put(prefix + b"k", b"v")
        rec.wait(lambda r: len(r.events) == 1)
        assert heard.failed == []
        assert 3 <= probes_answered <= 12, probes_answered
