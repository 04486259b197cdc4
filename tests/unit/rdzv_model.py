"""A model of the whole rendezvous protocol, driven by the pure decisions only.

A dict stands in for etcd's node keys (a key present = a live lease) and a version number
for the state key's mod_revision: a commit succeeds only if the version it decided from is
still current (CAS) and, for a coordinator, only if its own key still has the create
revision it was elected with (the fence). Nodes behave as ``next_rendezvous()`` does
(decide_node, JOIN writes the node's own key); coordinators behave as the elected duty
does (decide_coordinator, apply, guarded and fenced commit). The property tests in
``test_rendezvous_properties.py`` drive it; this tests the decisions, not etcd: the
integration tests do that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TypeAlias

from hypothesis import currently_in_test_context, event

from coordinator.core.actions import Action, apply, close
from coordinator.core.join_decision import NodeAction, decide_node, incarnation_to_join
from coordinator.core.state import NodeInfo, RdzvState, decode_state, encode_state
from coordinator.core.transitions import CoordinatorDecision, Limits, decide_coordinator

Fence: TypeAlias = tuple[str, int]
"""A coordinator's key as it was elected: (node id, create revision)."""

SLOTS = 16
LAST_CALL = 10.0
QUIESCE_STEPS = 200


@dataclass
class Agent:
    """One incarnation of a node, as its handler sees itself."""

    node_id: str
    in_call: bool = False
    wanted: int = 0
    join_deadline: float = math.inf
    lease_lost: bool = False
    finished_round: int = 0
    # The run's incarnation this node belongs to (0: it has not asked yet).
    run_incarnation: int = 0


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
    # A second coordinator (a stale leader): what it read and decided, not yet committed,
    # and the key it was elected with (node id, create revision): its fence.
    stale: tuple[int, dict[str, NodeInfo], CoordinatorDecision, Fence] | None = None
    stale_deadline: float | None = None
    # False only in the tests that show what the fence prevents.
    fencing: bool = True
    history: dict[int, tuple[str, ...]] = field(default_factory=dict)
    finishes: dict[int, dict[str, int]] = field(default_factory=dict)

    # -- etcd stand-in --------------------------------------------------------------------

    def put_node(self, node_id: str, wanted: int, incarnation: int = 1) -> None:
        self.revision += 1
        old = self.keys.get(node_id)
        created = old.create_revision if old is not None else self.revision
        self.keys[node_id] = NodeInfo(
            node_id, wanted, addr=node_id, free_port=20000 + created,
            create_revision=created, incarnation=incarnation,
        )  # fmt: skip

    def elected(self) -> Fence | None:
        """The key a coordinator elected now leads with: the oldest live one (etcd's
        election recipe); None when no node has a key."""
        if not self.keys:
            return None
        oldest = min(self.keys.values(), key=lambda n: n.create_revision)
        return (oldest.node_id, oldest.create_revision)

    def holds(self, fence: Fence) -> bool:
        """Whether the fence's key still exists with the create revision it led with."""
        node = self.keys.get(fence[0])
        return node is not None and node.create_revision == fence[1]

    def commit(
        self,
        actions: tuple[Action, ...],
        seen: dict[str, NodeInfo],
        based_on: int,
        fence: Fence | None = None,
    ) -> bool:
        """Apply ``actions`` if the state is still the one decided from (CAS) and the
        committer still holds its key (the fence, in the same transaction)."""
        if not actions or based_on != self.version:
            return False
        if fence is not None and self.fencing and not self.holds(fence):
            return False
        old = self.state
        new = apply(old, actions, written_by="coordinator", now_unix_ms=int(self.now * 1000))
        check_commit(old, new, seen, self.limits, self.history)
        if fence is not None and new.round != old.round:
            # The round a coordinator completes never names it unless its lease is alive
            # (checked apart from the refusal above: the broken variant trips this).
            assert fence[0] not in new.participants or self.holds(fence), (fence, new)
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
        action = decide_node(
            state, agent.node_id, agent.wanted, self.now, agent.join_deadline,
            agent.run_incarnation,
        )  # fmt: skip
        if action is NodeAction.JOIN:
            agent.wanted = state.round + 1
            agent.lease_lost = False
            agent.run_incarnation = agent.run_incarnation or incarnation_to_join(state)
            self.put_node(agent.node_id, agent.wanted, agent.run_incarnation)
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
        elif action in (NodeAction.ERROR_CLOSED, NodeAction.EXIT_GRACEFULLY):
            assert state.closed and agent.run_incarnation == state.incarnation
            graceful = state.rank_of(agent.node_id) is None and state.close_mode != "failed"
            assert graceful == (action is NodeAction.EXIT_GRACEFULLY), (agent, state)
            agent.in_call = False
        elif action is NodeAction.ERROR_SUPERSEDED:
            assert agent.run_incarnation != incarnation_to_join(state)
            self.leave(slot)
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
        """The coordinator elected now reads and decides, then pauses before it commits."""
        fence = self.elected()
        if fence is None:
            return  # no node has a key: nobody is elected
        seen = dict(self.keys)
        decision = decide_coordinator(self.state, seen, self.limits, self.now, self.stale_deadline)
        self.stale_deadline = decision.last_call_deadline
        self.stale = (self.version, seen, decision, fence)

    def freeze_stale(self) -> None:
        """The stale coordinator stays frozen past its TTL: its lease ends."""
        if self.stale is None:
            return
        leader = self.stale[3][0]
        for slot, agent in self.agents.items():
            if agent.node_id == leader:
                self.expire(slot)
                return

    def stale_commit(self) -> None:
        if self.stale is not None:
            based_on, seen, decision, fence = self.stale
            self.stale = None
            holds = self.holds(fence)
            won = self.commit(decision.actions, seen, based_on, fence)
            assert not won or based_on + 1 == self.version
            if decision.actions and currently_in_test_context():
                fenced_out = not won and based_on == self.version and not holds
                outcome = "won" if won else "fenced out" if fenced_out else "lost"
                event(f"stale coordinator commit {outcome}")

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
    if new.incarnation != old.incarnation:
        # A new incarnation: only after a close, only once every live node asks for it.
        assert old.closed and new.incarnation == old.incarnation + 1, (old, new)
        assert seen and all(n.incarnation == new.incarnation for n in seen.values()), seen
        assert (new.round, new.participants, new.closed) == (old.round, (), False), new
        return
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
        progressed = everyone(world)
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


def everyone(world: World) -> bool:
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
