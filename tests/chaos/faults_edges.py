"""The faults of issue 21 (the edges of what was built), run by :class:`FaultRunner`:

``master_port_restart``
    A worker of the agent of group rank 0 is SIGKILLed. Every chaos agent runs with a
    ``--master-port`` of its own (:class:`~tests.chaos.fleet.FleetConfig`), so that agent
    must bind the same port again for the next round while the last round's server is
    being released.
``node_keys_deleted``
    An operator deletes every node key of the run (``etcdctl del --prefix .../nodes/``)
    while the job trains; the leases live on. Every agent must notice its key is gone,
    join again, and the job train again.
``warm_import_stuck``
    One agent's next warm interpreter hangs in its import (``chaos_stall``, using no
    CPU). The pool refills by forking a ready interpreter and imports only when a local
    rank has none left, so once that agent's pool is full its last local rank's spares
    are SIGKILLed (as the OOM killer would) and a worker of it is killed: the restart
    finds no live spare for that rank, and the refill after it imports, and hangs. Once
    the agent holds a ready spare per worker again (for that rank only one imported
    beside the stuck import can give it, which the pool must start since no CPU moves
    in the stuck one), a worker is killed once more: it must start from that spare,
    not wait for the stuck import (before, the stuck import blocked every refill and the
    restart waited 30 s for it).

``etcd_role_revoked``
    An operator revokes the agents' role's permission on the key prefix (etcd has auth
    in a run whose plan has this kind). One TTL later, while the job trains on (it needs
    no etcd; the keep-alives are still answered), a worker of one agent is killed: the
    nodes count the restart and re-form while etcd refuses them, and must wait for the
    grant, which comes back ``duration`` after the revocation. The checker holds the job
    to no restart before the kill (``quiet_while_refused``) and training again within
    TTL + slack of the grant (``recovery_bound``); no agent may exit.

Each records ``trigger`` events naming what it saw; the checker holds every restart of
these kinds to the node-loss bound (``TIMED_RESTARTS``; for ``warm_import_stuck`` each
worker kill of the fault is judged on its own).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from agent.config import LaunchConfig
from agent.observe.journal import JournalWriter
from agent.workers.warm_interpreter import cpu_ticks
from tests.chaos.etcd_ops import EtcdOps, HarnessError
from tests.chaos.fleet import Fleet, Slot
from tests.chaos.scheduler import Fault
from tests.chaos.tail import HistoryTail
from tests.e2e.agents import descendants
from tests.integration.orphans_support import start_time

if TYPE_CHECKING:
    from tests.chaos.faults import Timing

__all__ = ["EdgeFaults"]


class EdgeFaults:
    """Mixed into :class:`tests.chaos.faults.FaultRunner` (which sets these attributes)."""

    fleet: Fleet
    etcd: EtcdOps
    timing: Timing
    nproc: int
    tail: HistoryTail
    history: JournalWriter
    run_prefix: str
    stall_dir: Path

    def _target(self, index: int) -> Slot:
        raise NotImplementedError

    def _until(self, done: Callable[[], bool], timeout: float) -> bool:
        raise NotImplementedError

    def wait(self, seconds: float, poll: float | None = None) -> None:
        raise NotImplementedError

    def _kill_worker_of(self, slot: Slot) -> None:
        agent_pid = slot.agent.pid if slot.agent is not None else -1
        workers = self.fleet.live_workers(slot)
        if not workers:
            raise HarnessError(f"agent slot {slot.index} has no live worker to kill")
        with contextlib.suppress(ProcessLookupError):
            os.kill(workers[-1], signal.SIGKILL)
        self.history.record("worker_killed", worker_pid=workers[-1], agent_pid=agent_pid)

    def _master_port_restart(self, fault: Fault) -> None:
        self.tail.poll()
        holder = self.tail.rank0_pid
        slot = next((s for s in self.fleet.slots if s.agent and s.agent.pid == holder), None)
        if slot is None:
            raise HarnessError(f"no live agent holds group rank 0 (last seen: pid {holder})")
        self.history.record(
            "trigger", index=fault.index, what=f"agent pid {holder} holds group rank 0",
            after_s=0.0,
        )  # fmt: skip
        self._kill_worker_of(slot)

    def _node_keys_deleted(self, fault: Fault) -> None:
        deleted = self.etcd.delete_prefix(f"{self.run_prefix}/nodes/")
        self.history.record(
            "trigger", index=fault.index, what=f"{deleted} node keys deleted", after_s=0.0
        )

    def _warm_import_stuck(self, fault: Fault) -> None:
        slot = self._target(fault.target)
        assert slot.agent is not None
        agent = slot.agent.pid
        arm = self.stall_dir / f"stall-{agent}"
        taken = arm.with_name(arm.name + ".taken")
        start = time.monotonic()
        wait_s = self.timing.settle_timeout_s

        def note(what: str) -> None:
            self.history.record(
                "trigger", index=fault.index, what=what,
                after_s=round(time.monotonic() - start, 3),
            )  # fmt: skip

        depth = LaunchConfig.warm_pool_size  # the chaos agents keep the default
        full = self._until(lambda: self._ready_spares(agent, 0) >= depth, wait_s)
        note("the agent's warm pool is full" if full else "the agent's pool did not fill")
        taken.unlink(missing_ok=True)  # an earlier fault's on this agent
        arm.write_text("")
        try:
            rank = str(self.nproc - 1)
            killed = [p for p, r in self._spares(agent, 0).items() if r == rank]
            for pid in killed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            note(f"{len(killed)} spares of local rank {rank} killed")
            self._kill_worker_of(slot)  # the refill after this restart imports: it hangs
            hung = self._until(lambda: taken.exists() and taken.read_text().isdigit(), 90.0)
            note("a warm import hangs" if hung else "no warm import hung")
            stuck = int(taken.read_text()) if hung else 0
            self._until(lambda: self.tail.stepped_since(start), wait_s)
            spares = self._until(lambda: self._ready_spares(agent, stuck) >= 1, wait_s)
            note("a spare beside the stuck import" if spares else "no spare beside it")
            since = time.monotonic()
            self._kill_worker_of(slot)  # must not wait for the stuck import
            # The runner settles from the fault's start: the job must train after this
            # kill before the next fault comes.
            self._until(lambda: self.tail.stepped_since(since), wait_s)
        finally:
            arm.unlink(missing_ok=True)

    def _etcd_role_revoked(self, fault: Fault) -> None:
        slot = self._target(fault.target)
        start = time.monotonic()
        self.etcd.revoke_role()
        try:
            self.wait(self.timing.lease_ttl)  # keep-alives pass; nothing else needs etcd
            self._kill_worker_of(slot)  # the nodes re-form while the role is refused
            self.wait(max(0.0, start + fault.duration - time.monotonic()))
        finally:
            self.etcd.grant_role()

    def _spares(self, agent_pid: int, stuck: int) -> dict[int, str]:
        """The warm interpreters under ``agent_pid`` that wait, ready, and the local rank
        each serves (a spare serves its own local rank only): past their preload
        (``chaos_stall`` marks each one that does not hang, and each copy forked from
        one) and using no CPU over one second (one that just became a worker uses some),
        the stuck one aside."""
        self.tail.poll()
        workers = set(self.tail.workers_of(agent_pid))
        warm = {
            p: rank for p in descendants(agent_pid)
            if p not in workers and p != stuck and _mentions(p, b"warm_process")
            and (rank := _ready_rank(self.stall_dir, p)) is not None
        }  # fmt: skip
        before = {p: _ticks(p) for p in warm}
        time.sleep(1.0)
        return {p: r for p, r in warm.items() if before[p] is not None and _ticks(p) == before[p]}

    def _ready_spares(self, agent_pid: int, stuck: int) -> int:
        """The fewest ready spares (:meth:`_spares`) of any one local rank."""
        ready = list(self._spares(agent_pid, stuck).values())
        return min(ready.count(str(rank)) for rank in range(self.nproc))


def _ready_rank(stall_dir: Path, pid: int) -> str | None:
    """The local rank of warm interpreter ``pid`` if it got past its preload
    (``chaos_stall`` marked it, by pid and start time: pids wrap), else None."""
    start = start_time(pid)
    try:
        return None if start is None else (stall_dir / f"ready-{pid}-{start}").read_text()
    except OSError:
        return None


def _ticks(pid: int) -> int | None:
    try:
        return cpu_ticks(pid)
    except OSError:
        return None


def _mentions(pid: int, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
