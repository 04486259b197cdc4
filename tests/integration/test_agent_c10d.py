"""Our agent loop driven by torch's own c10d rendezvous: two agents, real gloo workers.

Two agents run as threads of this process, each with its own c10d handler (the first
hosts the TCP store). Workers are real subprocesses that form a gloo group from the
environment the agent gives them and all-reduce their ranks, so a wrong RANK,
WORLD_SIZE or MASTER_ADDR/PORT fails the test. The same scenarios run later against the
etcd handler.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from agent.config import LaunchConfig
from agent.loop.agent import Agent
from coordinator.core.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORKER = """
    import json, os, sys, time
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    NAMES = ["RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
             "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "AGENT"]

    @record
    def main() -> None:
        out, mode = sys.argv[1], sys.argv[2]
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if mode == "hang":
            with open(os.path.join(out, f"pid_{os.getpid()}"), "w"):
                pass
            time.sleep(600)
        if mode == "always":
            raise RuntimeError(f"always failing on rank {rank}")
        if mode == "once" and rank == world - 1:
            try:
                fd = os.open(os.path.join(out, "failed_once"), os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                pass
            else:
                os.close(fd)
                raise RuntimeError(f"failing once on rank {rank}")
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        env = {n: os.environ[n] for n in NAMES}
        env["sum"] = total.item()
        name = f"result_{os.environ['AGENT']}_{rank}.json"
        with open(os.path.join(out, name), "w") as f:
            json.dump(env, f)
        dist.destroy_process_group()

    main()
"""


class Job:
    """Two agents with c10d handlers; always stopped, joined and shut down."""

    def __init__(self, tmp_path: Path, run_id: str) -> None:
        self.tmp_path = tmp_path
        self.run_id = run_id
        self.port = free_port()
        self.handlers: list[RendezvousHandler] = []
        self.agents: list[Agent] = []
        self.threads: list[threading.Thread] = []
        self.codes: dict[int, int] = {}
        self.errors: list[BaseException] = []
        self.consoles: list[io.StringIO] = []

    def handler(self, is_host: bool) -> RendezvousHandler:
        params = RendezvousParameters(
            backend="c10d", endpoint=f"127.0.0.1:{self.port}", run_id=self.run_id,
            min_nodes=2, max_nodes=2, local_addr="127.0.0.1", is_host=is_host,
            join_timeout="60", read_timeout="30",
        )  # fmt: skip
        handler = get_rendezvous_handler(params)
        self.handlers.append(handler)
        return handler

    def run(self, mode: str, nprocs: tuple[int, ...], max_restarts: int) -> None:
        self.start(mode, nprocs, max_restarts)
        self.wait()

    def start(self, mode: str, nprocs: tuple[int, ...], max_restarts: int) -> None:
        script = self.tmp_path / "worker.py"
        script.write_text(textwrap.dedent(WORKER))
        for i, nproc in enumerate(nprocs):
            config = LaunchConfig(
                min_nodes=2, max_nodes=2, nproc_per_node=nproc, entrypoint=str(script),
                args=(str(self.tmp_path), mode), rdzv_backend="c10d", rdzv_id=self.run_id,
                max_restarts=max_restarts, log_dir=str(self.tmp_path / f"logs{i}"),
                local_addr="127.0.0.1", exit_barrier_timeout=60, stop_grace_period=2.0,
            )  # fmt: skip
            console = io.StringIO()
            self.consoles.append(console)
            env = {**_base_env(), "AGENT": str(i)}
            agent = Agent(config, self.handler(i == 0), base_env=env, console_err=console)
            self.agents.append(agent)
        for i, agent in enumerate(self.agents):
            thread = threading.Thread(target=self._run_one, args=(i, agent), name=f"agent{i}")
            self.threads.append(thread)
            thread.start()

    def wait(self) -> None:
        for thread in self.threads:
            thread.join(timeout=240)
        assert not any(t.is_alive() for t in self.threads), "agents did not finish in 240 s"
        assert not self.errors, self.errors

    def _run_one(self, i: int, agent: Agent) -> None:
        try:
            self.codes[i] = agent.run()
        except BaseException as exc:
            self.errors.append(exc)

    def close(self) -> None:
        for agent in self.agents:
            agent.request_stop(15)
        for thread in self.threads:
            thread.join(timeout=60)
        for handler in self.handlers:
            handler.shutdown()

    def results(self) -> list[dict[str, str]]:
        return [json.loads(p.read_text()) for p in sorted(self.tmp_path.glob("result_*.json"))]


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}


@pytest.fixture
def job(tmp_path: Path, run_id: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Job]:
    # Each round gets its own TCP store on rank 0 (as with our etcd handler), instead of
    # one store shared across rounds where stale keys of an old gloo group linger.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    j = Job(tmp_path, run_id)
    try:
        yield j
    finally:
        j.close()


def test_success_with_different_nproc_per_node(job: Job) -> None:
    job.run("ok", (2, 1), max_restarts=0)
    assert job.codes == {0: 0, 1: 0}
    results = job.results()
    assert sorted(int(r["RANK"]) for r in results) == [0, 1, 2]
    for r in results:
        assert r["sum"] == 6.0  # 1 + 2 + 3: every rank took part once
        assert (r["WORLD_SIZE"], r["GROUP_WORLD_SIZE"], r["ROLE_WORLD_SIZE"]) == ("3", "2", "3")
        assert r["LOCAL_WORLD_SIZE"] == ("2" if r["AGENT"] == "0" else "1")
        assert r["TORCHELASTIC_RESTART_COUNT"] == "0"
    assert all(a.report is None for a in job.agents)


def test_worker_failing_once_restarts_once(job: Job) -> None:
    job.run("once", (1, 1), max_restarts=2)
    assert job.codes == {0: 0, 1: 0}
    counts = sorted(a.restart_count for a in job.agents)
    assert counts == [0, 1]  # the failing node counted it; the other restarted for free
    results = job.results()
    assert sorted(int(r["RANK"]) for r in results) == [0, 1]
    for r in results:
        assert r["sum"] == 3.0
        agent = job.agents[int(r["AGENT"])]
        assert r["TORCHELASTIC_RESTART_COUNT"] == str(agent.restart_count)
    assert all(a.attempt == 1 for a in job.agents)  # both started their workers twice


def test_always_failing_exits_1_with_root_cause(job: Job) -> None:
    job.run("always", (1, 1), max_restarts=1)
    assert job.codes == {0: 1, 1: 1}
    reports = [a.report or "" for a in job.agents]
    assert any("RuntimeError: always failing on rank" in r for r in reports), reports
    for agent, console in zip(job.agents, job.consoles, strict=True):
        assert agent.report is not None
        assert agent.report in console.getvalue()
    gave_up = [a for a in job.agents if a.failures]
    assert gave_up, "no agent recorded a failure"
    for agent in gave_up:
        assert agent.restart_count == 1
        (failure,) = agent.failures.values()
        assert failure.exitcode == 1
        assert 'raise RuntimeError(f"always failing on rank {rank}")' in failure.traceback


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _wait_for(predicate: object, timeout: float, what: str) -> None:
    # Tests may poll for outside effects (files written by workers); product code may not.
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.05)


def _worker_pids(tmp_path: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in tmp_path.glob("pid_*")]


def test_stop_request_returns_143_and_reaps_workers(job: Job) -> None:
    job.start("hang", (2, 1), max_restarts=0)
    _wait_for(lambda: len(_worker_pids(job.tmp_path)) == 3, 120, "3 running workers")
    pids = _worker_pids(job.tmp_path)
    for agent in job.agents:
        agent.request_stop(signal.SIGTERM)
    job.wait()
    assert job.codes == {0: 143, 1: 143}
    assert not [pid for pid in pids if _alive(pid)]


SIGNALLED_AGENT = """
    import sys
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    from agent.loop.agent import Agent
    from agent.config import LaunchConfig
    from agent.loop.stopping import stop_requests

    port, run_id, nodes, script, out = sys.argv[1:]
    handler = get_rendezvous_handler(RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{port}", run_id=run_id, min_nodes=int(nodes),
        max_nodes=int(nodes), local_addr="127.0.0.1", is_host=True, join_timeout="120"))
    config = LaunchConfig(min_nodes=int(nodes), max_nodes=int(nodes), nproc_per_node=2,
                          entrypoint=script, args=(out, "hang"), stop_grace_period=2.0,
                          local_addr="127.0.0.1")
    agent = Agent(config, handler)
    with stop_requests(agent.request_stop):
        print("ready", flush=True)
        code = agent.run()
    sys.exit(code)
"""


@pytest.mark.parametrize(
    ("phase", "signum"),
    [("rendezvous", signal.SIGTERM), ("running", signal.SIGTERM), ("running", signal.SIGINT)],
)
def test_signal_stops_agent_with_128_plus_signum(
    tmp_path: Path, run_id: str, phase: str, signum: signal.Signals
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(SIGNALLED_AGENT))
    # "rendezvous": the agent waits for a second node that never comes.
    nodes = "2" if phase == "rendezvous" else "1"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    argv = [sys.executable, str(driver), str(free_port()), run_id, nodes, str(script)]
    proc = subprocess.Popen([*argv, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        if phase == "running":
            _wait_for(lambda: len(_worker_pids(tmp_path)) == 2, 120, "2 running workers")
        else:
            threading.Event().wait(2.0)  # let it enter next_rendezvous()
        pids = _worker_pids(tmp_path)
        start = time.monotonic()
        proc.send_signal(signum)
        code = proc.wait(timeout=60)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"{phase} {signum.name}: agent exited {code} in {took:.2f} s")
    assert code == 128 + signum
    assert not [pid for pid in pids if _alive(pid)]
