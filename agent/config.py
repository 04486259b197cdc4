"""The validated launch configuration: what ``etcdrun``'s command line means.

Built by :mod:`agent.cli.etcdrun` (which validates every value and names the flag on error) and
consumed by the agent loop. Frozen: nothing changes it after parsing.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["LaunchConfig", "Std"]

# Which worker streams go to files: torch's Std values (0 none, 1 stdout, 2 stderr, 3 both),
# kept per local rank after parsing "-r 3" or "-r 0:1,1:2".
Std = int


@dataclass(frozen=True)
class LaunchConfig:
    """Everything the agent needs to run one node of a job.

    Attributes:
        min_nodes, max_nodes: from ``--nnodes N`` or ``MIN:MAX``.
        nproc_per_node: resolved worker count on this node (``gpu``/``cpu``/``auto`` already
            turned into a number).
        rdzv_backend: ``etcd-v2`` or ``etcd-v3`` (the same backend here).
        rdzv_endpoint: comma-separated ``host:port`` list (validated).
        rdzv_id: the run id.
        rdzv_conf: ``--rdzv-conf`` as strings, keys validated against the known set.
        standalone: start an embedded single-member etcd for this run.
        max_restarts: restarts allowed after worker failures (membership changes don't count).
        monitor_interval: upper bound between health checks; the loop wakes on events first.
        start_method: ``spawn``/``fork``/``forkserver`` (workers are separate processes
            started by ``subprocess`` either way; kept for torchrun compatibility).
        role: worker role name.
        entrypoint: the script (or module, or program with ``--no-python``).
        args: its arguments.
        module: ``-m``: run ``entrypoint`` as a Python module.
        no_python: run ``entrypoint`` directly, not through Python.
        run_path: ``--run-path``: run the script with ``runpy.run_path``.
        log_dir: base folder for worker logs (one folder per attempt below it), or None.
        redirects: local rank -> Std for ``--redirects``.
        tee: local rank -> Std for ``--tee``.
        local_ranks_filter: local ranks whose console output is shown (None: all).
        node_rank: ``--node-rank`` (only meaningful for static rendezvous; kept).
        master_addr, master_port: override what group rank 0 publishes.
        local_addr: this node's address as others should reach it.
        exit_barrier_timeout: seconds to wait for other agents after local success.
        stop_grace_period: seconds between SIGTERM and SIGKILL when stopping workers.
        warm_start: start restarted workers from interpreters started ahead
            (:mod:`agent.workers.warm`); ``--no-warm-start`` turns it off.
        warm_modules: what those interpreters import ahead (``--warm-modules``).
        warm_pool_size: how many are kept per local worker (``--warm-pool-size``).
        drain_signal: the early warning a leaving agent's workers get first (drained by an
            operator, or the agent was sent a stop signal), instead of the stop signal;
            SIGKILL follows ``stop_grace_period`` later. None: the stop signal.
        metrics_port: where Prometheus metrics are served (``--metrics-port``; 0: any
            free port); None: no metrics endpoint.
        metrics_addr: the address it listens on (``--metrics-addr``).
        hang_timeout: ``--hang-timeout``: seconds a node's workers may report no progress
            (``etcd_elastic.progress.report_progress``) before the run re-forms, a counted
            restart on every node (``docs/hang-detection.md``). None: off.
        health_check: run the pre-flight check before the workers of each round start
            (``--health-check``; docs/health-check.md).
        health_check_timeout: seconds this node's check may take before it counts as
            failed (``--health-check-timeout``).
        quarantine_seconds: how long a node that failed the check is left out
            (``--quarantine-seconds``).
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    entrypoint: str
    args: tuple[str, ...] = ()
    rdzv_backend: str = "etcd-v2"
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    rdzv_conf: dict[str, str] = field(default_factory=dict, repr=False)  # may hold a password
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: Literal["spawn", "fork", "forkserver"] = "spawn"
    role: str = "default"
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    log_dir: str | None = None
    redirects: dict[int, Std] = field(default_factory=dict)
    tee: dict[int, Std] = field(default_factory=dict)
    local_ranks_filter: frozenset[int] | None = None
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    local_addr: str | None = None
    exit_barrier_timeout: float = 300.0
    stop_grace_period: float = 5.0
    warm_start: bool = True
    warm_modules: tuple[str, ...] = ("torch",)
    warm_pool_size: int = 2
    drain_signal: signal.Signals | None = None
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    hang_timeout: float | None = None
    health_check: bool = False
    health_check_timeout: float = 30.0
    quarantine_seconds: float = 300.0
