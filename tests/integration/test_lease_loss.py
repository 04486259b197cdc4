"""Leases on real etcd: lost when etcd says so, never by a client timer (issue 8, item 1).

* the whole 3-member cluster killed for 3 TTLs and restarted from its data dirs: the
  lease, its key and the watch all survive; UNREACHABLE and ALIVE are reported once each;
* etcd stopped for good: UNREACHABLE, never lost, for as long as it lasts;
* a lease revoked by another client (etcdctl): LOST within TTL/3 + 1 s;
* a lease that really expired while its owner was frozen (SIGSTOP): LOST as soon as the
  owner runs again and etcd answers;
* a keep-alive thread that dies: FAILED, reported to the death listener and to on_lost.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from coordinator.core.etcd_client import LeaseState
from coordinator.core.session import Session
from coordinator.core.threads import ThreadDied
from coordinator.etcd_server import EtcdCluster
from tests.integration.etcd_client_support import (
    LeaseEvents,
    Recorder,
    _client,
    _eventually,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("threads_reaped")]

ROOT = Path(__file__).resolve().parents[2]


def _restart_all(cluster: EtcdCluster) -> None:
    """Start every member again from its data dir, at once: none is healthy (has a
    leader) until a quorum is back, so they cannot be restarted one after the other."""
    errors: list[BaseException] = []

    def restart(index: int) -> None:
        try:
            cluster.restart(index, timeout=60)
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=restart, args=(i,)) for i in range(len(cluster.members))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def test_the_whole_cluster_down_for_3_ttl_and_restarted_keeps_the_lease_key_and_watch(
    fresh_cluster3: EtcdCluster, prefix: bytes
) -> None:
    """The issue's scenario: etcd keeps leases across a restart and a new leader extends
    them all, so the lease was never lost. A client that declared loss by its own timer
    (the old code: one TTL without an answer) fails here at ``wait_lost`` below."""
    cluster, ttl = fresh_cluster3, 3
    seen = LeaseEvents()
    key = prefix + b"node"
    with _client(cluster.endpoints) as client:
        session = Session(
            client, ttl, seen.on_lost,
            on_unreachable=seen.on_unreachable, on_reachable=seen.on_reachable,
        )  # fmt: skip
        client.put(key, b"alive", lease=session.lease_id)
        rec = Recorder()
        start = client.put(prefix + b"w/00", b"0")
        client.watch(prefix + b"w/", start, rec.on_events, rec.on_compacted, prefix=True)
        rec.wait(lambda r: len(r.events) == 1)
        assert session.state is LeaseState.ALIVE

        for index in range(len(cluster.members)):
            cluster.kill(index)
        down_at = time.monotonic()
        # Reported once the last answer's guarantee ran out: at most a TTL after the kill.
        seen.wait(lambda s: bool(s.unreachable), timeout=ttl + 5)
        assert session.state is LeaseState.UNREACHABLE and not session.lost()
        outage = seen.unreachable[0]
        message = outage.message(time.monotonic())
        assert message.startswith(
            "etcd unreachable: no member answered the keep-alive of lease "
            f"{session.lease_id:x} for "
        )
        assert all(endpoint in message for endpoint in cluster.endpoints), message
        assert set(outage.tried) == set(cluster.endpoints)

        # Three TTLs of silence: not lost (the old client timer said "lost" after one).
        assert not seen.lost
        time.sleep(max(0.0, down_at + 3 * ttl - time.monotonic()))  # the outage itself
        assert not session.lost() and seen.lost == []
        _restart_all(cluster)
        back_at = time.monotonic()

        seen.wait(lambda s: bool(s.reachable), timeout=ttl + 10)
        assert seen.reachable[0] >= 3 * ttl  # the silence it reports covers the outage
        assert session.state is LeaseState.ALIVE and not session.lost()
        kv, _ = client.get(key)
        assert kv is not None and kv.value == b"alive" and kv.lease == session.lease_id
        # Keep-alives resumed: two more TTLs later the lease is still there.
        assert client.lease_time_to_live(session.lease_id) > 0
        time.sleep(2 * ttl)
        assert client.lease_time_to_live(session.lease_id) > 0
        assert session.alive_until > time.monotonic()

        # The watch resumed too: writes after the restart arrive, none lost or repeated.
        for i in range(1, 6):
            client.put(prefix + b"w/%02d" % i, b"%d" % i)
        rec.wait(lambda r: len(r.events) >= 6, timeout=30)
        assert [e.kv.key for e in rec.events] == [prefix + b"w/%02d" % i for i in range(6)]
        assert rec.compacted == [] and rec.errors == []

        # One warning and one line for the whole outage, and no loss.
        assert len(seen.unreachable) == 1 and len(seen.reachable) == 1 and seen.lost == []
        print(
            f"\nwhole-cluster outage: {back_at - down_at:.1f} s from kill to healthy; "
            f"unreachable reported {seen.unreachable_at[0] - down_at:.1f} s after the kill; "
            f"etcd silent for {seen.reachable[0]:.1f} s in all"
        )
        session.close()
        assert client.lease_time_to_live(session.lease_id) == -1
        assert client.get(key)[0] is None


def test_default_reporting_is_one_warning_and_one_line_per_outage(
    prefix: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Without callbacks the keep-alive logs the outage itself: one warning naming the
    endpoints when the lease's guarantee runs out, one line when etcd answers again."""
    ttl = 2
    caplog.set_level(logging.INFO, logger="coordinator.core.etcd_client")
    with EtcdCluster(1, no_fsync=True) as cluster, _client(cluster.endpoints) as client:
        lease = client.lease_grant(ttl)
        client.put(prefix + b"node", b"x", lease=lease)
        keepalive = client.keep_alive(lease, ttl)
        _eventually(lambda: keepalive.endpoint is not None)
        cluster.kill(0)
        _eventually(lambda: keepalive.state is LeaseState.UNREACHABLE, timeout=ttl + 5)
        time.sleep(ttl)  # a longer outage: still one warning
        cluster.restart(0)
        _eventually(lambda: keepalive.state is LeaseState.ALIVE, timeout=ttl + 10)
        assert not keepalive.lost() and client.get(prefix + b"node")[0] is not None
        keepalive.close()
    records = [(r.levelname, r.getMessage()) for r in caplog.records]
    warnings = [m for level, m in records if level == "WARNING"]
    assert len(warnings) == 1, records
    assert warnings[0].startswith(
        f"etcd unreachable: no member answered the keep-alive of lease {lease:x} for "
    )
    assert (
        f"(tried {cluster.endpoints[0]}; last error from {cluster.endpoints[0]}: " in (warnings[0])
    )
    back = [m for level, m in records if level == "INFO" and m.startswith("etcd answers again")]
    assert len(back) == 1, records
    assert re.fullmatch(
        rf"etcd answers again \({re.escape(cluster.endpoints[0])}\) after \d+\.\d s of "
        rf"silence: lease {lease:x} is alive",
        back[0],
    ), back


