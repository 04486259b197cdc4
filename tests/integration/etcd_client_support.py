"""What the tests of coordinator.core.etcd_client share: a client factory, a bounded poll and
a watch-callback recorder (their fixtures are in ``conftest.py``)."""

from __future__ import annotations

import threading
import time
from typing import Any

from coordinator.core.etcd_client import EtcdClient, EtcdConfig, WatchEvent

__all__ = ["Recorder", "_client", "_eventually"]


def _client(endpoints: list[str], **kwargs: Any) -> EtcdClient:
    options: dict[str, Any] = {"request_timeout": 2.0, "retry_budget": 10.0, **kwargs}
    rng = options.pop("rng", None)
    return EtcdClient(EtcdConfig(endpoints=tuple(endpoints), **options), rng=rng)


def _eventually(predicate: Any, timeout: float = 10.0) -> None:
    """Poll a condition nothing signals (a thread's progress), with a bound."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not predicate():
        assert time.monotonic() < deadline, f"condition not met within {timeout} s"
        pause.wait(0.02)


class Recorder:
    """Collects watch callbacks; tests wait on it with a bound, never a bare sleep."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.events: list[WatchEvent] = []
        self.compacted: list[int] = []
        self.errors: list[Exception] = []

    def on_events(self, events: list[WatchEvent], revision: int) -> None:
        with self.cond:
            self.events.extend(events)
            self.cond.notify_all()

    def on_compacted(self, revision: int) -> None:
        with self.cond:
            self.compacted.append(revision)
            self.cond.notify_all()

    def on_error(self, error: Exception) -> None:
        with self.cond:
            self.errors.append(error)
            self.cond.notify_all()

    def wait(self, predicate: Any, timeout: float = 10.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: predicate(self), timeout), (
                f"watch did not deliver in {timeout} s: {len(self.events)} events, "
                f"compacted={self.compacted}, errors={self.errors}"
            )
