"""Pure parts of coordinator.core.etcd_client: parsing, ranges, backoff, error kinds, failover loop.

No server: the failover loop is driven with a fake clock, a recording sleep and attempt
functions that raise gRPC errors the way a channel does.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import grpc
import pytest

from coordinator.core import etcd_client as ec
from coordinator.core.errors import ConfigError, EtcdConnectionError, EtcdTLSError
from coordinator.core.etcd_client import (
    EtcdClient,
    EtcdConfig,
    backoff_delay,
    classify_status,
    parse_endpoint,
    prefix_range_end,
    run_with_failover,
)

Code = grpc.StatusCode


class FakeRpcError(grpc.RpcError):
    """What a failed gRPC call raises: an RpcError with code() and details()."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:2379", ("127.0.0.1", 2379)),
        ("etcd1:1", ("etcd1", 1)),
        ("[::1]:2379", ("::1", 2379)),
        ("host.example:65535", ("host.example", 65535)),
    ],
)
def test_parse_endpoint_accepts_host_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize(
    "text", ["2379", "host", ":2379", "host:", "host:0", "host:65536", "host:x", "http://h:1"]
)
def test_parse_endpoint_rejects_with_the_value_named(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_endpoint(text)
    assert str(info.value) == (
        f"etcd endpoint {text!r} is not host:port (e.g. 127.0.0.1:2379); "
        "give members as host:port without a scheme"
    )


@pytest.mark.parametrize(
    ("prefix", "end"),
    [
        (b"/run/", b"/run0"),
        (b"a", b"b"),
        (b"a\xff", b"b"),
        (b"a\xfe", b"a\xff"),
        (b"a\xff\xff", b"b"),
        (b"\xff", b"\0"),
        (b"\xff\xff", b"\0"),
        (b"", b"\0"),
    ],
)
def test_prefix_range_end(prefix: bytes, end: bytes) -> None:
    assert prefix_range_end(prefix) == end


def test_prefix_range_end_bounds_exactly_the_prefixed_keys() -> None:
    for prefix in (b"/r/", b"x\xff", b"\x00"):
        end = prefix_range_end(prefix)
        for key in (prefix, prefix + b"\x00", prefix + b"\xff\xff"):
            assert prefix <= key < end
        assert not (prefix + b"" < prefix or end <= prefix)


def test_backoff_grows_to_the_cap_and_jitters_in_the_upper_half() -> None:
    assert backoff_delay(0, 0.0) == pytest.approx(0.025)
    assert backoff_delay(0, 1.0) == pytest.approx(0.05)
    assert backoff_delay(3, 1.0) == pytest.approx(0.4)
    assert backoff_delay(50, 0.999) <= 1.0
    assert backoff_delay(50, 0.0) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("code", "details", "kind"),
    [
        (Code.UNAVAILABLE, "failed to connect to all addresses", ec.RETRY),
        (Code.UNAVAILABLE, "etcdserver: leader changed", ec.RETRY),
        (Code.DEADLINE_EXCEEDED, "Deadline Exceeded", ec.RETRY),
        (Code.UNKNOWN, "context deadline exceeded", ec.RETRY),
        (Code.UNAUTHENTICATED, "etcdserver: invalid auth token", ec.REAUTH),
        (Code.INVALID_ARGUMENT, "etcdserver: revision of auth store is old", ec.REAUTH),
        (
            Code.INVALID_ARGUMENT,
            "etcdserver: authentication failed, invalid user ID or password",
            ec.AUTH_FAILED,
        ),
        (Code.INVALID_ARGUMENT, "etcdserver: user name is empty", ec.AUTH_REQUIRED),
        (Code.PERMISSION_DENIED, "etcdserver: permission denied", ec.PERMISSION),
        (Code.FAILED_PRECONDITION, "etcdserver: authentication is not enabled", ec.AUTH_DISABLED),
        (Code.NOT_FOUND, "etcdserver: requested lease not found", ec.NOT_FOUND),
        (Code.INVALID_ARGUMENT, "etcdserver: request is too large", ec.FATAL),
        (Code.RESOURCE_EXHAUSTED, "etcdserver: too many requests", ec.RETRY),
        (Code.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded", ec.FATAL),
        (None, "etcdserver: permission denied", ec.PERMISSION),
    ],
)
def test_classify_status(code: grpc.StatusCode | None, details: str, kind: str) -> None:
    assert classify_status(code, details) == kind


def _ring(*names: str, start: int = 0) -> ec._Ring:
    return ec._Ring(names, start)


def test_failover_moves_to_the_next_endpoint_without_waiting() -> None:
    fake = FakeTime()
    calls: list[tuple[int, float]] = []

    def attempt(index: int, timeout: float) -> str:
        calls.append((index, timeout))
        if index == 0:
            raise FakeRpcError(Code.UNAVAILABLE, "connection refused")
        return "ok"

    ring = _ring("a:1", "b:2", "c:3")
    result = run_with_failover(
        attempt, ring, what="get", request_timeout=2.0, budget=10.0,
        clock=fake.clock, sleep=fake.sleep, rng=random.Random(1),
    )  # fmt: skip
    assert result == "ok"
    assert calls == [(0, 2.0), (1, 2.0)]
    assert fake.sleeps == []
    assert ring.current() == 1


def test_failover_backs_off_after_each_full_round_and_gives_up_naming_every_endpoint() -> None:
    fake = FakeTime()
    seen: list[int] = []

    def attempt(index: int, timeout: float) -> str:
        seen.append(index)
        fake.now += 0.1
        raise FakeRpcError(Code.UNAVAILABLE, f"down {index}")

    with pytest.raises(EtcdConnectionError) as info:
        run_with_failover(
            attempt, _ring("a:1", "b:2", start=1), what="get", request_timeout=1.0,
            budget=2.0, clock=fake.clock, sleep=fake.sleep, rng=random.Random(7),
        )  # fmt: skip
    assert type(info.value) is EtcdConnectionError
    assert re.fullmatch(
        r"no etcd member answered get within 2 s; tried b:2, a:1; last error from (a:1|b:2): "
        r"UNAVAILABLE: down [01]\. Check that etcd runs and is reachable at these endpoints",
        str(info.value),
    )
    assert isinstance(info.value.__cause__, grpc.RpcError)
    assert seen[:4] == [1, 0, 1, 0]
    # One backoff per full round, growing, and never past the budget.
    assert len(fake.sleeps) >= 2
    assert fake.sleeps[1] >= fake.sleeps[0]
    assert fake.now <= 2.0 + 0.1 * 2 + 1e-9


def test_failover_tries_every_endpoint_once_even_past_the_budget() -> None:
    fake = FakeTime()
    seen: list[int] = []

    def attempt(index: int, timeout: float) -> str:
        seen.append(index)
        fake.now += 5.0  # each attempt times out after request_timeout
        raise FakeRpcError(Code.DEADLINE_EXCEEDED, "Deadline Exceeded")

    with pytest.raises(EtcdConnectionError, match="tried a:1, b:2, c:3;"):
        run_with_failover(
            attempt, _ring("a:1", "b:2", "c:3"), what="put", request_timeout=5.0,
            budget=1.0, clock=fake.clock, sleep=fake.sleep, rng=random.Random(0),
        )  # fmt: skip
    assert seen == [0, 1, 2]


def test_failover_reports_a_refused_tls_handshake_as_a_tls_error() -> None:
    fake = FakeTime()

    def attempt(index: int, timeout: float) -> str:
        fake.now += 1.0
        raise FakeRpcError(Code.UNAVAILABLE, "Ssl handshake failed: CERTIFICATE_VERIFY_FAILED")

    with pytest.raises(EtcdTLSError, match="CERTIFICATE_VERIFY_FAILED"):
        run_with_failover(
            attempt, _ring("a:1"), what="get", request_timeout=1.0, budget=0.5,
            clock=fake.clock, sleep=fake.sleep, rng=random.Random(0),
        )  # fmt: skip


def test_failover_passes_other_errors_through_untouched() -> None:
    fake = FakeTime()
    error = FakeRpcError(Code.PERMISSION_DENIED, "etcdserver: permission denied")

    def attempt(index: int, timeout: float) -> str:
        raise error

    with pytest.raises(FakeRpcError) as info:
        run_with_failover(
            attempt, _ring("a:1", "b:2"), what="get", request_timeout=1.0, budget=5.0,
            clock=fake.clock, sleep=fake.sleep, rng=random.Random(0),
        )  # fmt: skip
    assert info.value is error


def test_ring_failover_by_two_threads_moves_once() -> None:
    ring = _ring("a:1", "b:2", "c:3")
    ring.failed(0)
    ring.failed(0)  # a second caller that also saw endpoint 0 fail
    assert ring.current() == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"endpoints": ()}, "etcd endpoints: none given; pass at least one host:port"),
        (
            {"endpoints": ("h:1",), "cert": "c.pem"},
            "etcd TLS: cert='c.pem' and cert_key=None: give both the client certificate "
            "and its key, or neither",
        ),
        (
            {"endpoints": ("h:1",), "ca_cert": "ca.pem"},
            "etcd TLS files were given but protocol is 'http'; set protocol=https",
        ),
        (
            {"endpoints": ("h:1",), "user": "root"},
            "etcd auth: give both user and password, or neither",
        ),
        (
            {"endpoints": ("h:1",), "retry_budget": 0},
            "etcd timeouts must be positive: request_timeout=5.0, retry_budget=0",
        ),
        (
            {"endpoints": ("h:1",), "protocol": "grpc"},
            "etcd protocol: 'grpc' is not 'http' or 'https'",
        ),
    ],
)
def test_config_rejects_bad_settings(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        EtcdConfig(**kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_missing_tls_file_names_the_file_at_construction(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "client.pem"
    config = EtcdConfig(
        endpoints=("127.0.0.1:1",), protocol="https", cert=str(missing), cert_key=str(missing)
    )
    with pytest.raises(EtcdTLSError) as info:
        EtcdClient(config)
    assert str(info.value) == (
        f"cannot read the TLS client key file {str(missing)!r}: No such file or directory; "
        "check the path and its permissions"
    )


def test_bad_transaction_shapes_fail_before_any_network() -> None:
    with EtcdClient(EtcdConfig(endpoints=("127.0.0.1:1",))) as client:
        with pytest.raises(ValueError, match=r"^key /r/a is written twice in one transaction$"):
            client.put_if_mod_revision(b"/r/a", b"1", 0, also_put=[(b"/r/a", b"2", 0)])
        with pytest.raises(
            ValueError, match=r"^key /r/n/1 is put and deleted \(prefix /r/n/\) in one transaction$"
        ):
            client.put_if_mod_revision(
                b"/r/s", b"1", 3, also_put=[(b"/r/n/1", b"", 0)], also_delete_prefixes=[b"/r/n/"]
            )
        with pytest.raises(ValueError, match="whole keyspace"):
            client.delete_prefix(b"")


def test_closed_client_refuses_calls() -> None:
    client = EtcdClient(EtcdConfig(endpoints=("127.0.0.1:1",)))
    client.close()
    client.close()
    with pytest.raises(EtcdConnectionError, match="the etcd client is closed; create a new one"):
        client.get(b"/k")
