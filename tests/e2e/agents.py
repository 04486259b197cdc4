"""Helpers for end-to-end tests that run several ``etcdrun`` agents as real processes.

Every agent runs in its own session with its output in a log file (a pipe nobody reads
could fill up and block it). Its workers run in sessions of their own (the agent signals
each worker's group), so killing an agent's process group does not reach them:
:meth:`AgentProc.kill_node` kills the agent and every descendant, as losing the machine
would, and :meth:`Agents.reap` sweeps anything whose command line or environment carries
the test's run id, so nothing outlives a test even when it fails half way.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "ETCDRUN",
    "EXAMPLE",
    "ROOT",
    "AgentProc",
    "Agents",
    "alive",
    "descendants",
    "read_report",
    "wait_for",
]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
ETCDRUN = Path(sys.executable).parent / "etcdrun"


def read_report(path: Path) -> list[dict[str, Any]]:
    """The example's per-worker, per-attempt JSON lines (none yet: empty)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(
    what: str, predicate: Callable[[], bool], timeout: float, *, diagnose: Callable[[], str]
) -> None:
    """Poll ``predicate`` until it holds; fail with ``diagnose()`` after ``timeout``.

    The processes under test tell us nothing but what they write to files, so a test
    has to look; 0.1 s between looks is far below every bound asserted here.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            raise AssertionError(
                f"timed out after {timeout:.0f} s waiting for {what} (load average {load})"
                f"\n{diagnose()}"
            )
        time.sleep(0.1)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name (field 2) may hold spaces and parentheses: split after it.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def descendants(pid: int) -> list[int]:
    """Every living descendant of ``pid`` (children first)."""
    tree = _children()
    found: list[int] = []
    todo = list(tree.get(pid, []))
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo.extend(tree.get(child, []))
    return found


def _mentions(pid: int, needle: bytes) -> bool:
    for name in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                if needle in f.read():
                    return True
        except OSError:
            continue
    return False


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot; None: gone). With the time, a pid
    names one process: the kernel reuses pids (32768 of them here), and on a machine
    busy with other test runs a dead child's pid may belong to a stranger seconds later."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def still_running(started: dict[int, int | None]) -> list[int]:
    """The processes of ``started`` (pid -> :func:`start_time`) that run now: the same
    pid with the same start time, not a zombie."""
    return [pid for pid, when in started.items() if alive(pid) and start_time(pid) == when]


class AgentProc:
    """One ``etcdrun`` process of a test."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.name = name
        self.proc = proc
        self.log = log

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait(self, timeout: float) -> int:
        """The exit code; fails the test (with the log tail) after ``timeout``."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"agent {self.name} still runs after {timeout:.0f} s:\n{self.output()[-4000:]}"
            ) from None

    def kill_node(self) -> list[int]:
        """SIGKILL the agent and all its descendants at once, as a lost machine; returns
        the pids killed."""
        pids = [self.pid, *descendants(self.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(30)
        return pids


class Agents:
    """Starts agents of one run and reaps everything of that run at the end."""

    def __init__(self, run_id: str, endpoint: str, tmp_path: Path) -> None:
        self.run_id = run_id
        self.endpoint = endpoint
        self.tmp_path = tmp_path
        self.procs: list[AgentProc] = []

    def start(
        self,
        name: str,
        etcdrun_args: Sequence[str],
        script_args: Sequence[str] = (),
        *,
        endpoint: str | None = None,
        script: Path = EXAMPLE,
        env: dict[str, str] | None = None,
        with_run_id: bool = True,
    ) -> AgentProc:
        """Start ``etcdrun <etcdrun_args> --rdzv-endpoint=… --rdzv-id=… SCRIPT <script_args>``
        (the example by default), with ``env`` added to this process's environment
        (without ``--rdzv-id`` if not ``with_run_id``: put the run id in ``env`` then, so
        that :meth:`leftovers` finds the processes)."""
        env = {**os.environ, **(env or {})}
        env.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy:UserWarning")
        env["TMPDIR"] = str(self.tmp_path)
        argv = [
            str(ETCDRUN),
            *etcdrun_args,
            f"--rdzv-endpoint={endpoint or self.endpoint}",
            *([f"--rdzv-id={self.run_id}"] if with_run_id else []),
            str(script),
            *script_args,
        ]
        log = self.tmp_path / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        agent = AgentProc(name, proc, log)
        self.procs.append(agent)
        return agent

    def logs(self) -> str:
        """Every agent's log tail, for failure messages."""
        return "\n".join(
            f"----- {a.name} (pid {a.pid}, exit {a.proc.poll()}) -----\n{a.output()[-3000:]}"
            for a in self.procs
        )

    def leftovers(self) -> list[int]:
        """Living processes that belong to this run (agents, workers, their children)."""
        needle = self.run_id.encode()
        me = os.getpid()
        return [
            int(e)
            for e in os.listdir("/proc")
            if e.isdigit() and int(e) != me and alive(int(e)) and _mentions(int(e), needle)
        ]

    def reap(self) -> list[int]:
        """SIGKILL whatever of this run still runs and reap our children; returns the
        pids that had to be killed."""
        killed: list[int] = []
        for agent in self.procs:
            if agent.proc.poll() is None:
                killed.extend(agent.kill_node())
        for pid in self.leftovers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        for agent in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.proc.wait(30)
        return killed
