"""The etcd client's reports on a real etcd, as the agent's metrics count them: calls by
method, failed attempts of a failover, keep-alive round trips, watch answers."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.observe.metrics import PrometheusMetrics
from coordinator.core.etcd_client import EtcdClient, EtcdConfig, WatchEvent
from coordinator.etcd_server import EtcdCluster, free_port
from tests.chaos.proxy import Mode, TcpFaultProxy

pytestmark = pytest.mark.integration


class Tee:
    """Forwards every report to the agent's metrics and signals the ones a test waits for."""

    def __init__(self, metrics: PrometheusMetrics) -> None:
        self._to = metrics.etcd_observer
        self.keepalive = threading.Event()
        self.no_answer = threading.Event()

    def call_done(self, method: str, seconds: float, failed: bool) -> None:
        self._to.call_done(method, seconds, failed)

    def attempt_failed(self, method: str, code: str) -> None:
        self._to.attempt_failed(method, code)
        if (method, code) == ("lease_keepalive", "NO_ANSWER"):
            self.no_answer.set()

    def keepalive_answered(self, seconds: float) -> None:
        self._to.keepalive_answered(seconds)
        self.keepalive.set()

    def answered(self, at: float) -> None:
        self._to.answered(at)


class FirstEndpoint(random.Random):
    """Makes the client start at its first endpoint (the ring's start is random)."""

    def randrange(self, *args: object, **kwargs: object) -> int:  # type: ignore[override]
        return 0


def scraped(metrics: PrometheusMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    found = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "run_id")
            found[(s.name, labels)] = s.value
    return found


@pytest.fixture
def metrics() -> PrometheusMetrics:
    return PrometheusMetrics("metrics-it")


@pytest.fixture
def observed_client(
    etcd1: EtcdCluster, metrics: PrometheusMetrics
) -> Iterator[tuple[EtcdClient, Tee]]:
    tee = Tee(metrics)
    with EtcdClient(EtcdConfig(tuple(etcd1.endpoints)), observer=tee) as client:
        yield client, tee


def test_calls_keepalives_and_watch_answers_are_counted(
    threads_reaped: None,
    observed_client: tuple[EtcdClient, Tee],
    metrics: PrometheusMetrics,
    prefix: bytes,
) -> None:
    client, tee = observed_client
    key = prefix + b"k"
    revision = client.put(key, b"1")
    client.get(key)
    client.get_prefix(prefix)
    lost = client.put_if_mod_revision(key, b"2", mod_revision=revision - 1)
    assert not lost.succeeded  # a lost race is an answer, not a failure
    events = threading.Event()

    def on_events(batch: list[WatchEvent], header: int) -> None:
        events.set()

    watch = client.watch(key, revision + 1, on_events, lambda rev: None)
    client.put(key, b"3")
    assert events.wait(30), "no watch event"
    watch.cancel()
    lease = client.lease_grant(3)
    keepalive = client.keep_alive(lease, 3)
    assert tee.keepalive.wait(30), "no keep-alive answered"
    keepalive.close()

    found = scraped(metrics)

    def count(method: str) -> float:
        return found[("etcd_elastic_etcd_request_seconds_count", frozenset({("method", method)}))]

    assert count("put") == 2
    assert count("get") == 1
    assert count("get_prefix") == 1
    assert count("put_if_mod_revision") == 1
    assert count("lease_grant") == 1
    assert count("lease_revoke") == 1  # close() revokes
    assert all(
        v == 0 for (name, _), v in found.items() if name.endswith("request_failures_total")
    ), found
    assert not any(name == "etcd_elastic_etcd_errors_total" for name, _ in found), found
    assert found[("etcd_elastic_keepalive_seconds_count", frozenset())] >= 1
    assert 0 < found[("etcd_elastic_keepalive_seconds_sum", frozenset())] < 30
    assert 0 <= found[("etcd_elastic_etcd_last_answer_age_seconds", frozenset())] < 30


def test_a_failover_counts_the_failed_attempt_not_a_failed_call(
    etcd1: EtcdCluster, metrics: PrometheusMetrics, prefix: bytes, threads_reaped: None
) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: connection refused
    config = EtcdConfig((dead, *etcd1.endpoints), request_timeout=2.0)
    with EtcdClient(config, observer=Tee(metrics), rng=FirstEndpoint()) as client:
        client.put(prefix + b"k", b"v")
    found = scraped(metrics)
    put = frozenset({("method", "put")})
    assert found[("etcd_elastic_etcd_request_seconds_count", put)] == 1
    assert found[("etcd_elastic_etcd_request_failures_total", put)] == 0
    errors = {
        dict(labels)["code"]: v
        for (name, labels), v in found.items()
        if name == "etcd_elastic_etcd_errors_total" and dict(labels)["method"] == "put"
    }
    assert errors == {"UNAVAILABLE": 1}, found


def test_a_call_no_member_answers_is_a_failed_call_and_the_age_grows(
    metrics: PrometheusMetrics, threads_reaped: None
) -> None:
    dead = f"127.0.0.1:{free_port()}"
    config = EtcdConfig((dead,), request_timeout=0.5, retry_budget=1.0)
    with EtcdClient(config, observer=Tee(metrics)) as client, pytest.raises(Exception) as info:
        client.get(b"/x")
    assert "no etcd member answered get" in str(info.value)
    found = scraped(metrics)
    get = frozenset({("method", "get")})
    assert found[("etcd_elastic_etcd_request_failures_total", get)] == 1
    assert (
        found[("etcd_elastic_etcd_errors_total", frozenset({*get, ("code", "UNAVAILABLE")}))] >= 1
    )
    # Nothing ever answered: the age counts from the start, past the budget by now.
    assert found[("etcd_elastic_etcd_last_answer_age_seconds", frozenset())] >= 1.0


def test_a_hung_member_shows_as_keepalives_without_answer_and_a_growing_age(
    etcd1: EtcdCluster, metrics: PrometheusMetrics, threads_reaped: None
) -> None:
    host, port = etcd1.endpoints[0].rsplit(":", 1)
    tee = Tee(metrics)
    age = ("etcd_elastic_etcd_last_answer_age_seconds", frozenset())
    with (
        TcpFaultProxy((host, int(port)), name="hung-member") as proxy,
        EtcdClient(EtcdConfig((proxy.endpoint,)), observer=tee) as client,
    ):
        lease = client.lease_grant(3)
        keepalive = client.keep_alive(lease, 3)
        assert tee.keepalive.wait(30), "no keep-alive answered"
        proxy.set_mode(Mode.BLACKHOLE)  # connections stay open; nothing gets through
        # One interval (1 s) without an answer: the client gives up on that stream.
        assert tee.no_answer.wait(30), "the hung stream was never given up"
        silent = scraped(metrics)
        proxy.set_mode(Mode.PASS)
        tee.keepalive.clear()
        assert tee.keepalive.wait(60), "no keep-alive answered after the member came back"
        back = scraped(metrics)
        keepalive.close()
    assert silent[age] >= 0.9, silent[age]
    assert back[age] < silent[age]
    key = ("etcd_elastic_etcd_errors_total",
           frozenset({("method", "lease_keepalive"), ("code", "NO_ANSWER")}))  # fmt: skip
    assert silent[key] >= 1
