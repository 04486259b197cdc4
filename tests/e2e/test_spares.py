"""Hot spares with real agents and workers: a spare past a short join_timeout waits on
events (its CPU is measured) without exiting, takes a lost node's place within
TTL + 1 s with rank 0 unmoved, and spares still waiting when the job ends exit 0."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys
from coordinator.core.state import RdzvState, decode_state
from coordinator.etcd_server import EtcdCluster
from tests.e2e.agents import Agents, read_report, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

TTL = 3
JOB = 240.0
# Seconds over which the waiting spare's CPU is measured (ETCD_ELASTIC_SPARE_CPU_WINDOW
# for a longer measurement than CI's).
WINDOW = float(os.environ.get("ETCD_ELASTIC_SPARE_CPU_WINDOW", "4"))


def _cpu_ticks(pid: int) -> int:
    """utime + stime of every thread of ``pid`` (clock ticks), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _state(client: EtcdClient, keys: RunKeys) -> RdzvState:
    kv, _ = client.get(keys.state)
    return RdzvState() if kv is None else decode_state(keys.state.decode(), kv.value)


def test_spares_wait_without_cost_replace_a_lost_node_and_exit_0(
    agents: Agents, etcd1: EtcdCluster, tmp_path: Path
) -> None:
    report = tmp_path / "report.jsonl"
    script = [
        "--epochs", "4", "--steps-per-epoch", "4", "--sleep-per-step", "2",
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--report", str(report),
    ]  # fmt: skip
    conf = f"--rdzv-conf=lease_ttl={TTL},join_timeout=2,last_call_timeout=1"
    flags = ["--nnodes=2", "--nproc-per-node=1", "--max-restarts=3", conf]
    keys = RunKeys(DEFAULT_KEY_PREFIX, agents.run_id)
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as client:
        a = agents.start("a", flags, script)
        b = agents.start("b", flags, script)
        wait_for("2 workers", lambda: len(read_report(report)) >= 2, JOB, diagnose=agents.logs)
        first = _state(client, keys)
        spare = agents.start("spare", flags, script)
        extra = agents.start("extra", flags, script)
        wait_for(
            "2 listed spares",
            lambda: len(_state(client, keys).redundancy_list) == 2,
            JOB,
            diagnose=agents.logs,
        )
        time.sleep(2.5)  # both spares are past join_timeout=2 now
        before, t0 = _cpu_ticks(spare.pid), time.monotonic()
        time.sleep(WINDOW)
        used = (_cpu_ticks(spare.pid) - before) / os.sysconf("SC_CLK_TCK")
        cpu = 100 * used / (time.monotonic() - t0)
        print(f"waiting spare: {cpu:.2f} % of a core over {WINDOW:g} s")
        assert spare.proc.poll() is None and extra.proc.poll() is None, agents.logs()
        assert cpu <= 2.0, f"a waiting spare used {cpu:.1f} % of a core"
        # Lose the node that is not rank 0.
        rank0 = first.participants[0]
        victim = b if f"-{b.pid}-" in first.participants[1] else a
        assert f"-{victim.pid}-" not in rank0, (first, a.pid, b.pid)
        assert len(read_report(report)) == 2, "the job moved on before the node loss"
        victim.kill_node()
        killed = time.monotonic()
        wait_for(
            "the spare to take its place",
            lambda: _state(client, keys).round > first.round,
            30,
            diagnose=agents.logs,
        )
        promoted_in = time.monotonic() - killed
        after = _state(client, keys)
        print(f"spare promoted {promoted_in:.2f} s after the SIGKILL (lease_ttl {TTL} s)")
        assert after.participants[0] == rank0, (first, after)
        assert f"-{spare.pid}-" in after.participants[1], (spare.pid, after)
        assert promoted_in <= TTL + 1, f"promoted after {promoted_in:.2f} s"
        survivor = a if victim is b else b
        for agent in (survivor, spare, extra):
            assert agent.wait(JOB) == 0, agents.logs()
    out = extra.output()
    assert "while node" in out and "waited as a spare: nothing left to do; exiting 0" in out, out
    assert not any(line.startswith(("etcdrun: error", "Traceback")) for line in out.splitlines()), (
        out
    )
    assert agents.leftovers() == []
