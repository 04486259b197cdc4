"""A run leaves nothing behind (DESIGN §10), on real etcd: every key of a run hangs on a
node's lease or on the run's lease, and the run's lease ends ``retention`` seconds after
its last agent left, whether the run was closed or its agents were all SIGKILLed; a run
id used again after that starts a clean timeline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from coordinator.core.etcd_client import EtcdClient, KeyValue
from coordinator.core.events import Event
from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys
from coordinator.core.run_lease import ensure_run_lease, run_lease_id
from coordinator.core.state import decode_state
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.integration.rdzvctl_support import ctl
from tests.rdzv_helpers import Joins, make_handler, wait_until

pytestmark = pytest.mark.integration

# Short, so that a test waits seconds; lease_ttl 1 keeps the run lease's TTL at retention.
RETENTION = 2


def _handlers(
    etcd: EtcdCluster, run_id: str, n: int, retention: float = RETENTION
) -> list[EtcdRendezvousHandler]:
    return [make_handler(etcd, run_id, n, n, lease_ttl=1, retention=retention) for _ in range(n)]


def _under(client: EtcdClient, keys: RunKeys) -> list[KeyValue]:
    return client.get_prefix(keys.run_prefix)[0]


def _folders(client: EtcdClient, keys: RunKeys) -> set[str]:
    """The top-level names under the run's folder (state, nodes, store, events, ...)."""
    return {kv.key[len(keys.run_prefix) :].decode().split("/")[0] for kv in _under(client, keys)}


def _gone(client: EtcdClient, lease: int) -> bool:
    return client.lease_time_to_live(lease) == -1


def test_an_ended_run_leaves_no_key_and_no_lease_once_its_retention_passed(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient, handlers: list[EtcdRendezvousHandler]
) -> None:
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    run_lease = run_lease_id(keys)
    two = _handlers(etcd1, run_id, 2)
    handlers += two
    node_leases: set[int] = set()
    for round in (1, 2):
        infos = Joins(two).start().infos(30)
        node_leases |= {kv.lease for kv in client.get_prefix(keys.nodes_prefix)[0]}
        # The Store of each round: plain puts, exactly-once adds (with their markers),
        # compare-and-set, as torch's agent and our exit barrier use it.
        for info in infos.values():
            store = info.store
            store.set(f"set-{info.rank}", "x")
            store.add("arrived", 1)
            store.compare_set("once", "", f"rank {info.rank}")
        assert {h.last_round for h in two} == {round}
    two[0].record_event(Event("fault", node_id=two[1].node_id, cause="hung", round=2))
    wait_until(lambda: client.count_prefix(keys.events_prefix + b"fault/")[0] == 1, 10, "the fault")
    # Every key of the run is on a lease: its node's (node, turn and progress keys), else
    # the run's. Nothing is left for an operator to delete.
    for kv in _under(client, keys):
        by_node = kv.key.startswith((keys.nodes_prefix, keys.turns_prefix))
        assert kv.lease in (node_leases if by_node else {run_lease}), kv.key
    assert _folders(client, keys) == {"state", "nodes", "turns", "store", "events"}

    two[0].set_closed("the job is over")
    for h in two:
        h.leave()
    # The last agent renewed the run's lease as it left: the keys stay the retention.
    assert client.lease_time_to_live(run_lease) >= RETENTION - 1
    assert _folders(client, keys) == {"state", "store", "events"}
    state, _ = client.get(keys.state)
    assert state is not None and decode_state(keys.state.decode(), state.value).closed

    waited = wait_until(lambda: not _under(client, keys), RETENTION + 10, "the run's keys to go")
    assert waited >= RETENTION - 1  # not before the retention
    assert [lease for lease in (run_lease, *node_leases) if not _gone(client, lease)] == []


_KILLED_NODE = textwrap.dedent(
    """
    import sys, time
    from tests.rdzv_helpers import make_handler
    h = make_handler(sys.argv[1], sys.argv[2], 2, 2, lease_ttl=1, retention=int(sys.argv[3]))
    info = h.next_rendezvous()
    info.store.set(f"rank-{info.rank}", b"x")
    print("rank", info.rank, flush=True)
    time.sleep(600)
    """
)


