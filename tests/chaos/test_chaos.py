"""A short seeded chaos run on real agents and a real 3-member etcd (issue 8, "In CI").

Thirty faults drawn from every kind of the catalogue (``tests/chaos/scheduler.py``), the
ones that remove a node included, with every invariant checked, ``recovery_bound``
(training steps again within TTL + 5 s) too. Two agents with a 3 s lease, not three: on
two cores, three agents' six workers and their warm interpreters make a run take twice
as long. ``scripts/chaos`` runs three agents by default; ``CHAOS_SEED`` picks another
seed. A failing run keeps its folder and names the invariant and the event.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.harness import ChaosConfig, run_chaos
from tests.chaos.scheduler import ALL_KINDS

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(540)]

FAULTS = 30
# No fault starts after this; the start (every agent and worker imports torch) and the
# teardown come on top. The plan takes 200-215 s on a quiet machine; the bound leaves room
# for a loaded one (at load 7-10 it ran 26 of 30 faults in 240 s: a slow machine is not a
# broken invariant), and the whole run must stay under seven minutes on two cores.
BUDGET_S = 330.0


def test_thirty_faults_of_every_kind_break_no_invariant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seed = int(os.environ.get("CHAOS_SEED", "8"))
    cfg = ChaosConfig(
        seed=seed,
        faults=FAULTS,
        agents=2,
        lease_ttl=3,
        kinds=ALL_KINDS,
        out_dir=tmp_path / "run",
        budget_s=BUDGET_S,
    )
    result = run_chaos(cfg)
    with capsys.disabled():
        print(f"\nseed {seed}: {result.summary()}")
    assert {row.kind for row in result.rows} == set(ALL_KINDS) or result.executed < FAULTS
    assert not result.violations, (
        f"seed {seed}: {len(result.violations)} violations; history kept in "
        f"{result.history}\n{result.summary()}"
    )
    assert result.seconds < 420, f"the run took {result.seconds:.0f} s (budget: 420 s)"
