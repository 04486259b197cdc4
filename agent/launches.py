"""What one attempt starts: the master address and every worker's command, environment
and log files, computed from the round's outcome (pure but for the store exchange of
:func:`resolve_master`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agent.config import LaunchConfig
from agent.logs import LogSpec, console_prefix, plan_attempt
from agent.ranks import Assignment, Store, publish_master
from agent.workers import GroupInfo, WorkerLaunch, build_argv, worker_env

__all__ = ["build_launches", "resolve_master"]


def resolve_master(
    config: LaunchConfig, info: Any, store: Store, group_rank: int
) -> tuple[str, int]:
    """MASTER_ADDR/MASTER_PORT of the round: ``--master-addr/--master-port`` first, then the
    handler's bootstrap info, else group rank 0 publishes a free port through the store."""
    bootstrap = getattr(info, "bootstrap_store_info", None)
    if bootstrap is not None and bootstrap.master_port:
        # The handler already agreed on rank 0's address (torch's handlers, ours); with an
        # agent store the workers must connect exactly there.
        return (
            config.master_addr or bootstrap.master_addr,
            config.master_port or bootstrap.master_port,
        )
    return publish_master(
        store, group_rank, config.local_addr, config.master_addr, config.master_port
    )


def build_launches(
    config: LaunchConfig,
    group: GroupInfo,
    assignment: Assignment,
    logspec: LogSpec,
    attempt_dir: Path,
    base_env: Mapping[str, str],
) -> list[WorkerLaunch]:
    """One :class:`WorkerLaunch` per local rank of this node."""
    local_ranks = range(config.nproc_per_node)
    ranks = {lr: assignment.worker(lr) for lr in local_ranks}
    prefixes = {
        lr: console_prefix(logspec.prefix_template, config.role, r.global_rank, lr)
        for lr, r in ranks.items()
    }
    plans = plan_attempt(logspec, attempt_dir, prefixes)
    return [
        WorkerLaunch(
            ranks=ranks[lr],
            argv=build_argv(
                config.entrypoint,
                config.args,
                module=config.module,
                no_python=config.no_python,
                run_path=config.run_path,
                local_rank=lr,
            ),
            env=worker_env(base_env, group, ranks[lr], plans[lr].error_file),
            logs=plans[lr],
        )
        for lr in local_ranks
    ]
