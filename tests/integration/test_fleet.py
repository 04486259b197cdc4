"""The fleet harness at a small size: every phase runs on a real 3-member etcd, and each
counts something real from etcd's own metrics.

The budgets are pinned where each is built (tests/e2e/test_healthy_writes.py,
tests/integration/test_exchange_cost.py, test_retention.py); here the counts are printed
(``-s``) and the assertions check that the harness measures: the writes a formation
cannot do without, the renewals of a healthy window, the leases etcd expired after a
kill, what was left after the retention (nothing under a closed run's prefix), the
harness's own CPU.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.fleet.cli import summary
from benchmarks.fleet.model import PHASES
from benchmarks.fleet.run import FleetOptions, run_fleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N = 12
TTL = 2


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    options = FleetOptions(
        nodes=N,
        lease_ttl=TTL,
        steady_s=2.0,
        hang_timeout=1.5,
        retention_s=2.0,
        after_s=1.0,
        settle_s=1.0,
        formations=3,
        preflight=True,
        churn_jobs=3,
        churn_parallel=3,
        churn_train_s=0.5,
    )
    out = run_fleet(options)
    print("\n" + "\n".join(summary(out)))
    return out


def _phase(result: dict[str, Any], name: str) -> dict[str, Any]:
    found = [p for p in result["phases"] if p["phase"] == name]
    assert found, f"no {name} phase in {[p['phase'] for p in result['phases']]}"
    return found[0]


def test_every_job_and_phase_ran(result: dict[str, Any]) -> None:
    assert result["errors"] == []
    names = [p["phase"] for p in result["phases"]]
    for name in PHASES:  # every phase the model knows
        assert name in names
    assert names.count("formation") == 3


def test_formation_counts_a_lease_and_a_key_per_agent(result: dict[str, Any]) -> None:
    for phase in result["phases"]:
        if phase["phase"].startswith("formation"):
            etcd = phase["etcd"]
            # each agent's lease, and the run's (granted once, by the node that creates
            # the run's state: its store and events expire with it after the retention)
            assert etcd["lease_grants"] == N + 1
            # and asked for by the coordinator only (each failed grant is a raft proposal
            # too); twice when two nodes led for a moment at the new run's start, both
            # looked before either granted, and one was refused
            assert N + 1 <= etcd["rpc_LeaseGrant"] <= N + 2
            assert etcd["writes"] >= 2 * N  # each agent's lease and node key, at least
            assert etcd["watch_events"] > 0
            assert etcd["bytes_put"] > 0
            assert phase["times"]["first_round_complete"] == 1.0
            assert phase["harness"]["hosts_cpu_s"] > 0


def test_a_healthy_window_counts_the_renewals(result: dict[str, Any]) -> None:
    steady = _phase(result, "steady")
    expected = N * steady["window_s"] * 3 / TTL  # one renewal per TTL/3 per lease
    assert 0.5 * expected <= steady["etcd"]["keepalives"] <= 2 * expected
    assert steady["times"]["training_node_s"] > 0.9 * N * steady["window_s"]


def test_restarts_are_counted_until_every_agent_trains_again(result: dict[str, Any]) -> None:
    for name in ("worker-failure", "hang"):
        phase = _phase(result, name)
        assert phase["times"]["rounds"] >= 1
        assert phase["etcd"]["writes"] > 0
        assert phase["etcd"]["watch_events"] > 0


def test_losses_are_etcds_expiries(result: dict[str, Any]) -> None:
    node_loss = _phase(result, "node-loss")
    assert node_loss["etcd"]["lease_expired"] >= 1
    assert node_loss["etcd"]["keys_deleted"] >= 1
    half = _phase(result, "half-lost")
    assert half["etcd"]["lease_expired"] >= half["times"]["killed"] > 0
    assert "trained_after_last_expiry_s" in half["times"]
    lost = _phase(result, "job-lost")
    # every agent's lease; the run's (TTL 2·lease_ttl here) expires too when it falls
    # inside the window, which ends when the last agent's did
    assert N <= lost["etcd"]["lease_expired"] <= N + 1
    assert lost["etcd"]["writes"] >= N  # each expiry is a revoke through raft


def test_the_end_revokes_every_lease_and_what_is_left_is_counted(result: dict[str, Any]) -> None:
    ends = [p for p in result["phases"] if p["phase"] == "job-end"]
    assert ends and all(p["etcd"]["rpc_LeaseRevoke"] >= p["nodes"] for p in ends)
    for name in ("job-end", "job-lost"):
        left = result["leftovers"][name]
        assert isinstance(left["keys"], int) and isinstance(left["leases"], int)
        assert left["keys_under_prefix"] >= left["keys"]
    # A closed run leaves nothing once its run lease (the retention, at least 2 TTLs) ends;
    # a run nobody closed (every process killed) neither, once that lease's TTL passed
    # after its last renewal.
    for name in ("job-end", "job-lost"):
        left = result["leftovers"][name]
        assert (left["keys"], left["leases"]) == (0, 0), (name, left)


def test_the_churn_measures_the_database_before_and_after(result: dict[str, Any]) -> None:
    churn = result["churn"]
    assert churn["jobs"] == 3
    assert churn["db_size_start"] > 0 and churn["db_size_end"] > 0
    assert churn["bytes_put"] > 0
