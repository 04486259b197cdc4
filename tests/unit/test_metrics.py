"""The agent's Prometheus metrics: the name set (and docs/metrics.md), what each report
does to the exposition, the etcd client's observer plumbing, the endpoint and its flags.

No etcd here: the client's calls are driven with attempt functions that raise gRPC errors
the way a channel does, on a fake clock. tests/e2e/test_metrics_e2e.py scrapes real agents.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

import agent.cli.etcdrun as cli
from agent.cli.etcdrun import main, parse_args
from agent.config import LaunchConfig
from agent.loop.policy import Step, restart_cause
from agent.observe.metrics import (
    METRIC_NAMES,
    RESTART_CAUSES,
    PrometheusMetrics,
    RunMetrics,
    running_workers,
)
from agent.observe.metrics_server import (
    MetricsServer,
    MetricsServerError,
    listen_error,
    metrics_url,
)
from agent.workers.state import WorkerState
from coordinator.core.errors import EtcdAuthError
from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.etcd_client._observer import Observed

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "metrics.md"

Code = grpc.StatusCode


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def samples(metrics: PrometheusMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels without run_id) -> value, parsed from the exposition."""
    found: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "run_id"}
            found[(sample.name, frozenset(labels.items()))] = sample.value
    return found


def value(metrics: PrometheusMetrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, frozenset(labels.items()))]


def exposed_names(text: str) -> set[str]:
    """Family names as written in the exposition (counters with _total)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


# -- the name set ------------------------------------------------------------------------


def test_the_exposition_has_exactly_the_documented_families_each_labelled_with_the_run() -> None:
    metrics = PrometheusMetrics("job-7")
    metrics.identify("host-1-2-ab", "host")
    text = metrics.exposition().decode()
    assert exposed_names(text) == set(METRIC_NAMES)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels["run_id"] == "job-7", sample
    assert value(metrics, "etcd_elastic_agent_info", node_id="host-1-2-ab", hostname="host") == 1
    assert "_created" not in text


def test_docs_name_every_metric_and_no_other() -> None:
    text = DOCS.read_text()
    documented = set(re.findall(r"^\| `(etcd_elastic_[a-z_]+)`", text, flags=re.MULTILINE))
    assert documented == set(METRIC_NAMES)
    # Every name the page mentions anywhere (PromQL examples too) is a real one.
    suffixes = ("_bucket", "_count", "_sum")
    for name in set(re.findall(r"etcd_elastic_[a-z_]+", text)):
        base = next((name[: -len(s)] for s in suffixes if name.endswith(s)), name)
        assert name in METRIC_NAMES or base in METRIC_NAMES, name
    for cause in RESTART_CAUSES:
        assert f"`{cause}`" in text


def test_two_agents_in_one_process_keep_their_own_registries() -> None:
    a, b = PrometheusMetrics("run-a"), PrometheusMetrics("run-b")
    a.restarted("worker_failure")
    assert value(a, "etcd_elastic_restarts_total", cause="worker_failure") == 1
    assert value(b, "etcd_elastic_restarts_total", cause="worker_failure") == 0
    assert "run-a" not in b.exposition().decode()


# -- what the agent reports --------------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "state", "cause"),
    [
        (Step.RESTART_COUNTED, WorkerState.FAILED, "worker_failure"),
        (Step.RESTART_COUNTED, WorkerState.UNHEALTHY, "unhealthy"),
        (Step.RESTART_UNCOUNTED, WorkerState.HEALTHY, "membership_change"),
    ],
)
def test_restart_cause(step: Step, state: WorkerState, cause: str) -> None:
    assert restart_cause(step, state) == cause
    assert cause in RESTART_CAUSES


@pytest.mark.parametrize("step", [Step.CONTINUE, Step.SUCCEED, Step.FAIL])
def test_restart_cause_refuses_steps_that_are_no_restart(step: Step) -> None:
    with pytest.raises(ValueError, match=f"restart_cause: {step.value} is not a restart"):
        restart_cause(step, WorkerState.HEALTHY)


def test_rounds_restarts_workers_and_progress() -> None:
    metrics = PrometheusMetrics("job")
    assert value(metrics, "etcd_elastic_last_progress_step") == -1
    assert value(metrics, "etcd_elastic_workers_running") == 0
    metrics.round_formed(1, 2, 0.3)
    metrics.round_formed(2, 3, 12.0)
    metrics.restarted("worker_failure")
    metrics.restarted("membership_change")
    metrics.restarted("membership_change")
    metrics.restarts_left(2)
    metrics.progress_step(1234)
    running = [3]
    metrics.watch_workers(lambda: running[0])
    assert value(metrics, "etcd_elastic_rounds_total") == 2
    assert value(metrics, "etcd_elastic_round") == 2
    assert value(metrics, "etcd_elastic_group_nodes") == 3
    assert value(metrics, "etcd_elastic_formation_seconds_count") == 2
    assert value(metrics, "etcd_elastic_formation_seconds_sum") == pytest.approx(12.3)
    assert value(metrics, "etcd_elastic_formation_seconds_bucket", le="0.5") == 1
    assert value(metrics, "etcd_elastic_restarts_total", cause="worker_failure") == 1
    assert value(metrics, "etcd_elastic_restarts_total", cause="membership_change") == 2
    assert value(metrics, "etcd_elastic_restarts_total", cause="unhealthy") == 0
    assert value(metrics, "etcd_elastic_restarts_left") == 2
    assert value(metrics, "etcd_elastic_last_progress_step") == 1234
    assert value(metrics, "etcd_elastic_workers_running") == 3
    running[0] = 1  # read at scrape time
    assert value(metrics, "etcd_elastic_workers_running") == 1


def test_a_failing_worker_count_reads_as_nan_and_the_scrape_still_works() -> None:
    metrics = PrometheusMetrics("job")

    def broken() -> int:
        raise RuntimeError("boom")

    metrics.watch_workers(broken)
    assert value(metrics, "etcd_elastic_workers_running") != value(
        metrics, "etcd_elastic_workers_running"
    )  # NaN


class _FakeGroup:
    def __init__(self, pids: dict[int, int], exited: set[int]) -> None:
        self.pids = pids
        self._exited = exited

    def exits(self) -> dict[int, object]:
        return {rank: object() for rank in self._exited}


def test_running_workers_counts_started_and_not_exited() -> None:
    assert running_workers(None) == 0
    assert running_workers(_FakeGroup({0: 10, 1: 11, 2: 12}, {1})) == 2  # type: ignore[arg-type]
    assert running_workers(_FakeGroup({0: 10}, {0})) == 0  # type: ignore[arg-type]


def test_the_base_class_records_nothing_and_has_no_observer() -> None:
    off = RunMetrics()
    assert off.etcd_observer is None
    off.round_formed(1, 1, 0.1)
    off.restarted("worker_failure")
    off.progress_step(3)
    off.watch_workers(lambda: 1)


# -- the etcd client's reports -------------------------------------------------------------


class Recorder:
    """An EtcdObserver that writes down every report."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def call_done(self, method: str, seconds: float, failed: bool) -> None:
        self.events.append(("call", method, seconds, failed))

    def attempt_failed(self, method: str, code: str) -> None:
        self.events.append(("attempt_failed", method, code))

    def keepalive_answered(self, seconds: float) -> None:
        self.events.append(("keepalive", seconds))

    def answered(self, at: float) -> None:
        self.events.append(("answered", at))


