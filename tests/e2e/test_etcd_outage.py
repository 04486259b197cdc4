"""Training outlives etcd (issue 8 item 1, DESIGN §9).

Three real agents train a real gloo job on a 3-member etcd; then the WHOLE etcd cluster
is killed and, after three lease TTLs (and, again, after 70 s: longer than the 60 s retry
budget of one etcd call), restarted from its data directories. etcd keeps
leases across a restart (a new leader extends them all), so no lease was really lost:
every worker must keep stepping through the outage, no worker may be restarted, and each
agent logs one warning naming the endpoints and one line when etcd is back.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.etcd_server import EtcdCluster, find_etcd_binary
from tests.e2e.agents import Agents, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TTL = 3
STEP_S = 0.2

WORKER = """
import json, os, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
with open(out, "a") as f:
    for step in range(1500):  # bounded: 5 minutes at most
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        assert total.item() == world * (world + 1) / 2, total
        f.write(json.dumps({"pid": os.getpid(), "rank": rank, "step": step,
                            "t": time.time()}) + "\\n")
        f.flush()
        time.sleep(STEP_S)
dist.destroy_process_group()
""".replace("STEP_S", str(STEP_S))


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(3, binary=find_etcd_binary()) as c:
        yield c


def _steps(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("outage_s", [3 * TTL, 70], ids=["3xTTL", "70s"])
def test_a_whole_cluster_restart_costs_no_worker_restart(
    cluster: EtcdCluster, run_id: str, tmp_path: Path, outage_s: float
) -> None:
    agents = Agents(run_id, cluster.endpoint_list, tmp_path)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    steps = tmp_path / "steps.jsonl"
    conf = ["--nnodes=3", "--nproc-per-node=1", "--max-restarts=3",
            f"--rdzv-conf=lease_ttl={TTL},last_call_timeout=5"]  # fmt: skip
    try:
        for name in "abc":
            agents.start(name, conf, [str(steps)], script=script)
        wait_for(
            "3 workers stepping",
            lambda: len({s["pid"] for s in _steps(steps) if s["step"] >= 5}) == 3,
            180,
            diagnose=agents.logs,
        )
        pids = {s["pid"] for s in _steps(steps)}
        down_at = time.time()
        for index in range(3):
            cluster.kill(index)
        time.sleep(outage_s)
        cluster.restart(range(3), timeout=60)
        up_at = time.time()
        time.sleep(2 * TTL)  # time for a wrong "lease lost" to show as a restart
        during = [s for s in _steps(steps) if down_at < s["t"] < up_at]
        after = _steps(steps)
        by_pid = {pid: sorted(s["t"] for s in after if s["pid"] == pid) for pid in pids}
        gaps = {pid: max(b - a for a, b in itertools.pairwise(ts)) for pid, ts in by_pid.items()}
        print(
            f"outage {up_at - down_at:.1f} s: {len(during)} steps taken meanwhile; "
            f"largest gap between steps per worker: "
            + ", ".join(f"{g:.2f} s" for g in gaps.values())
        )
        assert {s["pid"] for s in after} == pids, "a worker was restarted"
        assert {s["pid"] for s in during} == pids, "a worker stopped stepping during the outage"
        assert max(gaps.values()) < 3.0, gaps
        for agent in agents.procs:
            assert agent.proc.poll() is None, agents.logs()
            out = agent.output()
            assert out.count("etcd unreachable") == 1, agents.logs()
            assert "etcd answers again" in out, agents.logs()
            assert "restarting" not in out, agents.logs()
    finally:
        agents.reap()
