"""From a parsed ``etcdrun`` command line to a validated :class:`~agent.config.LaunchConfig`.

Every value is checked here, before anything starts (no etcd, no worker), and a bad one
raises :class:`~agent.cli.values.UsageError` naming the flag (and the ``PET_*`` variable
it came from, see :mod:`agent.cli.parser`). The timeouts are checked together too
(:mod:`coordinator.core.timeouts`, ``docs/timeouts.md``): a combination that cannot work is
refused, a risky one is warned about.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from agent.cli import devices
from agent.cli.parser import IGNORED_FLAGS, environment_source
from agent.cli.values import (
    UsageError,
    parse_hang_timeout,
    parse_metrics,
    parse_modules,
    parse_nnodes,
    parse_ranks_filter,
    parse_rdzv_conf,
    parse_seconds,
    parse_signal,
    parse_std_map,
    parse_whole,
)
from agent.config import LaunchConfig
from coordinator.core.endpoints import parse_endpoints
from coordinator.core.errors import ConfigError
from coordinator.core.keys import validate_run_id
from coordinator.core.settings import RendezvousSettings
from coordinator.core.timeouts import Finding, nesting

__all__ = ["BACKENDS", "build_config", "scheduler_run_id", "timeout_findings", "warn_ignored"]

log = logging.getLogger(__name__)

BACKENDS = ("etcd-v2", "etcd-v3")
"""Accepted ``--rdzv-backend`` names; both mean this project's etcd v3 rendezvous."""

# Stands in for the embedded etcd's endpoint, which exists only once it has started,
# when --standalone settings are validated.
_STANDALONE_PLACEHOLDER = "127.0.0.1:2379"


def _settings_error(exc: ConfigError) -> UsageError:
    """Name the flag behind a coordinator settings error."""
    text = str(exc)
    for prefix, flag in (
        ("rdzv_endpoint ", "--rdzv-endpoint"),
        ("rdzv_id ", "--rdzv-id"),
        ("rdzv_conf has ", "--rdzv-conf"),
        ("rdzv_conf ", "--rdzv-conf"),
    ):
        if text.startswith(prefix):
            reason = text[len(prefix) :]
            if flag == "--rdzv-endpoint" and "give" not in reason:
                reason += "; give the etcd members as host:port[,host:port...]"
            return UsageError(flag, reason)
    flag, sep, rest = text.partition(": ")
    if sep and flag.startswith("--"):
        return UsageError(flag, rest)
    return UsageError("--rdzv-conf", text)


@dataclasses.dataclass(frozen=True)
class _Parameters:
    """What the settings read of torch's ``RendezvousParameters``, without importing torch
    (seconds): a bad command line ends before torch is loaded."""

    run_id: str
    endpoint: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None
    config: dict[str, Any]


def _check_rendezvous(config: LaunchConfig) -> RendezvousSettings:
    """Validate endpoint, run id and rdzv_conf exactly as the coordinator will."""
    endpoint = _STANDALONE_PLACEHOLDER if config.standalone else config.rdzv_endpoint
    try:
        parse_endpoints(endpoint)
        validate_run_id(config.rdzv_id)
        return RendezvousSettings.from_parameters(
            _Parameters(
                run_id=config.rdzv_id,
                endpoint=endpoint,
                min_nodes=config.min_nodes,
                max_nodes=config.max_nodes,
                local_addr=config.local_addr,
                config=dict(config.rdzv_conf),
            )
        )
    except ConfigError as exc:
        raise _settings_error(exc) from None


def _check_script(ns: argparse.Namespace) -> tuple[str, tuple[str, ...]]:
    script: str | None = ns.training_script
    if not script:
        raise UsageError(
            "script",
            "missing; give the training script and its arguments after the options, "
            "e.g. etcdrun --nproc-per-node=2 train.py --epochs 3",
        )
    if ns.module and ns.no_python:
        raise UsageError("--no-python", "cannot be combined with -m/--module; drop one of them")
    if (ns.run_path or not (ns.module or ns.no_python)) and not os.path.isfile(script):
        raise UsageError(
            "script",
            f"{script!r} does not exist (relative to {os.getcwd()}); give the path of the "
            "training script, or -m for a module, or --no-python for a program",
        )
    return script, tuple(ns.training_script_args)


