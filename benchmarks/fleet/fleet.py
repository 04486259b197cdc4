"""The driver's side of the fleet: host processes in fixed slots, the agents' events.

A fleet has a layout: slot ``i`` holds ``sizes[i]`` simulated agents of each job, in one
host process (:mod:`benchmarks.fleet.host`). A job builds its agents in every slot (a
slot whose process was killed gets a new one), runs them from one common start and is
released once its agents have exited; host processes are kept across jobs (torch is
imported once per slot, not per job). Every event a host reports lands in one table
that the phases wait on (:meth:`Fleet.wait_for`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.procs import Child, RunError, cpu_seconds

__all__ = ["AgentStart", "Fleet", "FleetSettings", "JobSpec"]

_HOST_UP_S = 120.0  # a host imports torch and our agent before it answers


@dataclass(frozen=True)
class FleetSettings:
    """What every host process is told (see :mod:`benchmarks.fleet.host`)."""

    endpoint: str
    log_dir: str
    step_s: float = 0.25
    client: str = "per-agent"


@dataclass(frozen=True)
class JobSpec:
    """One job of the fleet: its run id, its sizes and its agents' settings."""

    run_id: str
    nodes: int
    min_nodes: int
    conf: dict[str, Any]
    hang_timeout: float | None = None
    health_check: bool = False
    monitor_interval: float = 1.0


@dataclass(frozen=True)
class AgentStart:
    """One start of an agent's (stand-in) workers, as its host reported it."""

    agent: int
    run: str
    round: int
    rank: int
    world: int
    formed_s: float | None
    t: float


@dataclass
class _Table:
    """Everything the hosts reported, by agent."""

    starts: dict[int, list[AgentStart]] = field(default_factory=dict)
    stops: dict[int, list[float]] = field(default_factory=dict)
    exits: dict[int, tuple[int, float]] = field(default_factory=dict)
    answers: dict[tuple[str, int], list[dict[str, Any]]] = field(default_factory=dict)
    dead: dict[int, str] = field(default_factory=dict)  # host tag -> why (unexpected)


