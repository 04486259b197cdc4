"""The agent end to end: several ``etcdrun`` agents as separate processes, real workers
(examples/train_ddp.py over gloo), the session's real etcd. Issue 3, "What it must show".

Every agent of a test shares one run id and a checkpoint folder; the example appends one
JSON line per worker and attempt to a report file (ranks, world size, restart count,
start epoch, the time it was running), which is what most assertions read.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys
from coordinator.core.ports import free_ports
from coordinator.core.state import RdzvState, decode_state
from coordinator.etcd_server import EtcdCluster, free_port
from tests.e2e.agents import (
    ETCDRUN,
    EXAMPLE,
    ROOT,
    AgentProc,
    Agents,
    alive,
    descendants,
    read_report,
    wait_for,
)

# Several bounded waits per test add up beyond the suite-wide 300 s on a crowded machine.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

# Bounds are generous: two cores shared with other test runs (a load average of 68 was
# seen, where three workers took over 90 s to import torch and start), torch imports in
# every worker. What each test proves is in its ordering and counts, not in these numbers.
JOB = 240.0
STARTED = 180.0


def _script(tmp_path: Path, *extra: str, epochs: int = 2, steps: int = 5) -> list[str]:
    return [
        "--epochs", str(epochs), "--steps-per-epoch", str(steps),
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--report", str(tmp_path / "report.jsonl"),
        *extra,
    ]  # fmt: skip


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
    # b's lease must outlive its freeze, which lasts as long as the workers take to finish:
    # on a loaded machine that was over 15 s, and a's round then lost b (a re-formation).
    conf = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-conf=lease_ttl=120"]
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


def _run_state(etcd: EtcdCluster, run_id: str) -> RdzvState:
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd.endpoints))) as client:
        kv, _ = client.get(keys.state)
    assert kv is not None, f"no state for run {run_id}"
    return decode_state(keys.state.decode(), kv.value)


def test_a_job_retried_with_the_same_id_runs_again_after_a_failure_and_a_success(
    agents: Agents, etcd1: EtcdCluster, tmp_path: Path
) -> None:
    """Scenario 7, as a scheduler retries a job (same --rdzv-id): each run whose nodes
    all left starts again as a new incarnation, whatever its ending. (The worker imports
    no torch: what is tested is the agents' rendezvous.)"""
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import sys\nopen(sys.argv[2], 'a').write('ran\\n')\nsys.exit(int(sys.argv[1]))\n"
    )
    ran = tmp_path / "ran.txt"
    conf = ["--nnodes=1", "--nproc-per-node=1"]
    failing = agents.start("failing", conf, ["3", str(ran)], script=worker)
    assert failing.wait(JOB) == 1, agents.logs()
    assert _run_state(etcd1, agents.run_id).close_mode == "failed"
    for n, name in ((2, "after-failure"), (3, "after-success")):
        retry = agents.start(name, conf, ["0", str(ran)], script=worker)
        assert retry.wait(JOB) == 0, agents.logs()
        assert f"asking to start it again as incarnation {n}" in retry.output()
        state = _run_state(etcd1, agents.run_id)
        assert (state.incarnation, state.closed, state.close_mode) == (n, True, "finished")
    assert ran.read_text() == "ran\n" * 3
    assert agents.leftovers() == []


def test_two_jobs_without_a_run_id_never_share_a_run(
    agents: Agents, etcd1: EtcdCluster, tmp_path: Path
) -> None:
    """Without --rdzv-id a multi-node job is refused at once (exit 2, nothing written).
    (Under Slurm each job takes its own id from SLURM_JOB_ID: tests/unit/test_cli.py.)"""
    conf = ["--nnodes=2", "--nproc-per-node=1"]
    bare = {"SLURM_JOB_ID": "", "SLURM_STEP_ID": "", "PET_RDZV_ID": "", "TAG": agents.run_id}
    refused = [
        agents.start(f"bare-{i}", conf, _script(tmp_path), env=bare, with_run_id=False)
        for i in range(2)
    ]
    for agent in refused:
        assert agent.wait(STARTED) == 2, agents.logs()
        assert (
            agent.output()
            .strip()
            .splitlines()[-1]
            .startswith("etcdrun: error: --rdzv-id: missing; a job of up to 2 nodes needs a run id")
        ), agent.output()
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as client:
        kvs, _ = client.get_prefix(f"{DEFAULT_KEY_PREFIX}/none/".encode())
    assert kvs == [], "a refused agent wrote to etcd"
    assert agents.leftovers() == []


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
    endpoints = [f"127.0.0.1:{p}" for p in free_ports(2)]
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


