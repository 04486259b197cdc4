"""The chaos fault plan: deterministic per seed, covers the catalogue, durations vs TTL."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.chaos.scheduler import (
    ALL_KINDS,
    CATALOGUE,
    FORMATION_SECOND,
    NEWCOMER_DURING,
    Effect,
    plan,
)


def test_the_catalogue_has_every_kind_of_the_issue_and_their_effects() -> None:
    assert len(ALL_KINDS) >= 15
    removing = {k for k, spec in CATALOGUE.items() if spec.removes_node}
    assert removing == {
        "agent_sigkill",
        "agent_sigstop",
        "agent_sigterm",
        "agent_partition",
        "formation_fault",
        "rank_exchange_fault",
    }
    free = {k for k, spec in CATALOGUE.items() if spec.effect is Effect.NONE}
    assert "agent_sigstop_short" in free and "etcd_cluster_restart" in free
    assert CATALOGUE["worker_sigkill"].disruptive and not CATALOGUE["worker_sigkill"].removes_node
    assert all(CATALOGUE[k].effect is Effect.NONE for k in NEWCOMER_DURING)


@pytest.mark.parametrize("seed", [0, 1, 42, 2**40])
def test_same_seed_same_plan_and_every_kind_once_the_plan_is_long_enough(seed: int) -> None:
    faults = plan(seed, 30)
    assert faults == plan(seed, 30)
    assert [f.index for f in faults] == list(range(30))
    assert set(Counter(f.kind for f in faults)) == set(ALL_KINDS)


def test_different_seeds_differ() -> None:
    assert plan(1, 30) != plan(2, 30)


def test_a_short_plan_has_distinct_kinds_from_those_asked() -> None:
    faults = plan(7, 3, ["agent_sigkill", "etcd_leader_kill", "newcomer", "agent_sigkill"])
    assert sorted(f.kind for f in faults) == ["agent_sigkill", "etcd_leader_kill", "newcomer"]
    assert plan(7, 0) == []


@pytest.mark.parametrize("ttl", [1.0, 2.0, 5.0])
def test_durations_and_targets_fit_their_kind(ttl: float) -> None:
    n_agents = 3
    for f in plan(3, 300, n_agents=n_agents, lease_ttl=ttl):
        if f.kind in ("agent_sigstop", "agent_partition"):
            assert f.duration > ttl + 0.9, f  # the lease must expire
        if f.kind in ("agent_sigstop_short", "agent_net_reset"):
            assert 0 < f.duration <= ttl / 3, f  # keep-alives get through around it
        if f.kind == "agent_net_delay":
            assert f.duration >= 2.0 and 0 < f.delay <= min(0.3, ttl / 10), f
        if f.kind == "etcd_cluster_restart":
            assert ttl <= f.duration <= 3 * ttl, f
        if f.kind == "etcd_role_revoked":
            # Refused one TTL before the worker dies and at least one TTL after; well
            # under read_timeout (60 s), which a counted restart waits at most.
            assert 2 * ttl <= f.duration <= 3 * ttl < 60, f
        if f.kind.startswith(("agent_", "worker_")) or f.kind in (
            "newcomer",
            "formation_fault",
            "rank_exchange_fault",
            "warm_import_stuck",
            "etcd_role_revoked",
        ):
            assert 0 <= f.target < n_agents, f
        else:
            assert f.target == -1, f
        if f.kind in ("formation_fault", "rank_exchange_fault"):
            assert 0 <= f.other < n_agents and f.other != f.target, f
        if f.kind == "newcomer":
            assert f.inner in NEWCOMER_DURING, f
        if f.kind == "formation_fault":
            assert f.inner in FORMATION_SECOND, f
        if f.kind in ("etcd_follower_kill", "etcd_follower_freeze"):
            assert f.follower in (0, 1), f
        if f.kind == "etcd_follower_freeze":
            assert 1.0 <= f.duration <= 2 * ttl, f
        if f.kind == "etcd_leader_freeze":  # under the frozen leader's earliest expiry
            assert 1.0 <= f.duration <= max(1.0, ttl / 2), f
            assert ttl < 3 or f.duration < ttl - ttl / 3, f
        record = f.to_json()
        assert record["removes_node"] is CATALOGUE[f.kind].removes_node
        assert record["disruptive"] is CATALOGUE[f.kind].disruptive


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kinds": ["agent_sigkil"]}, r"unknown fault kinds \['agent_sigkil'\]"),
        ({"kinds": []}, "no fault kinds"),
        ({"n_faults": -1}, "number of faults must be >= 0, got -1"),
        ({"n_agents": 1}, "at least 2 agents .* got 1"),
        ({"lease_ttl": 0.5}, "lease_ttl must be at least 1 s, got 0.5"),
    ],
)
def test_bad_arguments_are_refused_with_their_values(
    kwargs: dict[str, object], message: str
) -> None:
    args: dict[str, object] = {"seed": 1, "n_faults": 5, **kwargs}
    with pytest.raises(ValueError, match=message):
        plan(**args)  # type: ignore[arg-type]


def test_the_default_draw_is_every_kind_of_the_catalogue_but_the_pending_ones() -> None:
    from tests.chaos.scheduler import CATALOGUE, PENDING

    assert set(PENDING) <= set(CATALOGUE)
    assert not set(PENDING) & set(ALL_KINDS)
    assert set(ALL_KINDS) | set(PENDING) == set(CATALOGUE)
    for kind in PENDING:  # still runnable by name
        assert [f.kind for f in plan(1, 2, (kind,))] == [kind] * 2
