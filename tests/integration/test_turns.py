"""Who coordinates, on real etcd: the turn keys (``turns/``, :meth:`RunKeys.turn`).

Each node writes a turn key with its node key, in one transaction, on its lease; a node
that came later has a smaller key. The node with the last key coordinates; every other
node waits on the first key after its own. Finding that key is one range read with a
limit, which etcd answers from its index (the election recipe's "newest key created
before mine" made etcd sort every node key for every joining node: O(N^2) per formation).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from coordinator.core.duty import CoordinatorDuty, Membership
from coordinator.core.etcd_client import EtcdClient, EtcdConfig, WatchEvent
from coordinator.core.membership import create_node_key
from coordinator.core.state import NodeInfo, encode_node
from coordinator.core.transitions import Limits
from coordinator.core.view import StateView
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.integration.coordinator_support import TTL, Node, Run, run_fixture  # noqa: F401
from tests.rdzv_helpers import Joins, make_handler, wait_until

pytestmark = pytest.mark.integration

# Nobody completes a round here: the tests look at who holds the duty.
LIMITS = Limits(min_nodes=9, max_nodes=9, last_call_timeout=30.0)
# What a node that should never lead gets to prove it (it would lead within a round trip).
SETTLE_S = 0.5


@dataclass
class Duty:
    """A node's coordinator duty on its own view of the state."""

    node: Node
    membership: list[Membership | None]
    duty: CoordinatorDuty
    view: StateView

    @property
    def leads(self) -> bool:
        return self.duty.is_leader


@contextlib.contextmanager
def duties(run: Run, nodes: list[Node], client: EtcdClient | None = None) -> Iterator[list[Duty]]:
    """Start the duty of each node (joined already), in order, on ``client`` (default the
    run's); stop them all at the end."""
    client = client or run.client
    started: list[Duty] = []
    try:
        for node in nodes:
            current: list[Membership | None] = [node.membership]
            view = StateView(client, run.keys.state)
            duty = CoordinatorDuty(client, run.keys, view, LIMITS, lambda c=current: c[0])
            started.append(Duty(node, current, duty, view))
            view.start()
            duty.start()
        yield started
    finally:
        for d in started:
            d.duty.stop()
            d.view.close()


def _turns(run: Run) -> list[str]:
    kvs, _ = run.client.get_prefix(run.keys.turns_prefix)
    return [kv.value.decode() for kv in kvs]


def test_the_first_node_coordinates_and_each_later_one_waits_for_the_one_before(
    run: Run,
) -> None:
    a, b, c = (run.node(f"node-{x}") for x in "abc")
    for node in (a, b, c):
        node.join(1)
    # Ordered by arrival, the first last: the coordinator's key is the last one.
    assert _turns(run) == ["node-c", "node-b", "node-a"]
    with duties(run, [a, b, c]) as (da, db, dc):
        wait_until(lambda: da.leads, 30, "node-a to coordinate")
        time.sleep(SETTLE_S)
        assert not db.leads and not dc.leads
        # The coordinator's lease ends: its turn key goes with it, and the node after it
        # takes over; the last one still waits (for b).
        da.membership[0] = None
        a.freeze_past_ttl()
        assert _turns(run) == ["node-c", "node-b"]
        wait_until(lambda: db.leads, 30, "node-b to coordinate")
        time.sleep(SETTLE_S)
        assert not dc.leads


def test_a_newcomer_never_takes_over_from_the_coordinator(run: Run) -> None:
    a = run.node("node-z")  # the first, though its id sorts last
    a.join(1)
    with duties(run, [a]) as (da,):
        wait_until(lambda: da.leads, 30, "node-z to coordinate")
        newcomer = run.node("node-0")
        newcomer.join(1)
        with duties(run, [newcomer]) as (dn,):
            time.sleep(SETTLE_S)
            assert da.leads and not dn.leads


def _join_as_if_earlier(run: Run, node: Node, granted: int = 1) -> Membership:
    """``node`` writes its keys as a node does whose lease etcd granted at revision
    ``granted`` (default: before everybody else's) and whose write was the slowest: nodes
    that join together."""
    node.lease, _ = run.client.lease_grant_at(TTL)
    node.keepalive = run.client.keep_alive(node.lease, TTL)
    record = encode_node(NodeInfo(node.node_id, 1, addr=node.node_id, free_port=29500))
    created, turn = create_node_key(run.client, run.keys, node.node_id, record, node.lease, granted)
    key = run.keys.node(node.node_id)
    node.membership = Membership(node.node_id, key, created, turn, node.lease)
    return node.membership


def test_a_coordinator_steps_down_for_a_node_that_came_earlier(
    run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="coordinator.core.duty")
    a, early = run.node("node-a"), run.node("node-early")
    a.join(1)
    with duties(run, [a]) as (da,):
        wait_until(lambda: da.leads, 30, "node-a to coordinate")
        _join_as_if_earlier(run, early)
        assert _turns(run) == ["node-a", "node-early"]
        with duties(run, [early]) as (de,):
            wait_until(lambda: de.leads and not da.leads, 30, "node-early to take over")
            time.sleep(SETTLE_S)
            assert de.leads and not da.leads  # a waits behind it, and stays there
    said = [r.getMessage() for r in caplog.records if "came earlier" in r.getMessage()]
    assert said == [
        f"node node-a: a node that came earlier joined run {run.keys.run_id}; it coordinates now"
    ]


