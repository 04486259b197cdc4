"""The agents' exit barrier over a real etcd store: all arrive, or one gives up."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import pytest

from agent.loop.ending import exit_barrier, release_exit_barrier
from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import RunKeys
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.store import EtcdStore


def _stores(etcd: EtcdCluster, run_id: str, n: int) -> tuple[EtcdClient, list[EtcdStore]]:
    client = EtcdClient(EtcdConfig(endpoints=tuple(etcd.endpoints)))
    prefix = RunKeys("/etcd-elastic-test", run_id).store_prefix(1)
    return client, [EtcdStore(client, prefix, timedelta(seconds=60)) for _ in range(n)]


def test_every_node_arriving_passes_the_barrier(etcd1: EtcdCluster, run_id: str) -> None:
    client, stores = _stores(etcd1, run_id, 3)
    try:
        results: list[bool] = []
        threads = [
            threading.Thread(target=lambda s=s: results.append(exit_barrier(s, 3, 60, "t")))
            for s in stores
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [True, True, True]
    finally:
        client.close()


def test_a_node_that_gives_up_releases_the_others_at_once(
    etcd1: EtcdCluster, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Without the release, the waiting node would sit out the whole 60 s timeout."""
    client, (waiting, quitting) = _stores(etcd1, run_id, 2)
    try:
        result: list[bool] = []
        start = time.monotonic()
        waiter = threading.Thread(target=lambda: result.append(exit_barrier(waiting, 2, 60, "a")))
        with caplog.at_level(logging.WARNING, logger="agent.loop.ending"):
            waiter.start()
            time.sleep(0.5)
            release_exit_barrier(quitting, "node 1 (hostB)", "b")
            waiter.join(60)
        assert result == [False]
        assert time.monotonic() - start < 30
        assert (
            "a: exit barrier released: node 1 (hostB) gave up and will not arrive; closing "
            "anyway" in caplog.messages
        )
    finally:
        client.close()
