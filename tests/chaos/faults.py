"""Runs each planned fault on the live job, then waits (bounded) until the job is steady.

A fault is recorded as ``fault_start``, its actions, ``fault_end``. After a disruptive
fault the runner first waits (bounded) for the survivors to train in a newer round, and
only then starts agents in the slots the fault emptied; then, after every fault, it waits
for the job to be steady again (every slot's agent in one group whose ranks all step;
after a disruptive fault, with workers started since the fault), for at most
``settle_timeout_s``. Every action that breaks something undoes it in a
``finally`` (members restarted, proxies passing, agents thawed), so a failing fault never
leaves the next one a broken cluster.

Timed faults: ``formation_fault`` injects its second fault when the first agent reports
``workers_stopped`` after the first kill (the nodes start re-forming);
``rank_exchange_fault`` kills its agent the moment etcd commits the next round (ranks
are being exchanged; see ``round_watch.py``). Without agent events (an agent that
writes no history) the formation trigger falls back on TTL + 0.2 s after the kill, which
only approximates that window; the checker then fails ``history_complete`` anyway.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from agent.observe.journal import JournalWriter
from tests.chaos.etcd_ops import EtcdOps, HarnessError
from tests.chaos.faults_edges import EdgeFaults
from tests.chaos.fleet import Fleet, Slot
from tests.chaos.proxy import Mode
from tests.chaos.scheduler import Fault
from tests.chaos.tail import HistoryTail

__all__ = ["FaultRunner", "Timing"]


_FREEZES = ("etcd_leader_freeze", "etcd_follower_freeze")


@dataclass(frozen=True)
class Timing:
    """The runner's bounds, in seconds."""

    lease_ttl: float
    settle_timeout_s: float = 45.0
    recovery_slack_s: float = 5.0  # the checker's: recovery within TTL + this
    recover_slack_s: float = 5.0  # how much longer the runner waits before topping up
    # After a fault that must cost nothing, look this long before the job may count as
    # steady. A client timer that wrongly declares a lease lost fires one TTL into an
    # outage, so inside every fault that cuts etcd off that long, and the agent stops
    # its workers when it fires: that shows in the fault's own window.
    observe_s: float = 1.0
    steady_window_s: float = 1.0  # every rank must have stepped within this window
    poll_s: float = 0.05
    trigger_poll_s: float = 0.01  # for the faults timed to a round's completion


