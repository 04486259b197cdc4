"""The phases of one job on the fleet, each measured (:class:`~benchmarks.fleet.measure.Measurer`).

A :class:`JobRun` builds a job's agents, forms it, and then takes it through whatever
the caller asks: a steady training window, a worker failure, a hang, the loss of some
hosts (one agent, or half the job at once), the loss of the whole job, and its end.
Every phase waits on what the agents themselves report (their workers started in a new
round, their ``run()`` returned), with times stamped by the hosts, and leaves
``settle_s`` after the last event for the writes that trail it (the run's timeline, the
first progress record of a round) before its window closes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.fleet.etcd_admin import EtcdAdmin
from benchmarks.fleet.fleet import AgentStart, Fleet, JobSpec
from benchmarks.fleet.measure import (
    ExpiryPoller,
    Measurer,
    PhaseResult,
    quiesce,
    training_seconds,
)
from benchmarks.procs import RunError
from benchmarks.stats import rank_problem
from coordinator.etcd_server import EtcdCluster

__all__ = ["JobRun", "Leftovers", "formed_after", "latest_starts"]

_START_MARGIN_S = 1.0
# How long the requests a killed host had sent may take to land in etcd.
_IN_FLIGHT_S = 0.5
# The parts of a run's prefix (docs/keys.md), for what a run leaves behind.
_KINDS = ("state", "nodes/", "progress/", "store/", "events/")


@dataclass(frozen=True)
class Leftovers:
    """What a job left in etcd ``after_s`` after it should have left nothing."""

    keys: int
    keys_under_prefix: int
    leases: int
    after_s: float
    by_kind: dict[str, int]
    """Keys left under each part of the run's prefix (state, nodes, store, ...)."""


def latest_starts(fleet: Fleet, agents: Sequence[int]) -> list[AgentStart | None]:
    """Each agent's latest start (None: none yet)."""
    out: list[AgentStart | None] = []
    for agent in agents:
        starts = fleet.starts_of(agent)
        out.append(starts[-1] if starts else None)
    return out


def formed_after(latest: Sequence[AgentStart | None], old_round: int) -> bool:
    """Whether every agent's latest start is in one round after ``old_round`` whose world
    is exactly these agents."""
    if any(s is None or s.round <= old_round for s in latest):
        return False
    rounds = {s.round for s in latest if s is not None}
    worlds = {s.world for s in latest if s is not None}
    return len(rounds) == 1 and worlds == {len(latest)}


def where_they_are(latest: Sequence[AgentStart | None]) -> str:
    """How far the agents got: how many train in which round (of which world size), and
    how many never started."""
    counts: dict[tuple[int, int], int] = {}
    for start in latest:
        if start is not None:
            key = (start.round, start.world)
            counts[key] = counts.get(key, 0) + 1
    parts = [f"{n} training in round {r} of {w}" for (r, w), n in sorted(counts.items())]
    never = sum(1 for start in latest if start is None)
    return ", ".join(parts + ([f"{never} never started"] if never else [])) or "nobody"