def _log_time(agent: AgentProc, pattern: str) -> float:
    """When ``agent`` first logged a line matching ``pattern`` (seconds since the epoch;
    the agent logs local time, as does this process)."""
    for line in agent.output().splitlines():
        if line.startswith("[20") and re.search(pattern, line):
            stamp = datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    raise AssertionError(f"{agent.name} never logged {pattern!r}:\n{agent.output()[-3000:]}")


def _pid_owner(agents: Agents, worker_pid: int) -> AgentProc:
    for agent in agents.procs:
        if worker_pid in descendants(agent.pid):
            return agent
    raise AssertionError(f"no agent runs worker pid {worker_pid}\n{agents.logs()}")


def _world(report: Path, size: int, after: float = 0.0) -> list[dict[str, Any]]:
    return [r for r in read_report(report) if r["world_size"] == size and r["time"] > after]


def test_a_third_agent_scales_the_job_up_without_counting_a_restart(
    agents: Agents, tmp_path: Path
) -> None:
    """Scenario 2: 2 x 2 workers, then a third agent joins -> WORLD_SIZE=6, same restart
    count, resumed from the checkpoint, finished."""
    report = tmp_path / "report.jsonl"
    conf = ["--nnodes=1:4", "--nproc-per-node=2", "--rdzv-conf=last_call_timeout=5"]
    # The job waits at epoch 2 until the third agent is in: however long that agent takes
    # to start on a loaded machine, the job cannot finish without it.
    go = tmp_path / "go"
    script = _script(tmp_path, "--hold-at-epoch", "2", "--hold-file", str(go), epochs=16)
    agents.start("a", conf, script)
    agents.start("b", conf, script)
    wait_for("a world of 4", lambda: len(_world(report, 4)) == 4, STARTED, diagnose=agents.logs)
    agents.start("c", conf, script)
    wait_for("a world of 6", lambda: len(_world(report, 6)) == 6, JOB, diagnose=agents.logs)
    go.touch()
    for agent in agents.procs:
        assert agent.wait(JOB) == 0, agents.logs()
    six = _world(report, 6)
    assert _ranks_ok(six, 6), six
    assert {r["env"]["GROUP_WORLD_SIZE"] for r in six} == {"3"}
    assert {r["restart_count"] for r in read_report(report)} == {0}, read_report(report)
    assert min(r["start_epoch"] for r in six) > 0, "the world of 6 did not resume"
    assert len({r["start_epoch"] for r in six}) == 1, six
    assert re.search(r"epoch 16/16: loss \S+ \(world size 6\)", agents.logs()), agents.logs()
    assert agents.leftovers() == []


def test_a_failed_worker_restarts_every_group_once(agents: Agents, tmp_path: Path) -> None:
    """Scenario 3: rank 3 exits 1 once at epoch 1; both groups restart, training resumes
    from epoch 1 and finishes.

    The failing node counts the restart. The other one usually does not: the failing
    node asks for the next round at once, which reaches it as a waiting node (a
    membership change) before its own workers fail on the broken collective; if they
    fail first, it counts one too, as torch's agent would.
    """
    report = tmp_path / "report.jsonl"
    conf = ["--nnodes=2", "--nproc-per-node=2", "--max-restarts=2"]
    script = _script(tmp_path, "--fail-once-at-epoch", "1", "--fail-rank", "3", epochs=3)
    a = agents.start("a", conf, script)
    b = agents.start("b", conf, script)
    assert a.wait(JOB) == 0, agents.logs()
    assert b.wait(JOB) == 0, agents.logs()
    lines = read_report(report)
    first = [r for r in lines if r["start_epoch"] == 0]
    second = [r for r in lines if r["start_epoch"] == 1]
    attempts = sorted((r["group_rank"], r["restart_count"], r["start_epoch"]) for r in lines)
    assert len(lines) == 8, f"{attempts}\n{agents.logs()}"
    assert _ranks_ok(first, 4) and _ranks_ok(second, 4), lines
    failing_node = next(r["group_rank"] for r in first if r["rank"] == 3)
    counts = {(r["group_rank"], r["restart_count"]) for r in second}
    print(f"scenario 3: (group rank, restart count) after the failure: {sorted(counts)}")
    assert (failing_node, 1) in counts, counts
    assert {r["restart_count"] for r in first} == {0}
    assert "epoch 3/3" in a.output() + b.output()
    assert agents.leftovers() == []


