"""Spares on real etcd: a listed spare has no deadline, waits on events only (its CPU is
measured in ``tests/e2e/test_spares_and_drain.py``), survives rounds that complete
without it, and ends gracefully (torch's ``RendezvousGracefulExitError``) when the job
finishes or is drained."""

from __future__ import annotations

import time

import pytest
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
)

from coordinator.core.etcd_client import EtcdClient
from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys
from coordinator.core.state import decode_state
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.rdzv_helpers import Joins, make_handler, wait_until

pytestmark = pytest.mark.integration


def _spares(client: EtcdClient, keys: RunKeys) -> tuple[str, ...]:
    kv, _ = client.get(keys.state)
    return () if kv is None else decode_state(keys.state.decode(), kv.value).redundancy_list


@pytest.mark.parametrize(("mode", "graceful"), [("finished", True), ("drain", True),
                                               ("failed", False)])  # fmt: skip
def test_a_spare_past_join_timeout_waits_on_events_and_ends_with_the_job(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient,
    handlers: list[EtcdRendezvousHandler], mode: str, graceful: bool,
) -> None:  # fmt: skip
    keys = RunKeys(DEFAULT_KEY_PREFIX, run_id)
    members = [make_handler(etcd1, run_id, 2, 2) for _ in range(2)]
    handlers += members
    Joins(members).start().infos(30)
    spare = make_handler(etcd1, run_id, 2, 2, join_timeout=1)
    handlers.append(spare)
    waiting = Joins([spare]).start()
    wait_until(lambda: _spares(client, keys) == (spare.node_id,), 10, "the spare listed")
    time.sleep(1.5)  # past its join_timeout
    assert waiting.outcomes == {}, waiting.outcomes
    # A round completes without it (the members re-rendezvous; it is still listed).
    Joins(members).start().infos(30)
    time.sleep(0.5)
    assert waiting.outcomes == {} and _spares(client, keys) == (spare.node_id,)
    members[0].set_closed("job over", mode)  # type: ignore[arg-type]
    error = waiting.wait(10)[0].error
    if graceful:
        assert isinstance(error, RendezvousGracefulExitError), error
        how = "was drained" if mode == "drain" else "finished"
        assert str(error) == (
            f"run {run_id!r} {how} (job over) while node {spare.node_id} waited as a spare: "
            "nothing left to do"
        )
    else:
        assert isinstance(error, RendezvousClosedError), error
        assert not isinstance(error, RendezvousGracefulExitError)
