"""The run's lease, its pure parts: which id, which TTL."""

from __future__ import annotations

import pytest

from coordinator.core.keys import RunKeys
from coordinator.core.run_lease import RunLease, run_lease_id, run_lease_ttl


def test_every_writer_of_a_run_computes_the_same_id_and_runs_get_different_ones() -> None:
    ids = {run_lease_id(RunKeys(p, r)) for p in ("/a", "/b") for r in ("job", "job2")}
    assert len(ids) == 4
    assert run_lease_id(RunKeys("/a", "job")) == run_lease_id(RunKeys("/a", "job"))
    # etcd's lease ids are positive int64 (0 asks etcd to choose one).
    assert all(0 < i < 2**63 for i in ids)


@pytest.mark.parametrize(
    ("retention", "lease_ttl", "ttl"),
    [
        (7200, 5, 7200),  # the default
        (2, 1, 2),
        (0.5, 1, 2),  # never below twice the node lease: it outlives every node key
        (1, 3, 6),
        (7200.2, 5, 7201),  # whole seconds, never shorter than asked
        (0, 5, 0),  # no lease: kept until rdzvctl gc
    ],
)
def test_the_ttl_is_the_retention_but_at_least_twice_the_node_lease(
    retention: float, lease_ttl: int, ttl: int
) -> None:
    assert run_lease_ttl(retention, lease_ttl) == ttl


def test_a_retention_of_0_keeps_no_lease() -> None:
    kept = RunLease(RunKeys("/a", "job"), 0, 5)
    assert (kept.id, kept.ttl) == (0, 0)
    kept.stop()  # nothing was started: nothing to do, nothing raised
    timed = RunLease(RunKeys("/a", "job"), 60, 5)
    assert (timed.id, timed.ttl) == (run_lease_id(RunKeys("/a", "job")), 60)