class JobRun:
    """One job on the fleet.

    Args:
        fleet, cluster: where it runs.
        job: its run id, sizes and settings.
        settle_s: seconds after a phase's last event before its window closes.
        key_prefix: the agents' key prefix (for the leftovers).
    """

    def __init__(
        self,
        fleet: Fleet,
        cluster: EtcdCluster,
        job: JobSpec,
        *,
        settle_s: float = 1.5,
        key_prefix: str = "/etcd-elastic",
    ) -> None:
        self.fleet = fleet
        self.cluster = cluster
        self.job = job
        self.settle_s = settle_s
        self.key_prefix = key_prefix
        self.measurer = Measurer(cluster, fleet)
        self.alive: set[int] = set()
        self.round = -1
        self.lease_ttl = float(job.conf.get("lease_ttl", 5))
        self.ended_at = 0.0
        """When the job ended (its last agent exited, or etcd expired its last lease)."""
        self.agents: list[int] = []
        self.dead_at: dict[int, float] = {}

    def _training(self, result: PhaseResult) -> PhaseResult:
        """Add the node-seconds of training in the phase's window (``training_node_s``):
        what the steady rates are multiplied by to tell a phase's own cost from the
        training that went on meanwhile."""
        result.times["training_node_s"] = sum(
            training_seconds(
                [s.t for s in self.fleet.starts_of(a)],
                self.fleet.stops_of(a),
                self.dead_at.get(a),
                result.began,
                result.ended,
            )
            for a in self.agents
        )
        return result

    # -- waiting on the agents -------------------------------------------------------

    def _latest(self, agents: Sequence[int]) -> list[AgentStart | None]:
        return latest_starts(self.fleet, agents)

    def _formed_after(self, old_round: int) -> bool:
        return formed_after(self._latest(sorted(self.alive)), old_round)

    def _wait_formed(self, what: str, old_round: int, timeout: float) -> list[AgentStart]:
        try:
            self.fleet.wait_for(what, lambda: self._formed_after(old_round), timeout)
        except RunError as exc:
            raise RunError(f"{exc}; {where_they_are(self._latest(sorted(self.alive)))}") from exc
        starts = [s for s in self._latest(sorted(self.alive)) if s is not None]
        problem = rank_problem([s.rank for s in starts], [s.world for s in starts], len(self.alive))
        if problem is not None:
            raise RunError(f"{what}: {problem}")
        self.round = starts[0].round
        return starts

    def _timeout(self) -> float:
        return 60.0 + 3 * self.lease_ttl + 0.1 * len(self.alive)

    def _settle(self) -> None:
        time.sleep(self.settle_s)  # the trailing writes are part of the phase

    # -- phases ----------------------------------------------------------------------

    def form(self) -> PhaseResult:
        """Build the agents, start them together; measured from the common start until
        every agent's workers run in one round of all of them."""
        self.agents = self.fleet.build(self.job)
        self.alive = set(self.agents)
        opened = self.measurer.begin()
        at = time.monotonic() + _START_MARGIN_S
        self.fleet.run(at)
        starts = self._wait_formed(f"formation of {self.job.nodes}", -1, self._timeout())
        t_last = max(s.t for s in starts)
        formed = [s.formed_s for s in starts if s.formed_s is not None]
        self._settle()
        once = all(len(self.fleet.starts_of(a)) == 1 for a in self.alive)
        times = {
            "formed_s": t_last - at,
            "first_started_s": min(s.t for s in starts) - at,
            "first_round_complete": 1.0 if once else 0.0,
            "agent_formed_median_s": sorted(formed)[len(formed) // 2] if formed else 0.0,
        }
        notes = ["health check on (stand-in check process)"] if self.job.health_check else []
        phase = "formation-preflight" if self.job.health_check else "formation"
        return self._training(self.measurer.end(opened, phase, self.job.nodes, times, notes))

    def steady(self, seconds: float) -> PhaseResult:
        """Training goes well for ``seconds``: what does that cost etcd?"""
        opened = self.measurer.begin()
        time.sleep(seconds)
        return self._training(self.measurer.end(opened, "steady", len(self.alive), {}))

    def worker_failure(self, agent: int | None = None) -> PhaseResult:
        """One worker of one agent exits 1; measured until every agent trains again."""
        victim = agent if agent is not None else max(self.alive)
        old = self.round
        opened = self.measurer.begin()
        t0 = self.fleet.act(victim, "fail", 1)
        starts = self._wait_formed("recovery from a worker failure", old, self._timeout())
        self._settle()
        times = {"recovered_s": max(s.t for s in starts) - t0, "rounds": float(self.round - old)}
        return self._training(self.measurer.end(opened, "worker-failure", len(self.alive), times))

    def hang(self, agent: int | None = None) -> PhaseResult:
        """One agent's workers stop reporting progress; measured until every agent
        trains again (after ``hang_timeout`` and a declared hang)."""
        if self.job.hang_timeout is None:
            raise RunError("the hang phase needs the job's hang_timeout")
        victim = agent if agent is not None else max(self.alive)
        old = self.round
        opened = self.measurer.begin()
        t0 = self.fleet.act(victim, "stall")
        starts = self._wait_formed("recovery from a hang", old, self._timeout() + 60)
        self._settle()
        times = {
            "recovered_s": max(s.t for s in starts) - t0,
            "hang_timeout_s": self.job.hang_timeout,
            "rounds": float(self.round - old),
        }
        return self._training(self.measurer.end(opened, "hang", len(self.alive), times))

    def lose(self, slots: Sequence[int], phase: str) -> PhaseResult:
        """SIGKILL the hosts of ``slots`` at once (their machines are gone); measured
        until the survivors train again in a round of their own."""
        killed = {a for s in slots for a in self.fleet.agents_of_slot[s]} & self.alive
        if not killed or killed == self.alive:
            raise RunError(f"{phase}: kill some agents, not none or all ({sorted(slots)})")
        old = self.round
        with ExpiryPoller(self.cluster) as poller:
            opened = self.measurer.begin()
            lost_cpu = _cpu_of(self.fleet, slots)
            t_kill = self.fleet.kill(slots)
            self.dead_at.update(dict.fromkeys(killed, t_kill))
            self.alive -= killed
            starts = self._wait_formed(f"recovery from {phase}", old, self._timeout())
            t_train = max(s.t for s in starts)
            self._settle()
            last = poller.last_expiry()
        times = {
            "killed": float(len(killed)),
            "recovered_s": t_train - t_kill,
            "rounds": float(self.round - old),
            "lease_ttl_s": self.lease_ttl,
        }
        if last is not None:
            times["last_expiry_after_kill_s"] = last - t_kill
            times["trained_after_last_expiry_s"] = t_train - last
        result = self.measurer.end(
            opened, phase, len(self.alive) + len(killed), times, hosts_cpu_lost=lost_cpu
        )
        return self._training(result)

    def end(self) -> PhaseResult:
        """Every worker exits 0: the agents pass the exit barrier, close the run, leave.
        Measured until every agent's ``run()`` returned."""
        alive = sorted(self.alive)
        opened = self.measurer.begin()
        t0 = self.fleet.finish()
        # The exit barrier's counter is one key every agent adds to (its cost grows with
        # N²): its bound does too.
        bound = max(self._timeout(), 120.0 + len(alive) ** 2 / 1000)
        self.fleet.wait_for(
            "the job's end", lambda: all(self.fleet.exit_of(a) is not None for a in alive), bound
        )
        exits = [e for a in alive if (e := self.fleet.exit_of(a)) is not None]
        codes = sorted({code for code, _ in exits})
        self.ended_at = max(t for _, t in exits)
        self._settle()
        times = {"ended_s": self.ended_at - t0}
        notes = [] if codes == [0] else [f"exit codes {codes}, not all 0"]
        result = self._training(self.measurer.end(opened, "job-end", len(alive), times, notes))
        self.fleet.release()
        self.alive = set()
        self._quiet(result)
        return result

    def _quiet(self, result: PhaseResult) -> None:
        """Wait until etcd is quiet before the next job, and say what came after the end
        (a job that is over should write nothing more)."""
        waited, writes = quiesce(self.cluster)
        result.times["quiet_after_s"] = waited
        result.times["writes_after_end"] = writes

    def lost(self) -> PhaseResult:
        """SIGKILL every host of the job at once; measured from just after the kill until
        etcd expired every lease of it: the counts are etcd's own clean-up (the requests
        the dead had in flight land before the window opens; no lease can expire that
        soon, each was renewed within its last TTL/3)."""
        slots = self.fleet.live_slots()
        count = len(self.alive)
        with ExpiryPoller(self.cluster) as poller:
            t_kill = self.fleet.kill(slots)
            self.dead_at.update(dict.fromkeys(self.alive, t_kill))
            self.alive = set()
            time.sleep(min(_IN_FLIGHT_S, self.lease_ttl / 3))
            opened = self.measurer.begin()
            deadline = t_kill + 3 * self.lease_ttl + 30 + count / 500
            while poller.expired_since_start() < count and time.monotonic() < deadline:
                time.sleep(0.2)  # etcd expires them on its own clock: nothing to wait on
            last = poller.last_expiry()
            self._settle()
        times = {"expired": poller.expired_since_start(), "lease_ttl_s": self.lease_ttl}
        if last is not None:
            times["last_expiry_after_kill_s"] = last - t_kill
            self.ended_at = last
        else:
            self.ended_at = time.monotonic()
        notes = (
            []
            if times["expired"] >= count
            else [f"only {times['expired']:g} of {count} leases expired"]
        )
        result = self._training(self.measurer.end(opened, "job-lost", count, times, notes))
        self._quiet(result)
        return result

    def leftovers(self, admin: EtcdAdmin, after_s: float, retention_s: float) -> Leftovers:
        """Wait until ``retention_s + after_s`` past the job's end, then count what it left:
        keys under its run's prefix, under the whole key prefix, and leases (in the whole
        cluster: ask when no other job runs)."""
        wait = self.ended_at + retention_s + after_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)  # etcd removes what the retention lease holds on its own clock
        run_prefix = f"{self.key_prefix}/{self.job.run_id}/"
        keys = admin.keys_under(run_prefix)
        kinds = {k: admin.keys_under(run_prefix + k) for k in _KINDS} if keys else {}
        kinds = {k: n for k, n in kinds.items() if n}
        other = keys - sum(kinds.values())
        if other:
            kinds["other"] = other
        return Leftovers(
            keys=keys,
            keys_under_prefix=admin.keys_under(f"{self.key_prefix}/"),
            leases=admin.leases(),
            after_s=after_s,
            by_kind=kinds,
        )


def _cpu_of(fleet: Fleet, slots: Sequence[int]) -> float:
    """CPU used so far by the hosts of ``slots`` (counted at the window's start, and
    gone from /proc once they are killed)."""
    from benchmarks.procs import cpu_seconds

    total = 0.0
    for slot in slots:
        host = fleet.host(slot)
        if host is not None:
            try:
                total += cpu_seconds(host.pid)
            except (OSError, IndexError, ValueError):
                continue
    return total
