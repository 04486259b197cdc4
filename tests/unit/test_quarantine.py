"""Quarantine in the pure rendezvous decisions, the state codec and ``rdzvctl``'s views.

Node ids are single letters in arrival order; ``now`` is monotonic seconds and
``now_unix_ms`` the coordinator's wall clock, the only clock a quarantine ends by.
"""

from __future__ import annotations

import json
import math

from coordinator.core.actions import Action, ActionKind, apply, close, quarantine
from coordinator.core.quarantine import ended, new_entries, quarantined_ids, release_in
from coordinator.core.state import NodeInfo, Quarantine, RdzvState, decode_state, encode_state
from coordinator.core.transitions import CoordinatorDecision, Limits, decide_coordinator
from coordinator.rdzvctl.format import node_status, status_json, status_lines
from coordinator.rdzvctl.watch import diff_states
from tests.unit.rdzvctl_samples import LIVE, NOW, ROUND1, UTC, snap

K = ActionKind
LIM = Limits(min_nodes=2, max_nodes=3, last_call_timeout=10.0)
T = 1_800_000_000_000  # the coordinator's wall clock "now" (ms)
C = Quarantine("c", "matmul 3.000 s, 300x the median 0.010 s", T + 300_000, "10.0.0.3")


def _nodes(**wanted: int) -> dict[str, NodeInfo]:
    revision = {"a": 1, "b": 2, "c": 3, "d": 4}
    return {
        n: NodeInfo(n, w, addr=f"host-{n}", free_port=29500, create_revision=revision[n])
        for n, w in wanted.items()
    }


def _complete(*ids: str) -> Action:
    return Action(
        K.MARK_RENDEZVOUS_COMPLETE, node_ids=ids, master_addr=f"host-{ids[0]}", master_port=29500
    )


def test_quarantining_adds_each_node_once_and_never_in_a_closed_run() -> None:
    running = RdzvState(round=1, participants=("a", "b", "c"))
    assert quarantine(running, [C]) == (Action(K.ADD_TO_QUARANTINE, quarantine=(C,)),)
    once = apply(running, quarantine(running, [C]))
    assert once.quarantined == (C,) and once.quarantine_of("c") == C
    # A second writer (every node of the round writes the same verdict) changes nothing:
    # the first writer's reason and end time stay.
    later = Quarantine("c", "other words", T + 999_000)
    assert quarantine(once, [later]) == ()
    assert apply(once, [Action(K.ADD_TO_QUARANTINE, quarantine=(later,))]).quarantined == (C,)
    assert new_entries(RdzvState(), [C, later]) == (C,)
    assert quarantine(apply(running, close(running, "done")), [C]) == ()
    assert quarantined_ids(once) == frozenset({"c"})


def test_a_quarantined_participant_makes_the_others_reform_without_it_at_once() -> None:
    running = apply(RdzvState(round=1, participants=("a", "b", "c")), quarantine(RdzvState(), [C]))
    # Every agent's num_nodes_waiting() counts it, so the workers of a running round stop.
    assert running.num_waiting == 1
    # The coordinator counts it out: lost for this round, and it decides again when the
    # quarantine ends even if nothing else happens.
    decision = decide_coordinator(running, _nodes(a=1, b=1, c=1), LIM, 50.0, None, now_unix_ms=T)
    assert decision == CoordinatorDecision(
        (Action(K.REMOVE_FROM_PARTICIPANTS, ("c",)),), None, 50.0 + 300.0
    )
    lost = apply(running, decision.actions)
    assert lost.num_waiting == 1  # not counted twice
    # a and b re-join: every live participant is back, so the round completes at once,
    # without c although c asks too (and although 3 would be max_nodes).
    decision = decide_coordinator(lost, _nodes(a=2, b=2, c=2), LIM, 51.0, None, now_unix_ms=T)
    assert decision.actions == (_complete("a", "b"),)
    formed = apply(lost, decision.actions)
    assert formed.num_waiting == 0 and formed.quarantined == (C,)
    # c waits: it is not put on the wait list, nobody restarts for it.
    decision = decide_coordinator(formed, _nodes(a=2, b=2, c=3), LIM, 52.0, None, now_unix_ms=T)
    assert decision.actions == ()
    assert decision.wake_at == 52.0 + 300.0


