"""How watches end on real etcd, so that no watcher silently goes quiet (issue 8, item 4):

* a stream that breaks and resumes after the history it needs was compacted calls
  ``on_compacted`` (and the break is logged naming the endpoint);
* a callback that raises ends its own watch only, and its owner gets the exception;
* a watch thread that dies ends every open watch with an error saying so and reaches the
  client's death listener; the next watch gets a new thread.
"""

from __future__ import annotations

import logging
import threading

import grpc
import pytest
from etcd3 import etcdrpc

from coordinator.core.errors import EtcdConnectionError
from coordinator.core.etcd_client import EtcdClient, EtcdConfig, WatchEvent
from coordinator.core.etcd_client._connection import Metadata
from coordinator.core.threads import ThreadDied
from coordinator.etcd_server import EtcdCluster
from tests.integration.etcd_client_support import Recorder, _client

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("threads_reaped")]


def _compact(endpoint: str, revision: int) -> None:
    channel = grpc.insecure_channel(endpoint)
    try:
        etcdrpc.KVStub(channel).Compact(
            etcdrpc.CompactionRequest(revision=revision, physical=True), timeout=10
        )
    finally:
        channel.close()


def test_a_watch_resumed_after_its_history_was_compacted_calls_on_compacted(
    fresh_cluster3: EtcdCluster,
    prefix: bytes,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cluster = fresh_cluster3
    caplog.set_level(logging.INFO, logger="coordinator.core.etcd_client")
    with _client(cluster.endpoints) as client:
        start = client.put(prefix + b"k00", b"0")
        rec = Recorder()
        client.watch(
            prefix, start, rec.on_events, rec.on_compacted, prefix=True, on_error=rec.on_error
        )
        rec.wait(lambda r: len(r.events) == 1)
        victim = client.watch_endpoint
        assert victim is not None
        others = [e for e in cluster.endpoints if e != victim]

        # The hook: hold the watch thread's next stream (every stream starts by getting the
        # auth token) until the history it must resume from is compacted.
        gate = threading.Event()
        real_metadata = client._metadata

        def held(budget: float | None = None) -> Metadata:
            if threading.current_thread().name == "etcd-watch":
                gate.wait(30)
            return real_metadata(budget)

        monkeypatch.setattr(client, "_metadata", held)
        cluster.kill(cluster.endpoints.index(victim))  # breaks the stream for real
        with _client(others) as writer:
            revisions = [writer.put(prefix + b"k%02d" % i, b"%d" % i) for i in range(1, 6)]
            _compact(others[0], revisions[-1])
            gate.set()
            rec.wait(lambda r: bool(r.compacted), timeout=30)
            assert rec.compacted == [revisions[-1]]
            # Nothing from the compacted history, nothing twice, no error: the owner
            # re-reads and watches again.
            assert [e.kv.key for e in rec.events] == [prefix + b"k00"] and rec.errors == []

            # The watch is over: a later write reaches a new watch, not the ended one.
            again = Recorder()
            client.watch(prefix, revisions[-1], again.on_events, again.on_compacted, prefix=True)
            later = writer.put(prefix + b"k06", b"6")
            again.wait(lambda r: bool(r.events) and r.events[-1].kv.mod_revision == later)
            assert len(rec.events) == 1 and rec.compacted == [revisions[-1]]
    broke = [r.getMessage() for r in caplog.records if "watch stream to" in r.getMessage()]
    assert broke and broke[0].startswith(f"etcd watch stream to {victim} broke: "), broke
    assert broke[0].endswith("; resuming on the next member"), broke
    assert not any("None" in message for message in broke), broke


def test_a_watch_callback_that_raises_ends_only_its_own_watch(
    etcd1: EtcdCluster, prefix: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A callback's exception is the owner's bug, not the watch thread's death: its own
    watch ends and its on_error gets that very exception; every other watch goes on."""
    deaths: list[ThreadDied] = []
    bug = ValueError("the owner's bug")
    errors: list[Exception] = []
    calls: list[int] = []

    def broken(events: list[WatchEvent], revision: int) -> None:
        calls.append(revision)
        raise bug

    config = EtcdConfig(endpoints=tuple(etcd1.endpoints))
    with EtcdClient(config, on_thread_death=deaths.append) as client:
        bad = client.watch(prefix, 0, broken, lambda _r: None, prefix=True, on_error=errors.append)
        bad.wait_created()
        good = Recorder()
        client.watch(prefix, 0, good.on_events, good.on_compacted, prefix=True).wait_created()
        thread = [t for t in threading.enumerate() if t.name == "etcd-watch"]
        written = [client.put(prefix + b"k%d" % i, b"v") for i in range(3)]
        good.wait(lambda r: len(r.events) == 3)
        assert [e.kv.mod_revision for e in good.events] == written
        assert errors == [bug] and errors[0] is bug and bad.error is bug
        assert len(calls) == 1  # nothing more reached the ended watch
        with pytest.raises(ValueError, match=r"^the owner's bug$"):
            bad.wait_created(0)
        # Not a death: the same watch thread serves on; no listener heard anything.
        assert (
            deaths == [] and [t for t in threading.enumerate() if t.name == "etcd-watch"] == thread
        )
    messages = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert messages == [
        f"the on_events callback of the etcd watch on key {prefix.decode()} raised ValueError: "
        "the owner's bug; the watch is cancelled and the error goes to its on_error"
    ]


def test_a_watch_thread_that_dies_ends_every_watch_and_tells_the_death_listener(
    etcd1: EtcdCluster, prefix: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    deaths: list[ThreadDied] = []
    config = EtcdConfig(endpoints=tuple(etcd1.endpoints))
    with EtcdClient(config, on_thread_death=deaths.append) as client:
        heard: list[ThreadDied] = []
        remove = client.add_death_listener(heard.append)
        a, b = Recorder(), Recorder()
        watch_a = client.watch(prefix + b"a", 0, a.on_events, a.on_compacted, on_error=a.on_error)
        watch_b = client.watch(prefix + b"b", 0, b.on_events, b.on_compacted, on_error=b.on_error)
        watch_a.wait_created()
        watch_b.wait_created()

        def broken(rs: object, metadata: Metadata) -> None:
            raise RuntimeError("injected into the watch thread")

        # The hook: the watch thread's handling of its next response raises.
        monkeypatch.setattr(client._watcher, "_handle", broken)
        client.put(prefix + b"a", b"1")
        a.wait(lambda r: bool(r.errors))
        b.wait(lambda r: bool(r.errors))
        for rec, name in ((a, "a"), (b, "b")):
            error = rec.errors[0]
            assert isinstance(error, EtcdConnectionError)
            assert str(error) == (
                f"no more events for the etcd watch on key {prefix.decode()}{name}: the "
                "client's watch thread died (RuntimeError('injected into the watch "
                "thread')); watch again (a new thread serves it)"
            )
            assert isinstance(error.__cause__, ThreadDied)
            assert rec.events == [] and len(rec.errors) == 1
        assert watch_a.error is a.errors[0]
        with pytest.raises(EtcdConnectionError, match="the client's watch thread died"):
            watch_b.wait_created(0)
        assert len(deaths) == 1 and heard == deaths
        assert deaths[0].name == "etcd-watch"
        assert str(deaths[0]) == (
            "background thread 'etcd-watch' died: RuntimeError: injected into the watch thread"
        )
        remove()

        # The client is not left without watches: the next one starts a new thread.
        monkeypatch.undo()
        c = Recorder()
        client.watch(prefix + b"a", 0, c.on_events, c.on_compacted).wait_created()
        written = client.put(prefix + b"a", b"2")
        c.wait(lambda r: bool(r.events))
        assert [e.kv.mod_revision for e in c.events] == [written]
        assert a.events == [] and len(a.errors) == 1  # the ended watches stay ended
