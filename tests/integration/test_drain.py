"""``rdzvctl drain RUN NODE`` on real etcd: the node learns it from its watched state, the
others re-rendezvous at once (it counts as waiting), the next round forms without it and
rank 0 stays; a drained node inside ``next_rendezvous`` ends gracefully."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousGracefulExitError

from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.integration.rdzvctl_support import ctl, ctl_json, form, handler
from tests.rdzv_helpers import Joins, wait_until

pytestmark = pytest.mark.integration


def test_rdzvctl_drain_takes_one_node_out_of_a_running_round(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    handlers += [handler(etcd1, run_id, 2, 3) for _ in range(3)]
    ranks = form(handlers)
    by_rank = sorted(handlers, key=lambda h: ranks[h.node_id])
    rank0, leaving, other = by_rank
    code, out, err = ctl(capsys, etcd1, "drain", run_id, leaving.node_id)
    assert (code, err) == (0, "")
    assert out == (
        f"node {leaving.node_id} of run {run_id} asked to leave: its workers get the agent's "
        "drain signal and grace, the others re-form without it, and its agent exits 0\n"
    )
    wait_until(lambda: leaving.drain_requested, 10, "the node to hear of its drain")
    assert not rank0.drain_requested
    # The others re-rendezvous at once: the drained node counts as waiting.
    wait_until(lambda: rank0.num_nodes_waiting() > 0, 10, "the others to hear of it")
    assert ctl(capsys, etcd1, "drain", run_id, leaving.node_id)[1] == (
        f"node {leaving.node_id} of run {run_id} was asked to leave already\n"
    )
    # A drained node that calls next_rendezvous (e.g. it was re-forming) leaves gracefully.
    with pytest.raises(RendezvousGracefulExitError) as info:
        leaving.next_rendezvous()
    assert str(info.value) == (
        f"run {run_id!r}: node {leaving.node_id} was drained (rdzvctl drain): it leaves the run"
    )
    leaving.leave()
    again = Joins([rank0, other]).start().infos(30)
    assert {rank0.node_id: again[0].rank, other.node_id: again[1].rank} == {
        rank0.node_id: 0, other.node_id: 1,
    }  # fmt: skip
    wait_until(
        lambda: ctl_json(capsys, etcd1, "status", run_id)["draining"] == [],
        10,
        "the drained node to leave the list",
    )
    code, _, err = ctl(capsys, etcd1, "drain", run_id, leaving.node_id)
    assert code == 1
    assert err == (
        f"rdzvctl: error: node {leaving.node_id} is not alive in run {run_id} (no key "
        f"/etcd-elastic/{run_id}/nodes/{leaving.node_id}); see rdzvctl status {run_id}\n"
    )
