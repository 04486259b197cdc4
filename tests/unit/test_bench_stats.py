"""The benchmarks' pure helpers: summaries, ratios, etcd counters, rank checks, targets."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.procs import split_nodes
from benchmarks.report import markdown_table, splice
from benchmarks.scenarios import formation_bound
from benchmarks.stats import (
    ETCD_COUNTERS,
    counter_delta,
    counter_where,
    etcd_activity,
    parse_prometheus,
    rank_problem,
    ratio,
    summarize,
)
from benchmarks.targets import verdicts

# -- stats ----------------------------------------------------------------------------


def test_summarize_gives_min_median_max_and_count() -> None:
    assert summarize([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}
    assert summarize([1.0, 4.0]) == {"min": 1.0, "median": 2.5, "max": 4.0, "n": 2}


def test_summarize_of_nothing_is_all_none() -> None:
    assert summarize([]) == {"min": None, "median": None, "max": None, "n": 0}


def test_ratio_is_torch_over_ours() -> None:
    assert ratio(2.0, 0.5) == 4.0
    assert ratio(None, 0.5) is None
    assert ratio(2.0, None) is None
    assert ratio(2.0, 0.0) is None


PAGE = """\
# HELP etcd_server_proposals_committed_total The total number of consensus proposals.
# TYPE etcd_server_proposals_committed_total gauge
etcd_server_proposals_committed_total 42
grpc_server_msg_received_total{grpc_method="Range",grpc_service="etcdserverpb.KV"} 10
grpc_server_msg_received_total{grpc_method="Txn",grpc_service="etcdserverpb.KV"} 5
etcd_disk_wal_fsync_duration_seconds_bucket{le="0.001"} 3
etcd_disk_wal_fsync_duration_seconds_sum 0.25
not a metric line at all !
broken_value NaNx
"""


def test_parse_prometheus_sums_labels_and_skips_comments() -> None:
    totals = parse_prometheus(PAGE)
    assert totals["etcd_server_proposals_committed_total"] == 42.0
    assert totals["grpc_server_msg_received_total"] == 15.0
    assert totals["etcd_disk_wal_fsync_duration_seconds_bucket"] == 3.0
    assert totals["etcd_disk_wal_fsync_duration_seconds_sum"] == 0.25
    assert "broken_value" not in totals
    assert "not" not in totals


def test_counter_where_sums_the_samples_whose_labels_match() -> None:
    received = "grpc_server_msg_received_total"
    assert counter_where(PAGE, received, grpc_method="Txn") == 5.0
    assert counter_where(PAGE, received, grpc_service="etcdserverpb.KV") == 15.0
    assert counter_where(PAGE, received) == 15.0
    assert counter_where(PAGE, received, grpc_method="LeaseKeepAlive") == 0.0
    assert counter_where(PAGE, "etcd_server_proposals_committed_total") == 42.0
    assert counter_where(PAGE, "broken_value") == 0.0


def test_counter_delta_counts_a_missing_counter_as_zero() -> None:
    assert counter_delta({"a": 1.0}, {"a": 4.0}, "a") == 3.0
    assert counter_delta({}, {"a": 4.0}, "a") == 4.0
    assert counter_delta({"a": 1.0}, {}, "b") == 0.0


def _scrape(**values: float) -> dict[str, float]:
    return {ETCD_COUNTERS[key]: value for key, value in values.items()}


def test_etcd_activity_estimates_failed_cas_for_v3() -> None:
    before = _scrape(proposals=10, revision=5, lease_grants=1)
    # 20 proposals: 8 key changes, 4 lease grants, 1 revoke, so 7 changed nothing.
    after = _scrape(proposals=30, revision=13, lease_grants=5, lease_revokes=1)
    activity = etcd_activity(before, after)
    assert activity["proposals"] == 20
    assert activity["revision"] == 8
    assert activity["failed_cas_estimate"] == 7
    assert set(ETCD_COUNTERS) <= set(activity)


def test_etcd_activity_has_no_v3_estimate_for_v2_traffic() -> None:
    activity = etcd_activity(_scrape(), _scrape(proposals=9, v2_writes=9))
    assert "failed_cas_estimate" not in activity
    assert activity["v2_writes"] == 9


def test_etcd_activity_never_estimates_below_zero() -> None:
    activity = etcd_activity(_scrape(), _scrape(proposals=2, revision=2, lease_grants=2))
    assert activity["failed_cas_estimate"] == 0


def test_rank_problem_accepts_a_permutation() -> None:
    assert rank_problem([2, 0, 1], [3, 3, 3], 3) is None


def test_rank_problem_names_wrong_world_sizes() -> None:
    assert rank_problem([0, 1], [2, 3], 2) == "world sizes [2, 3] reported, expected only 2"


def test_rank_problem_names_missing_and_duplicated_ranks() -> None:
    assert rank_problem([0, 0, 2], [4, 4, 4], 4) == (
        "ranks are not a permutation of 0..3: 3 ranks, missing [1, 3], duplicated [0]"
    )


# -- layout, bounds, report ------------------------------------------------------------


def test_split_nodes_deals_round_robin() -> None:
    assert split_nodes(5, 2) == [[0, 2, 4], [1, 3]]
    assert split_nodes(2, 4) == [[0], [1]]
    assert split_nodes(1, 1) == [[0]]


def test_formation_bound_grows_with_nodes() -> None:
    assert formation_bound(0) == 10.0
    assert formation_bound(1000) == pytest.approx(30.0)
    assert formation_bound(32) < formation_bound(512) < formation_bound(1000)


def test_splice_replaces_only_between_markers() -> None:
    from benchmarks.report import BEGIN, END

    doc = f"head\n{BEGIN}\nold\n{END}\ntail\n"
    assert splice(doc, "new") == f"head\n{BEGIN}\nnew\n{END}\ntail\n"
    assert splice("only text", "new") == f"only text\n\n{BEGIN}\nnew\n{END}\n"


def _entry(median: float | None, **extra: Any) -> dict[str, Any]:
    low = None if median is None else median * 0.9
    high = None if median is None else median * 1.1
    return {"available": True, "median": median, "min": low, "max": high, "errors": [], **extra}


def test_markdown_table_rows_show_median_range_and_ratio() -> None:
    result = {
        "scenario": "formation",
        "point": "N=32",
        "unit": "seconds",
        "systems": {
            "etcd-v3": _entry(0.1, ratio_vs_torch_c10d=13.0),
            "c10d": _entry(1.3),
            "etcd-v2": {**_entry(None), "errors": ["run 1: timed out"]},
        },
    }
    row = markdown_table([result]).splitlines()[2]
    assert row == "| formation | N=32 | seconds | 0.1 (0.09-0.11) | 1.3 (1.17-1.43) | failed | 13 |"


# -- targets ------------------------------------------------------------------------


def _result(scenario: str, point: str, ours: dict[str, Any]) -> dict[str, Any]:
    return {"scenario": scenario, "point": point, "systems": {"etcd-v3": ours}}


def test_verdicts_formation_met_and_missed() -> None:
    results = [
        _result(
            "formation",
            "N=32",
            _entry(
                0.2,
                ratio_vs_torch_c10d=12.0,
                figures={"etcd_proposals": 65.0, "etcd_failed_cas_estimate": 40.0},
            ),
        ),
        _result("formation", "N=1000", _entry(2.5, ratio_vs_torch_c10d=None)),
    ]
    lines = verdicts(results, ceiling=None, lease_ttl=5)
    assert "formation N=32: 0.2 s (target ≤ 0.15 s) — MISSED by 0.05 s" in lines
    assert "formation N=32: 12x faster than c10d — met" in lines
    assert "etcd writes, N=32: 65 writes (target ≤ 106 writes) — met" in lines
    assert "failed CAS, N=32: 40 txns (target ≤ 32 txns) — MISSED by 8 txns" in lines
    assert "formation N=1000: 2.5 s (target ≤ 3 s) — met" in lines


def test_verdicts_ratio_below_ten_is_missed_and_ceiling_share_is_given() -> None:
    results = [_result("formation", "N=128", _entry(0.5, ratio_vs_torch_c10d=5.0))]
    lines = verdicts(results, ceiling=1000.0, lease_ttl=5)
    assert "formation N=128: 5x faster than c10d — MISSED (5x, not 10x)" in lines
    assert (
        "formation N=128: 128 txns at the ceiling take 0.128 s, 25.6 % of the measured 0.5 s"
        in lines
    )


def test_verdicts_other_scenarios() -> None:
    results = [
        _result("scale-up", "N=8+1", _entry(0.1)),
        _result("node-loss", "N=8", _entry(5.7)),
        _result("worker-failure", "2 agents x 2 workers", _entry(0.2, ratio_vs_torch_c10d=0.5)),
        _result(
            "idle",
            "N=32, 10 s",
            _entry(
                0.01,
                figures={"cpu_percent_of_core_per_node": 0.1, "etcd_requests_per_s_per_node": 2},
            ),
        ),
    ]
    lines = verdicts(results, ceiling=None, lease_ttl=5)
    assert lines == [
        "scale-up: 0.1 s (target ≤ 0.5 s) — met",
        "node loss (lease TTL 5 s): 5.7 s (target ≤ 5.5 s) — MISSED by 0.2 s",
        "worker failure: 0.2 s (target ≤ 2 s) — met",
        "worker failure: 0.5x torchrun's speed — MISSED",
        "idle CPU per node: 0.1 % of a core (target ≤ 0.2 % of a core) — met",
        "idle etcd requests per node: 2 req/s (target ≤ 1 req/s) — MISSED by 1 req/s",
    ]


def test_verdicts_say_not_measured_when_a_figure_is_missing() -> None:
    results = [_result("scale-up", "N=8+1", _entry(None))]
    assert verdicts(results, ceiling=None, lease_ttl=5) == ["scale-up: not measured"]


def test_startup_puts_each_command_beside_its_etcdctl_baseline() -> None:
    from benchmarks.startup import against_baseline

    commands: dict[str, dict[str, Any]] = {
        "rdzvctl list": {"median": 0.13, "baseline": "etcdctl get"},
        "rdzvctl status": {"median": 0.31, "baseline": "etcdctl get"},
        "rdzvctl events": {"median": None, "baseline": "etcdctl get"},  # it failed
        "etcdrun --help": {"median": 0.2, "baseline": None},
        "etcdctl get": {"median": 0.02, "baseline": None},
    }
    rows = {row["command"]: row for row in against_baseline(commands, 0.3)}
    assert sorted(rows) == ["rdzvctl events", "rdzvctl list", "rdzvctl status"]
    assert (rows["rdzvctl list"]["ratio"], rows["rdzvctl list"]["within_target"]) == (6.5, True)
    assert rows["rdzvctl status"]["within_target"] is False
    assert (rows["rdzvctl events"]["ratio"], rows["rdzvctl events"]["within_target"]) == (
        None,
        None,
    )
    assert rows["rdzvctl list"]["baseline_median"] == 0.02
