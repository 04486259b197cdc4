"""coordinator.core.etcd_client against real etcd: KV and CAS, leases, failover, auth, TLS
(watches: test_etcd_watch.py).

Every test uses its own key prefix (from ``run_id``); tests that break a cluster, enable
auth or need TLS start their own etcd and stop it even on failure.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from etcd3 import etcdrpc

from coordinator.core.errors import EtcdAuthError, EtcdConnectionError, EtcdTLSError
from coordinator.core.etcd_client import EtcdClient, EtcdConfig, KeyValue
from coordinator.core.etcd_client._leases import earlier_grant_applied
from coordinator.core.ports import free_ports
from coordinator.etcd_server import EtcdCluster, find_etcd_binary, free_port
from tests.chaos.proxy import Mode
from tests.integration.etcd_client_support import (
    LeaseEvents,
    Recorder,
    _behind_a_proxy,
    _client,
    _eventually,
    _FirstEndpoint,
)

# Every thread a test's clients started is gone once they are closed.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("threads_reaped")]


# -- KV and CAS ---------------------------------------------------------------------------


def test_cas_create_only_success_and_failure_returning_the_current_value(
    etcd_any: EtcdCluster, prefix: bytes
) -> None:
    key = prefix + b"state"
    with _client(etcd_any.endpoints) as client:
        first = client.put_if_mod_revision(key, b"v1", 0, also_put=[(prefix + b"n/a", b"a", 0)])
        assert first.succeeded and first.current is None
        kv, rev = client.get(key)
        assert kv is not None and kv.value == b"v1" and kv.mod_revision == first.revision == rev

        again = client.put_if_mod_revision(key, b"other", 0)
        assert not again.succeeded
        assert again.current == kv

        second = client.put_if_mod_revision(
            key, b"v2", kv.mod_revision, also_delete_prefixes=[prefix + b"n/"]
        )
        assert second.succeeded and second.revision > kv.mod_revision
        assert client.count_prefix(prefix + b"n/")[0] == 0

        stale = client.put_if_mod_revision(key, b"v3", kv.mod_revision)
        assert not stale.succeeded
        assert stale.current is not None and stale.current.value == b"v2"
        assert stale.current.mod_revision == second.revision and stale.current.version == 2

        lost = client.delete_if_mod_revision(key, kv.mod_revision)
        assert not lost.succeeded and lost.current == stale.current
        won = client.delete_if_mod_revision(key, second.revision)
        assert won.succeeded
        assert client.get(key) == (None, won.revision)
        gone = client.put_if_mod_revision(key, b"v4", second.revision)
        assert not gone.succeeded and gone.current is None


def test_prefix_ops_sorting_limits_and_deletes(etcd1: EtcdCluster, prefix: bytes) -> None:
    with _client(etcd1.endpoints) as client:
        # Created in the order c, a, b: key order and create order differ.
        revs = {name: client.put(prefix + b"n/" + name, name * 2) for name in (b"c", b"a", b"b")}
        client.put(prefix + b"n0", b"outside the n/ prefix")

        kvs, rev = client.get_prefix(prefix + b"n/")
        assert [kv.key[-1:] for kv in kvs] == [b"a", b"b", b"c"]
        assert rev >= revs[b"b"]
        by_create, _ = client.get_prefix(prefix + b"n/", sort_by_create=True)
        assert [kv.key[-1:] for kv in by_create] == [b"c", b"a", b"b"]
        newest, _ = client.get_prefix(prefix + b"n/", sort_by_create=True, descending=True, limit=2)
        assert [kv.key[-1:] for kv in newest] == [b"b", b"a"]
        early, _ = client.get_prefix(prefix + b"n/", max_create_revision=revs[b"a"])
        assert [kv.key[-1:] for kv in early] == [b"a", b"c"]
        keys, _ = client.get_prefix(prefix + b"n/", keys_only=True)
        assert [kv.value for kv in keys] == [b"", b"", b""]
        assert client.count_prefix(prefix + b"n/")[0] == 3

        lease = client.lease_grant(30)
        client.put(prefix + b"leased", b"x", lease=lease)
        leased, _ = client.get(prefix + b"leased")
        assert leased is not None and leased.lease == lease
        client.lease_revoke(lease)
        client.lease_revoke(lease)  # already gone: not an error
        assert client.get(prefix + b"leased")[0] is None
        assert client.lease_time_to_live(lease) == -1

        assert client.delete(prefix + b"n/a")[0] == 1
        assert client.delete(prefix + b"n/a")[0] == 0
        deleted, rev = client.delete_prefix(prefix + b"n/")
        assert deleted == 2
        assert client.get_prefix(prefix + b"n/") == ([], rev)
        assert client.count_prefix(prefix)[0] == 1  # n0 survived


def test_one_client_shared_by_many_threads_counts_exactly_with_cas(
    etcd3: EtcdCluster, prefix: bytes
) -> None:
    key = prefix + b"counter"
    threads_n, increments = 16, 10
    errors: list[BaseException] = []
    with _client(etcd3.endpoints) as client:

        def worker() -> None:
            try:
                for _ in range(increments):
                    kv, _ = client.get(key)
                    while True:
                        value = int(kv.value) if kv else 0
                        result = client.put_if_mod_revision(
                            key, b"%d" % (value + 1), kv.mod_revision if kv else 0
                        )
                        if result.succeeded:
                            break
                        kv = result.current  # the lost race already read the winner
            except BaseException as exc:  # reported below, in the test's thread
                errors.append(exc)

        workers = [threading.Thread(target=worker) for _ in range(threads_n)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join(60)
        assert errors == []
        kv, _ = client.get(key)
        assert kv is not None and int(kv.value) == threads_n * increments


def test_put_created_returns_the_keys_create_revision(etcd1: EtcdCluster, prefix: bytes) -> None:
    with _client(etcd1.endpoints) as client:
        created = client.put_created(prefix + b"n", b"1")
        kv, _ = client.get(prefix + b"n")
        assert kv is not None and kv.create_revision == created == kv.mod_revision
        client.put(prefix + b"other", b"x")
        assert client.put_created(prefix + b"n", b"2") == created  # rewritten, not created
        kv, _ = client.get(prefix + b"n")
        assert kv is not None and kv.value == b"2" and kv.mod_revision > created


# -- leases -------------------------------------------------------------------------------


def test_keep_alive_holds_a_2s_lease_for_6s_then_revoke_on_close(
    etcd1: EtcdCluster, prefix: bytes
) -> None:
    with _client(etcd1.endpoints) as client:
        lease = client.lease_grant(2)
        client.put(prefix + b"node", b"alive", lease=lease)
        lost: list[int] = []
        keepalive = client.keep_alive(lease, 2, on_lost=lambda: lost.append(1))
        assert not keepalive.wait_lost(6.5)  # three TTLs
        assert client.get(prefix + b"node")[0] is not None
        assert client.lease_time_to_live(lease) > 0
        keepalive.close(revoke=True)
        assert client.lease_time_to_live(lease) == -1
        assert client.get(prefix + b"node")[0] is None
        assert lost == [] and not keepalive.lost()


def test_keep_alive_reports_a_lease_revoked_by_another_client(
    etcd1: EtcdCluster, prefix: bytes
) -> None:
    with _client(etcd1.endpoints) as owner, _client(etcd1.endpoints) as other:
        lease = owner.lease_grant(3)
        lost: list[int] = []
        keepalive = owner.keep_alive(lease, 3, on_lost=lambda: lost.append(1))
        other.lease_revoke(lease)
        began = time.monotonic()
        assert keepalive.wait_lost(10)
        assert time.monotonic() - began < 3 + 1  # noticed at the next keep-alive (ttl/3)
        assert keepalive.lost() and lost == [1]
        keepalive.close()
        assert lost == [1]


def test_a_granted_lease_has_the_id_the_client_chose_and_a_second_grant_of_it_is_refused(
    etcd1: EtcdCluster,
) -> None:
    # The contract a retried grant relies on (EtcdClient.lease_grant): etcd keeps the id
    # the client sends, and refuses that id again with "lease already exists", which the
    # retry then takes as its own lease (earlier_grant_applied). Pinned on each etcd.
    with _client(etcd1.endpoints) as client:
        lease = client.lease_grant(5)
        assert 0 < lease < 2**62
        assert client.lease_grant(5) != lease
        with grpc.insecure_channel(etcd1.endpoints[0]) as channel:
            stub = etcdrpc.LeaseStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.LeaseGrant(etcdrpc.LeaseGrantRequest(TTL=5, ID=lease), timeout=5)
        details = refused.value.details() or ""
        assert earlier_grant_applied(2, details), details
        assert client.lease_time_to_live(lease) > 0


# -- failover -----------------------------------------------------------------------------


def _leases_granted(etcd: EtcdCluster) -> float:
    """etcd's own count of leases it granted (its metrics page)."""
    text = etcd.members[0].metrics()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("etcd_debugging_lease_granted_total ")
    )


