"""Every flag of ``etcdrun``: torchrun's, in their groups, with their help and defaults.

What the flags are lives here; how they are parsed (the ``PET_*`` defaults, the one-line
errors) lives in :mod:`agent.cli.parser`, and what their values mean in
:mod:`agent.cli.configure`.
"""

from __future__ import annotations

import argparse
from typing import Protocol

__all__ = ["IGNORED_FLAGS", "add_options"]

_SIGNALS_DEFAULT = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

IGNORED_FLAGS: dict[str, tuple[str, object, str]] = {
    "event_log_handler": (
        "--event-log-handler",
        "null",
        "torch's event handlers are not used; the agent logs its events itself",
    ),
    "logs_specs": ("--logs-specs", None, "log files follow --log-dir/--redirects/--tee"),
    "numa_binding": ("--numa-binding", None, "workers are not bound to NUMA nodes"),
    "signals_to_handle": (
        "--signals-to-handle",
        _SIGNALS_DEFAULT,
        "the agent handles SIGTERM and SIGINT and stops the workers on either",
    ),
    "duplicate_stdout_filters": ("--duplicate-stdout-filters", "", "not implemented"),
    "duplicate_stderr_filters": ("--duplicate-stderr-filters", "", "not implemented"),
    "virtual_local_rank": ("--virtual-local-rank", False, "LOCAL_RANK is the real local rank"),
}
"""dest -> (flag, default, why): accepted so torchrun command lines work; warned about."""


class _Option(Protocol):
    def __call__(
        self,
        group: argparse._ArgumentGroup,
        *names: str,
        default: str | None,
        help: str,
        metavar: str | None = None,
        show_default: bool = True,
    ) -> None: ...


class _Flag(Protocol):
    def __call__(self, group: argparse._ArgumentGroup, *names: str, help: str) -> None: ...