def warn_ignored(ns: argparse.Namespace) -> None:
    """Say which accepted torchrun flags have no effect: a warning for a flag the user
    gave, an info line for a value a scheduler put in the environment (``PET_*``)."""
    for dest, (flag, default, why) in IGNORED_FLAGS.items():
        value = getattr(ns, dest)
        if value not in (default, None, [], ""):
            _say_ignored(ns, dest, f"{flag}={value!r} is accepted for torchrun compatibility "
                         f"and ignored: {why}")  # fmt: skip
    for dest in ("master_addr", "master_port"):
        variable = environment_source(ns, dest)
        if variable is not None:
            log.info("%s=%s ignored: this run's group rank 0 publishes the workers' master "
                     "address (torchrun ignores it too outside its static rendezvous)",
                     variable, getattr(ns, dest))  # fmt: skip
    if ns.node_rank not in ("0", 0):
        _say_ignored(ns, "node_rank", f"--node-rank={ns.node_rank} is only used by torch's "
                     "static rendezvous; ignored here")  # fmt: skip


def _say_ignored(ns: argparse.Namespace, dest: str, line: str) -> None:
    variable = environment_source(ns, dest)
    if variable is None:
        log.warning("%s", line)
    else:
        log.info("%s (from %s, set by the scheduler)", line, variable)


def timeout_findings(config: LaunchConfig) -> list[Finding]:
    """How this configuration's timeouts nest (:func:`coordinator.core.timeouts.nesting`):
    the rendezvous settings' and the agent's own, together."""
    spans = _check_rendezvous(config).spans()
    return nesting(
        dataclasses.replace(
            spans,
            hang_timeout=config.hang_timeout,
            health_check_timeout=config.health_check_timeout if config.health_check else None,
            shutdown_timeout=config.stop_grace_period,
        )
    )


def scheduler_run_id(environ: Mapping[str, str]) -> str | None:
    """A run id every node of one scheduled job derives alike, or None outside one.

    Slurm: ``slurm-<SLURM_JOB_ID>[.<SLURM_STEP_ID>]``: the job id is kept when Slurm
    requeues the job (a retry finds its run), and the step id keeps two ``srun`` steps of
    one allocation apart.
    """
    job, step = environ.get("SLURM_JOB_ID", "").strip(), environ.get("SLURM_STEP_ID", "").strip()
    if not job:
        return None
    candidate = f"slurm-{job}" + (f".{step}" if step else "")
    try:
        return validate_run_id(candidate)
    except ConfigError:
        return None


def _run_id(given: str, standalone: bool, max_nodes: int, environ: Mapping[str, str]) -> str | None:
    """The run id to use; None: a multi-node job without one (refused)."""
    if given not in ("none", ""):
        return given
    if standalone or max_nodes == 1:
        # One node: nobody else joins, so a random id cannot split a job, and two such
        # jobs on one etcd never meet.
        return str(uuid.uuid4())
    derived = scheduler_run_id(environ)
    if derived is not None:
        log.info("no --rdzv-id: run id %s from the scheduler's environment", derived)
    return derived


def _missing_run_id(max_nodes: int) -> UsageError:
    return UsageError(
        "--rdzv-id",
        f"missing; a job of up to {max_nodes} nodes needs a run id that all its nodes share "
        "and no other job uses (two jobs without one would share a run): give e.g. "
        "--rdzv-id=job42 (under Slurm, SLURM_JOB_ID gives one)",
    )


