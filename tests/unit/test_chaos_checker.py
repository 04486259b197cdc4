"""The chaos checker's invariants on synthetic histories: table-driven, no mocks.

One healthy history (three agents; agent c SIGKILLed and replaced by d; then an etcd
leader kill that costs nothing) passes every invariant; each row of the table breaks it
in one way and names the invariant that must catch it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from tests.chaos.checker import INVARIANTS, CheckConfig, check, format_violations
from tests.chaos.report import format_table, percentile, summarize

Event = dict[str, Any]
AGENTS = {"a": 100, "b": 200, "c": 300, "d": 400}
# round -> node -> worker pids (local ranks 0, 1)
WORKERS = {
    1: {"a": [101, 102], "b": [201, 202], "c": [301, 302]},
    2: {"a": [111, 112], "b": [211, 212], "d": [411, 412]},
}


class Builder:
    """Appends events with a clock the test moves by hand."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.now = 0.0

    def at(self, t: float) -> Builder:
        self.now = t
        return self

    def add(self, src: str, pid: int, event: str, **fields: Any) -> None:
        line = {"t": 1e9 + self.now, "mono": self.now, "src": src, "pid": pid, "event": event}
        self.events.append({**line, **fields})

    def harness(self, event: str, **fields: Any) -> None:
        self.add("harness", 1, event, **fields)

    def round(self, round_: int, members: list[str]) -> None:
        for rank, node in enumerate(members):
            self.add("agent", AGENTS[node], "round", node=node, round=round_, group_rank=rank,
                     group_world=len(members), members=members, run="r")  # fmt: skip

    def workers(self, round_: int) -> None:
        nodes = WORKERS[round_]
        world = 2 * len(nodes)
        for group_rank, (node, pids) in enumerate(nodes.items()):
            agent = AGENTS[node]
            self.add("agent", agent, "workers_started", node=node, round=round_, pids=pids,
                     restart_count=0)  # fmt: skip
            for local, pid in enumerate(pids):
                self.add(
                    "worker",
                    pid,
                    "worker_start",
                    node=node,
                    round=round_,
                    rank=2 * group_rank + local,
                    local_rank=local,
                    world=world,
                    group_rank=group_rank,
                    group_world=len(nodes),
                    agent_pid=agent,
                )

    def steps(self, round_: int, start: float, end: float, first_step: int = 0) -> None:
        nodes = WORKERS[round_]
        world = 2 * len(nodes)
        t, step = start, first_step
        while t < end:
            for group_rank, (node, pids) in enumerate(nodes.items()):
                for local, pid in enumerate(pids):
                    self.at(t + 0.01 * local)
                    self.add(
                        "worker",
                        pid,
                        "step",
                        node=node,
                        round=round_,
                        rank=2 * group_rank + local,
                        world=world,
                        step=step,
                        begin=t - 0.005,
                    )
            t, step = round(t + 0.2, 3), step + 1


def healthy() -> list[Event]:
    b = Builder()
    b.harness("run_start", run="r", seed=1, faults=2, agents=3, nproc=2, min_nodes=2,
              max_nodes=4, lease_ttl=2, step_s=0.2, endpoints=[])  # fmt: skip
    for slot, node in enumerate("abc"):
        b.at(0.1 * slot).harness("agent_started", slot=slot, agent_pid=AGENTS[node])
    b.at(3.0).round(1, ["a", "b", "c"])
    b.at(3.5).workers(1)
    b.steps(1, 5.0, 10.0)
    b.at(10.0).harness("fault_start", index=0, kind="agent_sigkill", target=2, removes_node=True,
                       disruptive=True, pids=[300])  # fmt: skip
    b.harness("agent_killed", slot=2, agent_pid=300, signal="SIGKILL")
    b.at(10.05).harness("agent_exited", slot=2, agent_pid=300, code=-9)
    b.at(10.1).harness("agent_started", slot=2, agent_pid=400)
    for node in "ab":
        b.at(12.0).add("agent", AGENTS[node], "workers_stopped", node=node, round=1,
                       reason="membership")  # fmt: skip
    b.at(12.3).round(2, ["a", "b", "d"])
    b.at(12.5).workers(2)
    b.steps(2, 14.0, 26.0, first_step=20)
    b.at(14.5).harness("fault_end", index=0, kind="agent_sigkill")
    b.at(20.0).harness("fault_start", index=1, kind="etcd_leader_kill", target=-1,
                       removes_node=False, disruptive=False, pids=[])  # fmt: skip
    b.at(22.0).harness("fault_end", index=1, kind="etcd_leader_kill")
    b.at(26.0).harness("teardown_start")
    b.at(27.0).harness("run_end", planned=2, executed=2, aborted="")
    return sorted(b.events, key=lambda e: e["mono"])