def add_options(parser: argparse.ArgumentParser, option: _Option, flag: _Flag) -> None:
    """Add every flag to ``parser``: ``option`` adds one that takes a value, ``flag`` one
    without (both read their ``PET_*`` default; see :func:`agent.cli.parser.build_parser`)."""
    size = parser.add_argument_group("nodes and workers")
    option(
        size,
        "--nnodes",
        default="1:1",
        metavar="N|MIN:MAX",
        help="number of nodes, or the range the job may run with",
    )
    option(
        size,
        "--nproc-per-node",
        "--nproc_per_node",
        default="1",
        metavar="N|gpu|cpu|auto",
        help="workers per node: a number, one per GPU, one per CPU, or GPUs if any else CPUs",
    )

    rdzv = parser.add_argument_group("rendezvous (etcd)")
    option(
        rdzv,
        "--rdzv-backend",
        "--rdzv_backend",
        default="etcd-v2",
        metavar="NAME",
        help="etcd-v2 or etcd-v3: both are this project's etcd v3 rendezvous",
    )
    option(
        rdzv,
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default="",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the etcd members, port 2379 unless given (default: none, which for a "
        "one-node job means --standalone)",
        show_default=False,
    )
    option(
        rdzv,
        "--rdzv-id",
        "--rdzv_id",
        default="none",
        metavar="RUN_ID",
        help="job name shared by all nodes: 1-128 of A-Z a-z 0-9 . _ - (required for "
        "more than one node, unless Slurm's SLURM_JOB_ID gives one; random for one node)",
        show_default=False,
    )
    option(
        rdzv,
        "--rdzv-conf",
        "--rdzv_conf",
        default="",
        metavar="KEY=VALUE,...",
        help="rendezvous settings, e.g. join_timeout=600,lease_ttl=5; keys: join_timeout, "
        "last_call_timeout, close_timeout, read_timeout, timeout, lease_ttl, key_prefix, "
        "protocol, ssl_cert, ssl_cert_key, ca_cert, user, password_file (the password: "
        "that file or $ETCD_ELASTIC_PASSWORD, never on the command line). lease_ttl by "
        "the nodes of all jobs on one etcd: 5 up to ~1,500, 10 up to ~3,000, 15 up to "
        "~5,000 (docs/scale.md)",
    )
    flag(
        rdzv,
        "--standalone",
        help="one node: start an embedded single-member etcd on a free loopback port "
        "(removed on exit) and a random --rdzv-id",
    )

    run = parser.add_argument_group("restarts and monitoring")
    option(
        run,
        "--max-restarts",
        "--max_restarts",
        default="0",
        metavar="N",
        help="restarts of the worker group after failures (membership changes don't count)",
    )
    option(
        run,
        "--monitor-interval",
        "--monitor_interval",
        default="0.1",
        metavar="SECONDS",
        help="longest time between worker health checks (exits are noticed at once)",
    )
    option(
        run,
        "--exit-barrier-timeout",
        "--exit_barrier_timeout",
        default="300",
        metavar="SECONDS",
        help="how long a finished node waits for the others",
    )
    option(
        run,
        "--shutdown-timeout",
        "--shutdown_timeout",
        default=None,
        metavar="SECONDS",
        help="grace period between SIGTERM and SIGKILL when stopping workers (default: 5)",
    )
    option(
        run,
        "--drain-signal",
        "--drain_signal",
        default=None,
        metavar="SIGNAL",
        help="early warning a leaving agent's workers get first (rdzvctl drain, or a stop "
        "signal to the agent), e.g. SIGUSR1 for a script that checkpoints on it; SIGKILL "
        "follows --shutdown-timeout later (default: the stop signal itself)",
    )
    option(
        run,
        "--hang-timeout",
        "--hang_timeout",
        default=None,
        metavar="SECONDS",
        help="re-form the run (a counted restart on every node) when a node's workers "
        "report no progress (etcd_elastic.progress.report_progress) for this long, naming the "
        "node(s) that stopped first; at least 1 (default: off)",
    )
    option(
        run,
        "--start-method",
        "--start_method",
        default="spawn",
        metavar="spawn|fork|forkserver",
        help="accepted for torchrun compatibility; workers are always new processes",
    )
    flag(
        run,
        "--no-warm-start",
        "--no_warm_start",
        help="start every worker in a new interpreter; by default a restarted worker "
        "starts from one started ahead with --warm-modules imported",
    )
    option(
        run,
        "--warm-modules",
        "--warm_modules",
        default="torch",
        metavar="MOD[,MOD...]",
        help="modules the interpreters started ahead import (CUDA is never touched)",
    )
    option(
        run,
        "--warm-pool-size",
        "--warm_pool_size",
        default="2",
        metavar="N",
        help="interpreters kept started ahead per local worker (0: none, as --no-warm-start)",
    )

    health = parser.add_argument_group("pre-flight check (docs/health-check.md)")
    flag(
        health,
        "--health-check",
        "--health_check",
        help="before the workers of each round start, check every node (devices, a small "
        "matmul, timed all_reduces between neighbours); a node that fails or is much "
        "slower than the others is quarantined and the others re-form without it",
    )
    option(
        health,
        "--health-check-timeout",
        "--health_check_timeout",
        default=None,
        metavar="SECONDS",
        help="how long one node's check may take before it counts as failed (default: 30)",
    )
    option(
        health,
        "--quarantine-seconds",
        "--quarantine_seconds",
        default=None,
        metavar="SECONDS",
        help="how long a node that failed the check is left out before it may join "
        "again (default: 300)",
    )

    what = parser.add_argument_group("what to run")
    option(what, "--role", default="default", help="role name of the workers")
    flag(what, "-m", "--module", help="run the script argument as a module, like python -m")
    flag(
        what,
        "--no-python",
        "--no_python",
        help="run the script argument as a program, without python",
    )
    flag(
        what,
        "--run-path",
        "--run_path",
        help="run the script with runpy.run_path (takes precedence over --no-python)",
    )

    logs = parser.add_argument_group("logs")
    option(
        logs,
        "--log-dir",
        "--log_dir",
        default=None,
        metavar="DIR",
        help="base folder for worker logs; one folder per attempt below it",
    )
    option(
        logs,
        "-r",
        "--redirects",
        default="0",
        metavar="STD|RANK:STD,...",
        help="send worker output to files: 0 none, 1 stdout, 2 stderr, 3 both; "
        "for all ranks (3) or per local rank (0:1,1:2)",
    )
    option(
        logs,
        "-t",
        "--tee",
        default="0",
        metavar="STD|RANK:STD,...",
        help="like --redirects, but also show the output on the console",
    )
    option(
        logs,
        "--local-ranks-filter",
        "--local_ranks_filter",
        default="",
        metavar="R,...",
        help="show console output only of these local ranks (default: every rank)",
        show_default=False,
    )

    metrics = parser.add_argument_group("metrics (docs/metrics.md)")
    option(
        metrics,
        "--metrics-port",
        "--metrics_port",
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://ADDR:PORT/metrics (0: any free port, "
        "logged at start; default: no metrics)",
        show_default=False,
    )
    option(
        metrics,
        "--metrics-addr",
        "--metrics_addr",
        default="127.0.0.1",
        metavar="HOST",
        help="address the metrics endpoint listens on; 0.0.0.0 for a scraper on another host",
    )

    addr = parser.add_argument_group("addresses")
    option(
        addr,
        "--node-rank",
        "--node_rank",
        default="0",
        metavar="N",
        help="accepted for torchrun compatibility (static rendezvous only)",
    )
    option(
        addr,
        "--master-addr",
        "--master_addr",
        default=None,
        metavar="HOST",
        help="address group rank 0 publishes for the workers (default: its own)",
    )
    option(
        addr,
        "--master-port",
        "--master_port",
        default=None,
        metavar="PORT",
        help="port group rank 0 publishes for the workers (default: a free one)",
    )
    option(
        addr,
        "--local-addr",
        "--local_addr",
        default=None,
        metavar="HOST",
        help="this node's address as the others reach it (default: its host name)",
    )

    compat = parser.add_argument_group(
        "torchrun flags accepted and ignored (a warning says so when set)"
    )
    for dest, (name, default, why) in IGNORED_FLAGS.items():
        if isinstance(default, bool):
            continue
        option(
            compat,
            name,
            "--" + dest,
            default=None if default is None else str(default),
            metavar="VALUE",
            help=f"ignored: {why}",
            show_default=bool(default),
        )
    flag(
        compat,
        "--virtual-local-rank",
        "--virtual_local_rank",
        help=f"ignored: {IGNORED_FLAGS['virtual_local_rank'][2]}",
    )

    parser.add_argument(
        "training_script",
        nargs="?",
        default=None,
        metavar="script",
        help="the training script (or module with -m, program with --no-python)",
    )
    parser.add_argument(
        "training_script_args",
        nargs=argparse.REMAINDER,
        metavar="args",
        help="arguments passed to the script",
    )