def _client(observer: Any, clock: FakeClock) -> EtcdClient:
    config = EtcdConfig(endpoints=("127.0.0.1:1", "127.0.0.1:2"), retry_budget=5.0)
    return EtcdClient(config, clock=clock, sleep=clock.sleep, observer=observer)


def test_a_call_that_fails_over_reports_the_failed_attempt_the_answer_and_the_time() -> None:
    clock, recorder = FakeClock(), Recorder()
    tries: list[int] = []

    def call(stubs: object, timeout: float, metadata: object) -> str:
        tries.append(1)
        clock.now += 0.25
        if len(tries) == 1:
            raise FakeRpcError(Code.UNAVAILABLE, "connection refused")
        return "result"

    with _client(recorder, clock) as client:
        assert client._unary("get", call) == "result"
    assert recorder.events == [
        ("attempt_failed", "get", "UNAVAILABLE"),  # a connection failure: no answer
        ("answered", 100.5),
        ("call", "get", 0.5, False),
    ]


def test_a_call_refused_by_etcd_is_an_answer_and_a_failed_call() -> None:
    clock, recorder = FakeClock(), Recorder()

    def call(stubs: object, timeout: float, metadata: object) -> str:
        clock.now += 0.1
        raise FakeRpcError(Code.PERMISSION_DENIED, "etcdserver: permission denied")

    with _client(recorder, clock) as client, pytest.raises(EtcdAuthError):
        client._unary("put", call, key=b"/k")
    assert recorder.events == [
        ("attempt_failed", "put", "PERMISSION_DENIED"),
        ("answered", pytest.approx(100.1)),
        ("call", "put", pytest.approx(0.1), True),
    ]


def test_method_names_the_call_when_what_carries_values() -> None:
    clock, recorder = FakeClock(), Recorder()
    with _client(recorder, clock) as client:
        client._unary("lease_revoke of lease 7f", lambda s, t, m: None, method="lease_revoke")
    assert recorder.events[-1][:2] == ("call", "lease_revoke")


