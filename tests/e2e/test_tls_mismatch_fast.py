"""Plain http against a TLS etcd is one line, at once, whatever else is configured
(issue 21 item 11).

A plain-http client sees a TLS server close the connection, which a member going away
looks like too, so that failure alone is not certain. With a user configured, the first
call is Authenticate, which retried it for the whole read_timeout; etcdrun then said
"etcd did not confirm the watch on key … within 10 s" after 15 s, and rdzvctl took 10.5 s.
Without a user the line was right, but also came only after read_timeout. The members
that closed the connection are now asked for a TLS handshake: one that answers it serves
TLS, certainly, and the call ends at once with the line that names the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from coordinator.core.errors import EtcdTLSError
from coordinator.core.etcd_client._tls_probe import serves_tls
from coordinator.core.ports import free_ports
from coordinator.etcd_server import EtcdCluster, ServerTLS
from coordinator.rdzvctl.main import main as rdzvctl_main
from coordinator.torch_adapter.handler import create_handler
from tests.conftest import _test_binary
from tests.e2e.agents import ROOT
from tests.tls_pki import Pki

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

READ_TIMEOUT = 10  # the calls' retry budget: a right line after it is not fast
FAST_S = 5.0


@pytest.fixture(scope="module")
def tls_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A member that serves TLS only (host:port)."""
    pki = Pki(tmp_path_factory.mktemp("tls-only"), "a")
    server = pki.issue("server", "etcd", server=True)
    tls = ServerTLS(server.cert, server.key)
    with EtcdCluster(1, binary=_test_binary(), no_fsync=True, stop_grace=1.0, tls=tls) as etcd:
        yield etcd.endpoints[0]


def _line(endpoint: str) -> str:
    return (
        f"etcd at http://{endpoint} closed the connection before answering plain http: it "
        "most likely serves TLS; use https:// endpoints (etcdrun: protocol=https,"
        "ca_cert=FILE; rdzvctl: --ca-cert)"
    )


AUTH = {"as a user": ("trainer", "never-sent"), "anonymous": None}


@pytest.mark.parametrize("auth", sorted(AUTH))
def test_a_handler_names_plain_http_against_tls_at_once(
    tls_endpoint: str, run_id: str, auth: str
) -> None:
    credentials = AUTH[auth]
    conf: dict[str, object] = {"read_timeout": READ_TIMEOUT}
    if credentials is not None:
        conf.update(user=credentials[0], password=credentials[1])
    began = time.monotonic()
    handler = create_handler(
        RendezvousParameters("etcd-v3", f"http://{tls_endpoint}", run_id, 1, 1, **conf)  # type: ignore[arg-type]
    )
    try:
        with pytest.raises(RendezvousConnectionError) as info:
            handler.next_rendezvous()
        took = time.monotonic() - began
    finally:
        handler.leave()
    assert isinstance(info.value, EtcdTLSError), str(info.value)
    assert str(info.value) == _line(tls_endpoint)
    assert took < FAST_S, f"{took:.1f} s"


@pytest.mark.parametrize("auth", sorted(AUTH))
def test_rdzvctl_names_plain_http_against_tls_at_once(
    tls_endpoint: str,
    run_id: str,
    auth: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    credentials = AUTH[auth]
    args = ["--endpoints", f"http://{tls_endpoint}", "--read-timeout", str(READ_TIMEOUT)]
    if credentials is not None:
        args += ["--user", credentials[0]]
        monkeypatch.setenv("RDZVCTL_PASSWORD", credentials[1])
    monkeypatch.setenv("GRPC_VERBOSITY", "NONE")  # what rdzvctl's main sets for itself
    # rdzvctl's main in this process: its own time, without an interpreter's start-up.
    began = time.monotonic()
    code = rdzvctl_main([*args, "status", run_id])
    took = time.monotonic() - began
    assert (code, capsys.readouterr().err) == (3, f"rdzvctl: error: {_line(tls_endpoint)}\n")
    assert took < FAST_S, f"{took:.1f} s"
    # The program itself, as an operator runs it: the same line, and no wait either.
    began = time.monotonic()
    program = subprocess.run(
        [sys.executable, "-m", "coordinator.rdzvctl", *args, "status", run_id],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "RDZVCTL_PASSWORD": credentials[1] if credentials else ""},
    )  # fmt: skip
    took = time.monotonic() - began
    assert (program.returncode, program.stderr) == (3, f"rdzvctl: error: {_line(tls_endpoint)}\n")
    assert took < READ_TIMEOUT, f"{took:.1f} s"


def test_only_a_member_that_serves_tls_is_taken_for_one(
    tls_endpoint: str, etcd1: EtcdCluster
) -> None:
    nobody = f"127.0.0.1:{free_ports(1)[0]}"
    assert serves_tls(tls_endpoint, 2.0)
    assert not serves_tls(etcd1.endpoints[0], 2.0)  # plain http answers in plain text
    assert not serves_tls(nobody, 2.0)  # a member gone: nothing answers