def build_config(
    ns: argparse.Namespace,
    cuda_device_count: Callable[[], int],
    cpu_count: Callable[[], int],
    environ: Mapping[str, str],
) -> LaunchConfig:
    min_nodes, max_nodes = parse_nnodes(ns.nnodes)
    try:
        nproc = devices.resolve_nproc(
            ns.nproc_per_node, cuda_device_count=cuda_device_count, cpu_count=cpu_count
        )
    except ValueError as exc:
        raise UsageError("--nproc-per-node", str(exc)) from None
    backend = ns.rdzv_backend.strip().lower()
    if backend not in BACKENDS:
        raise UsageError(
            "--rdzv-backend",
            f"{ns.rdzv_backend!r} is not supported; use etcd-v2 or etcd-v3 "
            "(both are this project's etcd v3 rendezvous)",
        )
    endpoint = ns.rdzv_endpoint.strip()
    standalone = bool(ns.standalone)
    if standalone and endpoint:
        raise UsageError(
            "--standalone",
            f"starts its own etcd, so --rdzv-endpoint={endpoint} makes no sense with it; "
            "drop one of the two",
        )
    if not standalone and not endpoint:
        if max_nodes > 1:
            raise UsageError(
                "--rdzv-endpoint",
                f"missing; a job of up to {max_nodes} nodes needs a shared etcd: give "
                "--rdzv-endpoint=host:port[,host:port...], or --standalone for one node",
            )
        # torchrun runs a one-node job without any rendezvous flag; so do we, on an
        # embedded etcd.
        standalone = True
    if standalone and max_nodes > 1:
        raise UsageError(
            "--nnodes",
            f"--standalone runs one node but --nnodes={ns.nnodes} allows {max_nodes}; "
            "drop --standalone and give --rdzv-endpoint of an etcd all nodes can reach",
        )
    run_id = _run_id(ns.rdzv_id.strip(), standalone, max_nodes, environ)
    # A scheduler's MASTER_ADDR/PORT (Kubeflow's PET_MASTER_*) name one pod, not this
    # run's group rank 0: as torchrun does for any rendezvous but the static one, they
    # are ignored (warn_ignored says so); given as flags they keep etcdrun's meaning.
    master_port = None if environment_source(ns, "master_port") else ns.master_port
    master_addr = None if environment_source(ns, "master_addr") else ns.master_addr
    local_addr = ns.local_addr
    for flag, value in (("--master-addr", master_addr), ("--local-addr", local_addr)):
        if value is not None and not value.strip():
            raise UsageError(flag, "is empty; give a host name or IP address")
    if not ns.role.strip():
        raise UsageError("--role", "the role name is empty; give one, e.g. trainer")
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        entrypoint="",
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_id=run_id or "none",
        rdzv_conf=parse_rdzv_conf(ns.rdzv_conf),
        standalone=standalone,
        local_addr=local_addr,
    )
    _check_rendezvous(config)
    if not run_id:
        raise _missing_run_id(max_nodes)
    shutdown = ns.shutdown_timeout
    config = dataclasses.replace(
        config,
        max_restarts=parse_whole(
            "--max-restarts", ns.max_restarts, low=0, what="0 or more restarts"
        ),
        monitor_interval=parse_seconds("--monitor-interval", ns.monitor_interval, zero_ok=False),
        exit_barrier_timeout=parse_seconds(
            "--exit-barrier-timeout", ns.exit_barrier_timeout, zero_ok=True
        ),
        stop_grace_period=(
            config.stop_grace_period
            if shutdown is None
            else parse_seconds("--shutdown-timeout", shutdown, zero_ok=True)
        ),
        drain_signal=(
            None if ns.drain_signal is None else parse_signal("--drain-signal", ns.drain_signal)
        ),
        hang_timeout=None if ns.hang_timeout is None else parse_hang_timeout(ns.hang_timeout),
        role=ns.role.strip(),
        log_dir=ns.log_dir or None,
        redirects=parse_std_map("--redirects", ns.redirects, nproc),
        tee=parse_std_map("--tee", ns.tee, nproc),
        local_ranks_filter=parse_ranks_filter(ns.local_ranks_filter),
        node_rank=parse_whole("--node-rank", ns.node_rank, low=0, what="0 or more"),
        master_addr=master_addr.strip() if master_addr else None,
        master_port=(
            None
            if master_port is None
            else parse_whole("--master-port", master_port, low=1, high=65535, what="a port 1-65535")
        ),
    )
    metrics_port, metrics_addr = parse_metrics(ns.metrics_port, ns.metrics_addr)
    config = dataclasses.replace(config, metrics_port=metrics_port, metrics_addr=metrics_addr)
    config = _health_check(config, ns)
    if ns.start_method not in ("spawn", "fork", "forkserver"):
        raise UsageError("--start-method", f"{ns.start_method!r} is not spawn, fork or forkserver")
    entrypoint, args = _check_script(ns)
    return dataclasses.replace(
        config,
        start_method=ns.start_method,
        module=bool(ns.module),
        no_python=bool(ns.no_python),
        run_path=bool(ns.run_path),
        warm_start=not ns.no_warm_start,
        warm_modules=parse_modules("--warm-modules", ns.warm_modules),
        warm_pool_size=parse_whole(
            "--warm-pool-size", ns.warm_pool_size, low=0, high=64, what="0 to 64"
        ),
        entrypoint=entrypoint,
        args=args,
    )


def _health_check(config: LaunchConfig, ns: argparse.Namespace) -> LaunchConfig:
    """The pre-flight check's flags; its timing flags mean nothing without it."""
    timeout, quarantine = ns.health_check_timeout, ns.quarantine_seconds
    if not ns.health_check:
        for flag, value in (("--health-check-timeout", timeout),
                            ("--quarantine-seconds", quarantine)):  # fmt: skip
            if value is not None:
                raise UsageError(flag, "has no effect without --health-check; add --health-check")
        return config
    return dataclasses.replace(
        config,
        health_check=True,
        health_check_timeout=(
            config.health_check_timeout
            if timeout is None
            else parse_seconds("--health-check-timeout", timeout, zero_ok=False)
        ),
        quarantine_seconds=(
            config.quarantine_seconds
            if quarantine is None
            else parse_seconds("--quarantine-seconds", quarantine, zero_ok=False)
        ),
    )
