"""One fleet run at one size: a fresh 3-member etcd, the jobs, every phase measured.

The jobs, in order (each on the same host processes; a killed host is started again):

A. formation, a steady window, a worker failure, a hang, the loss of one agent, the
   job's end, and what is left ``after_s`` after its retention;
B. formation, the loss of half the agents at once (SIGKILL of the hosts holding them),
   the survivors' end;
C. formation, the loss of every agent at once, what is left ``after_s`` later;
D. (``preflight``) formation with ``--health-check`` (the check process stood in), end;
E. more formations until ``formations`` in all, each ended by the loss of every agent
   (cheaper at a thousand agents than the exit barrier, and more samples of that loss);
F. (``churn_jobs``) that many small jobs, ``churn_parallel`` at a time, each formed,
   trained and ended; the database size before (compacted, defragmented) and after
   their retention (compacted, then defragmented), and what they left.

A phase that fails is recorded in ``errors``; the run goes on with the next job.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.fleet.etcd_admin import EtcdAdmin
from benchmarks.fleet.etcd_metrics import scrape
from benchmarks.fleet.fleet import Fleet, FleetSettings, JobSpec
from benchmarks.fleet.measure import PhaseResult
from benchmarks.fleet.phases import JobRun, Leftovers, formed_after, latest_starts
from benchmarks.procs import RunError
from benchmarks.systems import benchmark_etcd_binary
from coordinator.core.run_lease import run_lease_ttl
from coordinator.etcd_server import EtcdCluster, etcd_version

__all__ = ["FleetOptions", "layout", "pick_slots", "run_fleet"]


@dataclass(frozen=True)
class FleetOptions:
    """Everything one fleet run is told; every field is in its JSON output."""

    nodes: int
    jobs: str = "abcde"  # which of the jobs below run
    lease_ttl: int = 5
    hosts: int = 0  # host processes for the bulk of the agents (0: one per ~125, 2 to 8)
    step_s: float = 0.25  # 0: the stand-in workers report no progress (no hang phase)
    steady_s: float = 10.0
    hang_timeout: float = 3.0
    retention_s: float = 5.0
    after_s: float = 10.0
    settle_s: float = 1.5
    formations: int = 3
    preflight: bool = True
    client: str = "per-agent"
    monitor_interval: float = 1.0
    last_call_s: float = 30.0
    churn_jobs: int = 0
    churn_nodes: int = 2
    churn_parallel: int = 10
    churn_train_s: float = 1.0


def layout(nodes: int, hosts: int) -> list[int]:
    """Agents per slot: one alone (the one a node loss kills), the rest dealt over
    ``hosts`` slots (0: one per ~125 agents, at least 2, at most 8)."""
    if nodes < 3:
        raise ValueError(f"a fleet needs at least 3 agents, got {nodes}")
    rest = nodes - 1
    count = hosts or max(2, min(8, round(rest / 125)))
    count = min(count, rest)
    return [1] + [rest // count + (1 if i < rest % count else 0) for i in range(count)]


def pick_slots(sizes: Sequence[int], target: int, avoid: Sequence[int] = ()) -> list[int]:
    """The slots (not in ``avoid``) whose sizes add up closest to ``target``; fewest
    slots on a tie."""
    candidates = [i for i in range(len(sizes)) if i not in avoid]
    best: tuple[int, int, list[int]] | None = None
    for count in range(1, len(candidates) + 1):
        for combo in itertools.combinations(candidates, count):
            gap = abs(sum(sizes[i] for i in combo) - target)
            if best is None or (gap, count) < (best[0], best[1]):
                best = (gap, count, list(combo))
    return best[2] if best is not None else []


def _job(options: FleetOptions, tag: str, *, nodes: int, health: bool = False) -> JobSpec:
    conf = {
        "lease_ttl": options.lease_ttl,
        "last_call_timeout": options.last_call_s,
        "join_timeout": 600,
        "retention": options.retention_s,
    }
    return JobSpec(
        run_id=f"fleet-{tag}-{uuid.uuid4().hex[:6]}",
        nodes=nodes,
        min_nodes=max(1, nodes // 4),
        conf=conf,
        hang_timeout=options.hang_timeout,
        health_check=health,
        monitor_interval=options.monitor_interval,
    )


class _Run:
    """The state of one fleet run: results so far, errors, the cluster and fleet."""

    def __init__(self, options: FleetOptions, cluster: EtcdCluster, fleet: Fleet) -> None:
        self.options = options
        self.cluster = cluster
        self.fleet = fleet
        self.admin = EtcdAdmin(cluster)
        self.phases: list[PhaseResult] = []
        self.leftovers: dict[str, dict[str, Any]] = {}
        self.errors: list[str] = []
        self.churn: dict[str, Any] = {}

    def job(self, tag: str, body: Callable[[JobRun], None], health: bool = False) -> None:
        """Run one job's phases; a failure is recorded and its hosts are killed, so the
        next job starts clean."""
        job = JobRun(
            self.fleet,
            self.cluster,
            _job(self.options, tag, nodes=self.options.nodes, health=health),
            settle_s=self.options.settle_s,
        )
        try:
            body(job)
        except RunError as exc:
            self.errors.append(f"job {tag}: {exc}")
            self.fleet.kill(self.fleet.live_slots())
            self.fleet.reset_dead()
            # Its leases expire on etcd's clock: not in the next job's first window.
            time.sleep(self.options.lease_ttl + 2.0)

    def leftover(self, name: str, job: JobRun, retention: float) -> None:
        left: Leftovers = job.leftovers(self.admin, self.options.after_s, retention)
        self.leftovers[name] = {**asdict(left), "retention_s": retention}


def _kept_for(o: FleetOptions) -> float:
    """How long an ended run's keys stay: its run lease's TTL, the retention but never
    under twice the lease TTL (:func:`coordinator.core.run_lease.run_lease_ttl`)."""
    return float(run_lease_ttl(o.retention_s, o.lease_ttl))


def _job_a(run: _Run, job: JobRun) -> None:
    o = run.options
    run.phases.append(job.form())
    run.phases.append(job.steady(o.steady_s))
    run.phases.append(job.worker_failure())
    if o.step_s > 0:
        run.phases.append(job.hang())
    run.phases.append(job.lose([0], "node-loss"))
    run.phases.append(job.end())
    run.leftover("job-end", job, _kept_for(o))


def _job_b(run: _Run, job: JobRun) -> None:
    run.phases.append(job.form())
    slots = pick_slots(run.fleet.sizes, run.options.nodes // 2)
    run.phases.append(job.lose(slots, "half-lost"))
    run.phases.append(job.end())


def _job_c(run: _Run, job: JobRun) -> None:
    run.phases.append(job.form())
    run.phases.append(job.lost())
    # Nobody closed the run, but its keys hang on the run's lease, which nobody renews
    # after the kill: counted once that lease's TTL has passed too.
    run.leftover("job-lost", job, _kept_for(run.options))


def _job_plain(run: _Run, job: JobRun) -> None:
    run.phases.append(job.form())
    run.phases.append(job.end())


def _job_repeat(run: _Run, job: JobRun) -> None:
    run.phases.append(job.form())
    run.phases.append(job.lost())


def _wait_churn_formed(fleet: Fleet, job: JobSpec, agents: list[int], timeout: float) -> None:
    def formed() -> bool:
        return formed_after(latest_starts(fleet, agents), -1)

    fleet.wait_for(f"churn job {job.run_id}", formed, timeout)


def _wait_exited(fleet: Fleet, agents: list[int], timeout: float) -> None:
    def exited() -> bool:
        return all(fleet.exit_of(a) is not None for a in agents)

    fleet.wait_for("the churn jobs' end", exited, timeout)


def _churn(run: _Run) -> None:
    """Many small jobs, then the database size and what they left (see the module
    docstring)."""
    o = run.options
    fleet = run.fleet
    run.admin.compact()
    run.admin.defragment()
    start = scrape(run.cluster)
    begun = time.monotonic()
    jobs = [_job(o, f"c{i}", nodes=o.churn_nodes) for i in range(o.churn_jobs)]
    done = 0
    for first in range(0, len(jobs), o.churn_parallel):
        wave = jobs[first : first + o.churn_parallel]
        agents = fleet.build_jobs(wave)
        fleet.run(time.monotonic() + 0.5)
        for job in wave:
            _wait_churn_formed(fleet, job, agents[job.run_id], 60.0 + o.lease_ttl * 3)
        time.sleep(o.churn_train_s)  # the jobs train
        fleet.finish()
        _wait_exited(fleet, [a for job in wave for a in agents[job.run_id]], 120.0)
        fleet.release()
        done += len(wave)
    ended = time.monotonic()
    time.sleep(_kept_for(o) + o.after_s)  # etcd removes what the run leases hold
    keys = run.admin.keys_under("/etcd-elastic/")
    leases = run.admin.leases()
    run.admin.compact()
    compacted = scrape(run.cluster)
    run.admin.defragment()
    end = scrape(run.cluster)
    run.churn = {
        "jobs": done,
        "nodes_per_job": o.churn_nodes,
        "parallel": o.churn_parallel,
        "seconds": round(ended - begun, 2),
        "db_size_start": start.at_leader("etcd_mvcc_db_total_size_in_bytes"),
        "db_size_end": end.at_leader("etcd_mvcc_db_total_size_in_bytes"),
        "db_in_use_start": start.at_leader("etcd_mvcc_db_total_size_in_use_in_bytes"),
        "db_in_use_compacted": compacted.at_leader("etcd_mvcc_db_total_size_in_use_in_bytes"),
        "keys_start": start.at_leader("etcd_debugging_mvcc_keys_total"),
        "keys_left": keys,
        "leases_left": leases,
        "bytes_put": end.at_leader("etcd_debugging_mvcc_total_put_size_in_bytes")
        - start.at_leader("etcd_debugging_mvcc_total_put_size_in_bytes"),
    }


def _plan(run: _Run) -> list[tuple[str, Callable[[JobRun], None], bool]]:
    """The jobs of one run, in order (see the module docstring)."""
    options = run.options

    def plain(job: JobRun) -> None:
        _job_plain(run, job)

    def repeat(job: JobRun) -> None:
        _job_repeat(run, job)

    plan: list[tuple[str, Callable[[JobRun], None], bool]] = [
        ("a", lambda job: _job_a(run, job), False),
        ("b", lambda job: _job_b(run, job), False),
        ("c", lambda job: _job_c(run, job), False),
    ]
    if options.preflight:
        plan.append(("d", plain, True))
    plan += [(f"e{i}", repeat, False) for i in range(max(0, options.formations - 3))]
    return [entry for entry in plan if entry[0][0] in options.jobs]


def run_fleet(
    options: FleetOptions, progress: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Run every job at ``options.nodes`` agents; the result as JSON data."""
    binary = benchmark_etcd_binary()
    log_dir = tempfile.mkdtemp(prefix="fleet-logs-")
    cluster = EtcdCluster(3, binary=binary)
    sizes = layout(options.nodes, options.hosts)
    fleet: Fleet | None = None
    run: _Run | None = None
    started = time.monotonic()
    try:
        cluster.start()
        settings = FleetSettings(cluster.endpoint_list, log_dir, options.step_s, options.client)
        fleet = Fleet(settings, sizes)
        run = _Run(options, cluster, fleet)
        for tag, body, health in _plan(run):
            progress(f"N={options.nodes}: job {tag}")
            run.job(tag, body, health)
        if options.churn_jobs:
            progress(f"N={options.nodes}: {options.churn_jobs} churn jobs")
            try:
                _churn(run)
            except RunError as exc:
                run.errors.append(f"churn: {exc}")
    finally:
        if fleet is not None:
            fleet.close()
        cluster.stop()
        shutil.rmtree(log_dir, ignore_errors=True)
    return {
        "nodes": options.nodes,
        "options": asdict(options),
        "layout": sizes,
        "etcd": f"{etcd_version(binary)}, 3 members on loopback, data on disk, fsync on",
        "seconds": round(time.monotonic() - started, 1),
        "phases": [p.as_json() for p in run.phases] if run else [],
        "leftovers": run.leftovers if run else {},
        "churn": run.churn if run else {},
        "errors": run.errors if run else ["the cluster or the fleet did not start"],
    }
