"""Counting what etcd is asked: per caller on the client side, per kind on etcd's side.

* :class:`RequestCounter` is an :class:`~coordinator.core.etcd_client.EtcdObserver`: every
  unary call an :class:`~coordinator.core.etcd_client.EtcdClient` makes (``get``,
  ``get_prefix``, ``count_prefix``, ``put``, ``put_if_mod_revision``, ...) is counted by
  method and by the thread that made it (simulated nodes are threads, so a thread is a
  node). The client does not report watches; :func:`count_watches` wraps a client's
  ``watch`` so each watch created is counted the same way.
* :func:`server_counts` reads etcd's own ``/metrics``: gRPC requests by method (what
  reached etcd, retries included), keys written (mvcc puts and delete ops: what
  ``etcd_mvcc_put_total`` and ``etcd_mvcc_delete_total`` count) and watch events sent.

Pure but for the lock of the counter; :mod:`benchmarks.exchange_cost` uses both.
"""

from __future__ import annotations

import collections
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

from benchmarks.stats import parse_prometheus
from coordinator.core.etcd_client import EtcdClient

__all__ = ["WATCH", "RequestCounter", "count_watches", "server_counts"]

WATCH = "watch"
"""The method name a created watch is counted under (a message on the watch stream)."""

_GRPC = re.compile(
    r'^grpc_server_msg_received_total\{[^}]*grpc_method="([A-Za-z]+)"[^}]*\}\s+(\S+)'
)


class RequestCounter:
    """Counts calls by (thread name, method); thread-safe, never blocks for long."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def call_done(self, method: str, seconds: float, failed: bool) -> None:
        self.count(method)

    def attempt_failed(self, method: str, code: str) -> None:
        return None

    def keepalive_answered(self, seconds: float) -> None:
        return None

    def answered(self, at: float) -> None:
        return None

    def count(self, method: str) -> None:
        """Count one ``method`` call made by the current thread."""
        with self._lock:
            self._counts[(threading.current_thread().name, method)] += 1

    def take(self) -> dict[tuple[str, str], int]:
        """The counts since the last call, and start again from zero."""
        with self._lock:
            taken, self._counts = dict(self._counts), collections.Counter()
        return taken


def count_watches(client: EtcdClient, counter: RequestCounter) -> None:
    """Count every watch ``client`` creates (``watch`` and ``watch_then_read``) in
    ``counter`` under :data:`WATCH`, on the creating thread."""
    real: Callable[..., Any] = client.watch

    def watch(*args: Any, **kwargs: Any) -> Any:
        counter.count(WATCH)
        return real(*args, **kwargs)

    setattr(client, "watch", watch)  # noqa: B010 (an instance attribute, on purpose)


def server_counts(metrics_text: str) -> dict[str, float]:
    """etcd's own counts: ``grpc:<Method>`` (messages received, by gRPC method: one per
    unary request, one per message on a stream), ``writes`` (mvcc puts + delete ops),
    ``puts``, ``deletes``, ``proposals`` (raft proposals committed: every write request,
    however many keys it writes, and every lease grant and revoke) and ``watch_events``
    (sent to watchers)."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        match = _GRPC.match(line)
        if match is not None:
            name = f"grpc:{match.group(1)}"
            out[name] = out.get(name, 0.0) + float(match.group(2))
    totals = parse_prometheus(metrics_text)
    out["puts"] = totals.get("etcd_mvcc_put_total", 0.0)
    out["deletes"] = totals.get("etcd_mvcc_delete_total", 0.0)
    out["writes"] = out["puts"] + out["deletes"]
    out["proposals"] = totals.get("etcd_server_proposals_committed_total", 0.0)
    out["watch_events"] = totals.get("etcd_debugging_mvcc_events_total", 0.0)
    return out


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, int]:
    """``after - before`` for every count either has, as whole numbers."""
    return {k: round(after.get(k, 0.0) - before.get(k, 0.0)) for k in {*before, *after}}
