"""The docker-compose stack as users run it: 3 etcd members and agents training together.

Each test brings up its own stack (``docker-compose.yml`` with the host-network override)
and downs it with its volumes. Run them with ``scripts/compose_test``.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests.compose.stack import ETCD_ENDPOINTS, ROOT, ComposeStack, wait_for

pytestmark = [pytest.mark.compose, pytest.mark.slow, pytest.mark.timeout(600)]

# Above the default 5 s: this 2-core machine runs other test suites at the same time, and
# a starved agent that misses its keep-alives for a whole TTL is (rightly) dropped.
LEASE_TTL = 10
# Long enough for every agent's container to start and join round 1 together.
LAST_CALL = 15
START_TIMEOUT = 180
FINISH_TIMEOUT = 300

MakeStack = Callable[[dict[str, str]], ComposeStack]


def _settings(epochs: int, sleep_per_step: float) -> dict[str, str]:
    return {
        "RDZV_ID": f"c-{uuid.uuid4().hex[:10]}",
        "EPOCHS": str(epochs),
        "NPROC_PER_NODE": "1",
        "RDZV_CONF": f"lease_ttl={LEASE_TTL},last_call_timeout={LAST_CALL}",
        "TRAIN_ARGS": f"--sleep-per-step {sleep_per_step}",
    }


def _round_with(stack: ComposeStack, size: int, min_round: int = 1,
                endpoints: tuple[str, ...] = ETCD_ENDPOINTS) -> dict[str, Any] | None:  # fmt: skip
    state = stack.state(endpoints)
    if state and int(state.get("round", 0)) >= min_round and len(state["participants"]) == size:
        return state
    return None


def _participant_ids(state: dict[str, Any]) -> list[str]:
    return [p["node_id"] for p in sorted(state["participants"], key=lambda p: p.get("rank", 0))]


def _pid_in_node_id(node_id: str) -> int | None:
    match = re.search(r"-(\d+)-\d+(?:-[0-9a-f]+)?$", node_id)
    return int(match.group(1)) if match else None


def _node_id_of(stack: ComposeStack, container: str) -> str:
    # The hostnet override shares the host's pid namespace, so the container's main
    # process (etcdrun) has the pid that its node id carries: "<host>-<pid>-<counter>-<tag>".
    pid = stack.host_pid(container)
    ids = [n for n in stack.node_ids() if _pid_in_node_id(n) == pid]
    assert len(ids) == 1, f"no single node id with pid {pid} among {stack.node_ids()}"
    return ids[0]


def _rdzvctl_status(run_id: str) -> dict[str, Any]:
    out = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "rdzvctl"), "status", run_id,
         "--endpoints", ",".join(ETCD_ENDPOINTS), "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, f"rdzvctl status exited {out.returncode}: {out.stderr}"
    status: dict[str, Any] = json.loads(out.stdout)
    return status


def _one_view(stack: ComposeStack) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The state by etcdctl and rdzvctl's status of the same round (both read while no
    round passed), or None to try again."""
    before = stack.state()
    status = _rdzvctl_status(stack.settings["RDZV_ID"])
    after = stack.state()
    if before is None or before != after or status["round"] != int(before["round"]):
        return None
    if stack.node_ids() != set(_participant_ids(before)):
        return None
    return before, status


def test_three_agents_train_together_and_operators_see_them(make_stack: MakeStack) -> None:
    stack = make_stack(_settings(epochs=3, sleep_per_step=0.2))
    stack.up(agents=3)
    agents = stack.containers("agent")
    assert len(agents) == 3

    wait_for("round 1 with 3 participants", lambda: _round_with(stack, 3), START_TIMEOUT)
    state, status = wait_for("etcdctl and rdzvctl on one round", lambda: _one_view(stack), 60)
    participants = _participant_ids(state)
    # etcdctl alone: one node key per agent, the same nodes as the state's participants.
    assert stack.node_ids() == set(participants)
    assert {_node_id_of(stack, c) for c in agents} == set(participants)
    assert [(p["rank"], p["node_id"]) for p in status["participants"]] == list(
        enumerate(participants)
    )
    assert not status["closed"]

    assert stack.wait_exit(agents, FINISH_TIMEOUT) == [0, 0, 0]
    reports = stack.reports(agents[0])
    # Every attempt of every worker (a restart on a lost lease makes more than one) saw
    # the whole group.
    assert {r["rank"] for r in reports} == {0, 1, 2}, reports
    assert {r["world_size"] for r in reports} == {3}, reports
    assert stack.read_file(agents[0], f"/ckpt/{stack.settings['RDZV_ID']}/checkpoint.pt")
    final = stack.state()
    assert final is not None and final.get("closed") is True, final


