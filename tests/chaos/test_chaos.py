"""A short seeded chaos run (issue 8, "In CI"): 30 faults of every kind on real agents and
a real 3-member etcd, under five minutes on two cores, with zero violations.

Two agents with a 2 s lease, not three with 3 s: every restart re-imports torch in every
worker (about 2.5 s of CPU each), and on two cores three agents' six workers make a
30-fault run take 8 to 13 minutes. ``scripts/chaos`` runs three agents by default.
``CHAOS_SEED`` picks another seed; ``scripts/chaos --seed S --faults 30 --agents 2
--ttl 2`` reproduces a run outside pytest.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.harness import ChaosConfig, run_chaos
from tests.chaos.scheduler import ALL_KINDS

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]

FAULTS = 30
# No fault starts after this; the start (every agent and worker imports torch) and the
# teardown come on top, and the whole run must stay under five minutes on two cores.
BUDGET_S = 250.0


def test_a_short_seeded_chaos_run_breaks_no_invariant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seed = int(os.environ.get("CHAOS_SEED", "8"))
    cfg = ChaosConfig(
        seed=seed, faults=FAULTS, agents=2, lease_ttl=2, out_dir=tmp_path / "run", budget_s=BUDGET_S
    )
    result = run_chaos(cfg)
    with capsys.disabled():
        print(f"\nseed {seed}: {result.summary()}")
    assert {row.kind for row in result.rows} == set(ALL_KINDS) or result.executed < FAULTS
    assert not result.violations, (
        f"seed {seed}: {len(result.violations)} violations; history kept in "
        f"{result.history}\n{result.summary()}"
    )
    assert result.seconds < 300, f"the run took {result.seconds:.0f} s (budget: 300 s)"
