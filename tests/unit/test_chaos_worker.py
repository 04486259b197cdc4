"""The chaos worker's per-step check of its all_gather of (rank, step, pid) rows."""

from __future__ import annotations

import pytest

from tests.chaos.worker import WorkerConfig, check_gathered


@pytest.mark.parametrize(
    ("rows", "world", "step", "wrong"),
    [
        ([[0, 5, 10], [1, 5, 11], [2, 5, 12]], 3, 5, None),
        ([[0, 5, 10], [1, 5, 11]], 3, 5, "2 rows gathered in a world of 3"),
        ([[0, 5, 10], [0, 5, 11], [2, 5, 12]], 3, 5, "ranks [0, 0, 2] are not 0..2 in order"),
        ([[1, 5, 10], [0, 5, 11], [2, 5, 12]], 3, 5, "ranks [1, 0, 2] are not 0..2 in order"),
        ([[0, 5, 10], [1, 4, 11], [2, 5, 12]], 3, 5, "ranks are at steps [4, 5]"),
        ([[0, 5, 10], [1, 5, 10], [2, 5, 12]], 3, 5, "pids [10, 10, 12] are not 3 distinct"),
    ],
)
def test_check_gathered(rows: list[list[int]], world: int, step: int, wrong: str | None) -> None:
    found = check_gathered(rows, world, step)
    assert found == wrong if wrong is None else found is not None and found.startswith(wrong)


def test_missing_round_is_minus_one_not_the_restart_count() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "TORCHELASTIC_RESTART_COUNT": "2"}
    cfg = WorkerConfig.from_env(env)
    assert (cfg.round, cfg.restart_count, cfg.node, cfg.checkpoint_dir) == (-1, 2, "", None)
    ours = {"ETCD_ELASTIC_ROUND": "7", "ETCD_ELASTIC_NODE_ID": "n1", "CHAOS_STEP_SECONDS": "0.5"}
    full = WorkerConfig.from_env({**env, **ours})
    assert (full.round, full.node, full.step_s) == (7, "n1", 0.5)
