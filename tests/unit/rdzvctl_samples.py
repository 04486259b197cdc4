"""Sample runs shared by the unit tests of ``rdzvctl``'s pure parts: a run ``demo`` whose
round 1 completed at a fixed moment (T0), three live nodes, and builders for both."""

from __future__ import annotations

import datetime

from coordinator.core.keys import RunKeys
from coordinator.core.state import NodeInfo, RdzvState
from coordinator.rdzvctl.model import NodeView, RunSnapshot

__all__ = ["KEYS", "LIVE", "NOW", "ROUND1", "T0", "UTC", "node", "snap"]

UTC = datetime.timezone.utc
KEYS = RunKeys("/etcd-elastic", "demo")
# 2026-11-20 14:02:11 UTC
T0 = 1_795_183_331_000
NOW = T0 + 125_000


def node(node_id: str, wanted: int, *, rev: int, ttl: int | None = 4, pid: int = 100) -> NodeView:
    info = NodeInfo(
        node_id=node_id,
        wanted_round=wanted,
        addr=f"10.0.0.{rev}",
        hostname=f"host{rev}",
        pid=pid,
        local_world_size=2,
        role="default",
        lease_id=0x1000 + rev,
        started_at_unix_ms=T0 - 1000,
        free_port=29500,
        create_revision=rev,
    )
    return NodeView(info, lease=0x1000 + rev, create_revision=rev, mod_revision=rev, ttl_left=ttl)


def snap(
    state: RdzvState | None, nodes: tuple[NodeView, ...] = (), *, store: int = 0, rev: int = 40
) -> RunSnapshot:
    return RunSnapshot(
        keys=KEYS,
        state=state,
        state_mod_revision=30 if state is not None else 0,
        state_revision=rev,
        nodes=nodes,
        nodes_revision=rev,
        store_keys=store,
    )


ROUND1 = RdzvState(
    round=1,
    participants=("a-1-0", "b-2-0", "c-3-0"),
    master_addr="10.0.0.1",
    master_port=29500,
    completed_at_unix_ms=T0,
    written_by="a-1-0",
)
LIVE = (node("a-1-0", 1, rev=1), node("b-2-0", 1, rev=2), node("c-3-0", 1, rev=3))
