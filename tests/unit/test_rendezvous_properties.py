"""Properties of the whole rendezvous protocol, simulated from the pure decisions only.

A dict stands in for etcd's node keys (a key present = a live lease) and a version number
for the state key's mod_revision: a commit succeeds only if the version it decided from is
still current (CAS). Nodes behave as ``next_rendezvous()`` does (decide_node, JOIN writes
the node's own key); coordinators behave as the elected duty does (decide_coordinator,
apply, guarded commit). Hypothesis interleaves node steps, coordinator steps, time, lease
expiries, departures, closing, coordinator fail-over and a second coordinator deciding from
a stale read. This tests the decisions, not etcd: the integration tests do that.

Safety is checked at every commit and every FINISH; liveness after the random prefix: with
at least min_nodes nodes alive that keep calling next_rendezvous, the system quiesces with
a completed round of min(alive, max_nodes) live participants, each of which got FINISH with
its rank, and every other live node waiting in the redundancy list.

"Every participant had a live key asking for the round" is checked against the keys the
committing coordinator read: the commit is guarded by the state key's revision only, so a
key that vanishes between a stale read and its commit is the same as a node dying right
after the commit (the next decision records it as lost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from coordinator.core.state import NodeInfo, RdzvState, decode_state, encode_state
from coordinator.core.transitions import (
    Action,
    CoordinatorDecision,
    Limits,
    NodeAction,
    apply,
    close,
    decide_coordinator,
    decide_node,
)

SLOTS = 16
LAST_CALL = 10.0
QUIESCE_STEPS = 200

# Deterministic in CI: the same examples every run, no example database on disk. The
# example counts keep this file at a few seconds on a 2-core machine.
SETTINGS = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass
class Agent:
    """One incarnation of a node, as its handler sees itself."""

    node_id: str
    in_call: bool = False
    wanted: int = 0
    join_deadline: float = math.inf
    lease_lost: bool = False
    finished_round: int = 0


@dataclass
class World:
    limits: Limits
    join_timeout: float
    keys: dict[str, NodeInfo] = field(default_factory=dict)
    state: RdzvState = field(default_factory=RdzvState)
    version: int = 0
    revision: int = 0
    now: float = 0.0
    agents: dict[int, Agent] = field(default_factory=dict)
    incarnations: dict[int, int] = field(default_factory=dict)
    # The elected coordinator's running last-call deadline and its next wake-up.
    deadline: float | None = None
    wake_at: float = math.inf
    # A second coordinator (a stale leader): what it read and decided, not yet committed.
    stale: tuple[int, dict[str, NodeInfo], CoordinatorDecision] | None = None
    stale_deadline: float | None = None
    history: dict[int, tuple[str, ...]] = field(default_factory=dict)
    finishes: dict[int, dict[str, int]] = field(default_factory=dict)

    # -- etcd stand-in --------------------------------------------------------------------

    def put_node(self, node_id: str, wanted: int) -> None:
        self.revision += 1
        old = self.keys.get(node_id)
        created = old.create_revision if old is not None else self.revision
        self.keys[node_id] = NodeInfo(
            node_id, wanted, addr=node_id, free_port=20000 + created, create_revision=created
        )

    def commit(self, actions: tuple[Action, ...], seen: dict[str, NodeInfo], based_on: int) -> bool:
        """Apply ``actions`` if the state is still the one decided from (CAS)."""
        if not actions or based_on != self.version:
            return False
        old = self.state
        new = apply(old, actions, written_by="coordinator", now_unix_ms=int(self.now * 1000))
        check_commit(old, new, seen, self.limits, self.history)
        self.state, self.version = new, self.version + 1
        return True

    # -- nodes ----------------------------------------------------------------------------

    def call(self, slot: int) -> None:
        """The node in ``slot`` calls next_rendezvous (a new incarnation if there is none)."""
        agent = self.agents.get(slot)
        if agent is None:
            inc = self.incarnations.get(slot, 0)
            self.incarnations[slot] = inc + 1
            agent = self.agents[slot] = Agent(f"host-name-{slot:02d}-{4000 + slot}-{inc}")
        agent.in_call, agent.wanted = True, 0
        agent.join_deadline = self.now + self.join_timeout

    def node_step(self, slot: int) -> NodeAction | None:
        """One turn of the node's next_rendezvous loop (None: it is not inside one)."""
        agent = self.agents.get(slot)
        if agent is None or not agent.in_call:
            return None
        if agent.wanted and agent.lease_lost:
            agent.wanted = 0  # our key is gone: ask again with a new lease
        state = self.state
        action = decide_node(state, agent.node_id, agent.wanted, self.now, agent.join_deadline)
        if action is NodeAction.JOIN:
            agent.wanted = state.round + 1
            agent.lease_lost = False
            self.put_node(agent.node_id, agent.wanted)
        elif action is NodeAction.SYNC:
            assert agent.wanted == state.round + 1, (agent, state)
        elif action is NodeAction.FINISH:
            rank = state.rank_of(agent.node_id)
            assert rank is not None
            assert state.participants == self.history[state.round]
            per_round = self.finishes.setdefault(state.round, {})
            assert agent.node_id not in per_round, "FINISH twice for one round"
            assert rank not in per_round.values(), "two nodes got the same rank"
            per_round[agent.node_id] = rank
            agent.in_call, agent.finished_round = False, state.round
        elif action is NodeAction.ERROR_CLOSED:
            assert state.closed
            agent.in_call = False
        else:  # ERROR_TIMEOUT: the handler leaves (revokes its lease) and raises
            assert self.now >= agent.join_deadline
            self.leave(slot)
        return action

    def expire(self, slot: int) -> None:
        agent = self.agents.get(slot)
        if agent is not None and agent.node_id in self.keys:
            del self.keys[agent.node_id]
            agent.lease_lost = True

    def leave(self, slot: int) -> None:
        agent = self.agents.pop(slot, None)
        if agent is not None:
            self.keys.pop(agent.node_id, None)

    # -- coordinators ---------------------------------------------------------------------

    def coordinator_step(self) -> bool:
        seen = dict(self.keys)
        decision = decide_coordinator(self.state, seen, self.limits, self.now, self.deadline)
        self.deadline, self.wake_at = decision.last_call_deadline, decision.wake_at
        return self.commit(decision.actions, seen, self.version)

    def stale_read(self) -> None:
        seen = dict(self.keys)
        decision = decide_coordinator(self.state, seen, self.limits, self.now, self.stale_deadline)
        self.stale_deadline = decision.last_call_deadline
        self.stale = (self.version, seen, decision)

    def stale_commit(self) -> None:
        if self.stale is not None:
            based_on, seen, decision = self.stale
            self.stale = None
            won = self.commit(decision.actions, seen, based_on)
            assert not won or based_on + 1 == self.version
            if decision.actions:
                event(f"stale coordinator commit {'won' if won else 'lost'}")

    def race(self, main_first: bool) -> None:
        """Two coordinators decide from the same state; only the first commit may win."""
        seen, based_on = dict(self.keys), self.version
        a = decide_coordinator(self.state, seen, self.limits, self.now, self.deadline)
        b = decide_coordinator(self.state, seen, self.limits, self.now, None)
        self.deadline = a.last_call_deadline
        first, second = (a, b) if main_first else (b, a)
        won = self.commit(first.actions, seen, based_on)
        assert won == bool(first.actions)
        assert not (won and self.commit(second.actions, seen, based_on))

    def close_run(self) -> None:
        self.commit(close(self.state, "closed by a test"), dict(self.keys), self.version)


