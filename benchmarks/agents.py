"""The worker-failure scenario: real agents, real worker processes, one worker exits 1.

Two agents x two workers run ``benchmarks/worker_script.py``: ours (``etcdrun`` with
``--rdzv-backend=etcd-v3``) and stock ``torchrun`` with its c10d backend (and with its
etcd-v2 backend when python-etcd is installed). The worker with global rank 1 exits 1
when the harness says so; the time measured runs from the stamp it writes just before
exiting to the last of the four workers of the next attempt writing its start stamp.
Python start-up of the new workers is included.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.procs import REPO_ROOT, RunError
from benchmarks.runner import Sample, environment, finish, measure
from benchmarks.systems import System
from coordinator.etcd_server import free_port

__all__ = ["agent_argv", "worker_failure"]

_SCRIPT = Path(__file__).resolve().parent / "worker_script.py"
_NNODES = 2
_NPROC = 2
_FILE_POLL_S = 0.02
_GRACE_S = 10.0


def agent_argv(system: System, run_id: str, endpoint: str, out: Path) -> list[str]:
    """The command line of one agent of ``system`` (``etcd-v3``, ``c10d`` or ``etcd-v2``)."""
    common = [
        f"--nnodes={_NNODES}",
        f"--nproc-per-node={_NPROC}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        "--max-restarts=3",
    ]
    tail = [str(_SCRIPT), str(out)]
    if system.name == "etcd-v3":
        launcher = "import sys; from agent.cli.etcdrun import main; sys.exit(main())"
        return [sys.executable, "-c", launcher, "--rdzv-backend=etcd-v3", *common, *tail]
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--rdzv-backend={system.name}", *common, *tail,
    ]  # fmt: skip


def _stamps(out: Path, pattern: str) -> list[tuple[int, int, float]]:
    """Every finished stamp matching ``pattern``: (pid, rank, time.monotonic())."""
    found: list[tuple[int, int, float]] = []
    for path in out.glob(pattern):
        if path.suffix == ".tmp":
            continue
        pid, rank, stamp = path.read_text().split()
        found.append((int(pid), int(rank), float(stamp)))
    return found


def _wait_for(
    out: Path,
    pattern: str,
    count: int,
    after: float,
    deadline: float,
    agents: list[subprocess.Popen[bytes]],
) -> list[tuple[int, int, float]]:
    """Wait until ``count`` stamps matching ``pattern`` and later than ``after`` exist."""
    while True:
        found = [s for s in _stamps(out, pattern) if s[2] > after]
        if len(found) >= count:
            return found
        dead = [a.pid for a in agents if a.poll() is not None]
        if dead:
            raise RunError(f"agent(s) {dead} exited before {count} {pattern!r} stamps")
        if time.monotonic() > deadline:
            raise RunError(f"{len(found)} of {count} {pattern!r} stamps by the deadline")
        # The stamps carry their own times; how soon we notice them does not count.
        time.sleep(_FILE_POLL_S)


def _stop(agents: list[subprocess.Popen[bytes]], out: Path) -> None:
    """SIGTERM every agent's session, then SIGKILL it and any worker left; reap all."""
    for agent in agents:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(agent.pid, signal.SIGTERM)
    for agent in agents:
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(timeout=_GRACE_S)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
    # Workers may live in sessions of their own; their stamps name them.
    for pid, _, _ in _stamps(out, "start-*"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _log_tail(out: Path) -> str:
    lines: list[str] = []
    for path in sorted(out.glob("agent-*.log")):
        text = path.read_text(errors="replace").splitlines()[-8:]
        lines.append(f"--- {path.name}\n" + "\n".join(text))
    return "\n".join(lines)


def _one_run(system: System, timeout: float) -> Sample:
    out = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    os.mkfifo(out / "fail.fifo")
    run_id = f"bench-wf-{uuid.uuid4().hex[:8]}"
    endpoint = system.endpoint() if system.name != "c10d" else f"127.0.0.1:{free_port()}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    agents: list[subprocess.Popen[bytes]] = []
    try:
        for index in range(_NNODES):
            with open(out / f"agent-{index}.log", "wb") as log:
                agents.append(
                    subprocess.Popen(
                        agent_argv(system, run_id, endpoint, out),
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=REPO_ROOT,
                        env=env,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        workers = _NNODES * _NPROC
        _wait_for(out, "start-*", workers, 0.0, deadline, agents)
        with open(out / "fail.fifo", "w") as fifo:
            fifo.write("x")
        t_exit = _wait_for(out, "exit", 1, 0.0, deadline, agents)[0][2]
        restarted = _wait_for(out, "start-*", workers, t_exit, deadline, agents)
        ranks = sorted(rank for _, rank, _ in restarted)
        if ranks != list(range(workers)):
            raise RunError(f"the restarted workers have ranks {ranks}, not 0..{workers - 1}")
        stamps = [stamp for _, _, stamp in restarted]
        return Sample(max(stamps) - t_exit, {"first_new_worker_s": min(stamps) - t_exit})
    except RunError as exc:
        raise RunError(f"{exc}\n{_log_tail(out)}") from None
    finally:
        _stop(agents, out)
        shutil.rmtree(out, ignore_errors=True)


def worker_failure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the scenario for every selected system; see the module docstring."""
    timeout = min(args.timeout, 90.0)

    def run(system: System, _: int) -> Sample:
        return _one_run(system, timeout)

    shared = {
        "nnodes": _NNODES,
        "nproc_per_node": _NPROC,
        "max_restarts": 3,
        "launcher": "etcdrun (ours) / torchrun (torch), each agent's defaults otherwise",
    }
    systems = measure(args.systems, run, args.repeat, shared, lease_ttl=args.lease_ttl)
    method = (
        f"{_NNODES} real agents x {_NPROC} workers (worker_script.py, standard library only) "
        "on this machine; the worker with global rank 1 exits 1; time from the stamp it "
        "writes before exiting to the last of the 4 workers of the next attempt writing its "
        "start stamp (process start included). torchrun uses the named rendezvous backend "
        "with the c10d store hosted by its first agent."
    )
    return {
        "scenario": "worker-failure",
        "point": f"{_NNODES} agents x {_NPROC} workers",
        "unit": "seconds",
        "method": method,
        "environment": environment(),
        "systems": finish(systems),
    }
