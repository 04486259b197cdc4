"""The agent's Prometheus metrics (``--metrics-port``): what they are and what sets them.

Every name, type, label and meaning is in ``docs/metrics.md``; a unit test keeps this
module and that page in step. Each agent has a registry of its own (never
``prometheus_client``'s global one), so agents built in one process, as tests do, keep
apart. Every series carries the label ``run_id`` (one value per agent: the run it
serves, so ``sum by (run_id)`` needs no join); the node id, which changes each time an
agent starts, is only on ``etcd_elastic_agent_info``.

Who sets what:

* the agent's loop (:mod:`agent.loop.agent`) through :class:`RunMetrics`: rounds, formation
  time, restarts and their cause, restarts left, the worker count it reads at scrape
  time, and the last progress step (:meth:`RunMetrics.progress_step`, for the workers'
  progress reports);
* the etcd client (``coordinator/core/etcd_client``) through the
  :class:`~coordinator.core.etcd_client.EtcdObserver` this module implements: each call,
  failed attempt, keep-alive round trip and answer.

Cost per etcd call: two clock reads, a dict lookup and a histogram observation (one
short lock inside ``prometheus_client``); nothing is held across an RPC. Scrape-time
values (workers running, seconds since etcd last answered) are computed when scraped.
The HTTP server is :mod:`agent.observe.metrics_server`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from coordinator.core.etcd_client import EtcdObserver

if TYPE_CHECKING:
    from agent.workers.group import WorkerGroup

__all__ = [
    "METRIC_NAMES",
    "RESTART_CAUSES",
    "PrometheusMetrics",
    "RunMetrics",
    "running_workers",
]

RESTART_CAUSES = ("worker_failure", "hang", "unhealthy", "membership_change")
"""Values of ``etcd_elastic_restarts_total``'s ``cause`` label (see :func:`restart_cause`)."""

# Seconds: a call is ~1 ms on a healthy cluster; failover and backoff reach the retry
# budget (tens of seconds). Formation includes waiting for other nodes (last call).
_RPC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_FORMATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

METRIC_NAMES = (
    "etcd_elastic_agent_info",
    "etcd_elastic_rounds_total",
    "etcd_elastic_round",
    "etcd_elastic_group_nodes",
    "etcd_elastic_formation_seconds",
    "etcd_elastic_restarts_total",
    "etcd_elastic_restarts_left",
    "etcd_elastic_workers_running",
    "etcd_elastic_last_progress_step",
    "etcd_elastic_etcd_request_seconds",
    "etcd_elastic_etcd_request_failures_total",
    "etcd_elastic_etcd_errors_total",
    "etcd_elastic_keepalive_seconds",
    "etcd_elastic_etcd_last_answer_age_seconds",
)
"""Every metric family an agent exposes, as named in the exposition (and the docs)."""


def running_workers(group: WorkerGroup | None) -> int:
    """Workers of ``group`` (None: no group yet) started and not yet exited."""
    if group is None:
        return 0
    exits = group.exits()
    return len([rank for rank in group.pids if rank not in exits])


class RunMetrics:
    """What the agent reports about its run. This base records nothing: metrics are off.

    Every method is quick, never blocks and never raises; the loop calls them inline.
    """

    @property
    def etcd_observer(self) -> EtcdObserver | None:
        """What the rendezvous' etcd client reports to (None: nothing)."""
        return None

    def identify(self, node_id: str, hostname: str) -> None:
        """This agent's node id (known once the rendezvous handler exists)."""

    def watch_workers(self, running: Callable[[], int]) -> None:
        """``running()`` counts the local workers running; called at each scrape."""

    def round_formed(self, round_number: int, nodes: int, seconds: float) -> None:
        """A round formed with this node: its number (-1 if the handler does not say),
        how many nodes, and ``seconds`` from asking to join to ranks agreed."""

    def restarted(self, cause: str) -> None:
        """The worker group is restarted for ``cause`` (one of :data:`RESTART_CAUSES`)."""

    def restarts_left(self, left: int) -> None:
        """Counted restarts left (``--max-restarts`` minus those used)."""

    def progress_step(self, step: int) -> None:
        """A worker reported progress at training step ``step`` (the workers' progress
        reports call this; -1 is exposed until the first one)."""