def _late_formation_fault(events: list[Event], inner: str, trigger_at: float) -> list[Event]:
    """Fault 0 as a formation fault whose second fault (``inner``) began at
    ``trigger_at``, and round 2 training 8 s after it began."""
    late = [e for e in events if not (_is("step", round=2)(e) and e["mono"] < 18.0)]
    late = _edit(late, _is("fault_start", index=0), kind="formation_fault", inner=inner)
    return _add(
        late,
        trigger_at,
        "harness",
        1,
        "trigger",
        index=0,
        what="re-forming",
        after_s=trigger_at - 10.0,
    )


def _refused(events: list[Event], kill_at: float, granted_at: float) -> list[Event]:
    """Fault 0 as ``etcd_role_revoked``: the role revoked as it starts (10 s), a worker
    of a killed at ``kill_at``, the grant back at ``granted_at`` (the agents stop their
    workers at 12 s, round 2 steps from 14 s)."""
    h = _edit(events, _is("fault_start", index=0), kind="etcd_role_revoked", removes_node=False)
    h = _add(h, 10.0, "harness", 1, "role_revoked", role="trainer")
    h = _add(h, kill_at, "harness", 1, "worker_killed", worker_pid=101, agent_pid=100)
    return _add(h, granted_at, "harness", 1, "role_granted", role="trainer")


def _edit(events: list[Event], pred: Callable[[Event], bool], **fields: Any) -> list[Event]:
    return [{**e, **fields} if pred(e) else e for e in events]


def _add(events: list[Event], t: float, src: str, pid: int, event: str, **f: Any) -> list[Event]:
    return [*events, {"t": 1e9 + t, "mono": t, "src": src, "pid": pid, "event": event, **f}]


def _reorder(events: list[Event], round_: int, members: list[str]) -> list[Event]:
    """Round ``round_`` completed with ``members`` in this group-rank order, consistently."""
    return [
        {**e, "members": members, "group_rank": members.index(e["node"])}
        if e["event"] == "round" and e["round"] == round_
        else e
        for e in events
    ]


def _is(name: str, **match: Any) -> Callable[[Event], bool]:
    return lambda e: e["event"] == name and all(e.get(k) == v for k, v in match.items())


Mutation = Callable[[list[Event]], list[Event]]

