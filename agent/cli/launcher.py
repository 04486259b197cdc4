"""``launch(config)``: build the etcd rendezvous handler, run the agent, clean up.

Called by :func:`agent.cli.etcdrun` once the command line is valid.
"""

from __future__ import annotations

import dataclasses
import logging
import socket

from torch.distributed.elastic.rendezvous import RendezvousParameters

from agent.config import LaunchConfig
from agent.loop.agent import Agent
from agent.loop.stopping import stop_requests
from agent.observe.metrics import RunMetrics
from coordinator.core.etcd_client import EtcdObserver
from coordinator.torch_adapter.handler import EtcdRendezvousHandler, create_handler

__all__ = ["build_handler", "launch"]

log = logging.getLogger(__name__)


def build_handler(
    config: LaunchConfig, *, etcd_observer: EtcdObserver | None = None
) -> EtcdRendezvousHandler:
    """Our etcd rendezvous handler for ``config`` (its etcd client reports to
    ``etcd_observer``, if given).

    Raises:
        coordinator.core.errors.ConfigError: a rendezvous setting is invalid.
    """
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.rdzv_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_conf,
    )
    return create_handler(
        params,
        local_world_size=config.nproc_per_node,
        role=config.role,
        etcd_observer=etcd_observer,
    )


def launch(config: LaunchConfig, *, metrics: RunMetrics | None = None) -> int:
    """Run this node of the job; returns the process exit code.

    0: every worker succeeded; 1: workers failed with no restarts left (the root-cause
    report is printed) or the run was closed; 128+N: stopped by signal N.

    With ``config.standalone`` and no endpoint yet, an embedded etcd is started for the
    run (``agent.cli.etcdrun`` normally does this itself and passes its endpoint). ``metrics``
    (served by the caller, ``--metrics-port``) hears of the rounds, restarts and etcd
    calls; None: nothing is measured.
    """
    if config.standalone and not config.rdzv_endpoint:
        from agent.cli.standalone import embedded_etcd

        with embedded_etcd() as endpoint:
            return launch(dataclasses.replace(config, rdzv_endpoint=endpoint), metrics=metrics)
    metrics = metrics or RunMetrics()
    handler = build_handler(config, etcd_observer=metrics.etcd_observer)
    metrics.identify(handler.node_id, socket.gethostname())
    agent = Agent(config, handler, metrics=metrics)
    try:
        with stop_requests(agent.request_stop):
            return agent.run()
    finally:
        _release(handler)


def _release(handler: EtcdRendezvousHandler) -> None:
    # The agent already closed the run where that is right (success, restarts exhausted),
    # so a node only leaves: its lease is revoked and the others see it go at once. A
    # node that could not join (etcd unreachable, join timeout, the run is closed) must
    # not close the run for the others, which torch's shutdown() would do.
    try:
        handler.leave()
    except Exception:
        log.exception("run %s: could not release the rendezvous", handler.get_run_id())
