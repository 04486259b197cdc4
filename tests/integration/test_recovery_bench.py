"""The recovery benchmark runs end to end at its smallest size (nothing is timed here).

``python -m benchmarks recovery --smoke --runs 1 --systems etcd-v3 --json``: case (a),
ours only, a 1 MB checkpoint, as a user would run it. The JSON has the time, every
component of the breakdown, and the components add up to the time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.recovery_breakdown import AGENT_COMPONENTS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _run(
    *args: str, timeout: float = 200, scenario: str = "recovery"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", scenario, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_recovery_smoke_has_every_component_adding_up_to_the_time() -> None:
    proc = _run("--smoke", "--runs", "1", "--systems", "etcd-v3", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["scenario"] == "recovery"
    assert list(result["cases"]) == ["a"]
    case = result["cases"]["a"]
    assert (case["nnodes"], case["nproc_per_node"], case["failure"]) == (1, 2, "worker crash")
    entry = case["systems"]["etcd-v3"]
    assert entry["errors"] == []
    assert entry["n"] == 1
    (run,) = entry["runs"]
    assert tuple(run["components"]) == AGENT_COMPONENTS
    assert all(value >= 0 for value in run["components"].values())
    assert sum(run["components"].values()) == pytest.approx(run["total"], abs=0.002)
    assert run["total"] == pytest.approx(entry["median"], abs=0.001)
    assert run["total"] > 0
    assert run["world"] == 2
    assert run["restarts"] == 1  # a worker crash is a counted restart
    assert tuple(entry["breakdown"]) == AGENT_COMPONENTS
    assert case["target"]["met"] in (True, False)


def test_recovery_names_an_unknown_case() -> None:
    proc = _run("--cases", "a,x", timeout=60)
    assert proc.returncode == 2
    assert "--cases 'a,x': use a comma-separated subset of a,b,c" in proc.stderr


def test_crash_timing_smoke_measures_every_crash_of_one_job() -> None:
    proc = _run("--smoke", "--runs", "1", "--json", timeout=400, scenario="crash-timing")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["scenario"] == "crash-timing"
    assert result["errors"] == []
    (run,) = result["runs"]
    for crash in ("early", "steady", "second", "third"):
        parts = run[crash]["components"]
        assert tuple(parts) == AGENT_COMPONENTS
        assert sum(parts.values()) == pytest.approx(run[crash]["total"], abs=0.002)
    assert set(result["over_steady"]) == {"early", "second", "third"}
    assert result["met"] in (True, False)
