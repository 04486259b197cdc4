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
    CPU). A worker of that agent is killed (the refill after it hangs), then killed again
    twice, each time once the job trained again: the last restarts find no spare but the
    stuck one, and must not wait for it.

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

from agent.observe.journal import JournalWriter
from tests.chaos.etcd_ops import EtcdOps, HarnessError
from tests.chaos.fleet import Fleet, Slot
from tests.chaos.scheduler import Fault
from tests.chaos.tail import HistoryTail

__all__ = ["EdgeFaults"]

_KILLS = 3  # worker kills of warm_import_stuck


class EdgeFaults:
    """Mixed into :class:`tests.chaos.faults.FaultRunner` (which sets these attributes)."""

    fleet: Fleet
    etcd: EtcdOps
    tail: HistoryTail
    history: JournalWriter
    run_prefix: str
    stall_dir: Path

    def _target(self, index: int) -> Slot:
        raise NotImplementedError

    def _until(self, done: Callable[[], bool], timeout: float) -> bool:
        raise NotImplementedError

    def _recovered_after(self, since: float) -> bool:
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
        arm = self.stall_dir / f"stall-{slot.agent.pid}"
        taken = arm.with_name(arm.name + ".taken")
        start = time.monotonic()
        arm.write_text("")
        try:
            for kill in range(_KILLS):
                since = time.monotonic()
                self._kill_worker_of(slot)
                if kill == 0:
                    # The refill after this restart imports (after its deferral): it hangs.
                    stuck = self._until(taken.exists, 60.0)
                    self.history.record(
                        "trigger", index=fault.index,
                        what="a warm import hangs" if stuck else "no warm import hung",
                        after_s=round(time.monotonic() - start, 3),
                    )  # fmt: skip
                if kill < _KILLS - 1 and not self._recovered_after(since):
                    raise HarnessError("the job did not train again after a worker kill")
        finally:
            arm.unlink(missing_ok=True)
