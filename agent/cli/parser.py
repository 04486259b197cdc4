"""The ``etcdrun`` argument parser: torchrun's flags, grouped, with defaults from ``PET_*``.

Only the syntax lives here; :mod:`agent.cli.etcdrun` checks the values. Every value is read as a
string so that the checks, not argparse, word the error messages.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from typing import NoReturn

__all__ = ["IGNORED_FLAGS", "PROG", "build_parser"]

PROG = "etcdrun"

# argparse's own wordings, reworded to start with the flag like every other error.
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
_ABOUT_FLAG = re.compile(r"argument (-[^/ :]+)(?:/[^ :]+)?: (.*)")

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

_DESCRIPTION = """\
Start the workers of one node of an elastic PyTorch job, like torchrun, with the
rendezvous kept in etcd (v3 API). Run the same command on every node; nodes that share
--rdzv-endpoint and --rdzv-id form one job. Every flag also takes its default from the
environment variable PET_<FLAG> (e.g. PET_NPROC_PER_NODE=2), and every --flag-name can
be written --flag_name, as in torchrun."""

_EPILOG = """\
examples:
  one machine, two workers, embedded etcd:
    etcdrun --standalone --nproc-per-node=2 train.py --epochs 3
  one to four machines, one worker per GPU, a three-member etcd cluster:
    etcdrun --nnodes=1:4 --nproc-per-node=gpu --rdzv-id=job42 \\
            --rdzv-endpoint=etcd1:2379,etcd2:2379,etcd3:2379 train.py --lr 0.1

exit codes: 0 every worker succeeded; 1 the job failed (restarts exhausted, rendezvous
error); 2 bad command line; 128+N ended by signal N (README: every ending)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line: ``etcdrun: error: <message>``, exit code 2."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())
        unknown = _UNRECOGNIZED.fullmatch(message)
        about_flag = _ABOUT_FLAG.fullmatch(message)
        if unknown:
            message = (
                f"{unknown[1]}: unknown option; see {self.prog} --help "
                "(arguments for the script go after the script)"
            )
        elif about_flag:
            message = f"{about_flag[1]}: {about_flag[2]}"
        self.exit(2, f"{self.prog}: error: {message}\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Lists each option once, dash spelling only, with its value name once."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        # The underscore spellings work too (the description says so); listing them
        # would double every line of the help.
        names = ", ".join(n for n in action.option_strings if "_" not in n)
        if action.nargs == 0:
            return names
        default = self._get_default_metavar_for_optional(action)
        return f"{names} {self._format_args(action, default)}"


def _dest(names: tuple[str, ...]) -> str:
    long = next((n for n in names if n.startswith("--")), names[0])
    return long.lstrip("-").replace("-", "_")


def build_parser(*, environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Return the ``etcdrun`` argument parser.

    Args:
        environ: where ``PET_<FLAG>`` defaults are read from; default ``os.environ``.

    Returns:
        A parser whose ``error()`` prints one line and exits with code 2. Option values
        are strings (flags are booleans); ``training_script`` may be None (checked later)
        and ``training_script_args`` holds everything after the script.
    """
    env = os.environ if environ is None else environ
    parser = _Parser(
        prog=PROG,
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=_HelpFormatter,
    )

    def option(
        group: argparse._ArgumentGroup,
        *names: str,
        default: str | None,
        help: str,
        metavar: str | None = None,
        show_default: bool = True,
    ) -> None:
        dest = _dest(names)
        value = env.get(f"PET_{dest.upper()}", default)
        shown = f" (default: {default or 'none'})" if show_default and default is not None else ""
        group.add_argument(*names, dest=dest, default=value, metavar=metavar, help=help + shown)

    def flag(group: argparse._ArgumentGroup, *names: str, help: str) -> None:
        dest = _dest(names)
        value = env.get(f"PET_{dest.upper()}", "0").strip().lower() not in ("", "0", "false")
        group.add_argument(*names, dest=dest, action="store_true", default=value, help=help)

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
    return parser
