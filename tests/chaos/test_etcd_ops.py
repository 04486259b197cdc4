"""The harness's etcd faults on a real 3-member cluster: leader found, members killed and
brought back from their data, the leader frozen and thawed, the whole cluster down and up,
compaction twice."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.observe.journal import JournalWriter, read_journal
from coordinator.etcd_server import EtcdCluster
from tests.chaos.etcd_ops import EtcdOps, chaos_etcd_binary, etcdctl_binary
from tests.chaos.round_watch import state_round

pytestmark = [pytest.mark.chaos, pytest.mark.integration]


@pytest.fixture
def ops(tmp_path: Path) -> Iterator[EtcdOps]:
    history = JournalWriter(str(tmp_path / "h.jsonl"), "harness")
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
    events = [(e["event"], e["member"]) for e in read_journal(tmp_path / "h.jsonl")]
    assert events == [("etcd_killed", leader), ("etcd_started", leader)]


def test_a_frozen_leader_is_replaced_and_comes_back_as_a_member(
    ops: EtcdOps, tmp_path: Path
) -> None:
    leader = ops.leader()
    assert leader is not None
    ops.freeze(leader, "leader")
    try:
        assert ops.cluster.members[leader].running  # stopped, not gone
        assert not ops.cluster.members[leader].healthy(timeout=0.5)
        deadline = time.monotonic() + 20
        while ops.leader() in (None, leader):
            assert time.monotonic() < deadline, "no other member took over in 20 s"
            time.sleep(0.1)
    finally:
        ops.thaw(leader)
    deadline = time.monotonic() + 20
    while not ops.cluster.members[leader].healthy(timeout=1.0):
        assert time.monotonic() < deadline, "the thawed member is not healthy after 20 s"
        time.sleep(0.1)
    events = [(e["event"], e["member"]) for e in read_journal(tmp_path / "h.jsonl")]
    assert events == [("etcd_frozen", leader), ("etcd_thawed", leader)]


def test_whole_cluster_down_and_back_from_its_data(ops: EtcdOps) -> None:
    ops.kill_all()
    assert not any(m.running for m in ops.cluster.members)
    ops.restart_all()
    assert all(m.healthy() for m in ops.cluster.members)


def test_compaction_and_defragmentation_twice(ops: EtcdOps, tmp_path: Path) -> None:
    ops.compact_defrag()
    ops.compact_defrag()  # nothing written since: the second compaction is not an error
    names = [e["event"] for e in read_journal(tmp_path / "h.jsonl")]
    assert names.count("compacted") == 2 and names.count("defragmented") == 6


def test_round_watch_reports_the_first_newer_round_committed(ops: EtcdOps) -> None:
    key = "/etcd-elastic/t-round-watch/state"
    etcdctl = [str(etcdctl_binary(ops.cluster.binary)), f"--endpoints={ops.cluster.endpoint_list}"]

    def put(value: str) -> None:
        subprocess.run([*etcdctl, "put", key, value], check=True, capture_output=True, timeout=30)

    with ops.round_watch(key) as watch:
        assert watch.current == 0  # no state yet: no round completed
    put('{"round": "2", "complete": true}')
    with ops.round_watch(key) as watch:
        assert watch.current == 2
        put('{"round": "2", "wait_list": [{"node_id": "n"}]}')  # same round: not newer
        put("not json")  # unreadable: not newer
        put('{"round": "3", "complete": true}')
        assert watch.wait_newer(2, timeout=20.0) == 3
        assert watch.wait_newer(3, timeout=0.2) is None


@pytest.mark.parametrize(
    ("value", "expected"), [(b'{"round": "7"}', 7), (b"{}", 0), (b"junk", -1), (b"[1]", -1)]
)
def test_state_round(value: bytes, expected: int) -> None:
    assert state_round(value) == expected
