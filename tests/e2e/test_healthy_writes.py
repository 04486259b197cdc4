"""A healthy job costs etcd nothing but lease keep-alives (DESIGN §10; issue 20, item 3).

Two real agents on a 3-member etcd of the test's own, with every feature that could
write on: hang detection (``--hang-timeout``), metrics (``--metrics-port``), the
pre-flight check (``--health-check``, once per round, before the window), the run's
timeline (always on with our handler) and the agent journal. Their workers report
progress every 50 ms. Once both train, etcd's own counters (``etcd_mvcc_put_total`` and
``etcd_mvcc_delete_total`` of a member, and the cluster's revision) must not move for
``WINDOW`` seconds, and neither must the agents' own counts of their etcd calls: a
lease keep-alive is the only request, and it is neither a write nor a call counted there.

Before progress was written on suspicion only, each agent wrote its progress record
about once a second (about 1 write per node per second, measured here).
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.etcd_server import EtcdCluster
from tests.e2e.agents import AgentProc, Agents, wait_for
from tests.rdzv_helpers import metric

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

WORKER = Path(__file__).with_name("hang_worker.py")
WINDOW = 12.0
# Writes of the round's start (timeline events are written in the background) land
# well within this after the workers' first report.
SETTLE = 3.0
STARTED = 400.0  # formation and the pre-flight check (torch imports) on a loaded machine


@pytest.fixture
def group(fresh_cluster3: EtcdCluster, run_id: str, tmp_path: Path) -> Iterator[Agents]:
    made = Agents(run_id, fresh_cluster3.endpoint_list, tmp_path)
    try:
        yield made
    finally:
        made.reap()


def _scrape(agent: AgentProc) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    found = re.search(r"serving metrics at (http://127\.0\.0\.1:\d+/metrics)", agent.output())
    assert found, agent.output()[-3000:]
    with urllib.request.urlopen(found[1], timeout=30) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset((k, v) for k, v in s.labels.items() if k != "run_id")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _step(agent: AgentProc) -> float:
    if "serving metrics at" not in agent.output():
        return -1
    return _scrape(agent)[("etcd_elastic_last_progress_step", frozenset())]


def _calls(agent: AgentProc) -> dict[str, float]:
    """The agent's etcd calls so far by method (keep-alives are not among them)."""
    return {
        dict(labels)["method"]: value
        for (name, labels), value in _scrape(agent).items()
        if name == "etcd_elastic_etcd_request_seconds_count"
    }


def _etcd_counts(cluster: EtcdCluster, client: EtcdClient) -> tuple[float, float, int]:
    """(puts + deletes, ranges) applied by the first member, and the cluster's revision.
    Every member applies every write; the revision moves with every write of any key."""
    text = cluster.members[0].metrics()
    writes = metric(text, "etcd_mvcc_put_total") + metric(text, "etcd_mvcc_delete_total")
    _, revision = client.get(b"/")
    return writes, metric(text, "etcd_mvcc_range_total"), revision


def test_a_healthy_job_with_every_feature_on_writes_nothing_to_etcd(
    group: Agents, fresh_cluster3: EtcdCluster, tmp_path: Path
) -> None:
    stop = tmp_path / "stop"
    conf = [
        "--nnodes=2", "--nproc-per-node=1", "--hang-timeout=3", "--metrics-port=0",
        "--health-check", "--health-check-timeout=120", "--no-warm-start",
        "--rdzv-conf=lease_ttl=6",
    ]  # fmt: skip
    script = ["--steps=100000", "--step-seconds=0.05", f"--until={stop}"]
    journal = {"ETCD_ELASTIC_JOURNAL": str(tmp_path / "journal.jsonl")}
    agents = [group.start(n, conf, script, script=WORKER, env=journal) for n in ("a", "b")]
    wait_for(
        "both agents' workers reporting progress",
        lambda: all(_step(a) >= 0 for a in agents),
        STARTED,
        diagnose=group.logs,
    )
    time.sleep(SETTLE)
    with EtcdClient(EtcdConfig(tuple(fresh_cluster3.endpoints))) as client:
        writes0, ranges0, rev0 = _etcd_counts(fresh_cluster3, client)
        calls0 = [_calls(a) for a in agents]
        steps0 = [_step(a) for a in agents]
        began = time.monotonic()
        time.sleep(WINDOW)
        writes1, ranges1, rev1 = _etcd_counts(fresh_cluster3, client)
        seconds = time.monotonic() - began
        calls1 = [_calls(a) for a in agents]
        steps1 = [_step(a) for a in agents]
    made = [{m: n - c0.get(m, 0) for m, n in c1.items() if n != c0.get(m, 0)}
            for c0, c1 in zip(calls0, calls1, strict=True)]  # fmt: skip
    print(
        f"healthy window of {seconds:.1f} s, 2 nodes: {writes1 - writes0:.0f} etcd writes "
        f"({(writes1 - writes0) / seconds / 2:.2f} per node per second), revision "
        f"{rev0} -> {rev1}, {ranges1 - ranges0:.0f} ranges, agents' "
        f"calls {made}, steps {steps0} -> {steps1}"
    )
    assert writes0 > 0  # the counters exist: formation wrote the state and node keys
    # Training went on on both nodes through the window.
    assert all(s1 >= s0 + 20 for s0, s1 in zip(steps0, steps1, strict=True)), (steps0, steps1)
    assert writes1 - writes0 == 0, group.logs()
    assert rev1 == rev0, group.logs()
    assert made == [{}, {}], group.logs()

    stop.write_text("")
    for agent in agents:
        assert agent.wait(120) == 0, group.logs()
        assert "hang in round" not in agent.output(), group.logs()