def test_a_grant_answered_too_late_and_retried_leaves_exactly_one_lease(
    etcd1: EtcdCluster,
) -> None:
    # The worst moment for a grant: etcd applies it but the answer misses the attempt's
    # deadline. The proxy passes the request at once and holds every answer for 60 s, so
    # the grant is applied within milliseconds and its answer never comes in time,
    # whatever the machine's load (a 0.6 s delay each way, 1.2 s against the 1 s attempt,
    # was once answered in 0.60 s on a loaded machine); the retry on the direct endpoint
    # a second later must get that lease, not a second one.
    with _behind_a_proxy(etcd1, "late-member", request_timeout=1.0) as (proxy, client):
        client.get(b"/warm-up")  # the channel through the proxy is up before the delay
        before = _leases_granted(etcd1)
        proxy.set_mode(Mode.DELAY, delay=0.0, answer_delay=60.0)
        began = time.monotonic()
        lease = client.lease_grant(30)
        took = time.monotonic() - began
        proxy.set_mode(Mode.PASS)
        assert took >= 1.0, f"the first attempt was answered in time ({took:.2f} s)"
        assert _leases_granted(etcd1) - before == 1
        assert client.lease_time_to_live(lease) > 0
        client.lease_revoke(lease)


def test_a_member_silent_from_the_first_keepalive_after_a_grant_loses_no_lease(
    etcd1: EtcdCluster,
) -> None:
    # The first stream after a grant opens without a probe; the worst moment is the member
    # going silent right then. The stream must move to the next endpoint within an interval
    # and the lease stay alive: never UNREACHABLE, never LOST.
    with _behind_a_proxy(etcd1, "silent-member") as (proxy, client):
        events = LeaseEvents()
        granted_at = time.monotonic()
        lease = client.lease_grant(3)
        proxy.set_mode(Mode.BLACKHOLE)
        keepalive = client.keep_alive(
            lease, 3, events.on_lost, on_unreachable=events.on_unreachable,
            on_reachable=events.on_reachable, granted_at=granted_at,
        )  # fmt: skip
        try:
            _eventually(lambda: keepalive.endpoint == etcd1.endpoints[0], timeout=5)
            time.sleep(3 * 3)  # three TTLs on the other endpoint
            assert events.lost == [] and events.unreachable == []
            assert client.lease_time_to_live(lease) > 0
        finally:
            keepalive.close(revoke=True)