def test_an_observer_that_raises_is_logged_once_and_costs_no_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken(Recorder):
        def call_done(self, method: str, seconds: float, failed: bool) -> None:
            raise RuntimeError("observer bug")

        def answered(self, at: float) -> None:
            raise RuntimeError("observer bug")

    clock = FakeClock()
    with caplog.at_level(logging.ERROR), _client(Broken(), clock) as client:
        assert client._unary("get", lambda s, t, m: 1) == 1
        assert client._unary("get", lambda s, t, m: 2) == 2
    failures = [r for r in caplog.records if "observer" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in caplog.records]


def test_no_observer_reports_nothing_and_costs_nothing() -> None:
    observed = Observed(None)
    assert not observed.enabled
    observed.call_done("get", 1.0, False)
    observed.answered(1.0)


def test_prometheus_side_of_the_observer() -> None:
    clock = FakeClock()
    metrics = PrometheusMetrics("job", clock=clock)
    etcd = metrics.etcd_observer
    clock.now += 4.0
    # Before any answer the age counts from the start.
    assert value(metrics, "etcd_elastic_etcd_last_answer_age_seconds") == pytest.approx(4.0)
    etcd.call_done("get", 0.002, False)
    etcd.call_done("get", 0.004, False)
    etcd.call_done("put_if_mod_revision", 2.0, True)
    etcd.attempt_failed("put_if_mod_revision", "UNAVAILABLE")
    etcd.attempt_failed("put_if_mod_revision", "UNAVAILABLE")
    etcd.attempt_failed("lease_keepalive", "NO_ANSWER")
    etcd.keepalive_answered(0.003)
    etcd.answered(clock.now - 1.5)
    etcd.answered(clock.now - 3.0)  # an older answer reported late changes nothing
    seconds = "etcd_elastic_etcd_request_seconds"
    assert value(metrics, f"{seconds}_count", method="get") == 2
    assert value(metrics, f"{seconds}_sum", method="get") == pytest.approx(0.006)
    assert value(metrics, f"{seconds}_count", method="put_if_mod_revision") == 1
    failures = "etcd_elastic_etcd_request_failures_total"
    assert value(metrics, failures, method="put_if_mod_revision") == 1
    assert value(metrics, failures, method="get") == 0
    errors = "etcd_elastic_etcd_errors_total"
    assert value(metrics, errors, method="put_if_mod_revision", code="UNAVAILABLE") == 2
    assert value(metrics, errors, method="lease_keepalive", code="NO_ANSWER") == 1
    assert value(metrics, "etcd_elastic_keepalive_seconds_count") == 1
    assert value(metrics, "etcd_elastic_etcd_last_answer_age_seconds") == pytest.approx(1.5)


# -- the endpoint ---------------------------------------------------------------------------


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        body: bytes = response.read()
        assert response.headers["Content-Type"].startswith("text/plain")
    return body.decode()


def test_the_endpoint_serves_the_registry_on_an_ephemeral_port_and_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = PrometheusMetrics("job-e")
    metrics.round_formed(1, 1, 0.5)
    with caplog.at_level(logging.INFO, logger="agent.observe.metrics_server"):
        server = MetricsServer(metrics, "127.0.0.1", 0)
    with server:
        assert server.port > 0
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        assert f"serving metrics at {server.url}" in caplog.text
        text = _scrape(server.url)
        assert exposed_names(text) == set(METRIC_NAMES)
        assert 'etcd_elastic_rounds_total{run_id="job-e"} 1.0' in text
    with pytest.raises(urllib.error.URLError):
        _scrape(server.url)
    server.close()  # idempotent


@contextlib.contextmanager
def _listening() -> Iterator[int]:
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]
    finally:
        sock.close()


def test_a_port_in_use_is_one_line_naming_the_flag() -> None:
    with _listening() as port, pytest.raises(MetricsServerError) as info:
        MetricsServer(PrometheusMetrics("job"), "127.0.0.1", port)
    assert str(info.value) == (
        f"--metrics-port: port {port} on 127.0.0.1 is in use (Address already in use); "
        "choose another port, or 0 for any free one"
    )


@pytest.mark.parametrize(
    ("exc", "message"),
    [
        (OSError(errno.EACCES, "Permission denied"),
         "--metrics-port: no permission to listen on port 80 (Permission denied); ports "
         "below 1024 need root: choose one from 1024 up, or 0 for any free one"),
        (OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address"),
         "--metrics-addr: cannot listen on 'h' (Cannot assign requested address); give an "
         "address of this host: 127.0.0.1 (the default), 0.0.0.0 for every interface, or "
         "one of its own"),
        (socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
         "--metrics-addr: cannot listen on 'h' (Name or service not known); give an address "
         "of this host: 127.0.0.1 (the default), 0.0.0.0 for every interface, or one of its "
         "own"),
        (OSError(errno.EMFILE, "Too many open files"),
         "--metrics-port: cannot listen on h:80 (Too many open files)"),
    ],
)  # fmt: skip
def test_listen_errors_name_the_flag(exc: OSError, message: str) -> None:
    assert str(listen_error("h", 80, exc)) == message


