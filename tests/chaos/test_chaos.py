"""Short seeded chaos runs on real agents and a real 3-member etcd (issue 8, "In CI").

Two agents with a 2 s lease, not three with 3 s: every restart re-imports torch in every
worker (about 2.5 s of CPU each), and on two cores three agents' six workers make a
30-fault run take 8 to 13 minutes. ``scripts/chaos`` runs three agents by default.
``CHAOS_SEED`` picks another seed.

What CI enforces today, and why not more: every fault kind that removes no node (etcd
member, leader and whole-cluster restarts, compaction, a short freeze, network delay and
resets on one agent, a worker killed, a newcomer) runs here with every invariant
checked. The kinds that remove a node (SIGKILL, SIGTERM, a freeze or a partition past the
TTL, faults timed into formation and the rank exchange) pass every invariant but one:
``recovery_bound`` (training steps again within TTL + 5 s) fails by 1 to 6 s, because each
restart starts cold workers that import torch again on two shared cores (measured in the
closing note of issue 8). That invariant is not relaxed; the whole catalogue runs with
``scripts/chaos --seed S --faults N``, and this suite takes the node-loss kinds in once
warm restarts (issue 10) bring a restart under the bound.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.harness import ChaosConfig, run_chaos
from tests.chaos.scheduler import CATALOGUE

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]

FAULTS = 30
# No fault starts after this; the start (every agent and worker imports torch) and the
# teardown come on top, and the whole run must stay under five minutes on two cores.
BUDGET_S = 250.0
NO_NODE_LOSS = tuple(kind for kind, spec in CATALOGUE.items() if not spec.removes_node)


def test_faults_that_remove_no_node_break_no_invariant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seed = int(os.environ.get("CHAOS_SEED", "8"))
    cfg = ChaosConfig(
        seed=seed,
        faults=FAULTS,
        agents=2,
        lease_ttl=2,
        kinds=NO_NODE_LOSS,
        out_dir=tmp_path / "run",
        budget_s=BUDGET_S,
    )
    result = run_chaos(cfg)
    with capsys.disabled():
        print(f"\nseed {seed}: {result.summary()}")
    assert {row.kind for row in result.rows} == set(NO_NODE_LOSS) or result.executed < FAULTS
    assert not result.violations, (
        f"seed {seed}: {len(result.violations)} violations; history kept in "
        f"{result.history}\n{result.summary()}"
    )
    assert result.seconds < 300, f"the run took {result.seconds:.0f} s (budget: 300 s)"
