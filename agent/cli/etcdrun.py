"""``etcdrun``: torchrun's command line, validated into a :class:`~agent.config.LaunchConfig`.

Every ``torchrun`` flag is accepted in both spellings (``--nproc-per-node`` and
``--nproc_per_node``) with the same meaning, and, as in torchrun, a ``PET_<FLAG>``
environment variable supplies a flag's default (``PET_NPROC_PER_NODE=2``; a flag on the
command line wins). Flags that have no meaning here are accepted and ignored with a
warning, so a torchrun command line works unchanged.

Every value is checked before anything starts (no etcd, no worker): a bad one ends the
program with exit code 2 and one line, ``etcdrun: error: <flag>: <what is wrong and what
to do>`` (``<flag> (from PET_<FLAG>)`` when the value came from the environment).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from agent.cli import devices
from agent.cli.configure import BACKENDS, build_config, timeout_findings, warn_ignored
from agent.cli.parser import build_parser, from_environment
from agent.cli.values import UsageError
from agent.config import LaunchConfig
from coordinator.core.log_level import LOGLEVEL_ENV, log_level
from coordinator.etcd_server import EtcdBinaryNotFoundError, EtcdStartError

if TYPE_CHECKING:
    from agent.observe.metrics import RunMetrics

__all__ = ["BACKENDS", "UsageError", "build_parser", "main", "parse_args"]

log = logging.getLogger(__name__)


def parse_args(
    argv: Sequence[str],
    *,
    device_count: Callable[[], int] | None = None,
    cpu_count: Callable[[], int] | None = None,
    environ: Mapping[str, str] | None = None,
) -> LaunchConfig:
    """Parse and validate an ``etcdrun`` command line (without the program name).

    Args:
        argv: the arguments, e.g. ``["--nproc-per-node=2", "train.py", "--lr", "0.1"]``.
        device_count: returns the number of CUDA devices (for ``gpu``/``auto``); default
            asks torch.
        cpu_count: returns the number of usable CPUs (for ``cpu``/``auto``).
        environ: where ``PET_*`` defaults (and a scheduler's job id, see
            :data:`SCHEDULER_RUN_IDS`) are read from; default ``os.environ``.

    Returns:
        The validated configuration. ``--nproc-per-node`` is resolved to a number,
        ``--redirects``/``--tee`` to a value per local rank; a one-node job without
        ``--rdzv-endpoint`` becomes ``standalone`` (as torchrun does); a one-node run
        without ``--rdzv-id`` gets a random one, a multi-node run one from the scheduler
        (``slurm-<SLURM_JOB_ID>[.<SLURM_STEP_ID>]``), or else it is refused (exit 2).

    Raises:
        SystemExit: code 2 after printing ``etcdrun: error: <flag>: <reason>`` for any
            bad value (argparse's convention); code 0 after ``--help``.
    """
    parser = build_parser(environ=environ)
    ns = parser.parse_args(list(argv))
    try:
        config = build_config(
            ns,
            device_count or devices.cuda_device_count,
            cpu_count or devices.cpu_count,
            os.environ if environ is None else environ,
        )
        findings = timeout_findings(config)
        refused = [f for f in findings if f.refuse]
        if refused:
            first = refused[0].first
            raise UsageError(first if first.startswith("--") else "--rdzv-conf", refused[0].line)
    except UsageError as exc:
        variable = from_environment(ns, exc.flag)
        where = exc.flag if variable is None else f"{exc.flag} (from {variable})"
        parser.error(f"{where}: {exc.reason}")
    # Logged only now: a bad command line prints nothing but its one error line.
    warn_ignored(ns)
    for finding in findings:  # none refused: only warnings are left
        log.warning("%s (docs/timeouts.md)", finding.line)
    if config.standalone and not ns.standalone:
        log.info("no --rdzv-endpoint for a one-node job: running as --standalone")
    return config


# -- run -----------------------------------------------------------------------------------


def _launch(config: LaunchConfig, metrics: RunMetrics | None) -> int:
    # Imported only once the command line is valid: bad input never loads the agent.
    from agent.cli.launcher import launch

    return launch(config, metrics=metrics)


class _CannotServe(Exception):
    """The metrics endpoint cannot listen; the message names the flag to change."""


def _serve_metrics(config: LaunchConfig, stack: contextlib.ExitStack) -> RunMetrics | None:
    """Start the ``--metrics-port`` endpoint (stopped by ``stack``); None when off.

    Raises:
        _CannotServe: it cannot listen.
    """
    if config.metrics_port is None:
        return None
    # Imported only when asked for: most command lines never load prometheus_client.
    from agent.observe.metrics import PrometheusMetrics
    from agent.observe.metrics_server import MetricsServer, MetricsServerError

    metrics = PrometheusMetrics(config.rdzv_id)
    try:
        server = MetricsServer(metrics, config.metrics_addr, config.metrics_port)
    except MetricsServerError as exc:
        raise _CannotServe(str(exc)) from exc
    stack.enter_context(server)
    return metrics


def main(argv: Sequence[str] | None = None) -> int:
    """The ``etcdrun`` program: parse, start the embedded etcd if asked, run the agent.

    Returns:
        The exit code: the agent's (0 when every worker succeeded), 1 when the embedded
        etcd or the metrics endpoint could not start, 130 after Ctrl-C. Bad command
        lines exit with code 2 via ``SystemExit`` before anything starts.
    """
    try:
        level = log_level(os.environ.get(LOGLEVEL_ENV), "INFO")
    except ValueError as exc:
        print(f"etcdrun: error: {exc}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    config = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        with contextlib.ExitStack() as stack:
            try:
                # First: a port in use ends the program before any etcd or worker starts.
                metrics = _serve_metrics(config, stack)
            except _CannotServe as exc:
                print(f"etcdrun: error: {exc}", file=sys.stderr)
                return 1
            if not config.standalone:
                return _launch(config, metrics)
            try:
                endpoint = stack.enter_context(_embedded())
            except (EtcdBinaryNotFoundError, EtcdStartError) as exc:
                log.debug("embedded etcd failed", exc_info=True)
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                print(f"etcdrun: error: --standalone: {first}", file=sys.stderr)
                return 1
            return _launch(dataclasses.replace(config, rdzv_endpoint=endpoint), metrics)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


def _embedded() -> contextlib.AbstractContextManager[str]:
    from agent.cli.standalone import embedded_etcd

    return embedded_etcd()
