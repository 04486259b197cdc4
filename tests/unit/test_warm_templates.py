"""The warm interpreters started before the first round fit every later round's workers:
the templates differ from real launches only in torchrun's per-attempt variables."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import LaunchConfig
from agent.loop.launches import build_launches, warm_templates
from agent.loop.ranks import Assignment
from agent.observe.journal import NODE_ENV, ROUND_ENV
from agent.workers.group import GroupInfo
from agent.workers.logs import LogSpec
from agent.workers.warm import env_compatible


def _group(config: LaunchConfig, group_rank: int, restart_count: int) -> GroupInfo:
    return GroupInfo(
        role=config.role, group_rank=group_rank, group_world_size=3,
        local_world_size=config.nproc_per_node, master_addr="10.0.0.7", master_port=29511,
        restart_count=restart_count, max_restarts=config.max_restarts, run_id="job",
        use_agent_store=True,
    )  # fmt: skip


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("module", [False, True])
def test_templates_fit_the_launches_of_any_round(tmp_path: Path, nproc: int, module: bool) -> None:
    config = LaunchConfig(
        min_nodes=1, max_nodes=3, nproc_per_node=nproc, entrypoint="train.py",
        args=("--lr", "${local_rank}"), max_restarts=3, module=module,
    )  # fmt: skip
    base = {"PATH": "/usr/bin", "HOME": "/root", NODE_ENV: "vm-1"}
    templates = warm_templates(config, base)
    assert sorted(templates) == list(range(nproc))
    for group_rank, restart_count, round_ in ((0, 0, 1), (2, 3, 9)):
        env = {**base, ROUND_ENV: str(round_)}
        assignment = Assignment(group_rank * nproc, 3 * nproc, group_rank * nproc, 3 * nproc)
        launches = build_launches(
            config, _group(config, group_rank, restart_count), assignment, LogSpec(),
            tmp_path, env,
        )  # fmt: skip
        for launch in launches:
            argv, template_env = templates[launch.ranks.local_rank]
            assert list(launch.argv) == argv
            assert env_compatible(template_env, launch.env)
            assert template_env["LOCAL_RANK"] == launch.env["LOCAL_RANK"]


def test_a_different_omp_setting_makes_the_templates_unfit(tmp_path: Path) -> None:
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, entrypoint="train.py")
    templates = warm_templates(config, {"PATH": "/usr/bin"})
    assert templates[0][1]["OMP_NUM_THREADS"] == "1"  # torchrun's default for 2 workers
    launch = build_launches(
        config, _group(config, 0, 0), Assignment(0, 2, 0, 2), LogSpec(), tmp_path,
        {"PATH": "/usr/bin", "OMP_NUM_THREADS": "4"},
    )[0]  # fmt: skip
    assert not env_compatible(templates[0][1], launch.env)
