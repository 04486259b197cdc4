"""Hot spares and drain with real agents and workers, in one job of two places and five
agents (three spares):

* the spares wait past a short join_timeout on events only (the CPU of one is measured)
  and do not exit;
* ``rdzvctl drain`` of the node that is not rank 0: its worker gets SIGUSR1 and saves a
  checkpoint within the grace, its agent exits 0, the oldest spare takes its place and no
  restart is counted;
* that spare is then SIGKILLed: the next spare takes its place within TTL + 1 s, and
  rank 0 stays where it was;
* the spare still waiting when the job finishes exits 0.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys
from coordinator.core.state import RdzvState, decode_state
from coordinator.etcd_server import EtcdCluster
from coordinator.rdzvctl import main as rdzvctl
from tests.e2e.agents import AgentProc, Agents, read_report, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

TTL = 3
GRACE = 20
JOB = 240.0
# Seconds over which a waiting spare's CPU is measured (ETCD_ELASTIC_SPARE_CPU_WINDOW for
# a longer measurement than CI's).
WINDOW = float(os.environ.get("ETCD_ELASTIC_SPARE_CPU_WINDOW", "4"))


def _cpu_ticks(pid: int) -> int:
    """utime + stime of every thread of ``pid`` (clock ticks), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _state(client: EtcdClient, keys: RunKeys) -> RdzvState:
    kv, _ = client.get(keys.state)
    return RdzvState() if kv is None else decode_state(keys.state.decode(), kv.value)


def test_spares_wait_take_the_place_of_drained_and_lost_nodes_and_exit_0(
    agents: Agents, etcd1: EtcdCluster, tmp_path: Path
) -> None:
    report, ckpt = tmp_path / "report.jsonl", tmp_path / "ckpt"
    script = [
        "--epochs", "4", "--steps-per-epoch", "4", "--sleep-per-step", "1",
        "--checkpoint-dir", str(ckpt), "--report", str(report),
        "--checkpoint-on-signal", "SIGUSR1",
    ]  # fmt: skip
    flags = [
        "--nnodes=2", "--nproc-per-node=1", "--max-restarts=3", "--drain-signal=SIGUSR1",
        f"--shutdown-timeout={GRACE}",
        f"--rdzv-conf=lease_ttl={TTL},join_timeout=2,last_call_timeout=1",
    ]  # fmt: skip
    keys = RunKeys(DEFAULT_KEY_PREFIX, agents.run_id)
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as client:
        # Five agents at once for two places: the first two keys form round 1, the others
        # are listed as spares, oldest first (the next to be promoted).
        started = [agents.start(name, flags, script) for name in "abcde"]
        wait_for(
            "2 workers and 3 listed spares",
            lambda: (
                len(read_report(report)) >= 2 and len(_state(client, keys).redundancy_list) == 3
            ),
            JOB,
            diagnose=agents.logs,
        )
        first = _state(client, keys)

        def agent_of(node_id: str) -> AgentProc:
            return next(p for p in started if f"-{p.pid}-" in node_id)

        rank0, leaving = (agent_of(n) for n in first.participants)
        spare1, spare2, spare3 = (agent_of(n) for n in first.redundancy_list)

        # 1. Spares past join_timeout wait on events: measure one.
        time.sleep(2.5)
        before, t0 = _cpu_ticks(spare3.pid), time.monotonic()
        time.sleep(WINDOW)
        cpu = 100 * (_cpu_ticks(spare3.pid) - before) / os.sysconf("SC_CLK_TCK")
        cpu /= time.monotonic() - t0
        print(f"waiting spare: {cpu:.2f} % of a core over {WINDOW:g} s")
        assert all(s.proc.poll() is None for s in (spare1, spare2, spare3)), agents.logs()
        assert cpu <= 2.0, f"a waiting spare used {cpu:.1f} % of a core"
        assert len(read_report(report)) == 2, "the job moved on too early"

        # 2. Drain the node that is not rank 0.
        drained_at = time.monotonic()
        assert rdzvctl(["drain", agents.run_id, first.participants[1],
                        f"--endpoints={etcd1.endpoint_list}"]) == 0  # fmt: skip
        assert leaving.wait(GRACE + 10) == 0, agents.logs()
        print(f"drained agent exited 0 {time.monotonic() - drained_at:.2f} s after the drain")
        assert time.monotonic() - drained_at < GRACE
        assert (ckpt / "drained-rank1.pt").exists(), agents.logs()
        assert "SIGUSR1: saved drained-rank1.pt" in leaving.output(), leaving.output()
        wait_for("spare 1 training", lambda: len(read_report(report)) >= 4, JOB,
                 diagnose=agents.logs)  # fmt: skip
        second = _state(client, keys)
        assert second.participants == (first.participants[0], first.redundancy_list[0])
        after_drain = read_report(report)[2:4]
        assert [(r["world_size"], r["restart_count"]) for r in after_drain] == [(2, 0)] * 2

        # 3. Lose spare 1 (now rank 1): spare 2 takes its place within TTL + 1 s.
        spare1.kill_node()
        killed = time.monotonic()
        wait_for("spare 2 to take its place", lambda: _state(client, keys).round > second.round,
                 30, diagnose=agents.logs)  # fmt: skip
        promoted_in = time.monotonic() - killed
        third = _state(client, keys)
        print(f"spare promoted {promoted_in:.2f} s after the SIGKILL (lease_ttl {TTL} s)")
        assert third.participants == (first.participants[0], first.redundancy_list[1])
        assert promoted_in <= TTL + 1, f"promoted after {promoted_in:.2f} s"

        # 4. The job ends: the spare still waiting exits 0 with one info line.
        for agent in (rank0, spare2, spare3):
            assert agent.wait(JOB) == 0, agents.logs()
    out = spare3.output()
    assert "waited as a spare: nothing left to do; exiting 0" in out, out
    assert not any(line.startswith(("etcdrun: error", "Traceback")) for line in out.splitlines())
    assert agents.leftovers() == []