def test_killed_agent_the_others_reform_and_finish(make_stack: MakeStack) -> None:
    stack = make_stack(_settings(epochs=4, sleep_per_step=0.25))
    stack.up(agents=3)
    agents = stack.containers("agent")
    state = wait_for("round 1 with 3 participants", lambda: _round_with(stack, 3), START_TIMEOUT)
    wait_for("3 workers training", lambda: len(stack.reports(agents[0])) >= 3, 120)
    by_node = {_node_id_of(stack, c): c for c in agents}
    victim_node = _participant_ids(state)[-1]
    victim = by_node[victim_node]

    killed_at = time.monotonic()
    stack.kill(victim)
    reformed = wait_for(
        "a new round of the 2 survivors",
        lambda: _round_with(stack, 2, min_round=int(state["round"]) + 1),
        LEASE_TTL + 20,
    )
    reform_s = time.monotonic() - killed_at
    print(f"survivors re-formed {reform_s:.1f} s after docker kill (lease TTL {LEASE_TTL} s)")
    assert victim_node not in _participant_ids(reformed)

    survivors = [c for c in agents if c != victim]
    assert stack.wait_exit(survivors, FINISH_TIMEOUT) == [0, 0]
    assert stack.wait_exit([victim], 30) == [137]  # SIGKILL
    reports = stack.reports(survivors[0])
    after = [r for r in reports if r["world_size"] == 2]
    assert sorted(r["rank"] for r in after[-2:]) == [0, 1], reports
    logs = "".join(stack.logs(c) for c in survivors)
    assert "done: 4 epochs" in logs


def _leader(stack: ComposeStack) -> int:
    """Index in ETCD_ENDPOINTS of the member that is the leader now."""
    statuses = json.loads(stack.etcdctl("endpoint", "status", "-w", "json"))
    for index, endpoint in enumerate(ETCD_ENDPOINTS):
        for status in statuses:
            header = status["Status"]["header"]
            if (
                status["Endpoint"].endswith(endpoint)
                and header["member_id"] == status["Status"]["leader"]
            ):
                return index
    raise AssertionError(f"no leader among {statuses}")


def test_stopped_etcd_member_training_continues(make_stack: MakeStack) -> None:
    stack = make_stack(_settings(epochs=4, sleep_per_step=0.25))
    stack.up(agents=2)
    agents = stack.containers("agent")
    wait_for("round 1 with 2 participants", lambda: _round_with(stack, 2), START_TIMEOUT)
    wait_for("2 workers training", lambda: len(stack.reports(agents[0])) >= 2, 120)

    # The leader: the hardest member to lose (an election, every stream moves).
    leader = _leader(stack)
    stack.stop(stack.containers(f"etcd{leader + 1}")[0])
    alive = tuple(e for i, e in enumerate(ETCD_ENDPOINTS) if i != leader)

    assert stack.wait_exit(agents, FINISH_TIMEOUT) == [0, 0]
    reports = stack.reports(agents[0])
    # One attempt only: the workers were never restarted, the group never re-formed.
    assert sorted(r["rank"] for r in reports) == [0, 1], reports
    assert {r["restart_count"] for r in reports} == {0}, reports
    final = stack.state(alive)
    assert final is not None and int(final["round"]) == 1 and final.get("closed"), final
    assert "done: 4 epochs" in "".join(stack.logs(c) for c in agents)