class Fleet:
    """Host processes in slots, and the table of their agents' events.

    Args:
        settings: what every host is told.
        sizes: agents per slot, for every job.
    """

    def __init__(self, settings: FleetSettings, sizes: Sequence[int]) -> None:
        self.settings = settings
        self.sizes = list(sizes)
        self._replies: queue.Queue[Any] = queue.Queue()
        self._hosts: list[Child | None] = [None] * len(self.sizes)
        self._by_tag: dict[int, Child] = {}
        self._expected_gone: set[int] = set()
        self._cond = threading.Condition()
        self._table = _Table()
        self._next_id = 0
        self._next_agent = 0
        self.agents_of_slot: list[list[int]] = [[] for _ in self.sizes]
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, name="fleet-events", daemon=True)
        self._reader.start()

    # -- events ----------------------------------------------------------------------

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                tag, message = self._replies.get(timeout=0.5)
            except queue.Empty:
                continue
            with self._cond:
                self._record(tag, message)
                self._cond.notify_all()

    def _record(self, tag: int, message: dict[str, Any]) -> None:
        event = message.get("event")
        table = self._table
        if event == "started":
            start = AgentStart(
                int(message["agent"]),
                str(message["run"]),
                int(message["round"]),
                int(message["rank"]),
                int(message["world"]),
                message.get("formed_s"),
                float(message["t"]),
            )
            table.starts.setdefault(start.agent, []).append(start)
        elif event == "stopped":
            table.stops.setdefault(int(message["agent"]), []).append(float(message["t"]))
        elif event == "exited":
            table.exits[int(message["agent"])] = (int(message["code"]), float(message["t"]))
        elif event in ("eof", "fatal") and tag not in self._expected_gone:
            child = self._by_tag.get(tag)
            tail = child.log_tail() if child is not None else ""
            table.dead[tag] = f"{message.get('error', 'exited')}\n{tail}"
        if "id" in message and event is not None:
            table.answers.setdefault((str(event), int(message["id"])), []).append(message)

    def wait_for(self, what: str, done: Callable[[], bool], timeout: float) -> None:
        """Wait until ``done()`` (asked under the table's lock, after each event).

        Raises:
            RunError: a host died unexpectedly, or ``timeout`` seconds passed.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while not done():
                if self._table.dead:
                    tag, why = next(iter(self._table.dead.items()))
                    raise RunError(f"{what}: host process {tag} died: {why}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RunError(f"{what}: not done after {timeout:.0f} s")
                self._cond.wait(min(left, 1.0))

    def reset_dead(self) -> None:
        """Forget the hosts that died (a failed job's): the next job starts new ones."""
        with self._cond:
            for tag in self._table.dead:
                self._expected_gone.add(tag)
            self._table.dead.clear()

    def starts_of(self, agent: int) -> list[AgentStart]:
        """Every start of ``agent``'s workers so far (call under :meth:`wait_for`'s
        predicate, or after it)."""
        return list(self._table.starts.get(agent, []))

    def stops_of(self, agent: int) -> list[float]:
        """When the agent stopped its workers, each time."""
        with self._cond:
            return list(self._table.stops.get(agent, []))

    def exit_of(self, agent: int) -> tuple[int, float] | None:
        return self._table.exits.get(agent)

    # -- hosts -----------------------------------------------------------------------

    def _command_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _spawn(self, slot: int) -> Child:
        child = Child(len(self._by_tag), ["-m", "benchmarks.fleet.host"], self._replies)
        self._by_tag[child.index] = child
        child.send(
            {
                "endpoint": self.settings.endpoint,
                "log_dir": self.settings.log_dir,
                "step_s": self.settings.step_s,
                "client": self.settings.client,
                "epoch": time.monotonic(),
            }
        )
        self._hosts[slot] = child
        return child

    def _answers(self, event: str, cmd_id: int, count: int, timeout: float, what: str) -> None:
        self.wait_for(
            what, lambda: len(self._table.answers.get((event, cmd_id), [])) >= count, timeout
        )

    def host(self, slot: int) -> Child | None:
        """The host process of ``slot`` (None: never started)."""
        return self._hosts[slot]

    def live_slots(self) -> list[int]:
        return [i for i, h in enumerate(self._hosts) if h is not None and h.proc.poll() is None]

    def build(self, job: JobSpec) -> list[int]:
        """Build ``job``'s agents, ``sizes[i]`` of them in slot ``i`` (the sizes must add
        up to the job's); returns their indexes."""
        if sum(self.sizes) != job.nodes:
            raise ValueError(f"job of {job.nodes} agents on a layout of {sum(self.sizes)}")
        placed: list[list[tuple[JobSpec, int]]] = []
        for size in self.sizes:
            placed.append([(job, self._new_agent()) for _ in range(size)])
        self._build(placed, job.run_id)
        return [agent for slot in placed for _, agent in slot]

    def build_jobs(self, jobs: Sequence[JobSpec]) -> dict[str, list[int]]:
        """Build the agents of several jobs, dealt over the slots in turn; returns each
        job's agents by run id."""
        placed: list[list[tuple[JobSpec, int]]] = [[] for _ in self.sizes]
        out: dict[str, list[int]] = {}
        turn = 0
        for job in jobs:
            for _ in range(job.nodes):
                agent = self._new_agent()
                placed[turn % len(placed)].append((job, agent))
                out.setdefault(job.run_id, []).append(agent)
                turn += 1
        self._build(placed, f"{len(jobs)} jobs")
        return out

    def _new_agent(self) -> int:
        self._next_agent += 1
        return self._next_agent - 1

    def _build(self, placed: list[list[tuple[JobSpec, int]]], what: str) -> None:
        for slot in range(len(self.sizes)):
            if slot not in self.live_slots():
                self._spawn(slot)
        cmd_id = self._command_id()
        for slot, agents in enumerate(placed):
            self.agents_of_slot[slot] = [agent for _, agent in agents]
            host = self._hosts[slot]
            if host is None:
                raise RunError(f"slot {slot} has no host")
            specs = [self._agent_spec(job, agent) for job, agent in agents]
            host.send({"cmd": "build", "id": cmd_id, "agents": specs})
        timeout = _HOST_UP_S + 0.05 * sum(len(a) for a in placed)
        self._answers("ready", cmd_id, len(self.sizes), timeout, f"building {what}")

    @staticmethod
    def _agent_spec(job: JobSpec, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "run_id": job.run_id,
            "min": job.min_nodes,
            "max": job.nodes,
            "conf": job.conf,
            "hang_timeout": job.hang_timeout,
            "health_check": job.health_check,
            "monitor_interval": job.monitor_interval,
        }

    def run(self, at: float) -> None:
        """Every agent built and not yet run calls ``run()`` at ``at`` (monotonic)."""
        cmd_id = self._command_id()
        for slot in self.live_slots():
            host = self._hosts[slot]
            if host is not None:
                host.send({"cmd": "run", "id": cmd_id, "at": at})

    def slot_of(self, agent: int) -> int:
        for slot, agents in enumerate(self.agents_of_slot):
            if agent in agents:
                return slot
        raise KeyError(f"agent {agent} is in no slot")

    def act(self, agent: int, what: str, code: int = 1) -> float:
        """``fail`` (its worker exits ``code``) or ``stall`` one agent; returns when the
        host did it (monotonic)."""
        host = self._hosts[self.slot_of(agent)]
        if host is None:
            raise RunError(f"agent {agent}'s host is gone")
        key = ("done", agent)
        host.send({"cmd": what, "agent": agent, "code": code, "id": agent})
        self._answers("done", agent, 1, 30.0, f"{what} agent {agent}")
        with self._cond:
            answer = self._table.answers.pop(key)[0]
        return float(answer["t"])

    def finish(self) -> float:
        """Every running worker exits 0 (the training is over); returns when (the
        earliest host's stamp)."""
        cmd_id = self._command_id()
        slots = self.live_slots()
        for slot in slots:
            host = self._hosts[slot]
            if host is not None:
                host.send({"cmd": "finish", "id": cmd_id})
        self._answers("finished", cmd_id, len(slots), 30.0, "finish")
        with self._cond:
            return min(float(a["t"]) for a in self._table.answers[("finished", cmd_id)])

    def release(self) -> None:
        """Let go of the agents that exited (their clients closed)."""
        cmd_id = self._command_id()
        slots = self.live_slots()
        for slot in slots:
            host = self._hosts[slot]
            if host is not None:
                host.send({"cmd": "release", "id": cmd_id})
        self._answers("released", cmd_id, len(slots), 120.0, "release")

    def kill(self, slots: Sequence[int]) -> float:
        """SIGKILL the hosts of ``slots`` at once (their machines are gone); returns the
        moment just before the first kill (monotonic)."""
        hosts = [h for s in slots if (h := self._hosts[s]) is not None]
        for host in hosts:
            self._expected_gone.add(host.index)
            host.killed = True
        t_kill = time.monotonic()
        for host in hosts:
            host.kill()
        for host in hosts:
            with contextlib.suppress(Exception):
                host.proc.wait(timeout=30)
        return t_kill

    def cpu_seconds(self) -> float:
        """CPU used so far by the live hosts (all threads), from /proc."""
        total = 0.0
        for slot in self.live_slots():
            host = self._hosts[slot]
            if host is not None:
                with contextlib.suppress(OSError, IndexError, ValueError):
                    total += cpu_seconds(host.pid)
        return total

    def threads(self) -> int:
        """Threads of the live hosts now."""
        total = 0
        for slot in self.live_slots():
            host = self._hosts[slot]
            if host is not None:
                with contextlib.suppress(OSError):
                    total += len(os.listdir(f"/proc/{host.pid}/task"))
        return total

    def close(self) -> None:
        """Stop every host (they exit at the end of their input) and reap it."""
        for child in self._by_tag.values():
            self._expected_gone.add(child.index)
            child.send({"cmd": "exit"})
        for child in self._by_tag.values():
            child.stop()
        self._stop.set()
        self._reader.join(timeout=5)