def test_get_fails_over_past_a_dead_first_endpoint(etcd1: EtcdCluster, prefix: bytes) -> None:
    dead = f"127.0.0.1:{free_port()}"
    with _client([dead, *etcd1.endpoints], rng=_FirstEndpoint()) as client:
        assert client.current_endpoint == dead
        began = time.monotonic()
        assert client.get(prefix + b"absent")[0] is None
        assert time.monotonic() - began < 2
        assert client.current_endpoint == etcd1.endpoints[0]


def test_all_endpoints_dead_raises_naming_them_within_the_budget() -> None:
    dead = [f"127.0.0.1:{p}" for p in free_ports(2)]
    with _client(dead, request_timeout=0.5, retry_budget=1.0, rng=_FirstEndpoint()) as client:
        began = time.monotonic()
        with pytest.raises(EtcdConnectionError) as info:
            client.put(b"/etcd-client-test/x", b"")
        assert time.monotonic() - began < 1.0 + 2 * 0.5 + 1.0
    message = str(info.value)
    assert message.startswith(
        f"no etcd member answered put within 1 s; tried {dead[0]}, {dead[1]}; last error from "
    )
    assert "UNAVAILABLE" in message
    assert message.endswith("Check that etcd runs and is reachable at these endpoints")
    assert isinstance(info.value.__cause__, grpc.RpcError)


