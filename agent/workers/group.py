"""Start, watch and stop this node's worker processes.

Each worker is a subprocess in its own session (so its process group can be signalled
as a whole, children included). One waiter thread per worker blocks in ``wait()`` and
calls the group's wake callback the moment the worker exits, so the agent's loop reacts
at once instead of polling. Stopping sends SIGTERM to every group, waits up to a grace
period (on the waiters' events, not a sleep), then SIGKILLs what is left and reaps it.

Workers die with the agent (DESIGN §9, "no process outlives the agent"): on Linux each
is started by :func:`coordinator.core.lifeline.spawn`, so the kernel SIGKILLs it when
the agent process ends, even by SIGKILL, whichever thread called :meth:`WorkerGroup.start`
(the fork happens on the lifeline's own long-lived thread; see that module for why
neither ``preexec_fn`` nor the caller's thread would do). What the kernel kills is the
worker itself; processes the worker started (its own session) get no signal from the
kernel and must watch their parent, as torch's DataLoader workers do. Elsewhere than on
Linux a SIGKILLed agent leaves its workers running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from string import Template
from typing import Protocol, TextIO

from agent.workers.launch import WorkerLaunch, WorkerRanks
from agent.workers.logs import LinePump
from agent.workers.starts import start_cold, start_warm, warm_claims
from agent.workers.state import WorkerState
from agent.workers.warm import WarmPool
from agent.workers.warm_interpreter import WarmInterpreter
from coordinator.core.lifeline import Spawned
from coordinator.core.settings import PASSWORD_ENV

__all__ = [
    "RUN_PATH_CODE",
    "Exited",
    "GroupInfo",
    "WorkerGroup",
    "WorkerLauncher",
    "WorkerStartError",
    "build_argv",
    "omp_num_threads",
    "without_secrets",
    "worker_env",
]

log = logging.getLogger(__name__)

# --run-path: run the script with runpy in a fresh interpreter, with the script as argv[0].
RUN_PATH_CODE = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)

# How long to wait for SIGKILLed processes to be reaped before reporting them stuck
# (a process in uninterruptible sleep ignores even SIGKILL until the kernel lets go).
_REAP_AFTER_KILL = 30.0


class WorkerStartError(RuntimeError):
    """A worker process could not be started (the program does not exist, ...)."""


def build_argv(
    entrypoint: str,
    args: Sequence[str],
    *,
    module: bool = False,
    no_python: bool = False,
    run_path: bool = False,
    local_rank: int = 0,
    python: str | None = None,
) -> list[str]:
    """The command line of one worker, as torchrun builds it.

    ``${local_rank}`` in the arguments becomes the worker's local rank (torch's macro).
    Python runs unbuffered (``-u``); ``python`` defaults to ``$PYTHON_EXEC`` or this
    interpreter.

    Raises:
        ValueError: ``no_python`` together with ``module`` or ``run_path``.
    """
    if no_python and (module or run_path):
        other = "--module" if module else "--run-path"
        raise ValueError(f"--no-python cannot be combined with {other}; drop one of them")
    if module and run_path:
        raise ValueError("--module cannot be combined with --run-path; drop one of them")
    rest = [Template(a).safe_substitute(local_rank=local_rank) for a in args]
    if no_python:
        return [entrypoint, *rest]
    interpreter = python or os.environ.get("PYTHON_EXEC", sys.executable)
    if run_path:
        return [interpreter, "-u", "-c", RUN_PATH_CODE, entrypoint, *rest]
    if module:
        return [interpreter, "-u", "-m", entrypoint, *rest]
    return [interpreter, "-u", entrypoint, *rest]


def omp_num_threads(base_env: Mapping[str, str], nproc: int) -> str | None:
    """``"1"`` when several workers share the node and the user set no OMP_NUM_THREADS
    (torchrun's default, to keep the node from being overloaded), else None."""
    if nproc > 1 and "OMP_NUM_THREADS" not in base_env:
        return "1"
    return None


@dataclass(frozen=True)
class GroupInfo:
    """What every worker of this node's group shares for one round."""

    role: str
    group_rank: int
    group_world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    run_id: str
    use_agent_store: bool


# The etcd password never reaches a worker: training code has no use for it, and it
# would otherwise be one `env` away from every library a worker loads.
_SECRET_ENV = (PASSWORD_ENV, "RDZVCTL_PASSWORD")


def without_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the etcd password: its variables dropped, and ``password=`` dropped
    from ``PET_RDZV_CONF`` (torchrun's variable for ``--rdzv-conf``)."""
    kept = {name: value for name, value in env.items() if name not in _SECRET_ENV}
    conf = kept.get("PET_RDZV_CONF")
    if conf is not None:
        kept["PET_RDZV_CONF"] = ",".join(
            item for item in conf.split(",") if item.partition("=")[0].strip() != "password"
        )
    return kept


def worker_env(
    base_env: Mapping[str, str], group: GroupInfo, ranks: WorkerRanks, error_file: str
) -> dict[str, str]:
    """The full environment of one worker: ``base_env`` without the etcd password
    (:func:`without_secrets`) plus torchrun's variables."""
    env = without_secrets(base_env)
    env.update(
        {
            "LOCAL_RANK": str(ranks.local_rank),
            "RANK": str(ranks.global_rank),
            "GROUP_RANK": str(group.group_rank),
            "ROLE_RANK": str(ranks.role_rank),
            "ROLE_NAME": group.role,
            "LOCAL_WORLD_SIZE": str(group.local_world_size),
            "WORLD_SIZE": str(ranks.world_size),
            "GROUP_WORLD_SIZE": str(group.group_world_size),
            "ROLE_WORLD_SIZE": str(ranks.role_world_size),
            "MASTER_ADDR": group.master_addr,
            "MASTER_PORT": str(group.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(group.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(group.max_restarts),
            "TORCHELASTIC_RUN_ID": group.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": str(group.use_agent_store),
            "TORCHELASTIC_ERROR_FILE": error_file,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        }
    )
    omp = omp_num_threads(base_env, group.local_world_size)
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    return env


@dataclass(frozen=True)
class Exited:
    """A worker's exit: code (negative: killed by that signal), wall and monotonic time."""

    local_rank: int
    pid: int
    returncode: int
    wall_time: float
    monotonic_time: float


class _Worker:
    def __init__(self, launch: WorkerLaunch, spawned: Spawned) -> None:
        self.launch = launch
        self.spawned = spawned
        self.proc = spawned.process
        self.exited: Exited | None = None
        self.done = threading.Event()
        self.pumps: list[LinePump] = []


class WorkerGroup:
    """This node's workers for one attempt: start once, observe, stop once."""

    def __init__(
        self,
        launches: Sequence[WorkerLaunch],
        wake: Callable[[], None],
        *,
        console_out: TextIO | None = None,
        console_err: TextIO | None = None,
        warm: WarmPool | None = None,
        interrupted: threading.Event | None = None,
    ) -> None:
        """
        Args:
            launches: one per local rank.
            wake: called from a waiter thread each time a worker exits.
            console_out, console_err: where tee'd lines go (default: sys.stdout/stderr
                at start time).
            warm: ready interpreters to start workers from (:mod:`agent.workers.warm`); a
                worker none fits starts cold.
            interrupted: when set (then ``warm.poke()``), a start stops waiting for a
                warm interpreter that is still importing.
        """
        self._launches = list(launches)
        self._wake = wake
        self._console_out = console_out
        self._console_err = console_err
        self._warm = warm
        self._interrupted = interrupted
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._started = False
        self._stopped = False

    def start(self) -> None:
        """Start every worker.

        Every worker is started first, then each one's program is confirmed to run: the
        lifeline's exec trampoline of one worker starts while the next is forked.

        Raises:
            WorkerStartError: a worker could not be started; the whole group is stopped
                and reaped first.
        """
        if self._started:
            raise RuntimeError("WorkerGroup.start: already started; make a new group")
        self._started = True
        with warm_claims(self._warm, self._launches, self._interrupted) as claimed:
            for launch in self._launches:
                try:
                    self._start_one(launch, claimed.pop(launch.ranks.local_rank, None))
                except OSError as exc:
                    self._fail_start(launch, exc)
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            try:
                worker.spawned.confirm()
            except OSError as exc:
                self._fail_start(worker.launch, exc)

    def _fail_start(self, launch: WorkerLaunch, exc: OSError) -> None:
        self.stop(grace=0.0)
        raise WorkerStartError(
            f"cannot start local rank {launch.ranks.local_rank}: {launch.argv[0]!r}: "
            f"{exc.strerror or exc}; check the program path (and --no-python)"
        ) from exc

    def _start_one(self, launch: WorkerLaunch, warm: WarmInterpreter | None) -> None:
        started = start_warm(warm, launch) if warm is not None else None
        spawned, sources = started if started is not None else start_cold(launch)
        worker = _Worker(launch, spawned)
        for source, plan, console in (
            (sources[0], launch.logs.stdout, self._console_out or sys.stdout),
            (sources[1], launch.logs.stderr, self._console_err or sys.stderr),
        ):
            if source is not None and plan.file is not None:
                pump = LinePump(source, plan.file, console, launch.logs.prefix)
                pump.start()
                worker.pumps.append(pump)
        with self._lock:
            self._workers.append(worker)
        threading.Thread(
            target=self._wait, args=(worker,), name=f"waiter pid {spawned.process.pid}",
            daemon=True,
        ).start()  # fmt: skip

    def _wait(self, worker: _Worker) -> None:
        returncode = worker.proc.wait()
        worker.exited = Exited(
            worker.launch.ranks.local_rank,
            worker.proc.pid,
            returncode,
            time.time(),
            time.monotonic(),
        )
        worker.done.set()
        self._wake()

    @property
    def pids(self) -> dict[int, int]:
        """local rank -> pid of every started worker."""
        with self._lock:
            return {w.launch.ranks.local_rank: w.proc.pid for w in self._workers}

    @property
    def launches(self) -> list[WorkerLaunch]:
        """What was (or will be) started, by local rank."""
        return list(self._launches)

    def exits(self) -> dict[int, Exited]:
        """local rank -> exit of every worker that has exited so far."""
        with self._lock:
            workers = list(self._workers)
        return {w.launch.ranks.local_rank: w.exited for w in workers if w.exited is not None}

    def state(self) -> WorkerState:
        """INIT before start, STOPPED after stop; else FAILED if any worker exited
        non-zero, SUCCEEDED if all exited 0, HEALTHY otherwise."""
        if not self._started:
            return WorkerState.INIT
        if self._stopped:
            return WorkerState.STOPPED
        exits = self.exits()
        if any(e.returncode != 0 for e in exits.values()):
            return WorkerState.FAILED
        if len(exits) == len(self._launches):
            return WorkerState.SUCCEEDED
        return WorkerState.HEALTHY

    def stop(
        self,
        grace: float,
        sig: signal.Signals = signal.SIGTERM,
        *,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Stop every worker and everything it started, and reap them. Idempotent.

        Sends ``sig`` to each worker's process group, calls ``then`` (it must not block:
        the grace runs meanwhile), waits up to ``grace`` seconds for them to exit, then
        SIGKILLs the groups (also sweeping children of workers that already exited) and
        waits for the reaping.
        """
        with self._lock:
            workers = list(self._workers)
        self._stopped = True
        for worker in workers:
            worker.spawned.abandon()  # a start that failed half way: nobody will confirm
            if not worker.done.is_set():
                _signal_group(worker.proc.pid, sig)
        if then is not None:
            then()
        deadline = time.monotonic() + grace
        for worker in workers:
            worker.done.wait(max(0.0, deadline - time.monotonic()))
        for worker in workers:
            if not worker.done.is_set():
                log.warning(
                    "worker local rank %d (pid %d) did not exit %.1fs after %s; killing it",
                    worker.launch.ranks.local_rank,
                    worker.proc.pid,
                    grace,
                    sig.name,
                )
            # The group outlives its leader when the worker left children behind.
            _signal_group(worker.proc.pid, signal.SIGKILL)
        for worker in workers:
            if not worker.done.wait(_REAP_AFTER_KILL):
                log.error(
                    "worker pid %d still not reaped %.0fs after SIGKILL (stuck in the kernel?)",
                    worker.proc.pid,
                    _REAP_AFTER_KILL,
                )
            for pump in worker.pumps:
                pump.join(timeout=5.0)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(pgid, sig)


class WorkerLauncher(Protocol):
    """How the agent makes each attempt's worker group: :class:`WorkerGroup` itself (the
    default: processes), or a stand-in with its surface. The fleet harness
    (``benchmarks/fleet``) runs the real agent loop with threads standing in for worker
    processes, so that a thousand agents fit on one machine."""

    def __call__(
        self,
        launches: Sequence[WorkerLaunch],
        wake: Callable[[], None],
        *,
        console_out: TextIO | None,
        console_err: TextIO | None,
        warm: WarmPool | None,
        interrupted: threading.Event | None,
    ) -> WorkerGroup: ...