def test_a_quarantine_ends_by_the_coordinators_wall_clock_and_the_node_then_joins() -> None:
    formed = RdzvState(round=2, participants=("a", "b"), quarantined=(C,))
    nodes = _nodes(a=2, b=2, c=3)
    before = decide_coordinator(formed, nodes, LIM, 10.0, None, now_unix_ms=T + 299_000)
    assert before.actions == () and before.wake_at == 10.0 + 1.0
    # Its end: the entry goes, and in the same commit c is put on the wait list (the
    # others then re-rendezvous to admit it, as for any newcomer).
    after = decide_coordinator(formed, nodes, LIM, 11.0, None, now_unix_ms=T + 300_000)
    assert after == CoordinatorDecision(
        (Action(K.REMOVE_FROM_QUARANTINE, ("c",)), Action(K.ADD_TO_WAIT_LIST, ("c",))),
        None,
        math.inf,
    )
    assert apply(formed, after.actions).quarantined == ()
    # Without a wall clock (None) nothing ends.
    assert decide_coordinator(formed, nodes, LIM, 11.0, None).actions == ()


def test_a_quarantine_ends_when_the_nodes_key_is_gone() -> None:
    formed = RdzvState(round=2, participants=("a", "b"), quarantined=(C,))
    decision = decide_coordinator(formed, _nodes(a=2, b=2), LIM, 0.0, None, now_unix_ms=T)
    assert decision.actions == (Action(K.REMOVE_FROM_QUARANTINE, ("c",)),)
    assert ended(formed, {"a", "b"}, T) == ("c",)
    assert ended(formed, {"a", "b", "c"}, T) == ()
    assert release_in(formed, T) == 300.0 and release_in(RdzvState(), T) == math.inf


def test_while_forming_a_quarantined_node_is_no_joiner() -> None:
    first = RdzvState(quarantined=(C,))
    decision = decide_coordinator(first, _nodes(a=1, b=1, c=1), LIM, 0.0, None, now_unix_ms=T)
    # Two joiners (min_nodes): last call runs; c would have made it complete at once.
    assert decision.actions == () and decision.last_call_deadline == 10.0
    assert decision.wake_at == 10.0


def test_the_state_codec_keeps_the_quarantine() -> None:
    state = RdzvState(round=3, participants=("a", "b"), quarantined=(C,))
    raw = encode_state(state)
    assert json.loads(raw)["quarantined"] == [
        {
            "node_id": "c",
            "reason": "matmul 3.000 s, 300x the median 0.010 s",
            "until_unix_ms": str(T + 300_000),
            "addr": "10.0.0.3",
        }
    ]
    assert decode_state("k", raw) == state


def test_rdzvctl_shows_quarantined_nodes_with_reason_and_time_left() -> None:
    entry = Quarantine(
        "c-3-0", "matmul 3.000 s, 300x the median 0.010 s", NOW + 272_500, "10.0.0.3"
    )
    state = RdzvState(
        round=ROUND1.round,
        participants=ROUND1.participants[:2],
        completed_at_unix_ms=ROUND1.completed_at_unix_ms,
        quarantined=(entry,),
    )
    snapshot = snap(state, LIVE)
    lines = status_lines(snapshot, NOW, UTC)
    start = lines.index("draining:        -") + 1
    assert lines[start : start + 3] == [
        "quarantined:     1 (left out of the rounds)",
        "  NODE   ADDR      TIME LEFT  REASON",
        "  c-3-0  10.0.0.3  4m33s      matmul 3.000 s, 300x the median 0.010 s",
    ]
    assert node_status(snapshot, "c-3-0") == "quarantined"
    assert status_json(snapshot)["quarantined"] == [
        {
            "node_id": "c-3-0",
            "addr": "10.0.0.3",
            "reason": "matmul 3.000 s, 300x the median 0.010 s",
            "until_unix_ms": NOW + 272_500,
        }
    ]
    # Past its end by this machine's clock, the coordinator's has the last word.
    assert "ending" in status_lines(snapshot, NOW + 300_000, UTC)[start + 2]
    # A run without quarantined nodes shows no such line.
    assert not any(
        line.startswith("quarantined") for line in status_lines(snap(ROUND1, LIVE), NOW, UTC)
    )


def test_rdzvctl_watch_says_when_a_node_is_quarantined_and_released() -> None:
    before = RdzvState(round=2, participants=("a", "b"))
    after = RdzvState(round=2, participants=("a", "b"), quarantined=(C,))
    [change] = diff_states(before, after, 7)
    assert (change.kind, change.text, change.node_id, change.reason) == (
        "quarantined",
        "node c quarantined: matmul 3.000 s, 300x the median 0.010 s",
        "c",
        C.reason,
    )
    [change] = diff_states(after, before, 8)
    assert (change.kind, change.text) == ("released", "node c out of quarantine")
