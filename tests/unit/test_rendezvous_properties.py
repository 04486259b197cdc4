"""Properties of the whole rendezvous protocol, on the model in ``rdzv_model.py``.

Hypothesis interleaves node steps, coordinator steps, time, lease expiries, departures,
closing, coordinator fail-over, a second coordinator deciding from a stale read (and
committing later, fenced by the key it was elected with) and two coordinators racing.

Safety is checked at every commit and every FINISH; liveness after the random prefix: with
at least min_nodes nodes alive that keep calling next_rendezvous, the system quiesces with
a completed round of min(alive, max_nodes) live participants, each of which got FINISH with
its rank, and every other live node waiting in the redundancy list.

"Every participant had a live key asking for the round" is checked against the keys the
committing coordinator read: the commit is guarded by the state key's revision and by the
committer's own key, not by every participant's, so a participant's key that vanishes
between a stale read and its commit is the same as that node dying right after the commit
(the next decision records it as lost). The committer itself is different: a round it
completes never names it once its own lease has ended (the fence); the scenario tests at
the end show the model breaking that rule when the fence is taken out.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from coordinator.core.join_decision import NodeAction
from coordinator.core.transitions import Limits
from tests.unit.rdzv_model import (
    LAST_CALL,
    SLOTS,
    World,
    everyone,
    run_to_quiescence,
    settle,
)

# Deterministic in CI: the same examples every run, no example database on disk. The
# example counts keep this file at a few seconds on a 2-core machine.
SETTINGS = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# Weighted by repetition: nodes and the coordinator act more often than things break.
_OP_NAMES = (
    ["call"] * 4 + ["everyone"] * 2 + ["coord"] * 3 + ["tick"] * 2 + ["settle"] * 2
    + ["expire", "leave", "close", "failover", "stale_read", "stale_freeze", "stale_commit"]
    + ["race", "frozen_leader"]
)  # fmt: skip
_OPS = st.tuples(st.sampled_from(_OP_NAMES), st.integers(0, SLOTS - 1))
_TICKS = (0.5, 3.0, 9.0, 31.0)


@st.composite
def _limits(draw: st.DrawFn) -> Limits:
    min_nodes = draw(st.integers(1, 4))
    max_nodes = draw(st.integers(min_nodes, 12))
    return Limits(min_nodes, max_nodes, LAST_CALL)


def _run(world: World, ops: list[tuple[str, int]], slots: int) -> None:
    for op, arg in ops:
        slot = arg % slots
        if op == "call":
            if world.node_step(slot) is None:
                world.call(slot)
        elif op == "everyone":
            everyone(world)
        elif op == "coord":
            world.coordinator_step()
        elif op == "settle":
            settle(world, jump_to_deadlines=arg % 2 == 1)
        elif op == "tick":
            world.now += _TICKS[arg % len(_TICKS)]
        elif op == "expire":
            world.expire(slot)
        elif op == "leave":
            world.leave(slot)
        elif op == "close":
            if arg == 0:  # rare: most runs stay open so liveness gets checked
                world.close_run()
        elif op == "failover":
            world.deadline = None  # a new leader starts last call from its own clock
        elif op == "stale_read":
            world.stale_read()
        elif op == "stale_freeze":
            world.freeze_stale()
        elif op == "frozen_leader":
            # The elected node decides, freezes past its TTL, resumes and commits.
            world.stale_read()
            world.freeze_stale()
            world.stale_commit()
        elif op == "stale_commit":
            world.stale_commit()
        else:
            world.race(main_first=arg % 2 == 0)


@settings(SETTINGS, max_examples=800)
@given(
    limits=_limits(),
    spare_slots=st.integers(0, SLOTS - 4),
    formed=st.booleans(),
    join_timeout=st.sampled_from([60.0, math.inf]),
    # Epochs of random steps, each followed by no calm, a calm period, or one with time
    # jumping to the deadlines: faults then hit completed rounds, not only the first.
    epochs=st.lists(
        st.tuples(st.lists(_OPS, max_size=20), st.integers(0, 2)), min_size=1, max_size=8
    ),
    extra=st.integers(0, 2),
)
def test_rendezvous_is_safe_and_live(
    limits: Limits,
    spare_slots: int,
    formed: bool,
    join_timeout: float,
    epochs: list[tuple[list[tuple[str, int]], int]],
    extra: int,
) -> None:
    world = World(limits, join_timeout)
    slots = limits.min_nodes + spare_slots  # nodes the random steps use (at most 16)
    if formed:  # start from a formed round of every node, so faults hit a running group
        for slot in range(slots):
            world.call(slot)
        settle(world, jump_to_deadlines=True)
    for ops, calm in epochs:
        _run(world, ops, slots)
        if calm:
            settle(world, jump_to_deadlines=calm == 2)
    event(f"rounds completed by the random steps: {min(world.state.round, 3)} (3: or more)")

    if world.state.closed:
        event("closed")
        # Every node inside next_rendezvous fails at its next turn, whatever it waited for.
        for slot in sorted(world.agents):
            fresh = world.agents[slot].run_incarnation in (0, world.state.incarnation + 1)
            action = world.node_step(slot)
            # A node of the closed incarnation fails; one that has not asked yet asks to
            # start the run again, and waits while nodes of the old one are alive.
            allowed = (
                (NodeAction.JOIN, NodeAction.SYNC)
                if fresh
                else (NodeAction.ERROR_CLOSED, NodeAction.EXIT_GRACEFULLY)
            )
            assert action is None or action in allowed, action
        old_incarnation = world.state.incarnation
        fresh_only = bool(world.keys) and all(
            n.incarnation == old_incarnation + 1 for n in world.keys.values()
        )
        if not fresh_only:
            assert not world.coordinator_step(), "a coordinator changed a closed run"
            return
        # Only nodes that asked after the close are left: the run starts again.
        event("started again")
        assert world.coordinator_step()
        assert (world.state.incarnation, world.state.closed) == (old_incarnation + 1, False)
        return
    if set(world.state.participants) - set(world.keys):
        event("a participant's key is gone before the calm period")
    # Newcomers up to min_nodes (and maybe a few more), so that liveness is always checked.
    free = [s for s in range(SLOTS) if s not in world.agents]
    for slot in free[: max(0, limits.min_nodes - len(world.agents)) + extra]:
        world.call(slot)
    alive = {a.node_id for a in world.agents.values()}
    if len(alive) < limits.min_nodes:
        event("fewer than min_nodes alive: liveness not required")
        return
    event("liveness checked" + (" (over max_nodes)" if len(alive) > limits.max_nodes else ""))
    run_to_quiescence(world)

    state = world.state
    expected = min(len(alive), limits.max_nodes)
    assert state.round >= 1 and not state.closed
    assert len(state.participants) == expected, (len(alive), state)
    assert set(state.participants) <= alive
    assert state.num_waiting == 0, state
    for agent in world.agents.values():
        rank = state.rank_of(agent.node_id)
        if rank is not None:
            assert not agent.in_call and agent.finished_round == state.round, agent
            assert world.finishes[state.round][agent.node_id] == rank
        else:
            assert agent.in_call and agent.node_id in state.redundancy_list, (agent, state)
    assert set(state.redundancy_list) == alive - set(state.participants)


@SETTINGS
@given(limits=_limits(), alive=st.integers(1, SLOTS), first=st.integers(1, SLOTS))
def test_first_formation_and_growth(limits: Limits, alive: int, first: int) -> None:
    """Without faults: ``first`` nodes form, the rest arrive later; all end up placed."""
    world = World(limits, math.inf)
    first = min(first, alive)
    for slot in range(first):
        world.call(slot)
    if first >= limits.min_nodes:
        run_to_quiescence(world)
        assert len(world.state.participants) == min(first, limits.max_nodes)
        assert world.state.round == 1
    for slot in range(first, alive):
        world.call(slot)
    if alive < limits.min_nodes:
        return
    run_to_quiescence(world)
    state = world.state
    assert len(state.participants) == min(alive, limits.max_nodes)
    if first >= limits.min_nodes:
        assert state.participants[0] == world.history[1][0], "rank 0 moved while alive"
    assert len(state.redundancy_list) == max(0, alive - limits.max_nodes)


# -- the fence, in the model: what it prevents --------------------------------------------


@pytest.mark.parametrize("fencing", [True, False], ids=["fenced", "broken-variant-unfenced"])
def test_a_stale_coordinator_whose_key_expired_cannot_complete_a_round(fencing: bool) -> None:
    """The elected node decides to complete round 1 with itself, then its lease ends
    before it commits; nobody else changed the state. Fenced, the commit is refused;
    unfenced, it lands naming a node whose lease ended, and the model's check trips."""
    world = World(Limits(2, 2, LAST_CALL), math.inf, fencing=fencing)
    world.call(0)
    world.call(1)
    everyone(world)  # both ask for round 1
    world.stale_read()
    assert world.stale is not None and world.stale[3][0] == world.agents[0].node_id
    world.expire(0)  # the coordinator froze past its TTL: its key is gone
    if fencing:
        world.stale_commit()
        assert world.state.round == 0 and world.version == 0
    else:
        with pytest.raises(AssertionError):
            world.stale_commit()


def test_a_stale_coordinator_that_re_joined_is_fenced_by_its_old_key() -> None:
    world = World(Limits(2, 2, LAST_CALL), math.inf)
    world.call(0)
    world.call(1)
    everyone(world)
    world.stale_read()
    world.expire(0)
    everyone(world)  # node 0 notices and asks again: a new key, a new create revision
    assert world.agents[0].node_id in world.keys
    world.stale_commit()
    assert world.state.round == 0  # the old leader's decision did not land
    world.coordinator_step()  # the coordinator elected now completes it from a fresh read
    assert world.state.round == 1
