"""Every benchmark scenario runs end to end at its smallest size (nothing is timed here).

Runs ``python -m benchmarks SCENARIO --smoke --repeat 1 --json`` as a user would and
checks the JSON shape: each selected system either ran without error or says plainly
why it could not run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 280) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", *args, "--smoke", "--repeat", "1", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout)
    return result


@pytest.mark.parametrize(
    ("scenario", "systems"),
    [
        ("formation", "etcd-v3,c10d,etcd-v2"),
        ("scale-up", "etcd-v3,c10d"),
        ("node-loss", "etcd-v3,c10d"),
        ("worker-failure", "etcd-v3,c10d"),
        ("idle", "etcd-v3,c10d"),
    ],
)
def test_scenario_runs_at_smallest_size(scenario: str, systems: str) -> None:
    result = _run(scenario, "--systems", systems, "--timeout", "90")
    assert result["scenario"] == scenario
    entries = result["systems"]
    assert isinstance(entries, dict)
    assert sorted(entries) == sorted(systems.split(","))
    for name, entry in entries.items():
        if not entry["available"]:
            assert entry["reason"], f"{name} not run without a reason"
            continue
        assert entry["errors"] == [], f"{name}: {entry['errors']}"
        assert entry["n"] == 1
        assert entry["min"] <= entry["median"] <= entry["max"]
        assert "ratio_vs_torch_c10d" in entry
    if scenario == "formation":
        # Ours reports where the time went: keys written, then the commit, then the returns.
        (path,) = entries["etcd-v3"]["critical_path"]
        # Only what causality guarantees: the coordinator may hear the last join (watch)
        # before that node hears its put answered, and a node may hear of the commit
        # before the committer hears etcd's answer; a node returns after its own put.
        assert 0 < path["cp_commit_sent_s"] <= path["cp_commit_s"]
        assert path["cp_commit_sent_s"] <= path["cp_first_return_s"] <= path["cp_last_return_s"]
        assert 0 < path["cp_last_key_s"] <= path["cp_last_return_s"]
        assert path["commits"] == 1 and path["coordinator_cpu_s"] >= 0


def test_etcd_ceiling_runs() -> None:
    result = _run("etcd-ceiling")
    entry = result["systems"]["etcd"]  # type: ignore[index]
    assert entry["errors"] == []
    assert entry["median"] > 0


def test_the_retention_benchmark_finds_nothing_left_of_ended_jobs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.retention", "--jobs", "6", "--parallel", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["keys_left_10s_after_retention"] == 0
    assert result["leases_left_10s_after_retention"] in (0, None)  # None: no etcdctl
    assert result["db_within_1mb_of_start"] is True
    assert result["per_job"]["lease_grants"] == 3  # two nodes' leases and the run's