BROKEN: list[tuple[str, str, Mutation]] = [
    ("history_complete", "worker events without a round",
     lambda h: _edit(h, _is("step", pid=101), round=-1)),
    ("history_complete", "agent round events without a round number",
     lambda h: _edit(h, _is("round", node="a"), round=-1, members=[])),
    ("history_complete", "agent writes no round events",
     lambda h: [e for e in h if e["event"] != "round"]),
    ("history_complete", "no run_start", lambda h: [e for e in h if e["event"] != "run_start"]),
    ("history_complete", "malformed event", lambda h: [*h, {"event": "step"}]),
    ("one_membership_per_round", "two agents disagree on round 1",
     lambda h: _edit(h, _is("round", node="b", round=1), members=["b", "a", "c"])),
    ("one_membership_per_round", "agent's group rank does not match the members",
     lambda h: _edit(h, _is("round", node="b", round=1), group_rank=2)),
    ("ranks_permutation", "rank 4 twice in round 2",
     lambda h: _edit(h, _is("worker_start", pid=412), rank=4)),
    ("ranks_permutation", "two worlds in round 1",
     lambda h: _edit(h, _is("worker_start", pid=101), world=8)),
    ("ranks_permutation", "rank outside the world",
     lambda h: _edit(h, _is("worker_start", pid=102), rank=6)),
    ("world_bounds", "3 nodes under min_nodes 4",
     lambda h: _edit(h, _is("run_start"), min_nodes=4)),
    ("world_bounds", "a worker saw 5 nodes",
     lambda h: _edit(h, _is("worker_start", pid=101), group_world=5)),
    ("rounds_monotonic", "agent a completes round 1 after round 2",
     lambda h: _add(h, 15.0, "agent", 100, "round", node="a", round=1, group_rank=0,
                    group_world=3, members=["a", "b", "c"])),
    ("rounds_monotonic", "agent a reports round 2 twice",
     lambda h: _add(h, 15.0, "agent", 100, "round", node="a", round=2, group_rank=0,
                    group_world=3, members=["a", "b", "d"])),
    ("rank0_stable", "rank 0 moves from a, which stayed, to b",
     lambda h: _reorder(h, 2, ["b", "a", "d"])),
    ("no_overlapping_rounds", "round 1 begins a collective after round 2 stepped",
     lambda h: _add(h, 14.6, "worker", 101, "step", node="a", round=1, rank=0, world=6,
                    step=99, begin=14.5)),
    ("no_orphan_workers", "c's worker steps 1.5 s after c was SIGKILLed",
     lambda h: _add(h, 11.5, "worker", 301, "step", node="c", round=1, rank=4, world=6,
                    step=99, begin=10.001)),
    ("no_orphan_workers", "the harness found c's worker alive",
     lambda h: _add(h, 11.5, "harness", 1, "orphan_alive", worker_pid=301, agent_pid=300,
                    after_s=1.5)),
    ("recovery_bound", "round 2 trains 8 s after the kill (bound 2 + 5)",
     lambda h: [e for e in h if not (_is("step", round=2)(e) and e["mono"] < 18.0)]),
    ("recovery_bound", "a formation fault's leader kill 0.5 s in does not excuse 8 s",
     lambda h: _late_formation_fault(h, inner="etcd_leader_kill", trigger_at=10.5)),
    ("recovery_bound", "a formation fault's second agent kill re-arms no lease",
     lambda h: _late_formation_fault(h, inner="agent_sigkill", trigger_at=11.5)),
    ("recovery_bound", "round 2 never trains",
     lambda h: [e for e in h if not _is("step", round=2)(e)]),
    ("no_restart_without_node_loss", "agent a stops its workers during the etcd fault",
     lambda h: _add(h, 21.0, "agent", 100, "workers_stopped", node="a", round=2, reason="lease")),
    ("no_restart_without_node_loss", "a worker starts after the etcd fault",
     lambda h: _add(h, 23.0, "worker", 113, "worker_start", node="a", round=3, rank=0, world=6,
                    group_rank=0, group_world=3, agent_pid=100)),
    ("quiet_while_refused", "the agents stop their workers while the role is refused, "
     "before any worker died",
     lambda h: _refused(h, kill_at=12.5, granted_at=13.0)),
    ("no_agent_gives_up", "agent b exits on its own",
     lambda h: _add(h, 23.0, "harness", 1, "agent_exited", slot=1, agent_pid=200, code=1)),
    ("worker_checks", "a worker's all_gather check failed",
     lambda h: _add(h, 15.0, "worker", 111, "violation", node="a", round=2, rank=0, step=3,
                    what="ranks [0, 0, 2, 3, 4, 5]", gathered=[])),
    ("run_complete", "one of two faults ran",
     lambda h: _edit(h, _is("run_end"), executed=1, aborted="budget")),
    ("run_complete", "no run_end", lambda h: [e for e in h if e["event"] != "run_end"]),
    ("run_complete", "the job did not get back to full size",
     lambda h: _add(h, 19.0, "harness", 1, "settle_timeout", index=0, waited_s=30.0,
                    what="2 of 3 agents stepping")),
]  # fmt: skip