class FaultRunner(EdgeFaults):
    """Executes faults on one job; see the module docstring (and
    :mod:`tests.chaos.faults_edges` for issue 21's)."""

    def __init__(
        self,
        fleet: Fleet,
        etcd: EtcdOps,
        tail: HistoryTail,
        history: JournalWriter,
        timing: Timing,
        *,
        agents: int,
        nproc: int,
        min_nodes: int,
        state_key: str,
        stall_dir: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.fleet, self.etcd, self.tail, self.history = fleet, etcd, tail, history
        self.timing = timing
        self.agents, self.nproc, self.min_nodes = agents, nproc, min_nodes
        self.state_key = state_key
        self.run_prefix = state_key.rsplit("/", 1)[0]
        self.stall_dir = stall_dir or Path(os.environ.get("CHAOS_STALL_DIR", "."))
        self._clock, self._sleep = clock, sleep

    # -- waiting ---------------------------------------------------------------------------

    def wait(self, seconds: float, poll: float | None = None) -> None:
        """Let ``seconds`` pass, watching exits and orphans meanwhile."""
        deadline = self._clock() + seconds
        while (now := self._clock()) < deadline:
            self.fleet.poll(now)
            self._sleep(min(poll or self.timing.poll_s, deadline - now))

    def _until(self, done: Callable[[], bool], timeout: float) -> bool:
        return self._wait_until(done, timeout, self.timing.poll_s)

    def _recovered_after(self, since: float) -> bool:
        timing = self.timing
        bound = timing.lease_ttl + timing.recovery_slack_s + timing.recover_slack_s
        return self._wait_until(lambda: self.tail.stepped_since(since), bound, timing.poll_s)

    def _wait_until(self, done: Callable[[], bool], timeout: float, poll: float) -> bool:
        deadline = self._clock() + timeout
        while not done():
            now = self._clock()
            if now > deadline:
                return False
            self.fleet.poll(now)
            self.tail.poll()
            self._sleep(poll)
        return True

    def recover(self, since: float) -> bool:
        """After a disruptive fault: wait until a worker started after ``since`` steps
        (a newer round trains), bounded by the checker's recovery bound plus
        ``recover_slack_s``. Emptied slots are topped up only after that, unless fewer
        than ``min_nodes`` agents are left (then no round can form without them): a new
        interpreter importing torch competes for the CPU with the survivors' restart,
        which is what is measured, and its join would restart them again.
        """

        def recovered() -> bool:
            if len(self.fleet.live_pids()) < self.min_nodes:
                self.fleet.top_up()
            return self.tail.stepped_since(since)

        timing = self.timing
        bound = timing.lease_ttl + timing.recovery_slack_s + timing.recover_slack_s
        return self._wait_until(recovered, bound, timing.poll_s)

    def settle(
        self,
        index: int,
        *,
        since: float | None,
        agents: int | None = None,
        timeout: float | None = None,
    ) -> bool:
        """Wait until the job is steady with ``agents`` agents (default: the job's size),
        with workers started after ``since`` when given; top up empty slots meanwhile.
        Records ``settled`` or ``settle_timeout``."""
        count = agents or self.agents
        start = self._clock()

        def steady() -> bool:
            self.fleet.top_up()
            pids = self.fleet.live_pids()
            return len(pids) == count and self.tail.steady(
                pids,
                count * self.nproc,
                now=self._clock(),
                window=self.timing.steady_window_s,
                started_after=since,
            )

        if self._wait_until(steady, timeout or self.timing.settle_timeout_s, self.timing.poll_s):
            self.history.record("settled", index=index, waited_s=round(self._clock() - start, 3))
            return True
        last = self.tail.last_step_mono()
        self.history.record(
            "settle_timeout",
            index=index,
            waited_s=round(self._clock() - start, 3),
            what=f"{len(self.fleet.live_pids())} of {count} agents up; last step "
            + ("never" if last is None else f"{self._clock() - last:.1f} s ago")
            + f"; not all {count * self.nproc} ranks of one group stepping"
            + (" in a group started since the fault" if since is not None else ""),
        )
        return False

    # -- running ---------------------------------------------------------------------------

    def run(self, fault: Fault) -> bool:
        """Run one fault and wait for the job to settle; False if it did not (or the
        harness could not do its part: ``harness_error``)."""
        self.fleet.top_up()
        pids = []
        for slot_index in (fault.target, fault.other):
            slot = self._slot(slot_index)
            if slot is not None and slot.agent is not None:
                pids.append(slot.agent.pid)
        self.history.record("fault_start", pids=pids, **fault.to_json())
        start = self._clock()
        ok = True
        try:
            getattr(self, f"_{fault.kind}")(fault)
        except HarnessError as exc:
            self.history.record("harness_error", index=fault.index, what=str(exc))
            ok = False
        self.history.record("fault_end", index=fault.index, kind=fault.kind)
        if fault.spec.disruptive:
            self.recover(start)
            return self.settle(fault.index, since=start) and ok
        self.wait(self.timing.observe_s)
        return self.settle(fault.index, since=None) and ok

    def _slot(self, index: int) -> Slot | None:
        return next((s for s in self.fleet.slots if s.index == index), None)

    def _target(self, index: int) -> Slot:
        slot = self._slot(index)
        if slot is None or slot.agent is None:
            raise HarnessError(f"agent slot {index} has no agent to hit")
        return slot

    def _remove(self, slot: Slot, sig: signal.Signals) -> None:
        """SIGKILL or SIGTERM the slot's agent; its successor starts once the survivors
        train again (see :meth:`recover`). Started at once, its interpreter's torch
        import competed with the survivors' restarting workers on a small machine and
        its join restarted them again mid-start: a measured recovery of 9-15 s instead
        of 5-7 s with two agents, two workers each and a 2 s TTL on two cores."""
        self.fleet.signal(slot, sig)

    # -- faults held for a while (also the inner faults of newcomer / formation) -------------

    @contextlib.contextmanager
    def _hold(self, kind: str, fault: Fault) -> Iterator[None]:
        """Apply a fault of ``kind`` on entry, undo it on exit."""
        if kind in ("agent_sigstop", "agent_sigstop_short"):
            slot = self._target(fault.target)
            frozen = slot.agent
            self.fleet.signal(slot, signal.SIGSTOP)
            try:
                yield
            finally:
                if slot.agent is frozen:
                    self.fleet.signal(slot, signal.SIGCONT)
        elif kind in ("agent_partition", "agent_net_delay", "agent_net_reset"):
            slot = self._target(fault.target)
            mode = {"agent_partition": Mode.BLACKHOLE, "agent_net_delay": Mode.DELAY}
            self.fleet.set_mode(slot, mode.get(kind, Mode.RESET), fault.delay)
            try:
                yield
            finally:
                self.fleet.set_mode(slot, Mode.PASS)
        elif kind in ("etcd_leader_kill", "etcd_follower_kill", *_FREEZES):
            victim, role = self._member(fault, follower=kind.startswith("etcd_follower"))
            pause = kind in _FREEZES
            (self.etcd.freeze if pause else self.etcd.kill)(victim, role)
            try:
                yield
            finally:
                (self.etcd.thaw if pause else self.etcd.restart)(victim)
        elif kind == "etcd_cluster_restart":
            self.etcd.kill_all()
            try:
                yield
            finally:
                self.etcd.restart_all()
        else:
            raise HarnessError(f"{kind} is not a fault that can be held")

    def _member(self, fault: Fault, *, follower: bool) -> tuple[int, str]:
        """The etcd member a fault hits, and its role: the leader, or the fault's follower."""
        leader = self.etcd.leader()
        if leader is None:
            raise HarnessError("no etcd member says it leads")
        if not follower:
            return leader, "leader"
        followers = [i for i in range(len(self.etcd.cluster.members)) if i != leader]
        return followers[fault.follower % len(followers)], "follower"

    def _held(self, fault: Fault) -> None:
        with self._hold(fault.kind, fault):
            self.wait(fault.duration)

    _agent_sigstop = _agent_sigstop_short = _agent_partition = _held
    _agent_net_delay = _agent_net_reset = _held
    _etcd_leader_kill = _etcd_follower_kill = _etcd_cluster_restart = _held
    _etcd_leader_freeze = _etcd_follower_freeze = _held

    # -- instant faults ----------------------------------------------------------------------

    def _agent_sigkill(self, fault: Fault) -> None:
        self._remove(self._target(fault.target), signal.SIGKILL)

    def _agent_sigterm(self, fault: Fault) -> None:
        self._remove(self._target(fault.target), signal.SIGTERM)

    def _worker_sigkill(self, fault: Fault) -> None:
        self._kill_worker_of(self._target(fault.target))

    def _compaction_defrag(self, fault: Fault) -> None:
        self.etcd.compact_defrag()

    # -- composite and timed faults ----------------------------------------------------------

    def _newcomer(self, fault: Fault) -> None:
        """A new agent joins during the inner fault; once the bigger group trains it
        leaves again (SIGTERM), so the job keeps its size for the next fault."""
        slot = self.fleet.add_slot()
        newcomer = None
        try:
            newcomer = self.fleet.start(slot)
            with self._hold(fault.inner, fault):
                self.wait(fault.duration)
            self.settle(fault.index, since=None, agents=self.agents + 1)
        finally:
            if slot.agent is not None:
                self.fleet.signal(slot, signal.SIGTERM)
            if newcomer is not None and not self._wait_until(
                lambda: newcomer.proc.poll() is not None,
                self.timing.settle_timeout_s,
                self.timing.poll_s,
            ):
                raise HarnessError(f"the newcomer (pid {newcomer.pid}) ignored SIGTERM")
            self.fleet.remove_slot(slot)

    def _formation_fault(self, fault: Fault) -> None:
        start = self._clock()
        self._remove(self._target(fault.target), signal.SIGKILL)
        found = self.tail.agent_events > 0 and self._wait_until(
            lambda: self.tail.first_after("workers_stopped", start, src="agent") is not None,
            self.timing.lease_ttl + 2.0,
            self.timing.trigger_poll_s,
        )
        if not found:
            # No agent said it stopped its workers (or none writes a history): a guess.
            self.wait(max(0.0, start + self.timing.lease_ttl + 0.2 - self._clock()))
        self.history.record(
            "trigger",
            index=fault.index,
            what="an agent stopped its workers to re-form"
            if found
            else "no agent reported re-forming: second fault one TTL after the kill",
            after_s=round(self._clock() - start, 3),
        )
        if fault.inner == "agent_sigkill":
            self._remove(self._target(fault.other), signal.SIGKILL)
        else:
            with self._hold(fault.inner, fault):
                self.wait(fault.duration)

    def _rank_exchange_fault(self, fault: Fault) -> None:
        """A worker killed (every node re-forms), then another agent killed the moment
        etcd commits the next round, while the nodes exchange ranks."""
        start = self._clock()
        with self.etcd.round_watch(self.state_key) as watch:
            before = watch.current
            self._worker_sigkill(fault)
            newer = watch.wait_newer(
                before, self.timing.lease_ttl + 10.0, tick=lambda: self.fleet.poll(self._clock())
            )
        self._remove(self._target(fault.other), signal.SIGKILL)
        self.history.record(
            "trigger",
            index=fault.index,
            what=f"round {newer} committed (after {before})"
            if newer is not None
            else f"no round after {before} committed: the kill is not timed into an exchange",
            after_s=round(self._clock() - start, 3),
        )