class _Calls:
    """An observer that counts a client's calls by name."""

    def __init__(self) -> None:
        self.made: collections.Counter[str] = collections.Counter()

    def call_done(self, method: str, seconds: float, failed: bool) -> None:
        self.made[method] += 1

    def attempt_failed(self, method: str, code: str) -> None:
        pass

    def keepalive_answered(self, seconds: float) -> None:
        pass

    def answered(self, at: float) -> None:
        pass


def test_a_node_that_lands_between_a_waiting_node_and_its_senior_is_its_senior_unread(
    run: Run, etcd1: EtcdCluster
) -> None:
    """In a formation the turn keys of nodes that join together land in any order: a key
    written between a waiting node's and its senior's makes that node the senior, with no
    new read or watch (an extra look cost N reads and watches at scale, and a late one
    came in the middle of the next phase); only the senior's own departure is a look."""
    a, b, c = run.node("node-a"), run.node("node-b"), run.node("node-c")
    a.join(1)
    run.client.put(run.keys.run_prefix + b"later", b"")  # c's lease comes a revision later
    c.join(1)
    assert a.membership is not None
    a_granted = 2**63 - 1 - int(a.membership.turn.rsplit(b"/", 1)[1].split(b".")[0], 16)
    calls = _Calls()
    own = EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints)), observer=calls)
    try:
        with duties(run, [a]) as (da,), duties(run, [c], own) as (dc,):
            wait_until(lambda: da.leads, 30, "node-a to coordinate")
            wait_until(lambda: calls.made["next_key"] == 1, 10, "node-c to find its place")
            _join_as_if_earlier(run, b, a_granted + 1)
            assert _turns(run) == ["node-c", "node-b", "node-a"]
            with duties(run, [b]) as (db,):
                time.sleep(SETTLE_S)
                # a still leads; c took b as its senior from the watch, unread.
                assert da.leads and not db.leads and not dc.leads
                assert calls.made["next_key"] == 1, calls.made
                # a goes: b's turn; c waits on b, whose key is still there: no look.
                da.membership[0] = None
                a.freeze_past_ttl()
                wait_until(lambda: db.leads, 30, "node-b to coordinate")
                time.sleep(SETTLE_S)
                assert not dc.leads and calls.made["next_key"] == 1, calls.made
                # b goes: c's senior's key is deleted, c looks once and leads.
                db.membership[0] = None
                b.freeze_past_ttl()
                wait_until(lambda: dc.leads, 30, "node-c to coordinate")
                assert calls.made["next_key"] == 2, calls.made
    finally:
        own.close()


def test_nodes_joining_together_form_with_one_coordinator_the_last_turn_key(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    group = [make_handler(etcd1, run_id, 6, 6) for _ in range(6)]
    handlers += group
    infos = Joins(group).start().infos()
    assert sorted(info.rank for info in infos.values()) == list(range(6))
    keys = group[0]._keys
    client = group[0]._etcd()
    last, _ = client.get_prefix(keys.turns_prefix, descending=True, limit=1)
    # A node that led first because its look came before a slower key of a node that came
    # earlier steps down once it sees that key: then the last key's node leads, alone.
    wait_until(
        lambda: [h.node_id for h in group if h.is_coordinator] == [last[0].value.decode()],
        30, "the last turn key's node to be the one coordinator",
    )  # fmt: skip
    time.sleep(SETTLE_S)
    assert [h.node_id for h in group if h.is_coordinator] == [last[0].value.decode()]


def test_the_client_calls_under_the_turns(run: Run) -> None:
    """``next_key`` (the first key after one, None past the last), ``put_created`` with
    ``also_put`` (one revision, one lease), a watch of a key range and a deletions-only
    watch, each on real etcd."""
    client, prefix = run.client, run.keys.run_prefix + b"t/"
    lease = client.lease_grant(TTL)
    created = client.put_created(
        prefix + b"b", b"1", lease=lease, also_put=((prefix + b"d", b"2"),)
    )
    d, _ = client.get(prefix + b"d")
    assert d is not None and d.create_revision == created and d.lease == lease
    assert client.next_key(prefix + b"a", prefix)[0] == prefix + b"b"
    assert client.next_key(prefix + b"b", prefix)[0] == prefix + b"d"
    assert client.next_key(prefix + b"d", prefix)[0] is None
    with pytest.raises(ValueError, match="written twice"):
        client.put_created(prefix + b"b", b"1", also_put=((prefix + b"b", b"2"),))
    with pytest.raises(ValueError, match="is empty"):
        client.watch(prefix + b"d", 0, lambda _e, _r: None, lambda _r: None, range_end=prefix)
    seen: list[tuple[str, bytes]] = []

    def record(events: list[WatchEvent], _rev: int) -> None:
        seen.extend((e.kind, e.kv.key) for e in events)

    in_range = client.watch(prefix + b"b\0", 0, record, lambda _r: None, range_end=prefix + b"d\0")
    deletions = client.watch(prefix + b"b", 0, record, lambda _r: None, no_put=True)
    try:
        in_range.wait_created(10)
        deletions.wait_created(10)
        for key in (b"a", b"c", b"d", b"e", b"b"):
            client.put(prefix + key, b"x")
        client.delete(prefix + b"b")
        client.delete(prefix + b"d")
        wait_until(lambda: len(seen) == 4, 10, "the four events in range")
        # Two watches: each in revision order, not the two together.
        assert sorted(seen) == [
            ("delete", prefix + b"b"),
            ("delete", prefix + b"d"),
            ("put", prefix + b"c"),
            ("put", prefix + b"d"),
        ]
    finally:
        in_range.cancel()
        deletions.cancel()
        client.delete_prefix(prefix)