def test_a_run_whose_agents_were_all_killed_goes_within_its_retention(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient
) -> None:
    """Nobody closes the run and nobody is left to delete anything: the node keys go
    with their leases (lease_ttl), the state, store and timeline with the run's lease,
    at most the retention after the last agent's last renewal."""
    retention = 8  # well above lease_ttl: the nodes' keys go first, visibly
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    argv = [sys.executable, "-c", _KILLED_NODE, etcd1.endpoint_list, run_id, str(retention)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env) for _ in "ab"]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("rank"), line
        wait_until(
            lambda: client.count_prefix(keys.events_prefix + b"round_completed/")[0] == 1,
            10, "round 1 on the timeline",
        )  # fmt: skip
        node_leases = {kv.lease for kv in client.get_prefix(keys.nodes_prefix)[0]}
        assert len(node_leases) == 2
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        for proc in procs:
            proc.wait(10)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
    wait_until(lambda: "nodes" not in _folders(client, keys), 10, "the node keys to expire")
    left = time.monotonic() - killed_at
    # What is left once the nodes are gone: everything on the run's lease, which nobody
    # renews any more; it lives at least 2/3 of its TTL after the last renewal.
    assert left < retention * 2 / 3 - 1, f"the node keys took {left:.1f} s to expire"
    assert _folders(client, keys) == {"state", "store", "events"}
    wait_until(lambda: not _under(client, keys), retention + 10, "the run's keys to go")
    assert time.monotonic() - killed_at >= retention * 2 / 3 - 1
    leases = (run_lease_id(keys), *node_leases)
    assert [lease for lease in leases if not _gone(client, lease)] == []