def check_commit(
    old: RdzvState,
    new: RdzvState,
    seen: dict[str, NodeInfo],
    limits: Limits,
    history: dict[int, tuple[str, ...]],
) -> None:
    """Safety of one committed state change, given the node keys it was decided from."""
    # Storable: decode_state refuses duplicate participants and ranks other than 0..n-1.
    assert decode_state("state", encode_state(new)) == new
    assert len(set(new.participants)) == len(new.participants)
    assert old.closed <= new.closed, "a closed run re-opened"
    assert new.round in (old.round, old.round + 1), (old.round, new.round)
    assert set(new.lost) <= set(new.participants)
    assert not set(new.redundancy_list) & set(new.participants)
    assert not set(new.redundancy_list) & set(new.wait_list)
    if new.round == old.round:
        assert new.participants == old.participants
        return
    assert not old.closed, "a round completed in a closed run"
    assert new.round not in history, f"round {new.round} committed twice"
    history[new.round] = new.participants
    assert limits.min_nodes <= len(new.participants) <= limits.max_nodes, new
    for p in new.participants + new.redundancy_list:
        assert p in seen and seen[p].wanted_round == new.round, (p, seen.get(p), new)
    # Survivors keep their relative rank order (so rank 0 stays put while it is in the
    # round), and newcomers follow them.
    survivors = [p for p in new.participants if p in old.participants]
    assert survivors == [p for p in old.participants if p in survivors], (old, new)
    assert list(new.participants[: len(survivors)]) == survivors, (old, new)
    assert (new.master_addr, new.master_port) == (
        seen[new.participants[0]].addr,
        seen[new.participants[0]].free_port,
    )