def test_losing_a_node_restarts_the_others_within_the_lease_ttl(
    agents: Agents, tmp_path: Path
) -> None:
    """Scenario 4: SIGKILL the agent (and workers) of group rank 0, the coordinator's
    likely seat and the workers' master; the two others train again in a new round."""
    ttl = 3
    report = tmp_path / "report.jsonl"
    conf = [
        "--nnodes=2:3", "--nproc-per-node=1", "--max-restarts=1",
        f"--rdzv-conf=lease_ttl={ttl},last_call_timeout=5",
    ]  # fmt: skip
    script = _script(tmp_path, "--sleep-per-step", "0.1", epochs=12)
    for name in "abc":
        agents.start(name, conf, script)
    wait_for("a world of 3", lambda: len(_world(report, 3)) == 3, STARTED, diagnose=agents.logs)
    victim = _pid_owner(agents, next(r["pid"] for r in _world(report, 3) if r["rank"] == 0))
    killed_at = time.time()
    victim.kill_node()
    wait_for(
        "the survivors' new round",
        lambda: len(_world(report, 2, after=killed_at)) == 2,
        JOB,
        diagnose=agents.logs,
    )
    resumed = _world(report, 2, after=killed_at)
    survivors = [a for a in agents.procs if a is not victim]
    noticed = min(_log_time(a, "membership changed|worker group FAILED") for a in survivors)
    formed = max(_log_time(a, "attempt 1: round complete") for a in survivors)
    first_up = min(r["time"] for r in resumed) - killed_at
    all_up = max(r["time"] for r in resumed) - killed_at
    print(
        f"scenario 4: lease_ttl={ttl} s; from SIGKILL: a survivor restarts "
        f"{noticed - killed_at:.2f} s, new round complete {formed - killed_at:.2f} s, first "
        f"survivor worker running {first_up:.2f} s, both running {all_up:.2f} s"
    )
    assert all_up < ttl + 15, f"{all_up:.1f} s from SIGKILL to a new round, lease TTL {ttl} s"
    assert _ranks_ok(resumed, 2), resumed
    # The survivors' workers may fail on the broken collectives before the lease ends
    # (a counted restart, given back when the group turns out smaller) or be stopped for
    # the membership change first: either way a node loss costs no restart.
    assert {r["restart_count"] for r in resumed} == {0}, resumed
    how = ["refunded" if "not counted (" in a.output() else "uncounted" for a in survivors]
    print(f"scenario 4: survivors' restarts: {how}")
    for agent in agents.procs:
        if agent is not victim:
            assert agent.wait(JOB) == 0, agents.logs()
    assert agents.leftovers() == []


