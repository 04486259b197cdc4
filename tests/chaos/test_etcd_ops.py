"""The harness's etcd faults on a real 3-member cluster: leader found, members killed and
brought back from their data, the whole cluster down and up, compaction twice."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.history import HistoryWriter, read_history
from coordinator.etcd_server import EtcdCluster
from tests.chaos.etcd_ops import EtcdOps, chaos_etcd_binary

pytestmark = [pytest.mark.chaos, pytest.mark.integration]


@pytest.fixture
def ops(tmp_path: Path) -> Iterator[EtcdOps]:
    history = HistoryWriter(str(tmp_path / "h.jsonl"), "harness")
    cluster = EtcdCluster(3, binary=chaos_etcd_binary(), no_fsync=True, stop_grace=1.0)
    with cluster, history:
        yield EtcdOps(cluster, history)


def test_leader_kill_and_restart(ops: EtcdOps, tmp_path: Path) -> None:
    leader = ops.leader()
    assert leader is not None
    ops.kill(leader, "leader")
    assert not ops.cluster.members[leader].running
    ops.restart(leader)
    assert ops.cluster.members[leader].healthy()
    assert ops.leader() is not None
    events = [(e["event"], e["member"]) for e in read_history(tmp_path / "h.jsonl")]
    assert events == [("etcd_killed", leader), ("etcd_started", leader)]


def test_whole_cluster_down_and_back_from_its_data(ops: EtcdOps) -> None:
    ops.kill_all()
    assert not any(m.running for m in ops.cluster.members)
    ops.restart_all()
    assert all(m.healthy() for m in ops.cluster.members)


def test_compaction_and_defragmentation_twice(ops: EtcdOps, tmp_path: Path) -> None:
    ops.compact_defrag()
    ops.compact_defrag()  # nothing written since: the second compaction is not an error
    names = [e["event"] for e in read_history(tmp_path / "h.jsonl")]
    assert names.count("compacted") == 2 and names.count("defragmented") == 6
