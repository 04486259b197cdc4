"""One job of the recovery benchmark: real agents running the torch worker, and its failure.

A :class:`Job` starts ``nnodes`` agents of one system (ours: ``etcdrun`` over etcd v3;
torch: ``torchrun`` with its c10d backend) on this machine, each in a session of its
own, running ``benchmarks/recovery_worker.py``. It waits for the first attempt's first
step and for the machine to go quiet, breaks the job (a worker crash, or a node lost:
an agent and every process under it SIGKILLed at once) and waits, bounded, for the next
attempt's first step. Every process it started, and every process under them, is killed
and reaped (or left to init, for grandchildren) by :meth:`Job.stop`, even when a run fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.procs import REPO_ROOT, RunError, cpu_seconds
from benchmarks.recovery_breakdown import (
    WorkerRecord,
    parse_worker_lines,
    progress,
    recovered_attempt,
)

__all__ = ["Job", "JobSpec", "descendants"]

WORKER_SCRIPT = Path(__file__).resolve().parent / "recovery_worker.py"
TORCH_FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_POLL_S = 0.02
_GRACE_S = 10.0
# The job counts as quiet when its processes use less than this share of one core over
# one window: the first attempt's imports are over and ours has refilled its warm pool,
# as on a machine where the failure comes minutes into training.
_QUIET_CORES = 0.2
_QUIET_WINDOW_S = 1.0
_SETTLE_MAX_S = 60.0
# Names a process of ours may have on its command line (a stale pid is never killed).
_OURS = ("recovery_worker", "warm_process", "agent.cli", "torch.distributed.run", "trampoline")


class JobSpec:
    """What one job runs: system, nodes, workers per node and the agents' settings."""

    def __init__(
        self,
        system: str,
        endpoint: str,
        run_id: str,
        nnodes: int,
        nproc: int,
        min_nodes: int,
        lease_ttl: int,
        external_store: bool = False,
        max_restarts: int = 3,
    ) -> None:
        self.system = system
        self.external_store = external_store
        self.endpoint = endpoint
        self.run_id = run_id
        self.nnodes = nnodes
        self.nproc = nproc
        self.min_nodes = min_nodes
        self.lease_ttl = lease_ttl
        self.max_restarts = max_restarts

    def argv(self, out: Path, checkpoint: Path) -> list[str]:
        """One agent's command line."""
        nnodes = (
            str(self.nnodes) if self.min_nodes == self.nnodes else f"{self.min_nodes}:{self.nnodes}"
        )
        common = [
            f"--nnodes={nnodes}",
            f"--nproc-per-node={self.nproc}",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            f"--max-restarts={self.max_restarts}",
        ]
        tail = [str(WORKER_SCRIPT), str(out), str(checkpoint)]
        if self.system == "etcd-v3":
            launcher = "import sys; from agent.cli.etcdrun import main; sys.exit(main())"
            conf = f"--rdzv-conf=lease_ttl={self.lease_ttl}"
            return [sys.executable, "-c", launcher, "--rdzv-backend=etcd-v3", conf, *common, *tail]
        # torchrun's own deployment: the agent on the endpoint's host hosts the TCPStore.
        # With ``external_store`` the harness hosts it (``is_host=false``), so that losing
        # any node, the store's host included, leaves torchrun a rendezvous.
        store = ["--rdzv-conf=is_host=false"] if self.external_store else []
        return [
            sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=c10d",
            *store, *common, *tail,
        ]  # fmt: skip


