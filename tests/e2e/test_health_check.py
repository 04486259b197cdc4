"""The pre-flight check (``--health-check``) with real agents, workers and etcd.

Three agents of one job (``--nnodes=2:3``, one worker each); one is made slow on purpose
(``ETCD_ELASTIC_HEALTH_CHECK_DELAY``, the check's fault-injection hook). The first round
forms with all three; the check leaves the slow one out: every agent logs one line per
node naming it with the reason, it is quarantined in the state (``rdzvctl status`` shows
it with its reason and time left), the other two re-form without it, not a counted
restart, and train to the end. The slow node waits outside the rounds and exits 0 when
the job finishes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys
from coordinator.core.state import RdzvState, decode_state
from coordinator.etcd_server import EtcdCluster
from coordinator.rdzvctl import main as rdzvctl
from tests.e2e.agents import Agents, read_report, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

JOB = 300.0
DELAY = 3  # seconds the slow node adds to its matmul and to each of its pairs


def _state(client: EtcdClient, keys: RunKeys) -> RdzvState:
    kv, _ = client.get(keys.state)
    return RdzvState() if kv is None else decode_state(keys.state.decode(), kv.value)


def test_the_check_leaves_out_a_slow_node_and_the_others_train(
    agents: Agents, etcd1: EtcdCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, ckpt = tmp_path / "report.jsonl", tmp_path / "ckpt"
    script = [
        "--epochs", "2", "--steps-per-epoch", "4", "--sleep-per-step", "0.5",
        "--checkpoint-dir", str(ckpt), "--report", str(report),
    ]  # fmt: skip
    flags = [
        "--nnodes=2:3", "--nproc-per-node=1", "--max-restarts=0", "--health-check",
        "--health-check-timeout=60", "--quarantine-seconds=600",
        "--rdzv-conf=lease_ttl=3,last_call_timeout=2",
    ]  # fmt: skip
    keys = RunKeys(DEFAULT_KEY_PREFIX, agents.run_id)
    fast = [agents.start(name, flags, script) for name in ("a", "b")]
    slow = agents.start("slow", flags, script, env={"ETCD_ELASTIC_HEALTH_CHECK_DELAY": str(DELAY)})
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as client:
        wait_for(
            "the slow node quarantined",
            lambda: bool(_state(client, keys).quarantined),
            JOB,
            diagnose=agents.logs,
        )
        entry = _state(client, keys).quarantined[0]
        assert f"-{slow.pid}-" in entry.node_id, (entry, agents.logs())
        assert entry.reason.startswith("matmul "), entry
        assert "x the median" in entry.reason, entry

        wait_for("the two others training", lambda: len(read_report(report)) >= 2, JOB,
                 diagnose=agents.logs)  # fmt: skip
        state = _state(client, keys)
        assert len(state.participants) == 2, state
        assert entry.node_id not in state.participants
        capsys.readouterr()
        assert rdzvctl(["status", agents.run_id, f"--endpoints={etcd1.endpoint_list}"]) == 0
        status = capsys.readouterr().out
        assert "quarantined:     1 (left out of the rounds)" in status, status
        row = next(line for line in status.splitlines() if line.startswith(f"  {entry.node_id}"))
        assert re.search(r"\b(9|10)m\d\ds\b", row) and "matmul" in row, status
        # The node table says what it is too.
        assert any(
            entry.node_id in line and "quarantined" in line.split() for line in status.splitlines()
        ), status

    for agent in fast:
        assert agent.wait(JOB) == 0, agents.logs()
    assert slow.wait(60) == 0, agents.logs()

    # Only the two fast nodes ran workers, once each: no counted restart, world size 2.
    runs = read_report(report)
    assert sorted((r["world_size"], r["restart_count"]) for r in runs) == [(2, 0), (2, 0)], runs
    for agent in (*fast, slow):
        text = agent.output()
        # One line per node for the round that left it out, naming it with the reason.
        failed = [
            ln for ln in text.splitlines() if "pre-flight check: node" in ln and "FAILED" in ln
        ]
        assert any(entry.node_id in ln and "matmul" in ln for ln in failed), text[-4000:]
    for agent in fast:
        text = agent.output()
        assert re.search(r"pre-flight check of round \d+: 2 node\(s\) passed in [\d.]+ s", text), (
            text[-4000:]
        )
        assert "restarts left" not in text  # nothing counted
    assert "is quarantined in run" in slow.output(), slow.output()[-4000:]
