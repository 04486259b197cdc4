"""Fenced commits on real etcd: a coordinator that froze past its lease cannot commit.

A coordinator decides from its node table, then freezes (a GC pause, SIGSTOP, a VM
migration) for longer than its lease: etcd deletes its node key, and it may even re-join
with a new key. Nobody changed the state meanwhile, so a guard on the state's
mod_revision alone lets the resumed coordinator commit a round decided from a node table
that no longer holds, naming a node that is gone. The fence (its own key must still have
the create revision it was elected with, in the same transaction) refuses it.

Each test also runs the broken variant, with the fence taken out of the transaction, and
shows that it commits: the fenced assertions are not true by accident.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from coordinator.core.actions import ActionKind
from coordinator.core.duty import CoordinatorDuty, Membership
from coordinator.core.etcd_client import EtcdClient, EtcdConfig, TxnResult
from coordinator.core.executor import Fence, StateExecutor
from coordinator.core.node_table import NodeTable
from coordinator.core.state import RdzvState
from coordinator.core.transitions import Limits, decide_coordinator
from coordinator.core.view import StateView
from coordinator.etcd_server import EtcdCluster
from tests.integration.coordinator_support import Run, run_fixture  # noqa: F401 (fixture)
from tests.rdzv_helpers import wait_until

pytestmark = pytest.mark.integration

LIMITS = Limits(min_nodes=2, max_nodes=2, last_call_timeout=30.0)


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "broken-variant-unfenced"])
@pytest.mark.parametrize("afterwards", ["key-gone", "key-re-created"])
def test_executor_refuses_a_commit_from_a_stale_node_table(
    run: Run, fenced: bool, afterwards: str
) -> None:
    a, b = run.node("node-a"), run.node("node-b")
    leader = a.join(1)
    b.join(1)
    # The coordinator reads the node keys and decides: both want round 1, max_nodes 2.
    table = NodeTable()
    table.load(*run.client.get_prefix(run.keys.nodes_prefix))
    decision = decide_coordinator(
        RdzvState(), table.snapshot(), LIMITS, now=0.0, last_call_deadline=None
    )
    assert [x.kind for x in decision.actions] == [ActionKind.MARK_RENDEZVOUS_COMPLETE]
    # ... then freezes past its lease; etcd deletes its key (maybe it re-joins anew).
    a.freeze_past_ttl()
    if afterwards == "key-re-created":
        assert a.join(1).create_revision > leader.create_revision
    assert run.state() == (None, 0)  # nobody changed the state meanwhile

    executor = StateExecutor(run.client, run.keys, written_by="node-a")
    fence = Fence(leader.key, leader.create_revision) if fenced else None
    result = executor.commit((RdzvState(), 0), decision.actions, fence=fence)

    if fenced:
        assert not result.succeeded and result.fenced_out
        assert run.state() == (None, 0)
    else:  # the broken variant: a round naming a node whose lease had ended
        assert result.succeeded
        state, _ = run.state()
        assert state is not None and state.round == 1
        assert state.participants == ("node-a", "node-b")


class _FreezesBeforeCommit(EtcdClient):
    """A real client whose first fenced write of the state waits at a gate: the duty has
    decided (from its node table) and the process freezes before the transaction leaves.
    With ``unfenced`` it also drops the fence: the broken variant."""

    def __init__(self, config: EtcdConfig, state_key: bytes, *, unfenced: bool) -> None:
        super().__init__(config)
        self._state_key = state_key
        self._unfenced = unfenced
        self.frozen = threading.Event()
        self.resume = threading.Event()
        self.results: list[TxnResult] = []

    def put_if_mod_revision(self, key: bytes, *args: Any, **kwargs: Any) -> TxnResult:
        if key == self._state_key and kwargs.get("fence") is not None:
            if not self.frozen.is_set():
                self.frozen.set()
                assert self.resume.wait(60), "the test never resumed the coordinator"
            if self._unfenced:
                kwargs["fence"] = None
        result = super().put_if_mod_revision(key, *args, **kwargs)
        if key == self._state_key:
            self.results.append(result)
        return result


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "broken-variant-unfenced"])
@pytest.mark.parametrize("afterwards", ["key-gone", "key-re-created"])
def test_a_coordinator_frozen_past_its_ttl_cannot_commit(
    etcd1: EtcdCluster,
    run: Run,
    fenced: bool,
    afterwards: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The real duty: it decides to complete round 1 with nodes a (itself) and b, freezes
    before the commit leaves, its lease expires, it resumes and sends the commit."""
    caplog.set_level(logging.WARNING, logger="coordinator.core.duty")
    a, b = run.node("node-a"), run.node("node-b")
    current: list[Membership | None] = [a.join(1)]
    client = _FreezesBeforeCommit(
        EtcdConfig(endpoints=tuple(etcd1.endpoints)), run.keys.state, unfenced=not fenced
    )
    view = StateView(client, run.keys.state)
    duty = CoordinatorDuty(client, run.keys, view, LIMITS, lambda: current[0])
    try:
        view.start()
        duty.start()
        wait_until(lambda: duty.is_leader, 30, "node-a to lead")
        b.join(1)
        assert client.frozen.wait(30), "the coordinator never decided to complete round 1"
        a.freeze_past_ttl()
        # What the node's handler knows once it runs again: its key is gone or new.
        current[0] = a.join(1) if afterwards == "key-re-created" else None
        assert run.state() == (None, 0)  # nobody changed the state meanwhile
        client.resume.set()
        wait_until(lambda: bool(client.results), 30, "the commit")
        first = client.results[0]
        if fenced:
            assert not first.succeeded and first.fenced_out
            wait_until(lambda: not duty.is_leader, 30, "node-a to step down")
            assert duty.fenced_out == 1 and duty.commits == 0
            assert run.state() == (None, 0)
            assert [r.getMessage() for r in caplog.records if "no longer" in r.getMessage()] == [
                f"node node-a: no longer coordinates run {run.keys.run_id}: its key is gone or "
                "new; a commit decided from what it saw before was refused"
            ]
        else:  # the broken variant commits a round naming a node whose lease ended
            assert first.succeeded
            state, _ = run.state()
            assert state is not None and state.participants == ("node-a", "node-b")
    finally:
        client.resume.set()
        duty.stop()
        view.close()
        client.close()
