"""Build rendezvous handlers inside a node process, one per simulated node.

A node process receives a plain JSON spec (system name, endpoint, run id, sizes, config)
and turns it into handlers here, so no Python object ever crosses a process boundary.

Torch's handlers are built exactly as torch's registry builds them (``create_backend``
then ``dynamic_rendezvous.create_handler``), with one difference: the backend is wrapped
in :class:`CountingBackend`, which counts state reads, state writes and failed
compare-and-swaps. Ours comes from ``coordinator.torch_adapter.handler.create_handler``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from torch.distributed import Store  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    create_handler,
)

__all__ = [
    "Counters",
    "CountingBackend",
    "build_handler",
    "handler_counters",
    "release_handlers",
]


class Counters:
    """Thread-safe counters shared by every wrapped backend of one node process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, int] = {"state_reads": 0, "state_writes": 0, "failed_cas": 0}

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.values[name] = self.values.get(name, 0) + amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


class CountingBackend(RendezvousBackend):
    """Torch's backend, unchanged, with each call counted.

    ``set_state`` is one compare-and-swap; torch reports a lost race as ``has_set=False``
    (the etcd-v2 backend then reads the state again, which it does inside ``set_state``).
    """

    def __init__(self, inner: RendezvousBackend, counters: Counters) -> None:
        self._inner = inner
        self._counters = counters

    @property
    def name(self) -> str:
        return self._inner.name

    def get_state(self) -> tuple[bytes, Token] | None:
        self._counters.add("state_reads")
        return self._inner.get_state()

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        self._counters.add("state_writes")
        result = self._inner.set_state(state, token)
        if result is not None and not result[2]:
            self._counters.add("failed_cas")
        return result


def _params(spec: dict[str, Any], backend: str) -> RendezvousParameters:
    config = {str(k): str(v) for k, v in spec.get("config", {}).items()}
    return RendezvousParameters(
        backend=backend,
        endpoint=str(spec["endpoint"]),
        run_id=str(spec["run_id"]),
        min_nodes=int(spec["min_nodes"]),
        max_nodes=int(spec["max_nodes"]),
        local_addr="127.0.0.1",
        **config,
    )


def build_handler(spec: dict[str, Any], counters: Counters) -> RendezvousHandler:
    """Return a fresh handler for ``spec["system"]`` (``etcd-v3``, ``c10d`` or ``etcd-v2``).

    Raises:
        ValueError: the system name is none of the three.
    """
    system = spec["system"]
    backend: RendezvousBackend
    store: Store
    if system == "etcd-v3":
        from coordinator.torch_adapter.handler import create_handler as create_ours

        params = _params(spec, "etcd-v3")
        if spec.get("client") == "per-process":
            return create_ours(params, client=_shared_client(params))
        return create_ours(params)
    if system == "c10d":
        from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

        params = _params(spec, "c10d")
        backend, store = c10d_rendezvous_backend.create_backend(params)
    elif system == "etcd-v2":
        from torch.distributed.elastic.rendezvous import etcd_rendezvous_backend

        params = _params(spec, "etcd-v2")
        backend, store = etcd_rendezvous_backend.create_backend(params)
    else:
        raise ValueError(f"unknown system {system!r}: use etcd-v3, c10d or etcd-v2")
    return create_handler(store, CountingBackend(backend, counters), params)


def handler_counters(handlers: list[RendezvousHandler]) -> dict[str, int]:
    """Sum the counters our handlers expose (a ``counters()`` method), if they expose any."""
    total: dict[str, int] = {}
    for handler in handlers:
        method = getattr(handler, "counters", None)
        if not callable(method):
            continue
        values = method()
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            if isinstance(value, int):
                total[str(key)] = total.get(str(key), 0) + value
    return total


# One etcd client per node process, shared by its simulated nodes when the spec says
# "client": "per-process" (each node keeps its own lease, node key and watches, so etcd
# sees the same requests; only the client-side cost of simulating many machines on two
# cores shrinks: one channel and one watch stream instead of one per node).
_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()


def _shared_client(params: RendezvousParameters) -> Any:
    from benchmarks.critical_path import StampingClient
    from coordinator.core.settings import RendezvousSettings

    with _clients_lock:
        client = _clients.get(params.endpoint)
        if client is None:
            # Stamps its node-key puts and state commits for the critical-path report.
            config = RendezvousSettings.from_parameters(params).etcd_config()
            client = _clients[params.endpoint] = StampingClient(config)
        return client


def _release(handler: Any) -> None:
    leave = getattr(handler, "leave", None)
    if callable(leave):
        # Ours: stop watching, revoke the lease, close the client (the run is over).
        leave()
        return
    # Torch's handlers have no public way to stop without closing the rendezvous (a write
    # to a run nobody uses any more); stopping the heartbeat timer is all that is needed
    # for the old handler to cost nothing.
    stop = getattr(handler, "_stop_heartbeats", None)
    if callable(stop):
        stop()


def release_handlers(handlers: list[Any]) -> None:
    """Let the handlers of a finished run go: no thread of theirs keeps working.

    Done in parallel (ours revokes a lease per handler, a round trip each), and never
    fails: a handler that cannot be released cleanly only costs a little noise.
    """

    def release(handler: Any) -> None:
        with contextlib.suppress(Exception):
            _release(handler)

    threads = [threading.Thread(target=release, args=(h,), daemon=True) for h in handlers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    with _clients_lock:
        clients = list(_clients.values())
        _clients.clear()
    for client in clients:
        with contextlib.suppress(Exception):
            client.close()
