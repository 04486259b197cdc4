"""One line per TLS mismatch, from the gRPC details a real etcd 3.5 produced (observed
against servers started by tests/integration/test_tls_auth.py, grpc 1.6x): the pure
mapping, and that run_with_failover stops at once on a mismatch certain to repeat."""

from __future__ import annotations

import random
from collections.abc import Callable

import grpc
import pytest

from coordinator.core.errors import EtcdConnectionError, EtcdTLSError
from coordinator.core.etcd_client import _Ring, run_with_failover
from coordinator.core.etcd_client._failover import TlsSide, endpoint_mismatch, tls_mismatch

EP = "127.0.0.1:2379"
_PREFIX = "failed to connect to all addresses; last error: "
# The details grpc reported, verbatim but for the port.
SOCKET_CLOSED = _PREFIX + "UNAVAILABLE: ipv4:127.0.0.1:2379: Socket closed"
HANDSHAKE_READ = _PREFIX + "UNAVAILABLE: ipv4:127.0.0.1:2379: Handshake read failed (Socket closed)"
_VERIFY = (
    _PREFIX + "UNKNOWN: ipv4:127.0.0.1:2379: Tls handshake failed (TSI_PROTOCOL_FAILURE): "
    "SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: "
)
UNKNOWN_CA = _VERIFY + "unable to get local issuer certificate: OK"
SERVER_EXPIRED = _VERIFY + "certificate has expired: OK"
HOSTNAME = (
    _PREFIX + "UNKNOWN: ipv4:127.0.0.1:2379: Custom verification check failed with error: "
    "UNAUTHENTICATED: Hostname Verification Check failed."
)
CLIENT_REFUSED = _PREFIX + "UNAVAILABLE: ipv4:127.0.0.1:2379: Unwrap failed (TSI_DATA_CORRUPTED)"

HTTPS = TlsSide("https", "/pki/ca.pem", "/pki/client.pem")


@pytest.mark.parametrize(
    ("details", "side", "expected", "certain"),
    [
        (
            SOCKET_CLOSED,
            TlsSide("http"),
            "etcd at http://127.0.0.1:2379 closed the connection before answering plain "
            "http: it most likely serves TLS; use https:// endpoints (etcdrun: "
            "protocol=https,ca_cert=FILE; rdzvctl: --ca-cert)",
            False,
        ),
        (
            HANDSHAKE_READ,
            HTTPS,
            "etcd at https://127.0.0.1:2379 did not answer the TLS handshake: it most likely "
            "serves plain http; use http:// endpoints without TLS files, or start etcd with "
            "--cert-file and --key-file",
            True,
        ),
        (
            UNKNOWN_CA,
            HTTPS,
            "the certificate of etcd at https://127.0.0.1:2379 is not signed by the CA in "
            "/pki/ca.pem: set ca_cert (rdzvctl: --ca-cert) to the CA that signed etcd's "
            "--cert-file",
            True,
        ),
        (
            UNKNOWN_CA,
            TlsSide("https"),
            "the certificate of etcd at https://127.0.0.1:2379 is not signed by the system's "
            "CAs: set ca_cert (rdzvctl: --ca-cert) to the CA that signed etcd's --cert-file",
            True,
        ),
        (
            HOSTNAME,
            HTTPS,
            "the certificate of etcd at https://127.0.0.1:2379 does not name the host "
            "connected to: connect by a name or IP in its subjectAltName, or reissue it with "
            "that host in it",
            True,
        ),
        (
            SERVER_EXPIRED,
            HTTPS,
            "the certificate of etcd at https://127.0.0.1:2379 has expired: renew etcd's "
            "--cert-file (then restart that member)",
            True,
        ),
        (
            CLIENT_REFUSED,
            TlsSide("https", "/pki/ca.pem"),
            "etcd at https://127.0.0.1:2379 requires a client certificate (--client-cert-auth) "
            "and none was given: set ssl_cert and ssl_cert_key (rdzvctl: --cert and --key)",
            True,
        ),
        (
            CLIENT_REFUSED,
            HTTPS,
            "etcd at https://127.0.0.1:2379 refused the client certificate /pki/client.pem: "
            "it has expired or is not signed by etcd's --trusted-ca-file: renew it, signed "
            "by that CA",
            True,
        ),
    ],
)
def test_each_mismatch_is_one_line_naming_the_endpoint_and_the_fix(
    details: str, side: TlsSide, expected: str, certain: bool
) -> None:
    assert tls_mismatch(details, [EP], side) == (expected, certain)