def test_an_unknown_address_is_one_line_naming_the_address_flag() -> None:
    with pytest.raises(MetricsServerError, match=r"^--metrics-addr: cannot listen on '256\.1"):
        MetricsServer(PrometheusMetrics("job"), "256.1.1.1", 0)


def test_urls_bracket_ipv6() -> None:
    assert metrics_url("::1", 9) == "http://[::1]:9/metrics"
    assert metrics_url("127.0.0.1", 9) == "http://127.0.0.1:9/metrics"


# -- the flags ------------------------------------------------------------------------------


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)


def _parse(argv: list[str], environ: dict[str, str] | None = None) -> LaunchConfig:
    return parse_args(argv, device_count=lambda: 0, cpu_count=lambda: 1, environ=environ or {})


def test_metrics_are_off_by_default_and_on_with_the_flag(in_tmp: None) -> None:
    off = _parse(["train.py"])
    assert off.metrics_port is None and off.metrics_addr == "127.0.0.1"
    on = _parse(["--metrics-port=0", "train.py"])
    assert (on.metrics_port, on.metrics_addr) == (0, "127.0.0.1")
    both = _parse(["--metrics_port", "9400", "--metrics_addr", "0.0.0.0", "train.py"])
    assert (both.metrics_port, both.metrics_addr) == (9400, "0.0.0.0")
    env = _parse(["train.py"], {"PET_METRICS_PORT": "9401", "PET_METRICS_ADDR": "::1"})
    assert (env.metrics_port, env.metrics_addr) == (9401, "::1")


METRICS_MISUSE = [
    (["--metrics-port=x", "train.py"],
     "--metrics-port: 'x' is not a whole number; give a port 0-65535 (0: any free one)"),
    (["--metrics-port=65536", "train.py"],
     "--metrics-port: 65536 is out of range; give a port 0-65535 (0: any free one)"),
    (["--metrics-port=-1", "train.py"],
     "--metrics-port: -1 is out of range; give a port 0-65535 (0: any free one)"),
    (["--metrics-port=0", "--metrics-addr=", "train.py"],
     "--metrics-addr: is empty; give an address, e.g. 127.0.0.1 or 0.0.0.0"),
    (["--metrics-addr=0.0.0.0", "train.py"],
     "--metrics-addr: 0.0.0.0 serves nothing without --metrics-port; add "
     "--metrics-port=PORT (0: any free port)"),
]  # fmt: skip


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records what main() starts (the embedded etcd and the agent; neither really runs)."""
    calls: list[str] = []

    @contextlib.contextmanager
    def fake_embedded() -> Iterator[str]:
        calls.append("etcd")
        yield "127.0.0.1:23790"

    def fake_launch(config: LaunchConfig, metrics: RunMetrics | None) -> int:
        calls.append(f"launch {type(metrics).__name__}")
        if isinstance(metrics, PrometheusMetrics):
            calls.append(_scrape(metrics_url("127.0.0.1", config.metrics_port or 0)))
        return 7

    monkeypatch.setattr(cli, "_embedded", fake_embedded)
    monkeypatch.setattr(cli, "_launch", fake_launch)
    return calls


@pytest.mark.parametrize(("argv", "message"), METRICS_MISUSE)
def test_bad_metrics_flags_are_one_line_and_exit_code_2(
    in_tmp: None, started: list[str], argv: list[str], message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err == f"etcdrun: error: {message}\n"
    assert started == []


def test_main_with_a_port_in_use_prints_one_line_and_starts_nothing(
    in_tmp: None, started: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with _listening() as port:
        assert main([f"--metrics-port={port}", "--standalone", "train.py"]) == 1
    assert capsys.readouterr().err == (
        f"etcdrun: error: --metrics-port: port {port} on 127.0.0.1 is in use (Address already "
        "in use); choose another port, or 0 for any free one\n"
    )
    assert started == [], "no etcd and no agent start when the metrics port is taken"


def test_main_serves_while_the_agent_runs_and_stops_after(in_tmp: None, started: list[str]) -> None:
    with _listening() as port:
        pass  # a port that was free a moment ago
    assert main([f"--metrics-port={port}", "--standalone", "train.py"]) == 7
    assert started[:2] == ["etcd", "launch PrometheusMetrics"]
    assert "etcd_elastic_rounds_total" in started[2]
    with pytest.raises(urllib.error.URLError):
        _scrape(metrics_url("127.0.0.1", port))
    started.clear()
    assert main(["--standalone", "train.py"]) == 7
    assert started == ["etcd", "launch NoneType"]
