"""The agent end to end: several ``etcdrun`` agents as separate processes, real workers
(examples/train_ddp.py over gloo), the session's real etcd. Issue 3, "What it must show".

Every agent of a test shares one run id and a checkpoint folder; the example appends one
JSON line per worker and attempt to a report file (ranks, world size, restart count,
start epoch, the time it was running), which is what most assertions read.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from coordinator.etcd_client import EtcdClient, EtcdConfig
from coordinator.etcd_server import EtcdCluster, free_port
from coordinator.keys import DEFAULT_KEY_PREFIX, RunKeys
from tests.e2e.agents import ETCDRUN, EXAMPLE, ROOT, Agents, read_report, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Bounds are generous: two cores shared with other test runs, torch imports in every
# worker. What each test proves is in its ordering and counts, not in these numbers.
JOB = 150.0
STARTED = 90.0


def _script(tmp_path: Path, *extra: str, epochs: int = 2, steps: int = 5) -> list[str]:
    return [
        "--epochs", str(epochs), "--steps-per-epoch", str(steps),
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--report", str(tmp_path / "report.jsonl"),
        *extra,
    ]  # fmt: skip


def _attempt(lines: list[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    return [r for r in lines if r["world_size"] == world_size]


def _ranks_ok(lines: list[dict[str, Any]], world_size: int) -> bool:
    return sorted(r["rank"] for r in lines) == list(range(world_size))


def _node_keys(etcd: EtcdCluster, run_id: str) -> int:
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd.endpoints))) as client:
        count, _ = client.count_prefix(keys.nodes_prefix)
    return count


def test_two_agents_of_two_workers_train_to_the_end(agents: Agents, tmp_path: Path) -> None:
    """Scenario 1; agent b is frozen while the workers finish, so a reaches the exit
    barrier first and closes the run only once b got there too: both exit 0."""
    report = tmp_path / "report.jsonl"
    conf = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-conf=lease_ttl=15"]
    a = agents.start("a", conf, _script(tmp_path))
    b = agents.start("b", conf, _script(tmp_path))
    wait_for("4 workers", lambda: len(read_report(report)) >= 4, STARTED, diagnose=agents.logs)
    os.kill(b.pid, signal.SIGSTOP)
    try:
        wait_for(
            "a in the exit barrier",
            lambda: "waiting for the other nodes" in a.output(),
            JOB,
            diagnose=agents.logs,
        )
        assert a.proc.poll() is None, "a left before b reached the exit barrier"
    finally:
        os.kill(b.pid, signal.SIGCONT)
    assert a.wait(JOB) == 0, agents.logs()
    assert b.wait(JOB) == 0, agents.logs()
    lines = read_report(report)
    assert len(lines) == 4, lines
    assert _ranks_ok(lines, 4), lines
    for line in lines:
        env = line["env"]
        assert (env["WORLD_SIZE"], env["GROUP_WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            "4", "2", "2",
        )  # fmt: skip
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
    by_node = Counter(line["group_rank"] for line in lines)
    assert by_node == {0: 2, 1: 2}
    assert "epoch 2/2" in a.output() + b.output()
    assert agents.leftovers() == []


def test_an_agent_arriving_after_the_job_finished_gets_one_line(
    agents: Agents, tmp_path: Path
) -> None:
    """Scenario 7."""
    conf = ["--nnodes=1", "--nproc-per-node=1"]
    first = agents.start("first", conf, _script(tmp_path, epochs=1, steps=1))
    assert first.wait(JOB) == 0, agents.logs()
    late = agents.start("late", conf, _script(tmp_path, epochs=1, steps=1))
    code = late.wait(STARTED)
    out = late.output()
    assert code == 1, out
    errors = [line for line in out.splitlines() if "is closed" in line]
    assert len(errors) == 1, out
    assert errors[0] == (
        f"etcdrun: error: run {agents.run_id!r} is closed (the job finished: every worker "
        "succeeded): it admits no more nodes; start a new run with another --rdzv-id"
    ), out
    assert "Traceback" not in out
    assert not (tmp_path / "report.jsonl").read_text().count("\n") > 1, "the late node ran workers"


def test_misuse_exits_2_at_once_without_any_etcd(tmp_path: Path) -> None:
    """Scenario 8 (the ten-plus misuses are pinned in tests/unit/test_cli.py): nothing
    listens at the endpoint, and the command line is refused before it would matter."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONWARNINGS="ignore:Failed to initialize NumPy:UserWarning")
    start = time.monotonic()
    proc = subprocess.run(
        [str(ETCDRUN), "--nnodes=2", f"--rdzv-endpoint={endpoint}", "--rdzv-id=job",
         "--max-restarts=-1", str(EXAMPLE)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        "etcdrun: error: --max-restarts: -1 is out of range; give 0 or more restarts\n"
    )
    assert proc.stdout == ""
    # Importing torch takes most of it; a connection attempt would add read_timeout (60 s).
    assert took < 30, f"took {took:.1f} s"


def test_unreachable_etcd_fails_after_bounded_retries_naming_endpoints(
    agents: Agents, tmp_path: Path
) -> None:
    """Scenario 9: two endpoints where nothing listens, read_timeout=3."""
    endpoints = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    start = time.monotonic()
    agent = agents.start(
        "lonely",
        ["--nnodes=2", "--nproc-per-node=1", "--rdzv-conf=read_timeout=3"],
        _script(tmp_path),
        endpoint=",".join(endpoints),
    )
    code = agent.wait(STARTED)
    took = time.monotonic() - start
    out = agent.output()
    assert code == 1, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("etcdrun: error: ")]
    assert len(errors) == 1, out
    for endpoint in endpoints:
        assert endpoint in errors[0], out
    assert "within 3 s" in errors[0], out
    assert took < 60, f"took {took:.1f} s"
    assert not (tmp_path / "report.jsonl").exists()
