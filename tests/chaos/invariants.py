"""The invariants of rounds, ranks and workers over a chaos history (see checker.py).

Each takes the :class:`~tests.chaos.history_view.History` and the run's
:class:`~tests.chaos.verdict.CheckConfig` and yields its violations; pure.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from tests.chaos import events as ev
from tests.chaos.history_view import FaultSpan, History, Indexed
from tests.chaos.invariants_refused import trained_after_grant
from tests.chaos.scheduler import ROLE_REFUSED, TIMED_RESTARTS
from tests.chaos.verdict import CheckConfig, Violation, at, str_list

__all__ = [
    "no_orphan_workers",
    "no_overlapping_rounds",
    "no_restart_without_node_loss",
    "one_membership_per_round",
    "rank0_stable",
    "ranks_permutation",
    "recovery_bound",
    "rounds_monotonic",
    "world_bounds",
]


def one_membership_per_round(h: History, cfg: CheckConfig) -> Iterator[Violation]:
    """All agents' ``round`` events of a round agree; each agent is members[group_rank]."""
    name = "one_membership_per_round"
    first: dict[int, Indexed] = {}
    for item in h.of(ev.ROUND):
        round_ = item.int_field("round")
        if round_ < 0:
            continue  # no round number: history_complete says so
        members = str_list(item.event.get("members"))
        seen = first.setdefault(round_, item)
        agreed = str_list(seen.event.get("members"))
        if members != agreed:
            yield at(
                name,
                item,
                f"round {round_}: members {members} here, {agreed} at event #{seen.index}",
            )
            continue
        rank, world, node = (
            item.int_field("group_rank"),
            item.int_field("group_world"),
            str(item.event.get("node")),
        )
        if world != len(members) or not 0 <= rank < len(members) or members[rank] != node:
            yield at(
                name,
                item,
                f"round {round_}: node {node} reports group rank {rank} of {world}, but the "
                f"members are {members}",
            )


def ranks_permutation(h: History, cfg: CheckConfig) -> Iterator[Violation]:
    """Workers of a round share one world W, ranks 0..W-1 once each (all, if it stepped)."""
    name = "ranks_permutation"
    by_round: dict[int, list[Indexed]] = {}
    for item in h.of(ev.WORKER_START):
        if item.int_field("round") >= 0:
            by_round.setdefault(item.int_field("round"), []).append(item)
    stepped = {s.int_field("round"): s for s in reversed(h.steps)}
    for round_, starts in sorted(by_round.items()):
        world = starts[0].int_field("world")
        ranks: dict[int, Indexed] = {}
        for item in starts:
            rank = item.int_field("rank")
            if item.int_field("world") != world:
                yield at(
                    name,
                    item,
                    f"round {round_}: world {item.int_field('world')} "
                    f"here, {world} at event #{starts[0].index}",
                )
            elif not 0 <= rank < world:
                yield at(name, item, f"round {round_}: rank {rank} outside 0..{world - 1}")
            elif rank in ranks:
                yield at(
                    name,
                    item,
                    f"round {round_}: rank {rank} started twice (event #{ranks[rank].index} too)",
                )
            else:
                ranks[rank] = item
        if round_ in stepped and sorted(ranks) != list(range(world)):
            yield at(
                name,
                stepped[round_],
                f"round {round_} trained with ranks {sorted(ranks)} started, not 0..{world - 1}",
            )


def world_bounds(h: History, cfg: CheckConfig) -> Iterator[Violation]:
    """Every group, as agents and workers saw it, has min_nodes..max_nodes nodes."""
    for item in h.of(ev.ROUND, ev.WORKER_START):
        world = item.int_field("group_world")
        if item.name == ev.WORKER_START and world < 0:
            continue
        if not cfg.min_nodes <= world <= cfg.max_nodes:
            yield at(
                "world_bounds",
                item,
                f"group of {world} nodes outside --nnodes={cfg.min_nodes}:{cfg.max_nodes}",
            )


def rounds_monotonic(h: History, cfg: CheckConfig) -> Iterator[Violation]:
    """Per agent: completed rounds and started worker groups never go back."""
    name = "rounds_monotonic"
    last: dict[tuple[str, int], int] = {}
    for item in h.of(ev.ROUND, ev.WORKERS_STARTED, ev.WORKER_START):
        round_ = item.int_field("round")
        if round_ < 0:
            continue
        is_worker = item.name == ev.WORKER_START
        agent = item.int_field("agent_pid") if is_worker else item.int_field("pid")
        key = (item.name, agent)
        before = last.get(key)
        # Two workers of one agent start in the same round; an agent completes a round
        # and starts its group once per round.
        if before is not None and (round_ < before or (round_ == before and not is_worker)):
            yield at(
                name, item, f"agent pid {agent}: {item.name} of round {round_} after round {before}"
            )
        last[key] = max(round_, before if before is not None else round_)


