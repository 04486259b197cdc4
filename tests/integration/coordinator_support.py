"""Shared pieces of the coordinator tests on real etcd: node keys on leases of their own,
and a run's keys with a client that removes them at the end."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from coordinator.core.duty import Membership
from coordinator.core.etcd_client import EtcdClient, EtcdConfig, KeepAlive
from coordinator.core.keys import RunKeys
from coordinator.core.membership import create_node_key
from coordinator.core.state import NodeInfo, RdzvState, decode_state, encode_node
from coordinator.etcd_server import EtcdCluster
from tests.rdzv_helpers import wait_until

__all__ = ["TTL", "Node", "Run", "run_fixture"]

TTL = 3  # seconds: a node's lease


@dataclass
class Node:
    """A node key on a lease of its own, kept alive until the node 'freezes'."""

    client: EtcdClient
    keys: RunKeys
    node_id: str
    lease: int = 0
    keepalive: KeepAlive | None = None
    membership: Membership | None = None

    def join(self, wanted_round: int) -> Membership:
        self.lease, granted = self.client.lease_grant_at(TTL)
        self.keepalive = self.client.keep_alive(self.lease, TTL)
        record = NodeInfo(self.node_id, wanted_round, addr=self.node_id, free_port=29500)
        created, turn = create_node_key(
            self.client, self.keys, self.node_id, encode_node(record), self.lease, granted
        )
        key = self.keys.node(self.node_id)
        self.membership = Membership(self.node_id, key, created, turn, self.lease)
        return self.membership

    def put(self, wanted_round: int) -> None:
        """Ask for another round (same key, same lease: its create revision stays)."""
        record = NodeInfo(self.node_id, wanted_round, addr=self.node_id, free_port=29500)
        self.client.put(self.keys.node(self.node_id), encode_node(record), lease=self.lease)

    def freeze_past_ttl(self) -> None:
        """Stop keeping the lease alive and wait until etcd expires it (key deleted)."""
        assert self.keepalive is not None and self.membership is not None
        self.keepalive.close(revoke=False)
        key = self.membership.key
        wait_until(lambda: self.client.get(key)[0] is None, 4 * TTL, "the lease to expire")

    def close(self) -> None:
        if self.keepalive is not None:
            self.keepalive.close(revoke=True)


@dataclass
class Run:
    client: EtcdClient
    keys: RunKeys
    nodes: list[Node] = field(default_factory=list)

    def node(self, node_id: str) -> Node:
        self.nodes.append(Node(self.client, self.keys, node_id))
        return self.nodes[-1]

    def state(self) -> tuple[RdzvState | None, int]:
        kv, _ = self.client.get(self.keys.state)
        if kv is None:
            return None, 0
        return decode_state(self.keys.state.decode(), kv.value), kv.mod_revision


@pytest.fixture(name="run")
def run_fixture(etcd1: EtcdCluster, run_id: str) -> Iterator[Run]:
    client = EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints)))
    made = Run(client, RunKeys("/etcd-elastic-test", run_id))
    try:
        yield made
    finally:
        for node in made.nodes:
            node.close()
        client.delete_prefix(made.keys.run_prefix)
        client.close()
