"""Helpers for tests that drive several rendezvous nodes (threads) against real etcd."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters

from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler, create_handler


def make_handler(
    cluster: EtcdCluster | str,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    **conf: object,
) -> EtcdRendezvousHandler:
    endpoint = cluster if isinstance(cluster, str) else cluster.endpoint_list
    conf.setdefault("last_call_timeout", 0.5)
    conf.setdefault("join_timeout", 60)
    conf.setdefault("lease_ttl", 3)
    params = RendezvousParameters("etcd-v3", endpoint, run_id, min_nodes, max_nodes, **conf)
    return create_handler(params)


@dataclass
class Outcome:
    info: RendezvousInfo | None = None
    error: BaseException | None = None
    seconds: float = 0.0


@dataclass
class Joins:
    """next_rendezvous() of several handlers, each in its own thread."""

    handlers: Sequence[EtcdRendezvousHandler]
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, indexes: Sequence[int] | None = None) -> Joins:
        for i in indexes if indexes is not None else range(len(self.handlers)):
            t = threading.Thread(target=self._join, args=(i,), daemon=True)
            self.threads.append(t)
            t.start()
        return self

    def _join(self, i: int) -> None:
        start = time.monotonic()
        out = Outcome()
        try:
            out.info = self.handlers[i].next_rendezvous()
        except BaseException as exc:  # recorded for the test to assert on
            out.error = exc
        out.seconds = time.monotonic() - start
        self.outcomes[i] = out

    def wait(self, timeout: float = 60.0) -> dict[int, Outcome]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(deadline - time.monotonic(), 0.0))
        alive = [t.name for t in self.threads if t.is_alive()]
        if alive:
            # What the others ended with often says why these still wait.
            ended = {i: o.error or "ok" for i, o in self.outcomes.items()}
            raise AssertionError(
                f"next_rendezvous() still blocked after {timeout} s: {alive}; "
                f"the others ended with {ended!r}"
            )
        self.threads.clear()
        return self.outcomes

    def infos(self, timeout: float = 60.0) -> dict[int, RendezvousInfo]:
        outcomes = self.wait(timeout)
        errors = {i: o.error for i, o in outcomes.items() if o.error is not None}
        if errors:
            raise AssertionError(f"next_rendezvous() failed: {errors}")
        return {i: o.info for i, o in outcomes.items() if o.info is not None}


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Wait for a condition in a test (event-driven code is checked with a bound)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - start


def shutdown_all(handlers: Sequence[EtcdRendezvousHandler]) -> None:
    for h in handlers:
        h.leave()


def metric(text: str, name: str) -> float:
    """Sum of a Prometheus counter (all label sets) in etcd's /metrics text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total