def _left(h: History, cfg: CheckConfig, pid: int, lo: float, hi: float) -> bool:
    """Whether the harness killed, froze, stopped or cut off agent ``pid`` in [lo, hi], or
    deleted the node keys (to the coordinator a node without a key has left, whether its
    lease ended or an operator deleted it; the others may re-form before it is back)."""
    for item in h.of(ev.AGENT_KILLED, ev.AGENT_FROZEN, ev.AGENT_EXITED):
        if item.int_field("agent_pid") == pid and lo <= item.mono <= hi:
            return True
    if any(lo <= item.mono <= hi for item in h.of(ev.KEYS_DELETED)):
        return True
    return any(f.removes_node and pid in f.pids and lo <= f.start_mono <= hi for f in h.faults())


def rank0_stable(h: History, cfg: CheckConfig) -> Iterator[Violation]:
    """Group rank 0 moves between consecutive rounds only if its holder left."""
    first: dict[int, Indexed] = {}
    for item in h.of(ev.ROUND):
        first.setdefault(item.int_field("round"), item)
    pid_of = {str(r.event.get("node")): r.int_field("pid") for r in h.of(ev.ROUND)}
    rounds = sorted(r for r in first if r >= 0)
    for older, newer in itertools.pairwise(rounds):
        old_members = str_list(first[older].event.get("members"))
        new_members = str_list(first[newer].event.get("members"))
        if not old_members or not new_members or old_members[0] == new_members[0]:
            continue
        holder = old_members[0]
        if holder not in new_members:
            continue
        # A fault injected up to one TTL before the older round completed takes effect
        # (the lease expires) only after it.
        lo = first[older].mono - cfg.lease_ttl
        if _left(h, cfg, pid_of.get(holder, -1), lo, first[newer].mono):
            continue
        yield at(
            "rank0_stable",
            first[newer],
            f"rank 0 moved from {holder} (round {older}) to {new_members[0]} (round {newer}) "
            f"although {holder} stayed a member and did not leave",
        )


def no_overlapping_rounds(h: History, cfg: CheckConfig) -> Iterator[Violation]:
    """No collective of a round begins after a newer round's first step completed."""
    first_step: dict[int, Indexed] = {}
    for step in h.steps:
        first_step.setdefault(step.int_field("round"), step)
    rounds = sorted(r for r in first_step if r >= 0)
    # For each round, the earliest first step of any newer round.
    newer_first: dict[int, Indexed] = {}
    best: Indexed | None = None
    for round_ in reversed(rounds):
        if best is not None:
            newer_first[round_] = best
        if best is None or first_step[round_].mono < best.mono:
            best = first_step[round_]
    reported: set[int] = set()
    for step in h.steps:
        round_ = step.int_field("round")
        newer = newer_first.get(round_)
        if newer is None or round_ in reported:
            continue
        began = float(step.event.get("begin", step.mono))
        if began > newer.mono:
            reported.add(round_)
            yield at(
                "no_overlapping_rounds",
                step,
                f"a collective of round {round_} began {began - newer.mono:.3f} s after round "
                f"{newer.int_field('round')} completed its first step (event #{newer.index})",
            )


def no_orphan_workers(h: History, cfg: CheckConfig) -> Iterator[Violation]:
    """No worker steps more than ``orphan_grace_s`` after its agent died."""
    name = "no_orphan_workers"
    death: dict[int, Indexed] = {}
    for item in h.of(ev.AGENT_KILLED, ev.AGENT_EXITED):
        if item.name == ev.AGENT_KILLED and item.event.get("signal") != "SIGKILL":
            continue  # a SIGTERMed agent stops its workers first: its exit counts
        death.setdefault(item.int_field("agent_pid"), item)
    reported: set[int] = set()
    for step in h.steps:
        worker = step.int_field("pid")
        died = death.get(h.agent_of_worker(worker))
        if died is None or worker in reported:
            continue
        if step.mono > died.mono + cfg.orphan_grace_s:
            reported.add(worker)
            yield at(
                name,
                step,
                f"worker pid {worker} stepped {step.mono - died.mono:.2f} s "
                f"after its agent died (event #{died.index})",
            )
    for item in h.of(ev.ORPHAN_ALIVE):
        yield at(
            name,
            item,
            f"worker pid {item.int_field('worker_pid')} still ran "
            f"{item.event.get('after_s')} s after its agent died",
        )


# Second faults that re-arm every lease: etcd's new leader extends each lease by its TTL
# when it takes over (etcd's lessor "promote"), so a node lost just before is declared
# lost one TTL after the election, whatever the clients do.
_REARMS_LEASES = ("etcd_leader_kill", "etcd_cluster_restart")


def _rearmed_at(h: History, span: FaultSpan) -> float:
    """Seconds into ``span`` at which its second fault re-armed every lease (a formation
    fault whose second fault is an etcd leader kill: its ``trigger``); 0 otherwise."""
    if span.kind != "formation_fault" or span.start.event.get("inner") not in _REARMS_LEASES:
        return 0.0
    index = span.start.int_field("index")
    for trigger in h.of(ev.TRIGGER):
        if trigger.int_field("index") == index and trigger.mono >= span.start_mono:
            return trigger.mono - span.start_mono
    return 0.0