def test_a_run_id_used_again_after_the_retention_starts_a_clean_timeline(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient,
    handlers: list[EtcdRendezvousHandler], capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    first = _handlers(etcd1, run_id, 2)
    handlers += first
    Joins(first).start().infos(30)
    first[0].set_closed("the first job is over")
    for h in first:
        h.leave()
    wait_until(lambda: not _under(client, keys), RETENTION + 10, "the first run's keys to go")
    second = _handlers(etcd1, run_id, 2)
    handlers += second
    Joins(second).start().infos(30)
    wait_until(
        lambda: client.count_prefix(keys.events_prefix + b"round_completed/")[0] == 1,
        10, "round 1 of the second run on the timeline",
    )  # fmt: skip
    code, out, err = ctl(capsys, etcd1, "events", run_id, "--json")
    assert (code, err) == (0, "")
    objects = [json.loads(line) for line in out.splitlines()]
    # Only the second run: its nodes, its round 1 (the round count starts over), no close.
    assert sorted((o["kind"], o["node_id"]) for o in objects) == sorted(
        [("joined", h.node_id) for h in second] + [("round_completed", "")]
    )
    assert [(o["round"], o["incarnation"]) for o in objects if o["kind"] != "joined"] == [(1, 1)]
    code, out, err = ctl(capsys, etcd1, "status", run_id)
    assert code == 0 and "the first job is over" not in out


def test_two_nodes_recording_the_same_fault_write_one_event(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient, handlers: list[EtcdRendezvousHandler]
) -> None:
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    two = _handlers(etcd1, run_id, 2)
    handlers += two
    Joins(two).start().infos(30)
    hung = two[1].node_id
    now_ms = int(time.time() * 1000)
    for i, h in enumerate(two):
        # Each saw the same hang of round 1, at its own wall time.
        h.record_event(Event("fault", node_id=hung, cause="hung", round=1, unix_ms=now_ms + 7 * i))
    for h in two:
        h.leave()  # writes what its timeline queued
    kvs, _ = client.get_prefix(keys.events_prefix + b"fault/")
    assert [kv.key.decode() for kv in kvs] == [f"{keys.events_prefix.decode()}fault/{hung}/hung-1"]


def test_writes_under_a_bound_prefix_go_on_its_lease_unless_they_name_one(
    client: EtcdClient, run_id: str
) -> None:
    root = f"/retention-test/{run_id}/".encode()
    run, store, node = (client.lease_grant(60) for _ in range(3))
    try:
        unbind_run = client.bind_prefix(root, run)
        unbind_store = client.bind_prefix(root + b"store/", store)

        def lease_of(key: bytes) -> int:
            kv, _ = client.get(key)
            assert kv is not None
            return kv.lease

        client.put(root + b"state", b"s")
        client.put(root + b"store/1/k", b"v")  # the longest bound prefix wins
        client.put_created(root + b"nodes/n", b"n", lease=node)  # a named lease is kept
        client.put_if_mod_revision(root + b"store/1/x", b"x", 0, also_put=[(root + b"e", b"", 0)])
        client.create_many([(root + b"events/a", b"a")])
        client.put(f"/retention-test/{run_id}-other".encode(), b"o")  # not under it
        assert [lease_of(root + k) for k in (b"state", b"store/1/k", b"nodes/n")] == [
            run, store, node,
        ]  # fmt: skip
        assert [lease_of(root + k) for k in (b"store/1/x", b"e", b"events/a")] == [
            store, run, run,
        ]  # fmt: skip
        assert lease_of(f"/retention-test/{run_id}-other".encode()) == 0
        unbind_store()
        client.put(root + b"store/1/k", b"v")
        assert lease_of(root + b"store/1/k") == run
        unbind_run()
        client.put(root + b"state", b"s")
        assert lease_of(root + b"state") == 0
    finally:
        for lease in (run, store, node):
            client.lease_revoke(lease)
        client.delete_prefix(f"/retention-test/{run_id}".encode())


def test_the_coordinator_grants_the_run_lease_once_and_renews_the_one_in_force(
    client: EtcdClient, run_id: str
) -> None:
    lease = run_lease_id(RunKeys(DEFAULT_KEY_PREFIX, run_id))
    assert client.lease_refresh(lease) == 0  # absent: nothing renewed
    assert ensure_run_lease(client, lease, 30) == 30  # granted
    assert client.lease_grant_if_absent(lease, 30) == 0  # exists: not granted again
    # A later coordinator with another retention renews the lease in force, its TTL kept.
    assert ensure_run_lease(client, lease, 90) == 30
    assert 28 <= client.lease_time_to_live(lease) <= 30
    client.lease_revoke(lease)
    assert ensure_run_lease(client, lease, 90) == 90  # gone: granted again
    client.lease_revoke(lease)


def test_a_run_id_used_again_within_the_retention_shows_the_new_incarnation_alone(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient,
    handlers: list[EtcdRendezvousHandler], capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """The ended run is still kept: the id starts it again as incarnation 2 (a clean
    restart, the round number goes on), on the same run lease; the timeline commands
    show incarnation 2 and say, in one line, where the first one's events are."""
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    first = _handlers(etcd1, run_id, 1, retention=30)
    handlers += first
    Joins(first).start().infos(30)
    first[0].set_closed("the first job is over")
    first[0].leave()
    second = _handlers(etcd1, run_id, 1, retention=30)
    handlers += second
    Joins(second).start().infos(30)
    assert second[0].incarnation == 2
    wait_until(
        lambda: client.count_prefix(keys.events_prefix + b"round_completed/")[0] == 2,
        10, "round 2 on the timeline",
    )  # fmt: skip
    not_nodes = [kv for kv in _under(client, keys) if b"/nodes/" not in kv.key]
    assert {kv.lease for kv in not_nodes if b"/turns/" not in kv.key} == {run_lease_id(keys)}
    code, out, err = ctl(capsys, etcd1, "events", run_id)
    assert code == 0
    assert [line.split()[4] for line in out.splitlines()] == ["joined", "round_completed"]
    assert second[0].node_id in out and first[0].node_id not in out
    assert err == (
        f"rdzvctl: run {run_id} was started again with the same id: these are the events of "
        "incarnation 2; 4 event(s) of incarnation(s) 1 are kept until the run's retention "
        "passes (--incarnation N shows them)\n"
    ), ctl(capsys, etcd1, "events", run_id, "--incarnation", "1")
    code, out, _ = ctl(capsys, etcd1, "events", run_id, "--incarnation", "1")
    assert code == 0
    assert [line.split()[4] for line in out.splitlines()] == [
        "joined", "round_completed", "closed", "departed",
    ]  # fmt: skip
    code, _, err = ctl(capsys, etcd1, "events", run_id, "--incarnation", "3")
    assert (code, err) == (
        1,
        f"rdzvctl: error: run {run_id!r} has no events of incarnation 3: it has events of "
        "incarnation(s) 1, 2\n",
    )


def test_nodes_whose_run_lease_is_revoked_under_them_join_again_on_a_new_one(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient, handlers: list[EtcdRendezvousHandler]
) -> None:
    """The run's lease revoked by hand while the run is live: every key of the run that
    no node owns goes with it; each node hears it from its keep-alive, leaves and joins
    again, and the first to do so grants the lease again."""
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    run_lease = run_lease_id(keys)
    two = _handlers(etcd1, run_id, 2, retention=30)
    handlers += two
    Joins(two).start().infos(30)
    client.lease_revoke(run_lease)
    assert client.get(keys.state)[0] is None
    wait_until(lambda: all(h.num_nodes_waiting() > 0 for h in two), 10, "both to hear it")
    infos = Joins(two).start().infos(30)
    assert sorted(i.rank for i in infos.values()) == [0, 1]
    assert client.lease_time_to_live(run_lease) > 0
    state, _ = client.get(keys.state)
    assert state is not None and state.lease == run_lease