# -- auth ---------------------------------------------------------------------------------


def _etcdctl(endpoint: str, *args: str) -> None:
    etcdctl = Path(sys.executable).parent / "etcdctl"
    command = [str(etcdctl), f"--endpoints={endpoint}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"


def test_auth_good_and_bad_passwords_permissions_and_token_refresh(prefix: bytes) -> None:
    # Tokens live 1 s here, so the client must re-authenticate after an idle pause.
    with EtcdCluster(1, no_fsync=True, extra_args=["--auth-token-ttl=1"]) as cluster:
        ep = cluster.endpoints[0]
        allowed = prefix + b"allowed/"
        for args in (
            ("user", "add", "root:rootpw"),
            ("role", "add", "root"),
            ("user", "grant-role", "root", "root"),
            ("role", "add", "app"),
            ("role", "grant-permission", "app", "--prefix=true", "readwrite", allowed.decode()),
            ("user", "add", "alice:alicepw"),
            ("user", "grant-role", "alice", "app"),
            ("auth", "enable"),
        ):
            _etcdctl(ep, *args)

        with _client([ep], user="root", password="rootpw") as root:
            root.put(prefix + b"anything", b"1")
            assert root.get(prefix + b"anything")[0] is not None

        with _client([ep], user="alice", password="wrong") as bad:
            refused = Recorder()
            bad.watch(
                allowed, 0, refused.on_events, refused.on_compacted, on_error=refused.on_error
            )
            refused.wait(lambda r: bool(r.errors))
            with pytest.raises(EtcdAuthError) as info:
                bad.get(allowed + b"k")
        assert str(refused.errors[0]) == str(info.value)
        assert str(info.value) == (
            "etcd rejected the credentials of user 'alice' (etcdserver: authentication failed, "
            "invalid user ID or password); check the user and password settings"
        )

        anonymous = _client([ep])
        with anonymous, pytest.raises(EtcdAuthError) as info:
            anonymous.get(allowed + b"k")
        assert str(info.value) == (
            f"etcd refused get on key {allowed.decode()}k: etcdserver: user name is empty; "
            "etcd has auth enabled: set the user and password settings"
        )

        with _client([ep], user="alice", password="alicepw") as alice:
            alice.put(allowed + b"k", b"v")
            denied = prefix + b"secret"
            with pytest.raises(EtcdAuthError) as info:
                alice.put(denied, b"v")
            assert str(info.value) == (
                f"etcd user 'alice' is not permitted to put on key {denied.decode()} "
                "(etcdserver: permission denied); grant the user's role readwrite on the key "
                "prefix"
            )
            rec = Recorder()
            refused = alice.watch(denied, 0, rec.on_events, rec.on_compacted, on_error=rec.on_error)
            with pytest.raises(EtcdAuthError) as refusal:
                refused.wait_created()
            rec.wait(lambda r: bool(r.errors))
            assert rec.errors[0] is refusal.value
            # etcd's own wording of the reason differs between versions; ours is pinned.
            assert re.fullmatch(
                rf"etcd user 'alice' may not watch key {re.escape(denied.decode())} \(.*"
                r"etcdserver: permission denied\); grant the user's role read on the key prefix",
                str(refusal.value),
            ), str(refusal.value)

            token = alice._token
            time.sleep(3)  # let the 1 s token expire (the condition here is time itself)
            kv, _ = alice.get(allowed + b"k")
            assert kv is not None and kv.value == b"v"
            assert alice._token not in (None, token)


# -- TLS ----------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_pki(d: Path, name: str) -> None:
    """A CA ``{name}-ca`` and server/client certificates for 127.0.0.1 signed by it."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", f"{name}-ca.key", "-out", f"{name}-ca.pem",
             "-days", "2", "-subj", f"/CN={name}-ca", cwd=d)  # fmt: skip
    for role, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        (d / f"{role}.ext").write_text(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        _openssl("req", *ec, "-keyout", f"{name}-{role}.key", "-out", f"{role}.csr",
                 "-subj", f"/CN={role}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{role}.csr", "-CA", f"{name}-ca.pem",
                 "-CAkey", f"{name}-ca.key", "-CAcreateserial", "-days", "2",
                 "-extfile", f"{role}.ext", "-out", f"{name}-{role}.pem", cwd=d)  # fmt: skip


@contextlib.contextmanager
def _tls_etcd(d: Path) -> Iterator[str]:
    port, peer = free_ports(2)
    url = f"https://127.0.0.1:{port}"
    argv = [
        str(find_etcd_binary()), "--name", "tls", "--data-dir", str(d / "data"),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"tls=http://127.0.0.1:{peer}",
        "--cert-file", str(d / "a-server.pem"), "--key-file", str(d / "a-server.key"),
        "--trusted-ca-file", str(d / "a-ca.pem"), "--client-cert-auth",
        "--log-level", "error",
    ]  # fmt: skip
    with open(d / "etcd.log", "wb") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls_connection_and_refused_handshake(tmp_path: Path, prefix: bytes) -> None:
    _make_pki(tmp_path, "a")
    _make_pki(tmp_path, "b")  # an unrelated CA: the server's certificate fails against it
    with _tls_etcd(tmp_path) as endpoint:
        files = {
            "cert": str(tmp_path / "a-client.pem"),
            "cert_key": str(tmp_path / "a-client.key"),
        }
        # The budget also covers etcd's start-up: the first call waits for it.
        with _client([endpoint], protocol="https", ca_cert=str(tmp_path / "a-ca.pem"),
                     retry_budget=20.0, **files) as client:  # fmt: skip
            client.put(prefix + b"tls", b"ok")
            kv, _ = client.get(prefix + b"tls")
            assert kv == KeyValue(kv.key, b"ok", kv.create_revision, kv.mod_revision, 1, 0)
        wrong_ca = _client([endpoint], protocol="https", ca_cert=str(tmp_path / "b-ca.pem"),
                           request_timeout=1.0, retry_budget=1.0, **files)  # fmt: skip
        with wrong_ca, pytest.raises(EtcdTLSError) as info:
            wrong_ca.get(prefix + b"tls")
        assert str(info.value) == (
            f"the certificate of etcd at https://{endpoint} is not signed by the CA in "
            f"{tmp_path / 'b-ca.pem'}: set ca_cert (rdzvctl: --ca-cert) to the CA that signed "
            "etcd's --cert-file"
        )


def test_put_on_an_expired_lease_raises_lease_lost(etcd1: EtcdCluster) -> None:
    from coordinator.core.errors import LeaseLostError

    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as client:
        lease = client.lease_grant(5)
        client.lease_revoke(lease)
        with pytest.raises(LeaseLostError, match="it expired or was revoked"):
            client.put(b"/etcd-elastic-test/lease-gone", b"x", lease=lease)
        client.lease_revoke(lease)  # revoking a gone lease stays a no-op