def _refilled_at(h: History, cfg: CheckConfig, span: FaultSpan) -> float | None:
    """Seconds into ``span`` at which the harness started the agent that brought the job
    back to ``min_nodes``, when the fault left fewer alive (a formation fault whose
    second fault killed a second agent of three): no round can train before a new agent
    joins, so the bound counts from its start. None when enough survived (or the number
    of agents is unknown)."""
    if cfg.agents <= 0:
        return None
    gone = {
        k.int_field("agent_pid"): k
        for k in h.of(ev.AGENT_KILLED)
        if span.start_mono <= k.mono <= span.end_mono
    }
    short = cfg.min_nodes - (cfg.agents - len(gone))
    if short <= 0:
        return None
    last = max(k.mono for k in gone.values())
    starts = [a for a in h.of(ev.AGENT_STARTED) if a.mono >= last]
    # Never started: the bound is the last kill's, and the recovery (none) fails it.
    return (starts[short - 1].mono if len(starts) >= short else last) - span.start_mono


def _timed_restart(h: History, cfg: CheckConfig, span: FaultSpan) -> Iterator[Violation]:
    """A restart of :data:`TIMED_RESTARTS` trains again within TTL + slack: from the
    fault's start, and for ``warm_import_stuck`` from each of its worker kills."""
    bound = cfg.lease_ttl + cfg.recovery_slack_s
    if span.kind != "warm_import_stuck":
        points = [(span.start, h.recovery(span))]
    else:
        kills = h.of(ev.WORKER_KILLED)
        points = [
            (k, h.first_start_step(k.mono))
            for k in kills
            if span.start_mono <= k.mono <= span.end_mono
        ]
    for item, took in points:
        if took is None or took > bound:
            seen = "never" if took is None else f"after {took:.2f} s"
            yield at(
                "recovery_bound",
                item,
                f"{span.kind}: the job trained again {seen}; bound TTL {cfg.lease_ttl:g} + "
                f"{cfg.recovery_slack_s:g} = {bound:g} s",
            )


def recovery_bound(h: History, cfg: CheckConfig) -> Iterator[Violation]:
    """A disruptive fault is followed by training in a newer round, in time: TTL + slack
    after a fault that removes a node (counted from the second fault when that one
    re-armed every lease: :func:`_rearmed_at`; when it left fewer than ``min_nodes``
    agents, at least ``agent_start_s`` after the harness started the agent the job
    needed: :func:`_refilled_at`) and after a restart of :data:`TIMED_RESTARTS`; from
    the grant's return after ``etcd_role_revoked``."""
    faults = h.faults()
    for i, span in enumerate(faults):
        if not span.disruptive:
            continue
        if span.kind in TIMED_RESTARTS:
            yield from _timed_restart(h, cfg, span)
            continue
        if span.kind == ROLE_REFUSED:
            yield from trained_after_grant(h, cfg, span)
            continue
        took = h.recovery(span)
        if span.removes_node:
            rearmed = _rearmed_at(h, span)
            bound = rearmed + cfg.lease_ttl + cfg.recovery_slack_s
            refilled = _refilled_at(h, cfg, span)
            if refilled is not None:
                bound = max(bound, refilled + cfg.agent_start_s)
            if took is None or took > bound:
                seen = "never" if took is None else f"after {took:.2f} s"
                since = f"{rearmed:.2f} s (leases re-armed then) + " if rearmed else ""
                if refilled is not None:
                    why = (
                        f"bound {refilled:.2f} s (the agent the job needed started then) "
                        f"+ {cfg.agent_start_s:g} s, or TTL + slack"
                    )
                else:
                    why = f"bound {since}TTL {cfg.lease_ttl:g} + {cfg.recovery_slack_s:g}"
                yield at(
                    "recovery_bound",
                    span.start,
                    f"{span.kind}: a newer round trained {seen}; {why} = {bound:g} s",
                )
            continue
        limit = faults[i + 1].start_mono if i + 1 < len(faults) else h.end_mono
        if took is None or span.start_mono + took > limit:
            yield at(
                "recovery_bound",
                span.start,
                f"{span.kind}: no newer round trained "
                "before the next fault (or the end of the run)",
            )


def no_restart_without_node_loss(h: History, cfg: CheckConfig) -> Iterator[Violation]:
    """A fault that removes no node costs no restart until the next fault."""
    faults = h.faults()
    restarts = h.judged(h.of(ev.WORKERS_STOPPED, ev.ROUND, ev.WORKER_START))
    for i, span in enumerate(faults):
        if span.disruptive:
            continue
        hi = faults[i + 1].start_mono if i + 1 < len(faults) else h.teardown_mono
        before = h.last_round_before(span.start_mono)
        for item in restarts:
            if not span.start_mono <= item.mono < hi:
                continue
            if item.name == ev.ROUND and 0 <= item.int_field("round") <= before:
                continue  # a late report of a round that already trained: nothing new
            yield at(
                "no_restart_without_node_loss",
                item,
                f"{item.name} {item.mono - span.start_mono:.2f} s after {span.kind} "
                f"(fault #{span.start.int_field('index')}), which removes no node",
            )
            break
