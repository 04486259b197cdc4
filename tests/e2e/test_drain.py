"""``rdzvctl drain`` of one node mid-training, with real agents and workers: its worker
gets the early-warning signal and saves a checkpoint within the grace, its agent exits 0,
the other node re-forms without it and no restart is counted."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys
from coordinator.core.state import decode_state
from coordinator.etcd_server import EtcdCluster
from coordinator.rdzvctl import main as rdzvctl
from tests.e2e.agents import Agents, read_report, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

JOB = 240.0
GRACE = 20


def test_a_drained_node_checkpoints_leaves_and_the_other_goes_on_uncounted(
    agents: Agents, etcd1: EtcdCluster, tmp_path: Path
) -> None:
    report, ckpt = tmp_path / "report.jsonl", tmp_path / "ckpt"
    script = [
        "--epochs", "2", "--steps-per-epoch", "6", "--sleep-per-step", "1",
        "--checkpoint-dir", str(ckpt), "--report", str(report),
        "--checkpoint-on-signal", "SIGUSR1",
    ]  # fmt: skip
    flags = [
        "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=0", "--drain-signal=SIGUSR1",
        f"--shutdown-timeout={GRACE}", "--rdzv-conf=lease_ttl=3,last_call_timeout=2",
    ]  # fmt: skip
    a = agents.start("a", flags, script)
    b = agents.start("b", flags, script)
    wait_for("2 workers", lambda: len(read_report(report)) >= 2, JOB, diagnose=agents.logs)
    keys = RunKeys(DEFAULT_KEY_PREFIX, agents.run_id)
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as client:
        kv, _ = client.get(keys.state)
    assert kv is not None
    state = decode_state(keys.state.decode(), kv.value)
    assert len(state.participants) == 2, state
    leaving_id = state.participants[1]
    leaving, staying = (b, a) if f"-{b.pid}-" in leaving_id else (a, b)
    drained_at = time.monotonic()
    assert rdzvctl(["drain", agents.run_id, leaving_id, f"--endpoints={etcd1.endpoint_list}"]) == 0
    assert leaving.wait(GRACE + 10) == 0, agents.logs()
    left_in = time.monotonic() - drained_at
    print(f"drained agent exited 0 {left_in:.2f} s after rdzvctl drain")
    assert left_in < GRACE
    assert (ckpt / "drained-rank1.pt").exists(), agents.logs()
    assert "SIGUSR1: saved drained-rank1.pt" in leaving.output(), leaving.output()
    assert "drained by an operator" in leaving.output()
    assert staying.wait(JOB) == 0, agents.logs()
    lines = read_report(report)
    again = [line for line in lines[2:] if line["pid"] not in {x["pid"] for x in lines[:2]}]
    assert again and all((line["world_size"], line["restart_count"]) == (1, 0) for line in again), (
        lines
    )
    assert "restarting (not counted)" in staying.output() or "not counted" in staying.output()
    assert agents.leftovers() == []