class PrometheusMetrics(RunMetrics):
    """The agent's metrics in a :class:`CollectorRegistry` of its own.

    Args:
        run_id: the value of every series' ``run_id`` label.
        clock: monotonic seconds; must be the etcd client's clock (both default to
            ``time.monotonic``): the age of etcd's last answer is a difference of the two.
    """

    def __init__(self, run_id: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        # The _created series would double every counter and histogram for a value no
        # alert uses. A process-wide switch of prometheus_client; the agent is the process.
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        self._run_id = run_id
        reg, run = self.registry, ("run_id",)
        self._info = Info("etcd_elastic_agent", "This agent: its node id and host", run,
                          registry=reg)  # fmt: skip
        self._rounds = Counter(
            "etcd_elastic_rounds", "Rounds formed with this agent in them", run,
            registry=reg,
        ).labels(run_id)  # fmt: skip
        self._round = Gauge("etcd_elastic_round", "Number of the round the workers run in",
                            run, registry=reg).labels(run_id)  # fmt: skip
        self._nodes = Gauge("etcd_elastic_group_nodes", "Nodes in the current round", run,
                            registry=reg).labels(run_id)  # fmt: skip
        self._formation = Histogram(
            "etcd_elastic_formation_seconds",
            "From asking to join a round to that round formed with ranks agreed",
            run, registry=reg, buckets=_FORMATION_BUCKETS,
        ).labels(run_id)  # fmt: skip
        restarts = Counter(
            "etcd_elastic_restarts", "Restarts of the local worker group, by cause",
            (*run, "cause"), registry=reg,
        )  # fmt: skip
        self._restarts = {cause: restarts.labels(run_id, cause) for cause in RESTART_CAUSES}
        self._left = Gauge("etcd_elastic_restarts_left", "Counted restarts left", run,
                           registry=reg).labels(run_id)  # fmt: skip
        self._workers = Gauge("etcd_elastic_workers_running", "Local workers running", run,
                              registry=reg).labels(run_id)  # fmt: skip
        self._workers.set(0)
        self._progress = Gauge(
            "etcd_elastic_last_progress_step",
            "Last training step a worker reported progress at (-1: none yet)", run,
            registry=reg,
        ).labels(run_id)  # fmt: skip
        self._progress.set(-1)
        self._etcd = _EtcdMetrics(run_id, reg, clock)

    @property
    def etcd_observer(self) -> EtcdObserver:
        return self._etcd

    def identify(self, node_id: str, hostname: str) -> None:
        self._info.labels(self._run_id).info({"node_id": node_id, "hostname": hostname})

    def watch_workers(self, running: Callable[[], int]) -> None:
        self._workers.set_function(_never_raising(running))

    def round_formed(self, round_number: int, nodes: int, seconds: float) -> None:
        self._rounds.inc()
        self._round.set(round_number)
        self._nodes.set(nodes)
        self._formation.observe(seconds)

    def restarted(self, cause: str) -> None:
        self._restarts[cause].inc()

    def restarts_left(self, left: int) -> None:
        self._left.set(left)

    def progress_step(self, step: int) -> None:
        self._progress.set(step)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format, as the endpoint serves it."""
        return prometheus_client.generate_latest(self.registry)


def _never_raising(read: Callable[[], float]) -> Callable[[], float]:
    # A scrape-time reader that raises would fail the whole scrape; NaN says "unknown".
    def guarded() -> float:
        try:
            return float(read())
        except Exception:
            return math.nan

    return guarded


class _EtcdMetrics:
    """The :class:`~coordinator.core.etcd_client.EtcdObserver` behind the etcd metrics."""

    def __init__(self, run_id: str, reg: CollectorRegistry, clock: Callable[[], float]) -> None:
        self._run_id = run_id
        self._clock = clock
        run = ("run_id",)
        self._seconds = Histogram(
            "etcd_elastic_etcd_request_seconds",
            "etcd calls by method: time to the result or the error, failover included",
            (*run, "method"), registry=reg, buckets=_RPC_BUCKETS,
        )  # fmt: skip
        self._failures = Counter(
            "etcd_elastic_etcd_request_failures",
            "etcd calls that failed for good (raised to the caller), by method",
            (*run, "method"), registry=reg,
        )  # fmt: skip
        self._errors = Counter(
            "etcd_elastic_etcd_errors",
            "Failed attempts at etcd calls and broken streams, by method and gRPC code",
            (*run, "method", "code"), registry=reg,
        )  # fmt: skip
        self._keepalive = Histogram(
            "etcd_elastic_keepalive_seconds",
            "Round trip of the lease's keep-alives, request to answer",
            run, registry=reg, buckets=_RPC_BUCKETS,
        ).labels(run_id)  # fmt: skip
        # Children by label values: labels() takes a lock and builds a tuple each time.
        # A race only makes the same child twice (prometheus_client returns one object).
        self._by_method: dict[str, tuple[Histogram, Counter]] = {}
        self._by_code: dict[tuple[str, str], Counter] = {}
        # Before any answer the age counts from the start: an agent that never reached
        # etcd looks exactly as unreachable as one that lost it.
        self._last_answer = clock()
        Gauge(
            "etcd_elastic_etcd_last_answer_age_seconds",
            "Seconds since an etcd member last answered this agent (any call, keep-alive "
            "or watch response)",
            run,
            registry=reg,
        ).labels(run_id).set_function(lambda: max(0.0, self._clock() - self._last_answer))

    def _method(self, method: str) -> tuple[Histogram, Counter]:
        children = self._by_method.get(method)
        if children is None:
            children = (
                self._seconds.labels(self._run_id, method),
                self._failures.labels(self._run_id, method),
            )
            self._by_method[method] = children
        return children

    def call_done(self, method: str, seconds: float, failed: bool) -> None:
        seconds_child, failures_child = self._method(method)
        seconds_child.observe(seconds)
        if failed:
            failures_child.inc()

    def attempt_failed(self, method: str, code: str) -> None:
        child = self._by_code.get((method, code))
        if child is None:
            child = self._by_code[(method, code)] = self._errors.labels(self._run_id, method, code)
        child.inc()

    def keepalive_answered(self, seconds: float) -> None:
        self._keepalive.observe(seconds)

    def answered(self, at: float) -> None:
        # A float store: atomic under the GIL, so no lock; the newest answer wins.
        if at > self._last_answer:
            self._last_answer = at