def _wants_to_rejoin(world: World, agent: Agent) -> bool:
    # What an agent does between calls: re-rendezvous when told others wait or were lost,
    # when its own lease ended, or when the group moved on without it (its workers fail).
    state = world.state
    return (
        state.num_waiting > 0
        or agent.lease_lost
        or agent.finished_round != state.round
        or state.rank_of(agent.node_id) is None
    )


def settle(world: World, *, jump_to_deadlines: bool) -> None:
    """Nodes and the coordinator take turns until nothing changes (a calm period).

    With ``jump_to_deadlines`` the clock then jumps to the coordinator's next wake-up
    (the last-call deadline) and the turns go on, until nothing is pending at all.
    """
    for _ in range(QUIESCE_STEPS):
        progressed = _everyone(world)
        progressed |= world.coordinator_step()
        if progressed:
            continue
        if not jump_to_deadlines or world.wake_at == math.inf:
            return
        world.now = max(world.now, world.wake_at)
    raise AssertionError(f"no quiescence after {QUIESCE_STEPS} steps: {world.state}")


def run_to_quiescence(world: World) -> None:
    """Every live node keeps calling next_rendezvous until the system is quiet."""
    world.stale = None  # the stale leader's lease is gone
    for agent in world.agents.values():
        agent.join_deadline = math.inf
    settle(world, jump_to_deadlines=True)


# Weighted by repetition: nodes and the coordinator act more often than things break.
_OP_NAMES = (
    ["call"] * 4 + ["everyone"] * 2 + ["coord"] * 3 + ["tick"] * 2 + ["settle"] * 2
    + ["expire", "leave", "close", "failover", "stale_read", "stale_commit", "race"]
)  # fmt: skip
_OPS = st.tuples(st.sampled_from(_OP_NAMES), st.integers(0, SLOTS - 1))
_TICKS = (0.5, 3.0, 9.0, 31.0)


@st.composite
def _limits(draw: st.DrawFn) -> Limits:
    min_nodes = draw(st.integers(1, 4))
    max_nodes = draw(st.integers(min_nodes, 12))
    return Limits(min_nodes, max_nodes, LAST_CALL)


def _everyone(world: World) -> bool:
    """One turn of every live agent (a watch event woke them all); True if any acted."""
    acted = False
    for slot in sorted(world.agents):
        agent = world.agents.get(slot)
        if agent is None:
            continue  # it timed out and left during this turn
        if agent.in_call:
            acted |= world.node_step(slot) is not NodeAction.SYNC
        elif _wants_to_rejoin(world, agent) and not world.state.closed:
            world.call(slot)
            acted = True
    return acted


def _run(world: World, ops: list[tuple[str, int]], slots: int) -> None:
    for op, arg in ops:
        slot = arg % slots
        if op == "call":
            if world.node_step(slot) is None:
                world.call(slot)
        elif op == "everyone":
            _everyone(world)
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
            action = world.node_step(slot)
            assert action in (None, NodeAction.ERROR_CLOSED), action
        assert not world.coordinator_step(), "a coordinator changed a closed run"
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
