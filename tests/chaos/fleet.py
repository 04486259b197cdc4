"""The chaos run's agents: one slot per agent, each with its own fault proxies to etcd.

A slot holds at most one ``etcdrun`` process at a time; a killed or exited agent leaves
its slot empty until :meth:`Fleet.top_up` starts a new one, so the job keeps its size.
Each slot's agent reaches every etcd member through its own :class:`TcpFaultProxy`, so
one agent can be cut off while its peers are not.

Processes follow ``tests/e2e/agents.py``: every agent in its own session with its output
in a log file; :meth:`Fleet.close` SIGKILLs every agent with its descendants and sweeps
any process whose command line or environment carries the run id (``Agents.reap``).
Workers of an agent that died are looked for in /proc one grace period later: one still
alive is recorded as ``orphan_alive`` and killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agent.observe.journal import JournalWriter
from coordinator.core.ports import free_ports
from coordinator.etcd_server import EtcdCluster
from tests.chaos.etcd_ops import HarnessError
from tests.chaos.proxy import Mode, TcpFaultProxy
from tests.chaos.tail import HistoryTail
from tests.e2e.agents import ETCDRUN, ROOT, AgentProc, Agents, alive

__all__ = ["PRELOAD", "WORKER", "Fleet", "FleetConfig", "Slot"]

WORKER = ROOT / "tests" / "chaos" / "worker.py"
PRELOAD = ROOT / "tests" / "chaos" / "preload"
_MASTER_PORTS = (20000, 30000)


@dataclass(frozen=True)
class FleetConfig:
    """How every agent of the run is started."""

    run_id: str
    min_nodes: int
    max_nodes: int
    nproc: int
    lease_ttl: int
    out_dir: Path
    env: Mapping[str, str]  # added to every agent's (and so every worker's) environment
    join_timeout: float = 120.0
    last_call_timeout: float = 1.0
    max_restarts: int = 10_000
    orphan_grace_s: float = 1.0
    max_starts: int = 200  # agents started in the whole run: a crash loop stops the run
    # Every agent gets a --master-port of its own, as torchrun users habitually pass one:
    # each restart that agent hosts re-binds the same port (issue 21, item 1). One port per
    # agent process, below the ephemeral range: agents share this machine, a frozen one
    # keeps its server, and no outgoing connection takes the port meanwhile.
    fixed_master_port: bool = True
    # Imported ahead by every warm interpreter; chaos_stall (tests/chaos/preload, on the
    # agents' PYTHONPATH) hangs one import when the warm_import_stuck fault asks.
    warm_modules: str = "torch,chaos_stall"
    # etcd's user for the agents and the file with its password, when etcd has auth (a
    # plan with a kind of NEEDS_AUTH in tests/chaos/scheduler.py); "" without.
    user: str = ""
    password_file: str = ""

    def argv(self, endpoints: str, master_port: int = 0) -> list[str]:
        conf = (
            f"lease_ttl={self.lease_ttl},join_timeout={self.join_timeout:g},"
            f"last_call_timeout={self.last_call_timeout:g}"
        )
        if self.user:
            conf += f",user={self.user},password_file={self.password_file}"
        return [
            str(ETCDRUN),
            f"--nnodes={self.min_nodes}:{self.max_nodes}",
            f"--nproc-per-node={self.nproc}",
            "--rdzv-backend=etcd-v2",
            f"--rdzv-endpoint={endpoints}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={conf}",
            f"--max-restarts={self.max_restarts}",
            *([f"--master-port={master_port}"] if master_port else []),
            f"--warm-modules={self.warm_modules}",
            str(WORKER),
        ]


@dataclass
class Slot:
    """One place in the job: its proxies (one per etcd member) and its current agent."""

    index: int
    proxies: list[TcpFaultProxy]
    agent: AgentProc | None = None
    frozen: bool = False

    @property
    def endpoints(self) -> str:
        return ",".join(p.endpoint for p in self.proxies)


@dataclass
class _Gone:
    """An agent that was killed or exited: watched until reaped, its workers checked."""

    slot: int
    agent: AgentProc
    died_at: float | None  # monotonic time of death (SIGKILL sent, or exit seen)
    recorded: bool = False  # its exit is in the history
    checked: bool = False  # its workers were looked for


@dataclass
class Fleet:
    """Every agent of the run; see the module docstring."""

    config: FleetConfig
    cluster: EtcdCluster
    history: JournalWriter
    tail: HistoryTail
    slots: list[Slot] = field(default_factory=list)
    _gone: list[_Gone] = field(default_factory=list)
    _starts: int = 0

    def __post_init__(self) -> None:
        self.reaper = Agents(self.config.run_id, self.cluster.endpoint_list, self.config.out_dir)

    # -- slots and agents ------------------------------------------------------------------

    def add_slot(self) -> Slot:
        """A new slot with one proxy per etcd member (no agent yet)."""
        index = max((s.index for s in self.slots), default=-1) + 1
        proxies = [
            TcpFaultProxy((m.host, m.client_port), name=f"slot{index}-{m.name}")
            for m in self.cluster.members
        ]
        slot = Slot(index, proxies)
        self.slots.append(slot)
        return slot

    def remove_slot(self, slot: Slot) -> None:
        """Drop an empty slot and close its proxies."""
        if slot.agent is not None:
            raise HarnessError(f"slot {slot.index} still has agent pid {slot.agent.pid}")
        self.slots.remove(slot)
        for proxy in slot.proxies:
            proxy.close()

    def start(self, slot: Slot) -> AgentProc:
        """Start an agent in the empty ``slot``.

        Raises:
            HarnessError: the run started ``max_starts`` agents already (a crash loop).
        """
        if self._starts >= self.config.max_starts:
            raise HarnessError(f"{self._starts} agents started: they keep exiting")
        self._starts += 1
        env = {**os.environ, **self.config.env}
        env.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy:UserWarning")
        log = self.config.out_dir / "agents" / f"slot{slot.index}-{self._starts}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        port = free_ports(1, within=_MASTER_PORTS)[0] if self.config.fixed_master_port else 0
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                self.config.argv(slot.endpoints, port),
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        agent = AgentProc(f"slot{slot.index}-{self._starts}", proc, log)
        self.reaper.procs.append(agent)
        slot.agent, slot.frozen = agent, False
        self.history.record("agent_started", slot=slot.index, agent_pid=proc.pid, master_port=port)
        return agent

    def live_pids(self) -> set[int]:
        return {s.agent.pid for s in self.slots if s.agent is not None}

    def full(self) -> bool:
        return all(s.agent is not None for s in self.slots)

    def top_up(self) -> None:
        """Start an agent in every empty slot."""
        for slot in self.slots:
            if slot.agent is None:
                self.start(slot)

    # -- faults on agents ------------------------------------------------------------------

    def signal(self, slot: Slot, sig: signal.Signals) -> int:
        """Send ``sig`` to the slot's agent (not its workers); returns its pid.

        SIGKILL and SIGTERM empty the slot (the agent is dying or leaving); SIGSTOP and
        SIGCONT freeze and thaw it.
        """
        agent = slot.agent
        if agent is None:
            raise HarnessError(f"slot {slot.index} has no agent to send {sig.name} to")
        pid = agent.pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        now = time.monotonic()
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.history.record("agent_killed", slot=slot.index, agent_pid=pid, signal=sig.name)
            if slot.frozen and sig is signal.SIGTERM:
                os.kill(pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            slot.agent, slot.frozen = None, False
            self._gone.append(_Gone(slot.index, agent, now if sig is signal.SIGKILL else None))
        elif sig is signal.SIGSTOP:
            slot.frozen = True
            self.history.record("agent_frozen", slot=slot.index, agent_pid=pid)
        elif sig is signal.SIGCONT:
            slot.frozen = False
            self.history.record("agent_thawed", slot=slot.index, agent_pid=pid)
        return pid

    def set_mode(self, slot: Slot, mode: Mode, delay: float = 0.0) -> None:
        """Switch every proxy of the slot (its links to all members) at once."""
        for proxy in slot.proxies:
            proxy.set_mode(mode, delay)
        self.history.record("proxy_mode", slot=slot.index, mode=mode.value, delay=delay)

    def live_workers(self, slot: Slot) -> list[int]:
        """Pids of the slot's agent's workers that run now (newest last)."""
        if slot.agent is None:
            return []
        return [p for p in self.tail.workers_of(slot.agent.pid) if alive(p)]

    # -- watching ----------------------------------------------------------------------

    def poll(self, now: float) -> None:
        """Notice exits (recorded; the slot empties), check for orphans, check proxies."""
        for slot in self.slots:
            for proxy in slot.proxies:
                try:
                    proxy.check()
                except RuntimeError as exc:
                    raise HarnessError(str(exc)) from exc
            agent = slot.agent
            if agent is not None and agent.proc.poll() is not None:
                slot.agent, slot.frozen = None, False
                self._gone.append(_Gone(slot.index, agent, None))
        for gone in self._gone:
            code = gone.agent.proc.poll()
            if gone.died_at is None and code is not None:
                gone.died_at = now
            if code is not None and not gone.recorded:
                gone.recorded = True
                self.history.record(
                    "agent_exited", slot=gone.slot, agent_pid=gone.agent.pid, code=code
                )
            died = gone.died_at
            if died is not None and not gone.checked and now >= died + self.config.orphan_grace_s:
                gone.checked = True
                self._kill_orphans(gone.agent.pid, now - died)

    def _kill_orphans(self, agent_pid: int, after: float) -> None:
        self.tail.poll()
        for pid in self.tail.workers_of(agent_pid):
            if alive(pid):
                self.history.record(
                    "orphan_alive", worker_pid=pid, agent_pid=agent_pid, after_s=round(after, 3)
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def close(self) -> list[int]:
        """Kill and reap every agent and worker of the run, close every proxy; returns
        the pids that were still running."""
        for slot in self.slots:
            if slot.frozen and slot.agent is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.agent.pid, signal.SIGCONT)
        try:
            killed = self.reaper.reap()
        finally:
            for slot in self.slots:
                for proxy in slot.proxies:
                    with contextlib.suppress(RuntimeError):
                        proxy.close()
        self.poll(time.monotonic())
        return killed