STILL_HEALTHY: list[tuple[str, Mutation]] = [
    ("a collective of round 1 in flight while round 2 formed (began before, ended after)",
     lambda h: _add(h, 14.3, "worker", 101, "step", node="a", round=1, rank=0, world=6,
                    step=99, begin=13.9)),
    ("c's worker steps 0.5 s after c died (within the 1 s grace)",
     lambda h: _add(h, 10.5, "worker", 301, "step", node="c", round=1, rank=4, world=6,
                    step=99, begin=10.001)),
    ("rank 0 moves because its holder a was hit by the node-removing fault (frozen)",
     lambda h: _reorder(_edit(h, _is("fault_start", index=0), pids=[100]), 2, ["b", "a", "d"])),
    ("a formation fault whose etcd leader kill 1.5 s in re-armed every lease: 8 s is within "
     "1.5 + TTL 2 + 5",
     lambda h: _late_formation_fault(h, inner="etcd_leader_kill", trigger_at=11.5)),
    ("the role refused 2 s, a worker killed 1.5 s in: the restart comes after the kill",
     lambda h: _refused(h, kill_at=11.5, granted_at=12.0)),
    ("rank 0 moves after the harness deleted the node keys (to the coordinator, a or b "
     "left: a slower one's key comes back after the others re-formed)",
     lambda h: _reorder(_add(h, 11.0, "harness", 1, "keys_deleted", prefix="/r/nodes/",
                             deleted=3), 2, ["b", "a", "d"])),
    ("what happens at teardown is not judged",
     lambda h: _add(h, 26.5, "agent", 100, "workers_stopped", node="a", round=2, reason="stop")),
]  # fmt: skip


def test_the_healthy_history_passes_every_invariant() -> None:
    assert check(healthy()) == []


@pytest.mark.parametrize(("invariant", "why", "mutate"), BROKEN, ids=[r[1] for r in BROKEN])
def test_each_broken_history_is_caught_by_its_invariant(
    invariant: str, why: str, mutate: Mutation
) -> None:
    events = mutate(copy.deepcopy(healthy()))
    found = check(events, only=[invariant])
    assert found, f"{invariant} missed: {why}"
    assert {v.invariant for v in found} == {invariant}
    for v in found:
        if v.index is not None:  # the violation names the very event it points at
            assert events[v.index] == v.event
            assert f"event #{v.index}:" in str(v)


def test_every_invariant_has_a_failing_history() -> None:
    assert {row[0] for row in BROKEN} == set(INVARIANTS)


@pytest.mark.parametrize(("why", "mutate"), STILL_HEALTHY, ids=[r[0] for r in STILL_HEALTHY])
def test_what_the_invariants_allow(why: str, mutate: Mutation) -> None:
    assert check(mutate(copy.deepcopy(healthy()))) == []


def test_missing_rounds_are_skipped_only_when_the_config_allows() -> None:
    events = [{**e, "round": -1} if e["src"] == "worker" else e for e in healthy()]
    events = [e for e in events if e["event"] not in ("round", "workers_started")]
    lax = CheckConfig(min_nodes=2, max_nodes=4, lease_ttl=2, require_rounds=False)
    assert check(events, lax) == []
    strict = {v.invariant for v in check(events)}
    assert strict == {"history_complete"}


def test_unknown_invariant_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown invariants \['rank0_stabel'\]"):
        check([], only=["rank0_stabel"])


def test_format_names_invariant_count_and_event() -> None:
    events = BROKEN[0][2](healthy())
    text = format_violations(check(events))
    assert text.startswith("violations: 1\n  history_complete: 1\n")
    assert '"event":"step"' in text
    assert format_violations([]) == "violations: none"


