"""What one attempt starts: the master address and every worker's command, environment
and log files, computed from the round's outcome (pure but for the store exchange of
:func:`resolve_master`)."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.config import LaunchConfig
from agent.loop.ranks import Assignment, publish_master
from agent.store import Store
from agent.workers.bootstrap import BootstrapTicket
from agent.workers.group import GroupInfo, build_argv, worker_env
from agent.workers.launch import WorkerLaunch, WorkerRanks
from agent.workers.logs import LogSpec, console_prefix, plan_attempt

__all__ = ["Master", "build_launches", "resolve_master", "warm_templates"]


@dataclass(frozen=True)
class Master:
    """Where this round's workers bootstrap (the store itself, when this agent hosts it,
    is held by the :class:`~agent.workers.bootstrap.BootstrapHost`)."""

    addr: str
    port: int
    agent_store: bool


def resolve_master(
    config: LaunchConfig,
    info: Any,
    store: Store,
    group_rank: int,
    host: BootstrapTicket,
    *,
    handler_store: bool = False,
) -> Master:
    """MASTER_ADDR/MASTER_PORT of the round. When the handler hosts the workers' store
    itself (``handler_store``: torch's c10d handler with its agent store), its bootstrap
    info, with ``--master-addr/--master-port`` first. Otherwise the agent of group rank 0
    starts the workers' bootstrap store (:mod:`agent.workers.bootstrap`; on ``--master-port`` if
    given) and publishes where through the round's store (one key, one read per agent). A
    handler's suggested port (ours: one rank 0's node found free when it joined) is not
    used: nothing listens on it until a worker binds it, and it can be taken in between.

    Args:
        host: where group rank 0 hosts the store (its formation's ticket).

    Raises:
        BootstrapStoreError: group rank 0 cannot listen on ``--master-port``, or the
            formation was abandoned (:class:`~agent.workers.bootstrap.BootstrapSuperseded`).
        ValueError: a published value is not what an agent writes.
    """
    bootstrap = getattr(info, "bootstrap_store_info", None)
    if handler_store and bootstrap is not None and bootstrap.master_port:
        # The handler's own store serves the workers: they must connect exactly there.
        return Master(
            config.master_addr or bootstrap.master_addr,
            config.master_port or bootstrap.master_port,
            agent_store=True,
        )
    port = config.master_port
    if group_rank == 0:
        addr = config.master_addr or config.local_addr or socket.getfqdn()
        port = host.serve(addr, config.master_port)
    addr, port, agent_store = publish_master(
        store, group_rank, config.local_addr, config.master_addr, port,
        agent_store=group_rank == 0,
    )  # fmt: skip
    return Master(addr, port, agent_store=agent_store)


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


def warm_templates(
    config: LaunchConfig, base_env: Mapping[str, str]
) -> dict[int, tuple[list[str], dict[str, str]]]:
    """Per local rank, the command and environment a worker will have in any round, for
    starting warm interpreters before the first round (:mod:`agent.workers.warm`): torchrun's
    per-attempt variables get placeholders, which a warm interpreter never reads."""
    group = GroupInfo(
        role=config.role,
        group_rank=0,
        group_world_size=1,
        local_world_size=config.nproc_per_node,
        master_addr="",
        master_port=0,
        restart_count=0,
        max_restarts=config.max_restarts,
        run_id="",
        use_agent_store=False,
    )
    templates = {}
    for lr in range(config.nproc_per_node):
        argv = build_argv(
            config.entrypoint, config.args, module=config.module,
            no_python=config.no_python, run_path=config.run_path, local_rank=lr,
        )  # fmt: skip
        env = worker_env(base_env, group, WorkerRanks(lr, lr, lr, 1, 1), error_file="")
        templates[lr] = (argv, env)
    return templates
