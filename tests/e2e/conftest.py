"""Fixtures of the end-to-end agent tests: a run's agents, reaped whatever happens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.etcd_server import EtcdCluster
from tests.e2e.agents import Agents


@pytest.fixture
def agents(etcd1: EtcdCluster, run_id: str, tmp_path: Path) -> Iterator[Agents]:
    """Starts ``etcdrun`` agents of ``run_id`` on the session etcd; at teardown SIGKILLs
    and reaps every process of the run still alive (agents, workers, their children)."""
    group = Agents(run_id, etcd1.endpoint_list, tmp_path)
    try:
        yield group
    finally:
        group.reap()
