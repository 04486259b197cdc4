"""A run started again with the same id (a scheduler's retry), on real etcd: incarnations,
the old nodes still leaving while the retry starts, two retries racing, a node of an ended
incarnation, and the retention of an ended run's state."""

from __future__ import annotations

import time

import pytest
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousTimeoutError,
)

from coordinator.core.etcd_client import EtcdClient
from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys
from coordinator.core.state import NodeInfo, decode_state, encode_node
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.rdzv_helpers import Joins, make_handler, wait_until

pytestmark = pytest.mark.integration


def _state(client: EtcdClient, keys: RunKeys) -> tuple[int, int, bool]:
    kv, _ = client.get(keys.state)
    assert kv is not None
    state = decode_state(keys.state.decode(), kv.value)
    return state.incarnation, state.round, state.closed


def _form(handlers: list[EtcdRendezvousHandler], new: list[EtcdRendezvousHandler]) -> list[int]:
    handlers += new
    infos = Joins(new).start().infos(30)
    return sorted(i.rank for i in infos.values())


@pytest.mark.parametrize("mode", ["finished", "failed"])
def test_a_run_whose_nodes_all_left_starts_again_with_the_same_id(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient,
    handlers: list[EtcdRendezvousHandler], mode: str,
) -> None:  # fmt: skip
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    first = [make_handler(etcd1, run_id, 2, 2) for _ in range(2)]
    assert _form(handlers, first) == [0, 1]
    first[0].set_closed("job over", mode)  # type: ignore[arg-type]
    client.put(keys.store_key(1, "left-over"), b"x")
    for h in first:
        h.leave()
    assert _state(client, keys) == (1, 1, True)
    retry = [make_handler(etcd1, run_id, 2, 2) for _ in range(2)]
    assert _form(handlers, retry) == [0, 1]
    # A new incarnation: open, the round number goes on, the old store is gone.
    assert _state(client, keys) == (2, 2, False)
    assert [h.incarnation for h in retry] == [2, 2]
    assert client.get(keys.store_key(1, "left-over"))[0] is None


def test_a_retry_waits_for_the_old_nodes_to_leave_and_they_never_join_it(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient, handlers: list[EtcdRendezvousHandler]
) -> None:
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    old = [make_handler(etcd1, run_id, 2, 2) for _ in range(2)]
    assert _form(handlers, old) == [0, 1]
    old[0].set_closed("node 0 gave up", "failed")
    old[0].leave()
    # old[1] is still shutting down (its key lives) while the scheduler's retry starts.
    retry = [make_handler(etcd1, run_id, 2, 2) for _ in range(2)]
    handlers += retry
    joins = Joins(retry).start()
    time.sleep(1.0)
    assert joins.outcomes == {}, "the retry formed while a node of the old run was alive"
    assert _state(client, keys) == (1, 1, True)
    # The old node's next rendezvous fails: its incarnation is closed.
    with pytest.raises(RendezvousClosedError) as closed:
        old[1].next_rendezvous()
    assert str(closed.value) == (
        f"run {run_id!r} is closed (node 0 gave up): it admits no more nodes; start the job "
        "again (same --rdzv-id) once every node of this run has left"
    )
    left_at = time.monotonic()
    old[1].leave()
    infos = joins.infos(30)
    assert time.monotonic() - left_at < 5.0
    assert sorted(i.rank for i in infos.values()) == [0, 1]
    assert _state(client, keys) == (2, 2, False)
    # A node of incarnation 1 that comes back (frozen past its lease, say) never joins 2.
    stale = make_handler(etcd1, run_id, 2, 2)
    handlers.append(stale)
    stale.incarnation = 1
    with pytest.raises(RendezvousClosedError) as superseded:
        stale.next_rendezvous()
    assert str(superseded.value) == (
        f"run {run_id!r} was started again as incarnation 2 after this node's incarnation 1 "
        "ended: this node belongs to the ended one and never joins another; start it again"
    )
    # ...and cannot close the new incarnation either.
    stale_closer = make_handler(etcd1, run_id, 2, 2)
    handlers.append(stale_closer)
    stale_closer.incarnation = 1
    stale_closer.set_closed("late close", "failed")
    assert _state(client, keys) == (2, 2, False)


def test_two_retries_racing_start_one_incarnation(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient, handlers: list[EtcdRendezvousHandler]
) -> None:
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    first = [make_handler(etcd1, run_id, 1, 3)]
    assert _form(handlers, first) == [0]
    first[0].set_closed("done")
    first[0].leave()
    retry = [make_handler(etcd1, run_id, 3, 3) for _ in range(3)]
    assert _form(handlers, retry) == [0, 1, 2]
    assert _state(client, keys) == (2, 2, False)


def test_a_node_key_of_an_ended_incarnation_is_not_a_joiner(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient, handlers: list[EtcdRendezvousHandler]
) -> None:
    """A node of incarnation 1 that writes its key into incarnation 2 (it read the state
    before the restart) is neither admitted nor listed."""
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    first = [make_handler(etcd1, run_id, 1, 1)]
    assert _form(handlers, first) == [0]
    first[0].set_closed("done")
    first[0].leave()
    retry = [make_handler(etcd1, run_id, 1, 2)]
    assert _form(handlers, retry) == [0]
    lease = client.lease_grant(30)
    try:
        late = NodeInfo(node_id="late-1", wanted_round=3, lease_id=lease, incarnation=1)
        client.put(keys.node("late-1"), encode_node(late), lease=lease)
        # The retry re-rendezvouses (max 2: a second joiner would be admitted at once).
        assert _form(handlers, [retry[0]]) == [0]
        kv, _ = client.get(keys.state)
        assert kv is not None
        state = decode_state(keys.state.decode(), kv.value)
        assert state.participants == (retry[0].node_id,)
        assert "late-1" not in state.wait_list + state.redundancy_list
    finally:
        client.lease_revoke(lease)


def test_a_retry_that_waits_past_join_timeout_says_who_it_waited_for(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    old = [make_handler(etcd1, run_id, 1, 1)]
    assert _form(handlers, old) == [0]
    old[0].set_closed("maintenance", "drain")  # its node keeps running
    retry = make_handler(etcd1, run_id, 1, 1, join_timeout=1)
    handlers.append(retry)
    with pytest.raises(RendezvousTimeoutError) as info:
        retry.next_rendezvous()
    assert str(info.value) == (
        f"run {run_id!r}: node {retry.node_id} waited join_timeout=1 s to start the run "
        "again as incarnation 2, but a node of the closed incarnation 1 (maintenance) has "
        "not left"
    )


def test_the_state_of_an_ended_run_expires_after_its_retention(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient, handlers: list[EtcdRendezvousHandler]
) -> None:
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    ended = make_handler(etcd1, run_id, 1, 1, retention=1)
    assert _form(handlers, [ended]) == [0]
    ended.set_closed("done")
    ended.leave()
    kv, _ = client.get(keys.state)
    assert kv is not None and kv.lease != 0
    wait_until(lambda: client.get(keys.state)[0] is None, 10, "the state to expire")
    # Kept until gc with retention=0: no run lease, nothing expires.
    kept = RunKeys(DEFAULT_KEY_PREFIX, run_id + "-kept")
    forever = make_handler(etcd1, kept.run_id, 1, 1, retention=0)
    assert _form(handlers, [forever]) == [0]
    forever.set_closed("done")
    kv, _ = client.get(kept.state)
    assert kv is not None and kv.lease == 0
