"""``--metrics-port`` end to end: two real agents on the session's real etcd, a worker
that fails once, and both agents' endpoints scraped and parsed with prometheus_client's
parser while the restarted workers run (issue 11, item 3: "What it must show").

Not racy by construction: the workers of the round after the restart write a file and
then wait for the test's release file, so the scrape happens while both agents sit in
that round with their workers running; only then does the job finish.
"""

from __future__ import annotations

import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.agents import AgentProc, Agents, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

# Generous: two cores shared with other test runs, and each agent imports torch.
STARTED = 240.0
JOB = 240.0

_WORKER = """\
import os, pathlib, sys, time

folder, mode, name = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
if mode == "fail-once" and not (folder / f"{name}.failed").exists():
    (folder / f"{name}.failed").write_text("")
    sys.exit(1)
round_no = os.environ["ETCD_ELASTIC_ROUND"]
(folder / f"{name}.running.{round_no}").write_text(
    os.environ["ETCD_ELASTIC_NODE_ID"] + " " + os.environ["TORCHELASTIC_RESTART_COUNT"]
)
deadline = time.monotonic() + 300  # never outlive a broken test by much
while not (folder / "release").exists():
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.05)
"""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _url(agent: AgentProc) -> str | None:
    found = re.search(r"serving metrics at (http://127\.0\.0\.1:\d+/metrics)", agent.output())
    return found[1] if found else None


def _scrape(url: str) -> tuple[Samples, str]:
    """Samples without their run_id label (checked here), and the run id."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    found: Samples = {}
    run_ids = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            run_ids.add(sample.labels["run_id"])
            labels = frozenset((k, v) for k, v in sample.labels.items() if k != "run_id")
            found[(sample.name, labels)] = sample.value
    assert len(run_ids) == 1, run_ids
    return found, run_ids.pop()


def _get(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def _method_counts(samples: Samples) -> dict[str, float]:
    return {
        dict(labels)["method"]: v
        for (name, labels), v in samples.items()
        if name == "etcd_elastic_etcd_request_seconds_count"
    }


def _same_round(folder: Path) -> int | None:
    """The round both agents' workers run in after the restart, once they both do."""
    rounds = {
        name: {int(p.name.rsplit(".", 1)[1]) for p in folder.glob(f"{name}.running.*")}
        for name in "ab"
    }
    common = [r for r in rounds["a"] & rounds["b"] if r >= 2]
    return max(common) if common else None


def test_metrics_of_two_agents_after_a_worker_failure(agents: Agents, tmp_path: Path) -> None:
    folder = tmp_path / "marks"
    folder.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    conf = ["--nnodes=2", "--nproc-per-node=1", "--max-restarts=1", "--no-warm-start",
            "--metrics-port=0", "--rdzv-conf=lease_ttl=3"]  # fmt: skip
    a = agents.start("a", conf, [str(folder), "fail-once", "a"], script=worker)
    b = agents.start("b", conf, [str(folder), "run", "b"], script=worker)

    wait_for("both agents' workers running in the round after the restart",
             lambda: _same_round(folder) is not None, STARTED, diagnose=agents.logs)  # fmt: skip
    round_no = _same_round(folder)
    assert round_no is not None
    urls = {agent.name: _url(agent) for agent in (a, b)}
    assert None not in urls.values(), agents.logs()

    scraped: dict[str, Samples] = {}
    for name, url in urls.items():
        assert url is not None
        # A keep-alive answers every lease_ttl / 3 = 1 s; the first one long ago, but a
        # counter that only grows may be waited for without a race.
        wait_for(
            f"agent {name}'s first keep-alive round trip",
            lambda url=url: _get(_scrape(url)[0], "etcd_elastic_keepalive_seconds_count") >= 1,
            60,
            diagnose=agents.logs,
        )
        samples, run_id = _scrape(url)
        assert run_id == agents.run_id
        scraped[name] = samples
        node_id, restart_count = (folder / f"{name}.running.{round_no}").read_text().split()
        info = [dict(labels) for (metric, labels) in samples if metric == "etcd_elastic_agent_info"]
        assert [i["node_id"] for i in info] == [node_id], info
        print(f"agent {name}: round {round_no}, restart count {restart_count}, etcd calls "
              f"{_method_counts(samples)}")  # fmt: skip

        assert _get(samples, "etcd_elastic_rounds_total") >= 2
        assert _get(samples, "etcd_elastic_round") == round_no
        assert _get(samples, "etcd_elastic_group_nodes") == 2
        assert _get(samples, "etcd_elastic_formation_seconds_count") == _get(
            samples, "etcd_elastic_rounds_total"
        )
        assert _get(samples, "etcd_elastic_workers_running") == 1
        assert _get(samples, "etcd_elastic_last_progress_step") == -1
        assert _get(samples, "etcd_elastic_restarts_total", cause="unhealthy") == 0
        calls = _method_counts(samples)
        assert calls.get("lease_grant", 0) >= 1 and calls.get("put", 0) >= 1, calls
        assert sum(calls.values()) > 0
        assert all(
            v == 0 for (m, _), v in samples.items() if m.endswith("request_failures_total")
        ), samples
        assert 0 <= _get(samples, "etcd_elastic_etcd_last_answer_age_seconds") < 30
        assert 0 < _get(samples, "etcd_elastic_keepalive_seconds_sum") < 60

    # a's worker failed once: one counted restart, none left.
    assert _get(scraped["a"], "etcd_elastic_restarts_total", cause="worker_failure") == 1
    assert _get(scraped["a"], "etcd_elastic_restarts_total", cause="membership_change") == 0
    assert _get(scraped["a"], "etcd_elastic_restarts_left") == 0
    # b's worker never failed (no collective to break): a asking for the next round was a
    # membership change to b, not counted; but --max-restarts is the job's budget, which
    # a's failure used up for b too.
    assert _get(scraped["b"], "etcd_elastic_restarts_total", cause="worker_failure") == 0
    assert _get(scraped["b"], "etcd_elastic_restarts_total", cause="membership_change") >= 1
    assert _get(scraped["b"], "etcd_elastic_restarts_left") == 0
    # Exactly one of them coordinates the round: it wrote the state's compare-and-swap.
    assert any(_method_counts(s).get("put_if_mod_revision", 0) >= 1 for s in scraped.values())

    (folder / "release").write_text("")
    assert a.wait(JOB) == 0, agents.logs()
    assert b.wait(JOB) == 0, agents.logs()
    for url in urls.values():
        assert url is not None
        with pytest.raises(urllib.error.URLError):
            _scrape(url)  # the endpoint went with its agent
    assert agents.leftovers() == []


def test_a_metrics_port_in_use_is_one_line_and_nothing_starts(
    agents: Agents, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        agent = agents.start("a", ["--nnodes=1", f"--metrics-port={port}"],
                             ["--epochs", "1"])  # fmt: skip
        assert agent.wait(120) == 1
    assert agent.output().strip().splitlines()[-1] == (
        f"etcdrun: error: --metrics-port: port {port} on 127.0.0.1 is in use (Address "
        "already in use); choose another port, or 0 for any free one"
    )
    assert "joining" not in agent.output()
    assert agents.leftovers() == []