def test_etcd_gone_for_good_is_unreachable_never_lost_and_close_is_bounded(
    prefix: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    ttl = 1
    with (
        EtcdCluster(1, no_fsync=True) as cluster,
        _client(cluster.endpoints, request_timeout=0.5) as client,
    ):
        lease = client.lease_grant(ttl)
        lost: list[int] = []
        keepalive = client.keep_alive(lease, ttl, on_lost=lambda: lost.append(1))
        _eventually(lambda: keepalive.endpoint is not None)
        caplog.set_level("INFO", logger="coordinator.core.etcd_client")
        cluster.stop()
        # Ten TTLs of silence: still not lost.
        assert not keepalive.wait_lost(10 * ttl)
        assert keepalive.state is LeaseState.UNREACHABLE and lost == []
        began = time.monotonic()
        keepalive.close()  # revoking is impossible now: bounded, and no error
        assert time.monotonic() - began < 2 * 0.5 + 2
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    # The default reporting, without callbacks: ONE warning for the whole outage that
    # names the endpoint, and the failed revoke at close.
    unreachable = [w for w in warnings if w.startswith("etcd unreachable")]
    assert len(unreachable) == 1, warnings
    assert cluster.endpoints[0] in unreachable[0]
    assert [w for w in warnings if w.startswith(f"could not revoke lease {lease:x}")], warnings
    # Each failed attempt beyond the first is logged at debug, not info.
    infos = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len([i for i in infos if i.startswith(f"keep-alive of lease {lease:x}")]) == 1, infos


def _etcdctl(endpoint: str, *args: str) -> None:
    etcdctl = Path(sys.executable).parent / "etcdctl"
    command = [str(etcdctl), f"--endpoints={endpoint}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"


def test_a_lease_revoked_by_another_client_is_lost_within_a_third_of_its_ttl(
    etcd1: EtcdCluster, prefix: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    ttl = 3
    seen = LeaseEvents()
    with _client(etcd1.endpoints) as owner:
        lease = owner.lease_grant(ttl)
        owner.put(prefix + b"node", b"x", lease=lease)
        keepalive = owner.keep_alive(
            lease, ttl, seen.on_lost,
            on_unreachable=seen.on_unreachable, on_reachable=seen.on_reachable,
        )  # fmt: skip
        _eventually(lambda: keepalive.endpoint is not None)
        _etcdctl(etcd1.endpoints[0], "lease", "revoke", f"{lease:x}")
        revoked_at = time.monotonic()
        assert keepalive.wait_lost(ttl / 3 + 1)
        took = time.monotonic() - revoked_at
        assert took <= ttl / 3 + 1, took
        assert keepalive.state is LeaseState.LOST
        assert keepalive.lost_reason == "etcd says it expired or was revoked"
        assert len(seen.lost) == 1 and seen.unreachable == [] and seen.reachable == []
        keepalive.close()
        assert len(seen.lost) == 1
        print(f"\nrevoked elsewhere: lost after {took:.2f} s (ttl {ttl} s)")
    lost_lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert lost_lines == [f"etcd lease {lease:x} lost: etcd says it expired or was revoked"]


def _read_lines(stream: Any, lines: queue.Queue[dict[str, Any]]) -> None:
    for raw in stream:
        if raw.startswith("{"):
            lines.put(json.loads(raw))


def _next(
    lines: queue.Queue[dict[str, Any]], event: str, timeout: float, log: Path
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(
                f"no {event!r} from the lease owner in {timeout} s; its log:\n{log.read_text()}"
            ) from None
        if line["event"] == event:
            return line


def test_a_lease_that_expired_while_its_owner_was_frozen_is_lost_once_etcd_answers(
    etcd1: EtcdCluster, prefix: bytes, tmp_path: Path
) -> None:
    """Freezing the owner (SIGSTOP) is the only way to make etcd really expire a lease
    while its keep-alive is alive: an etcd outage would not (etcd extends leases when it
    comes back). Once resumed, the owner hears it from etcd, with etcd's reason."""
    ttl = 2
    key = prefix + b"frozen"
    log = tmp_path / "owner.log"
    with _client(etcd1.endpoints) as client, open(log, "w") as log_file:
        owner = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.etcd_client_support",
             etcd1.endpoint_list, str(ttl), key.decode()],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=log_file, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        lines: queue.Queue[dict[str, Any]] = queue.Queue()
        reader = threading.Thread(target=_read_lines, args=(owner.stdout, lines))
        reader.start()
        try:
            ready = _next(lines, "ready", 30, log)
            kv, revision = client.get(key)
            assert kv is not None and kv.lease == ready["lease"]
            rec = Recorder()
            watch = client.watch(key, revision + 1, rec.on_events, rec.on_compacted)

            owner.send_signal(signal.SIGSTOP)
            # etcd expires the lease (and deletes the key) while the owner cannot renew it.
            rec.wait(lambda r: any(e.kind == "delete" for e in r.events), timeout=ttl + 10)
            assert client.lease_time_to_live(ready["lease"]) == -1
            watch.cancel()

            owner.send_signal(signal.SIGCONT)
            resumed_at = time.monotonic()
            lost = _next(lines, "lost", ttl / 3 + 5, log)
            took = time.monotonic() - resumed_at
            assert lost["state"] == "lost"
            assert lost["reason"].startswith("etcd says"), lost
            assert took < ttl / 3 + 2, took
            assert owner.wait(30) == 0, log.read_text()
            print(f"\nexpired while frozen: lost {took:.2f} s after SIGCONT ({lost['reason']})")
        finally:
            if owner.poll() is None:
                owner.send_signal(signal.SIGCONT)
                owner.kill()
            owner.wait()
            reader.join()


def test_a_keepalive_thread_that_dies_fails_the_lease_and_tells_the_death_listener(
    etcd1: EtcdCluster, prefix: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    ttl = 3
    deaths: list[ThreadDied] = []
    seen = LeaseEvents()
    with _client(etcd1.endpoints) as client:
        client.add_death_listener(deaths.append)
        lease = client.lease_grant(ttl)
        keepalive = client.keep_alive(lease, ttl, seen.on_lost)
        _eventually(lambda: keepalive.endpoint is not None)

        def broken(index: int, rsp: object) -> bool:
            raise RuntimeError("injected into the keep-alive thread")

        # The hook: the keep-alive's handling of the next answer raises.
        monkeypatch.setattr(keepalive, "_on_answer", broken)
        seen.wait(lambda s: bool(s.lost), timeout=ttl / 3 + 5)
        assert keepalive.lost() and keepalive.state is LeaseState.FAILED
        assert keepalive.lost_reason == (
            "its keep-alive thread died (RuntimeError('injected into the keep-alive thread')); "
            "nothing renews it, so etcd expires it after its TTL"
        )
        assert len(deaths) == 1
        assert deaths[0].name == f"etcd-keepalive-{lease:x}"
        assert str(deaths[0]) == (
            f"background thread 'etcd-keepalive-{lease:x}' died: RuntimeError: injected into "
            "the keep-alive thread"
        )
        # The lease itself still exists: closing revokes it as usual.
        assert client.lease_time_to_live(lease) > 0
        keepalive.close()
        assert client.lease_time_to_live(lease) == -1
        assert len(seen.lost) == 1