def test_report_measures_recovery_and_stall_per_kind() -> None:
    rows = {r.kind: r for r in summarize(healthy())}
    kill, leader = rows["agent_sigkill"], rows["etcd_leader_kill"]
    assert (kill.count, kill.measure, kill.never) == (1, "recovery", 0)
    assert kill.max == pytest.approx(4.0)  # fault at 10 s, round 2's first step at 14 s
    assert leader.measure == "stall" and leader.max is not None and leader.max < 0.25
    table = format_table(list(rows.values()))
    assert "agent_sigkill" in table.splitlines()[2] and table.endswith("total                    2")


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [([], 50, None), ([3.0], 99, 3.0), ([4.0, 1.0, 3.0, 2.0], 50, 2.0), ([1.0, 2.0], 99, 2.0)],
)
def test_percentile_is_nearest_rank(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == expected


def _below_min(replaced_at: float, trains_at: float) -> list[Event]:
    """Fault 0 as a formation fault whose second fault killed b too: one agent of three
    alive, min_nodes 2. d, the agent the job needs, started at ``replaced_at``; round 2
    trains from ``trains_at``."""
    h = _edit(healthy(), _is("fault_start", index=0), kind="formation_fault", inner="agent_sigkill")
    h = _add(h, 11.0, "harness", 1, "agent_killed", slot=1, agent_pid=200, signal="SIGKILL")
    h = [{**e, "mono": replaced_at} if _is("agent_started", agent_pid=400)(e) else e for e in h]
    return [e for e in h if not (_is("step", round=2)(e) and e["mono"] < trains_at)]


BELOW_MIN = CheckConfig(min_nodes=2, max_nodes=4, lease_ttl=2, agents=3, agent_start_s=10.0)


@pytest.mark.parametrize(("trains_at", "caught"), [(21.9, False), (22.5, True)])
def test_below_min_nodes_the_bound_counts_from_the_agent_the_job_needed(
    trains_at: float, caught: bool
) -> None:
    # d started 2 s into the fault: the bound is 2 + agent_start_s 10 = 12 s, not TTL + 5.
    found = check(_below_min(12.0, trains_at), BELOW_MIN, only=["recovery_bound"])
    assert bool(found) is caught
    if caught:
        assert "the agent the job needed started then" in found[0].message
    # With min_nodes 1 the survivor alone could train: TTL + 5 holds, and 11.9 s breaks it.
    lone = CheckConfig(min_nodes=1, max_nodes=4, lease_ttl=2, agents=3, agent_start_s=10.0)
    assert check(_below_min(12.0, trains_at), lone, only=["recovery_bound"])


def _restart_fault(kind: str, kills: list[float]) -> list[Event]:
    """Fault 0 as ``kind``, a restart that removes no node, with worker kills at ``kills``
    (round 2's workers start at 12.5 s and step from 14 s)."""
    h = _edit(healthy(), _is("fault_start", index=0), kind=kind, removes_node=False)
    for t in kills:
        h = _add(h, t, "harness", 1, "worker_killed", worker_pid=101, agent_pid=100)
    return h


@pytest.mark.parametrize(
    ("kind", "kills", "caught"),
    [("warm_import_stuck", [10.0], False),
     ("warm_import_stuck", [10.0, 14.2], True),  # no worker started after the second kill
     ("master_port_restart", [10.0], False),
     ("node_keys_deleted", [], False)],
)  # fmt: skip
def test_timed_restarts_train_again_within_ttl_and_slack(
    kind: str, kills: list[float], caught: bool
) -> None:
    found = check(_restart_fault(kind, kills), only=["recovery_bound"])
    assert bool(found) is caught, format_violations(found)
    late = [
        e for e in _restart_fault(kind, kills) if not (_is("step", round=2)(e) and e["mono"] < 17.5)
    ]
    assert check(late, only=["recovery_bound"]), "7.5 s after the fault is past TTL 2 + 5"


@pytest.mark.parametrize(
    ("granted_at", "trains_from", "caught"),
    [(12.0, 14.0, False),
     (12.0, 18.5, False),  # 8.5 s after the fault's start, but 6.5 s after the grant
     (10.5, 18.5, True),  # 8 s after the grant: past TTL 2 + 5
     (12.0, 99.0, True)],  # never
)  # fmt: skip
def test_a_refused_role_is_held_to_ttl_and_slack_from_the_grant(
    granted_at: float, trains_from: float, caught: bool
) -> None:
    h = _refused(healthy(), kill_at=11.0, granted_at=granted_at)
    h = [e for e in h if not (_is("step", round=2)(e) and e["mono"] < trains_from)]
    found = check(h, only=["recovery_bound"])
    assert bool(found) is caught, format_violations(found)
    if caught:
        assert "from the grant" in found[0].message