def test_restarts_exhausted_every_agent_fails_naming_the_rank(
    agents: Agents, tmp_path: Path
) -> None:
    """Scenario 5: rank 3 always raises; one restart allowed."""
    conf = ["--nnodes=2", "--nproc-per-node=2", "--max-restarts=1"]
    script = _script(tmp_path, "--always-fail-rank", "3")
    a = agents.start("a", conf, script)
    b = agents.start("b", conf, script)
    codes = a.wait(JOB), b.wait(JOB)
    assert codes == (1, 1), agents.logs()
    error = "RuntimeError: rank 3: failing on purpose (--always-fail-rank)"
    # Rank 3's error and traceback reach the output whichever node gives up first.
    assert any(error in a.output() for a in agents.procs), agents.logs()
    gave_up = [a for a in agents.procs if "Root cause (first failure):" in a.output()]
    assert len(gave_up) >= 1, agents.logs()
    for agent in gave_up:
        report = agent.output().split("Root cause (first failure):", 1)[1]
        first = re.search(r"rank +: (\d) \(local rank \d\)", report)
        assert first is not None, report
        if re.search(r"rank +: 3 \(local rank 1\)", report):
            # Rank 3's node: its peer rank 2 broke in the same second, but rank 3 exited
            # first, so rank 3 is the root cause, with its error and traceback.
            assert first.group(1) == "3", report
            assert f"error      : {error}" in report, report
            assert "raise RuntimeError" in report, "the worker's traceback is missing"
    for agent in agents.procs:
        if agent in gave_up:
            continue
        # The other node found the run closed by the one that gave up, with its reason
        # (rank 3's error when rank 3's node gave up; else the collective it broke).
        lines = [x for x in agent.output().splitlines() if x.startswith("etcdrun: error: ")]
        assert len(lines) == 1, agent.output()
        closer = re.fullmatch(
            rf"etcdrun: error: run '{agents.run_id}' is closed \(node \d \(.+\) gave up "
            r"after 1 restart: rank (\d) failed: (.+)\): it admits no more "
            r"nodes; start the job again \(same --rdzv-id\) once every node of this run "
            "has left",
            lines[0],
        )
        assert closer is not None, lines[0]
        if closer.group(1) in ("2", "3"):
            assert closer.groups() == ("3", error), lines[0]
    assert agents.leftovers() == []


def test_sigterm_makes_an_agent_leave_and_the_others_carry_on(
    agents: Agents, etcd1: EtcdCluster, tmp_path: Path
) -> None:
    """Scenario 6: SIGTERM one of three agents (min_nodes 2); a long lease TTL shows that
    its key goes at once because it leaves, not because the lease expired."""
    report = tmp_path / "report.jsonl"
    grace = 5.0
    conf = [
        "--nnodes=2:3", "--nproc-per-node=1", "--max-restarts=3", f"--shutdown-timeout={grace}",
        "--rdzv-conf=lease_ttl=30,last_call_timeout=5",
    ]  # fmt: skip
    script = _script(tmp_path, "--sleep-per-step", "0.1", epochs=10)
    for name in "abc":
        agents.start(name, conf, script)
    wait_for("a world of 3", lambda: len(_world(report, 3)) == 3, STARTED, diagnose=agents.logs)
    assert _node_keys(etcd1, agents.run_id) == 3
    victim = _pid_owner(agents, next(r["pid"] for r in _world(report, 3) if r["rank"] == 1))
    workers = descendants(victim.pid)
    stopped_at = time.time()
    victim.proc.send_signal(signal.SIGTERM)
    wait_for(
        f"the workers {workers} to end",
        lambda: not [pid for pid in workers if alive(pid)],
        grace,
        diagnose=agents.logs,
    )
    assert victim.wait(30) == 128 + signal.SIGTERM, victim.output()
    took = time.time() - stopped_at
    # The lease TTL is 30 s: a key gone now was revoked by leave(), not expired.
    assert _node_keys(etcd1, agents.run_id) == 2, "the stopped node's key is still there"
    print(f"scenario 6: SIGTERM -> agent exited, workers gone, key revoked: {took:.2f} s")
    wait_for(
        "the others' new round",
        lambda: len(_world(report, 2, after=stopped_at)) == 2,
        JOB,
        diagnose=agents.logs,
    )
    # The stopped node left while its workers stopped (its revoke lands first), so the
    # others restarted for a membership change (a restart counted for their workers'
    # broken collectives would be given back: the round is smaller).
    assert {r["restart_count"] for r in _world(report, 2, after=stopped_at)} == {0}
    for agent in agents.procs:
        if agent is not victim:
            assert agent.wait(JOB) == 0, agents.logs()
    assert "epoch 10/10" in "".join(a.output() for a in agents.procs)
    assert agents.leftovers() == []
