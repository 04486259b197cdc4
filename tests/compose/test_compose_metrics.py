"""The compose stack publishes every agent's Prometheus metrics (docs/metrics.md).

With the host-network override each agent serves on a free port of 127.0.0.1 and logs
it; the test finds each URL in its container's log, scrapes it from the host as a
Prometheus would, and parses it with prometheus_client's parser.
"""

from __future__ import annotations

import re
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.compose.stack import ComposeStack, wait_for
from tests.compose.test_compose_stack import (
    FINISH_TIMEOUT,
    START_TIMEOUT,
    MakeStack,
    _round_with,
    _settings,
)

pytestmark = [pytest.mark.compose, pytest.mark.slow, pytest.mark.timeout(600)]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _url(stack: ComposeStack, container: str) -> str | None:
    found = re.search(
        r"serving metrics at (http://127\.0\.0\.1:\d+/metrics)", stack.logs(container)
    )
    return found[1] if found else None


def _urls(stack: ComposeStack, containers: list[str]) -> list[str] | None:
    urls = [_url(stack, c) for c in containers]
    return [u for u in urls if u is not None] if all(urls) else None


def _scrape(url: str) -> tuple[Samples, set[str]]:
    """Samples (labels without run_id) and the run ids seen."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    samples: Samples = {}
    run_ids = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            run_ids.add(sample.labels["run_id"])
            labels = frozenset((k, v) for k, v in sample.labels.items() if k != "run_id")
            samples[(sample.name, labels)] = sample.value
    return samples, run_ids


def _get(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_every_agent_publishes_metrics_prometheus_can_parse(make_stack: MakeStack) -> None:
    stack = make_stack(_settings(epochs=4, sleep_per_step=0.25))
    stack.up(agents=2)
    agents = stack.containers("agent")
    assert len(agents) == 2
    wait_for("round 1 with 2 participants", lambda: _round_with(stack, 2), START_TIMEOUT)
    urls = wait_for("every agent's metrics URL in its log", lambda: _urls(stack, agents), 60)
    assert len(set(urls)) == 2, urls
    node_ids = stack.node_ids()
    for url in urls:
        # The workers start right after the round forms; the gauge is read at scrape time.
        wait_for(
            f"a worker running, per {url}",
            lambda url=url: _get(_scrape(url)[0], "etcd_elastic_workers_running") == 1,
            60,
        )
        samples, run_ids = _scrape(url)
        assert run_ids == {stack.settings["RDZV_ID"]}
        info = [dict(lb) for (name, lb) in samples if name == "etcd_elastic_agent_info"]
        assert len(info) == 1 and info[0]["node_id"] in node_ids, (info, node_ids)
        assert _get(samples, "etcd_elastic_rounds_total") >= 1
        assert _get(samples, "etcd_elastic_group_nodes") == 2
        calls = sum(v for (n, _), v in samples.items() if n.endswith("request_seconds_count"))
        assert calls > 0
        assert 0 <= _get(samples, "etcd_elastic_etcd_last_answer_age_seconds") < 30
        print(f"{url}: {len(samples)} samples, {calls:.0f} etcd calls")
    assert stack.wait_exit(agents, FINISH_TIMEOUT) == [0, 0]
