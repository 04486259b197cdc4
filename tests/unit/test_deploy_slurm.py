"""deploy/slurm/etcdrun.sbatch, run without Slurm: stand-ins for srun, scontrol, etcd and
etcdrun (tests/unit/deploy_standins.py) record what each node would run, and the tests
pin the exact etcdrun command line and environment of every node, the embedded etcd, the
requeue, and the exit code."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.deploy_standins import calls, pet_variables, write_standins

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "etcdrun.sbatch"
HOSTS = ("gpu01", "gpu02", "gpu03")
JOB = "4242"
EXTERNAL = "etcd1:2379,etcd2:2379,etcd3:2379"
TRAINING = ["train.py", "--lr", "0.1"]
# 20000 + 2 * (job id mod 20000): the embedded etcd's client port; the peer port follows.
PORT = 20000 + int(JOB) % 20000 * 2
TIMEOUT = 60.0
# One task per node; an agent that fails does not take the others down.
_AGENTS_STEP = ["--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--kill-on-bad-exit=0"]


class Job:
    """One test's fake allocation: the stand-ins, their log, and the job's environment."""

    def __init__(self, folder: Path) -> None:
        self.log = folder / "calls.jsonl"
        self.tmp = folder / "tmp"
        self.tmp.mkdir()
        self.env = {
            "PATH": f"{write_standins(folder / 'bin')}:/usr/bin:/bin",
            "HOME": str(folder),
            "TMPDIR": str(self.tmp),
            "STANDIN_LOG": str(self.log),
            "SLURM_JOB_ID": JOB,
            "SLURM_JOB_NUM_NODES": str(len(HOSTS)),
            "SLURM_JOB_NODELIST": ",".join(HOSTS),
            "SLURM_RESTART_COUNT": "0",
            "ETCD_ENDPOINTS": EXTERNAL,
        }

    def run(self, *args: str, **env: str | None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(SCRIPT), *args],
            env={k: v for k, v in {**self.env, **env}.items() if v is not None},
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )

    def agents(self) -> list[dict[str, Any]]:
        """The etcdrun calls, by node."""
        return sorted(calls(self.log, "etcdrun"), key=lambda c: int(c["env"]["SLURM_NODEID"]))


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    made = Job(tmp_path)
    yield made
    # Whatever a failed test left running goes with it.
    for call in calls(made.log):
        with contextlib.suppress(ProcessLookupError):
            os.kill(call["pid"], signal.SIGKILL)


def _flags(endpoint: str, rdzv_id: str = f"slurm-{JOB}") -> list[str]:
    return [
        "--nnodes=3:3",
        "--nproc-per-node=gpu",
        "--max-restarts=3",
        "--rdzv-backend=etcd-v2",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
    ]


def test_one_agent_per_node_with_the_derived_run_id_and_the_external_etcd(job: Job) -> None:
    done = job.run(*TRAINING)

    assert done.returncode == 0, done.stderr
    (srun,) = calls(job.log, "srun")
    assert srun["argv"] == [
        *_AGENTS_STEP,
        "etcdrun",
        *_flags(EXTERNAL),
        *TRAINING,
    ]
    agents = job.agents()
    assert [a["env"]["SLURMD_NODENAME"] for a in agents] == list(HOSTS)
    for agent in agents:
        assert agent["argv"] == [*_flags(EXTERNAL), *TRAINING]
        # Configured by flags alone: nothing a PET_ default could change.
        assert pet_variables(agent["env"]) == {}
        assert agent["env"]["SLURM_JOB_ID"] == JOB
    assert calls(job.log, "etcd") == [] and calls(job.log, "scontrol") == []
    assert done.stderr == (
        f"etcdrun.sbatch: job {JOB} (requeued 0 times): run slurm-{JOB} on 3 to 3 nodes, "
        f"etcd at {EXTERNAL}\n"
    )


def test_without_endpoints_it_starts_one_etcd_on_the_first_node_and_stops_it(job: Job) -> None:
    up = job.tmp / "etcd-up"
    os.mkfifo(up)
    data = job.tmp / f"etcd-elastic-{JOB}"
    data.mkdir()

    done = job.run(*TRAINING, ETCD_ENDPOINTS=None, STANDIN_ETCD_UP=str(up))

    assert done.returncode == 0, done.stderr
    # Both steps run at once: which one records first is up to the scheduler.
    steps = calls(job.log, "srun")
    (etcd_step,) = [step for step in steps if "--overlap" in step["argv"]]
    (agents_step,) = [step for step in steps if "--overlap" not in step["argv"]]
    assert etcd_step["argv"][:4] == ["--overlap", "--nodes=1", "--ntasks=1", "--nodelist=gpu01"]
    (etcd,) = calls(job.log, "etcd")
    peer = f"http://127.0.0.1:{PORT + 1}"
    assert etcd["argv"] == [
        f"--name=etcd-{JOB}",
        f"--data-dir={data}",
        f"--listen-client-urls=http://0.0.0.0:{PORT}",
        f"--advertise-client-urls=http://gpu01:{PORT}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=etcd-{JOB}={peer}",
        "--log-level=warn",
    ]
    assert etcd["env"]["SLURMD_NODENAME"] == "gpu01"
    assert [a["argv"] for a in job.agents()] == [[*_flags(f"gpu01:{PORT}"), *TRAINING]] * 3
    assert agents_step["argv"][:4] == _AGENTS_STEP
    # Stopped and its data removed when the agents are done.
    with pytest.raises(ProcessLookupError):
        os.kill(etcd["pid"], 0)
    assert not data.exists()


def _read_lines(fd: int, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    data = b""
    while (lines := data.count(b"\n")) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"{lines} of {count} agents reported running"
        if select.select([fd], [], [], left)[0]:
            data += os.read(fd, 4096)


def test_the_time_limit_warning_requeues_the_job_and_the_next_attempt_keeps_the_run_id(
    job: Job,
) -> None:
    ready = job.tmp / "ready"
    os.mkfifo(ready)
    reader = os.open(ready, os.O_RDONLY | os.O_NONBLOCK)
    # Held open so that the FIFO never reads as closed between two agents' lines.
    writer = os.open(ready, os.O_WRONLY)
    script = subprocess.Popen(
        ["bash", str(SCRIPT), *TRAINING],
        env={**job.env, "STANDIN_READY": str(ready)},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _read_lines(reader, len(HOSTS))
        # What Slurm sends the batch shell 300 s before the time limit (--signal=B:USR1@300).
        script.send_signal(signal.SIGUSR1)
        _, stderr = script.communicate(timeout=TIMEOUT)
    finally:
        os.close(reader)
        os.close(writer)
        if script.poll() is None:
            script.kill()
            script.wait()

    assert [c["argv"] for c in calls(job.log, "scontrol")] == [["requeue", JOB]]
    # The agents were stopped as Slurm stops a requeued job's steps (SIGTERM: 143).
    assert script.returncode == 143
    assert (
        f"etcdrun.sbatch: time limit near: requeueing job {JOB}; run slurm-{JOB} continues "
        "when it starts again\n"
    ) in stderr
    first_attempt = [a["argv"] for a in job.agents()]

    job.log.unlink()
    again = job.run(*TRAINING, SLURM_RESTART_COUNT="1")

    assert again.returncode == 0, again.stderr
    expected = [[*_flags(EXTERNAL), *TRAINING]] * 3
    assert [a["argv"] for a in job.agents()] == first_attempt == expected
    assert f"job {JOB} (requeued 1 times): run slurm-{JOB}" in again.stderr


def test_an_agent_that_fails_fails_the_job_without_stopping_the_others(job: Job) -> None:
    done = job.run(*TRAINING, STANDIN_EXIT_CODES="0,1,0")

    assert done.returncode == 1
    assert len(job.agents()) == 3
    assert calls(job.log, "scontrol") == []


def test_the_settings_become_flags(job: Job) -> None:
    done = job.run(
        *TRAINING,
        ETCDRUN_RDZV_ID="pretrain-7",
        ETCDRUN_MIN_NODES="2",
        ETCDRUN_NPROC_PER_NODE="4",
        ETCDRUN_MAX_RESTARTS="0",
        ETCDRUN_RDZV_CONF="lease_ttl=10,join_timeout=900",
        ETCDRUN_ARGS="--drain-signal=SIGUSR1  --hang-timeout=120",
    )

    assert done.returncode == 0, done.stderr
    expected = [
        "--nnodes=2:3",
        "--nproc-per-node=4",
        "--max-restarts=0",
        "--rdzv-backend=etcd-v2",
        f"--rdzv-endpoint={EXTERNAL}",
        "--rdzv-id=pretrain-7",
        "--rdzv-conf=lease_ttl=10,join_timeout=900",
        "--drain-signal=SIGUSR1",
        "--hang-timeout=120",
        *TRAINING,
    ]
    assert [a["argv"] for a in job.agents()] == [expected] * 3


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ((), {}, "no training script; usage: sbatch --nodes=N etcdrun.sbatch train.py [args...]"),
        (
            tuple(TRAINING),
            {"SLURM_JOB_ID": None},
            "SLURM_JOB_ID is not set; submit this script with sbatch",
        ),
    ],
    ids=["no-script", "outside-slurm"],
)
def test_a_mistake_is_one_line_and_starts_nothing(
    job: Job, args: tuple[str, ...], env: dict[str, Any], message: str
) -> None:
    done = job.run(*args, **env)

    assert done.returncode == 2
    assert done.stderr == f"etcdrun.sbatch: error: {message}\n"
    assert calls(job.log) == []