def test_an_expired_client_certificate_is_named_as_such() -> None:
    message, _ = tls_mismatch(CLIENT_REFUSED, [EP], HTTPS, expired_client_cert=True) or ("", 0)
    assert message == (
        "etcd at https://127.0.0.1:2379 refused the client certificate /pki/client.pem: "
        "it has expired: renew it"
    )


@pytest.mark.parametrize(
    ("details", "side"),
    [
        ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:2379: "
         "Failed to connect to remote host: Connection refused", HTTPS),
        ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:2379: "
         "Failed to connect to remote host: Connection refused", TlsSide("http")),
        (UNKNOWN_CA, TlsSide("http")),  # not a TLS client: not its mismatch
        ("Deadline Exceeded", HTTPS),
    ],
)  # fmt: skip
def test_other_failures_are_not_called_tls_mismatches(details: str, side: TlsSide) -> None:
    assert tls_mismatch(details, [EP], side) is None


def test_two_endpoints_are_both_named() -> None:
    message, _ = tls_mismatch(UNKNOWN_CA, ["h1:2379", "h2:2379"], HTTPS) or ("", 0)
    assert message.startswith("the certificate of etcd at https://h1:2379, https://h2:2379 ")


class _Failed(grpc.RpcError):
    def __init__(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


def _run(
    details_by_index: dict[int, str],
    side: TlsSide,
    budget: float,
    serves_tls: Callable[[str, float], bool] = lambda endpoint, timeout: False,
) -> tuple[Exception, int]:
    calls = []
    now = [0.0]

    def attempt(index: int, timeout: float) -> None:
        calls.append(index)
        now[0] += 0.1
        raise _Failed(details_by_index[index])

    with pytest.raises(EtcdConnectionError) as info:
        run_with_failover(
            attempt, _Ring(["h1:1", "h2:2"], 0), what="get", request_timeout=1.0,
            budget=budget, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s),
            rng=random.Random(0), side=side, probe=serves_tls,
        )  # fmt: skip
    return info.value, len(calls)


def test_a_certain_mismatch_on_every_member_ends_the_call_at_once() -> None:
    error, calls = _run({0: UNKNOWN_CA, 1: UNKNOWN_CA}, HTTPS, budget=60.0)
    assert calls == 2 and type(error) is EtcdTLSError
    assert str(error).startswith("the certificate of etcd at https://h1:1, https://h2:2 is not")


def test_a_member_that_fails_otherwise_keeps_the_call_retrying_for_its_budget() -> None:
    refused = "failed to connect to all addresses; last error: Connection refused"
    error, calls = _run({0: UNKNOWN_CA, 1: refused}, HTTPS, budget=5.0)
    # The last failure was h1's: only h1 is named (h2 refused the connection).
    assert calls > 10 and type(error) is EtcdTLSError
    assert str(error).startswith("the certificate of etcd at https://h1:1 is not signed")


def test_plain_http_cut_off_by_members_that_do_not_answer_tls_retries_then_says_so() -> None:
    # Members going away cut plain http off too: without a TLS handshake answered, the
    # call keeps trying for its budget.
    error, calls = _run({0: SOCKET_CLOSED, 1: SOCKET_CLOSED}, TlsSide("http"), budget=5.0)
    assert calls > 10 and type(error) is EtcdTLSError
    assert str(error).startswith("etcd at http://h1:1, http://h2:2 closed the connection")


def test_plain_http_cut_off_by_members_that_answer_tls_ends_the_call_at_once() -> None:
    probed: list[str] = []

    def serves_tls(endpoint: str, timeout: float) -> bool:
        probed.append(endpoint)
        return True

    side = TlsSide("http")
    error, calls = _run({0: SOCKET_CLOSED, 1: SOCKET_CLOSED}, side, 60.0, serves_tls)
    assert (calls, probed, type(error)) == (2, ["h1:1", "h2:2"], EtcdTLSError)
    assert str(error) == (
        "etcd at http://h1:1, http://h2:2 closed the connection before answering plain "
        "http: it most likely serves TLS; use https:// endpoints (etcdrun: protocol=https,"
        "ca_cert=FILE; rdzvctl: --ca-cert)"
    )


def test_a_member_is_asked_for_tls_only_when_plain_http_was_cut_off() -> None:
    asked: list[str] = []

    def serves_tls(endpoint: str, timeout: float) -> bool:
        asked.append(endpoint)
        return True

    refused = "failed to connect to all addresses; last error: Connection refused"
    assert endpoint_mismatch(refused, "h1:1", TlsSide("http"), 1.0, serves_tls) is None
    assert endpoint_mismatch(UNKNOWN_CA, "h1:1", HTTPS, 1.0, serves_tls) is not None
    assert asked == []