def _ppids() -> dict[int, int]:
    table: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            table[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return table


def descendants(roots: list[int]) -> list[int]:
    """``roots`` and every live process below them (children first seen, then theirs)."""
    table = _ppids()
    found = [r for r in roots if r in table]
    index = 0
    while index < len(found):
        parent = found[index]
        found.extend(pid for pid, ppid in table.items() if ppid == parent and pid not in found)
        index += 1
    return found


def _cmdline_has(pid: int, *names: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return any(name in cmdline for name in names)


def _is_ours(pid: int) -> bool:
    return _cmdline_has(pid, *_OURS)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


class Job:
    """The agents of one run and what their workers stamped (see the module docstring)."""

    def __init__(self, spec: JobSpec, out: Path, checkpoint: Path, env: dict[str, str]) -> None:
        self.spec = spec
        self.out = out
        self.history = out / "history.jsonl"
        self.agents: list[subprocess.Popen[bytes]] = []
        self._killed: set[int] = set()
        child_env = dict(env)
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p
        )
        if spec.system == "etcd-v3":
            child_env["ETCD_ELASTIC_JOURNAL"] = str(self.history)
        else:
            # With torch 2.13's default (the workers reuse the agent's TCPStore across
            # attempts) a restart's gloo init reads the dead attempt's addresses and fails
            # ("connectFullMesh ... Connection refused"), attempt after attempt, until the
            # restarts run out; torch's own opt-out gives each attempt a fresh store.
            child_env[TORCH_FRESH_STORE_ENV] = "1"
        argv = spec.argv(out, checkpoint)
        for index in range(spec.nnodes):
            with open(out / f"agent-{index}.log", "wb") as log:
                self.agents.append(
                    subprocess.Popen(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=REPO_ROOT,
                        env=child_env,
                        start_new_session=True,
                    )
                )

    def workers(self) -> list[WorkerRecord]:
        """Every worker that stamped its start so far."""
        found: list[WorkerRecord] = []
        for path in self.out.glob("w-*.jsonl"):
            with contextlib.suppress(OSError):
                record = parse_worker_lines(path.read_text())
                if record is not None:
                    found.append(record)
        return found

    def _check_alive(self, what: str) -> None:
        dead = [a.pid for a in self.agents if a.pid not in self._killed and a.poll() is not None]
        if dead:
            raise RunError(f"agent(s) {dead} exited while waiting for {what}")

    def wait_step(self, after: float, world: int, deadline: float, what: str) -> list[WorkerRecord]:
        """Wait until a group of ``world`` workers started after ``after`` completed a step.

        Raises:
            RunError: an agent exited, or the deadline passed.
        """
        while True:
            # The stamps carry their own times: how soon they are read does not count.
            group = recovered_attempt(self.workers(), after, world)
            if group is not None:
                return group
            self._check_alive(what)
            if time.monotonic() > deadline:
                late = progress(self.workers(), after)
                raise RunError(f"{what}: no first step of {world} workers by the deadline; {late}")
            time.sleep(_POLL_S)

    def settle(self, deadline: float, idle_interpreters: int = 0) -> bool:
        """Wait until the job is quiet; False if it was not within ``_SETTLE_MAX_S``.

        Quiet: at least ``idle_interpreters`` warm interpreters (ours) wait under the
        agents beside the workers, each using no CPU over ``_QUIET_WINDOW_S`` (one still
        importing always uses some, however loaded the machine: a share of the job's CPU
        alone cannot tell it on a busy machine), and the job's processes used less than
        ``_QUIET_CORES`` of a core over the window.
        """
        stop = min(deadline, time.monotonic() + _SETTLE_MAX_S)
        while time.monotonic() < stop:
            pids = descendants([a.pid for a in self.agents])
            workers = {w.pid for w in self.workers()}
            warm = [p for p in pids if p not in workers and _cmdline_has(p, "warm_process")]
            cpu = {p: self._cpu(p) for p in pids}
            time.sleep(_QUIET_WINDOW_S)
            after = {p: self._cpu(p) for p in pids}
            used = sum(after.values()) - sum(cpu.values())
            idle = sum(1 for p in warm if after[p] == cpu[p])
            if idle >= idle_interpreters and used < _QUIET_CORES * _QUIET_WINDOW_S:
                return True
            self._check_alive("the job to go quiet")
        return False

    @staticmethod
    def _cpu(pid: int) -> float:
        try:
            return cpu_seconds(pid)
        except (OSError, IndexError, ValueError):
            return 0.0

    def crash_worker(self, deadline: float) -> float:
        """Make the crashing worker exit 1 at its next step; return its ``fail`` stamp."""
        (self.out / "crash").touch()
        while True:
            fails = [w.times["fail"] for w in self.workers() if "fail" in w.times]
            if fails:
                return max(fails)
            self._check_alive("the worker crash")
            if time.monotonic() > deadline:
                raise RunError("the crashing worker did not crash by the deadline")
            time.sleep(_POLL_S)

    def kill_node_of(self, pid: int) -> float:
        """SIGKILL the agent above worker ``pid`` and every process under it at once.

        Returns:
            ``time.monotonic()`` just before the first kill.

        Raises:
            RunError: no agent of this job is above ``pid``.
        """
        table = _ppids()
        agents = {a.pid for a in self.agents}
        node = pid
        while node not in agents:
            node = table.get(node, 0)
            if node <= 1:
                raise RunError(f"worker {pid} is under none of the agents {sorted(agents)}")
        tree = descendants([node])
        self._killed.add(node)
        t_fail = time.monotonic()
        _kill(tree)
        next(a for a in self.agents if a.pid == node).wait()
        return t_fail

    def log_tail(self, lines: int = 8) -> str:
        parts: list[str] = []
        for path in sorted(self.out.glob("agent-*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def stop(self) -> None:
        """SIGTERM every agent, then SIGKILL whatever is left under them; reap the agents."""
        tree = descendants([a.pid for a in self.agents])
        for agent in self.agents:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(agent.pid, signal.SIGTERM)
        for agent in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=_GRACE_S)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        # Workers may live in sessions of their own; the stamps name them too.
        left = set(tree) | {w.pid for w in self.workers()}
        _kill([pid for pid in left if _is_ours(pid)])
