"""Named invariants over a chaos run's history: what must hold whatever the faults did.

Pure: :func:`check` takes the events of one history file (agents', workers' and the
harness's; see ``agent/observe/journal.py``, ``tests/chaos/worker.py``, ``tests/chaos/events.py``)
and returns every :class:`Violation`, each naming its invariant and the event (its index
in the history and its JSON line). Times are ``mono`` values (one clock per machine).

=============================  ==========================================================
invariant                      what must hold
=============================  ==========================================================
history_complete               every event well-formed; a ``run_start``; in a real run every
                               worker event carries its round, and every round a worker
                               started in was reported by its agent (``round``)
one_membership_per_round       all agents' ``round`` events for round R agree on the members
                               (in group-rank order); each agent is ``members[group_rank]``
ranks_permutation              workers of round R share one world W, their ranks are in
                               0..W-1, each once; a round that stepped had all of them
world_bounds                   min_nodes <= group_world <= max_nodes (agents and workers)
rounds_monotonic               on every agent, completed rounds and started worker groups
                               only move forward
rank0_stable                   group rank 0 moves between consecutive rounds only if its
                               holder left: it is no member of the newer round, or the
                               harness killed, froze or cut it off since one TTL before
                               the older round
no_overlapping_rounds          no collective of round R began after the first step of a
                               newer round completed (see below)
no_orphan_workers              no worker steps more than 1 s after its agent died (SIGKILL
                               sent, or exit seen); no ``orphan_alive`` from the harness
recovery_bound                 after a fault that removes a node, a step of a newer round
                               within TTL + 5 s of its start (when it left fewer than
                               min_nodes agents: within agent_start_s of the start of the
                               agent the job needed, if that is later); after one that
                               restarts workers without removing a node, before the next
                               fault (within TTL + 5 s for the kinds of TIMED_RESTARTS,
                               from each worker kill of ``warm_import_stuck``; from the
                               grant's return for ``etcd_role_revoked``)
no_restart_without_node_loss   from a fault that removes no node until the next fault: no
                               ``workers_stopped``, no newer ``round``, no ``worker_start``
quiet_while_refused            the same, from the role's revocation in ``etcd_role_revoked``
                               until its worker kill (training needs no etcd)
no_agent_gives_up              no agent exits unless the harness stopped it
worker_checks                  no worker recorded a ``violation`` (its all_gather check)
run_complete                   every planned fault ran, the job got back to full size after
                               each one, the harness reported no error of its own
=============================  ==========================================================

The overlap rule is exact, without a time tolerance: a step records ``begin``, the
monotonic time just before its collective started, and ``mono`` when it ended. A
collective needs every rank of its round, so one that *began* after a newer round
completed a step proves both groups trained at once. A step that began before and
ended after (a collective in flight while the newer round formed) is allowed: it says
nothing about the old group still being alive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from tests.chaos import events as ev
from tests.chaos import invariants
from tests.chaos.history_view import History
from tests.chaos.invariants_refused import quiet_while_refused
from tests.chaos.verdict import CheckConfig, Violation, at

__all__ = ["INVARIANTS", "CheckConfig", "Violation", "check", "format_violations"]


def _history_complete(h: History, cfg: CheckConfig) -> Iterator[Violation]:
    name = "history_complete"
    if h.malformed:
        first = h.malformed[0]
        yield at(name, first, f"{len(h.malformed)} events lack a numeric mono or a name")
    if h.run_start() is None:
        yield Violation(name, "no run_start event: not a harness-made history")
    if not cfg.require_rounds:
        return
    workers = h.of(ev.WORKER_START, ev.STEP)
    unknown = [w for w in workers if w.int_field("round") < 0]
    if unknown:
        yield at(
            name,
            unknown[0],
            f"{len(unknown)} of {len(workers)} worker events carry no round: the agent does "
            "not set ETCD_ELASTIC_ROUND (and ETCD_ELASTIC_NODE_ID) for its workers",
        )
    numberless = [r for r in h.of(ev.ROUND) if r.int_field("round") < 0]
    if numberless:
        yield at(
            name,
            numberless[0],
            f"{len(numberless)} agent `round` events carry no round number (or members): "
            "the rendezvous handler does not tell the agent which round completed",
        )
    reported = {(r.int_field("pid"), r.int_field("round")) for r in h.of(ev.ROUND)}
    missing = [
        w
        for w in h.of(ev.WORKER_START)
        if w.int_field("round") >= 0
        and (w.int_field("agent_pid"), w.int_field("round")) not in reported
    ]
    if missing:
        yield at(
            name,
            missing[0],
            f"{len(missing)} workers started in rounds their agent never reported: the agent "
            "writes no `round` events to ETCD_ELASTIC_JOURNAL",
        )


def _no_agent_gives_up(h: History, cfg: CheckConfig) -> Iterator[Violation]:
    stopped = {k.int_field("agent_pid") for k in h.of(ev.AGENT_KILLED)}
    for item in h.judged(h.of(ev.AGENT_EXITED)):
        if item.int_field("agent_pid") not in stopped:
            yield at(
                "no_agent_gives_up",
                item,
                f"agent pid {item.int_field('agent_pid')} exited "
                f"with code {item.event.get('code')} on its own",
            )


def _worker_checks(h: History, cfg: CheckConfig) -> Iterator[Violation]:
    for item in h.of(ev.VIOLATION):
        yield at(
            "worker_checks",
            item,
            f"worker rank {item.event.get('rank')} of round "
            f"{item.event.get('round')}: {item.event.get('what')}",
        )


def _run_complete(h: History, cfg: CheckConfig) -> Iterator[Violation]:
    name = "run_complete"
    ends = h.of(ev.RUN_END)
    if not ends:
        yield Violation(name, "no run_end event: the harness did not finish the run")
    for end in ends:
        planned, done = end.int_field("planned"), end.int_field("executed")
        aborted = str(end.event.get("aborted") or "")
        if planned != done or aborted:
            yield at(
                name,
                end,
                f"{done} of {planned} planned faults ran"
                + (f"; aborted: {aborted}" if aborted else ""),
            )
    for item in h.of(ev.HARNESS_ERROR, "settle_timeout"):
        yield at(name, item, f"{item.name}: {item.event.get('what')}")


_CHECKS: dict[str, Callable[[History, CheckConfig], Iterator[Violation]]] = {
    "history_complete": _history_complete,
    "one_membership_per_round": invariants.one_membership_per_round,
    "ranks_permutation": invariants.ranks_permutation,
    "world_bounds": invariants.world_bounds,
    "rounds_monotonic": invariants.rounds_monotonic,
    "rank0_stable": invariants.rank0_stable,
    "no_overlapping_rounds": invariants.no_overlapping_rounds,
    "no_orphan_workers": invariants.no_orphan_workers,
    "recovery_bound": invariants.recovery_bound,
    "no_restart_without_node_loss": invariants.no_restart_without_node_loss,
    "quiet_while_refused": quiet_while_refused,
    "no_agent_gives_up": _no_agent_gives_up,
    "worker_checks": _worker_checks,
    "run_complete": _run_complete,
}
INVARIANTS: tuple[str, ...] = tuple(_CHECKS)


def check(
    events: Sequence[Mapping[str, Any]],
    config: CheckConfig | None = None,
    *,
    only: Sequence[str] = INVARIANTS,
) -> list[Violation]:
    """Every violation of the invariants named in ``only`` (default: all), in order.

    Args:
        events: the history, as :func:`agent.observe.journal.read_journal` returns it.
        config: the bounds; default: from the history's ``run_start`` (without one,
            ``history_complete`` fails and the node bounds are not checked).

    Raises:
        ValueError: an unknown invariant in ``only``.
    """
    unknown = [n for n in only if n not in _CHECKS]
    if unknown:
        raise ValueError(f"unknown invariants {unknown}; known: {', '.join(INVARIANTS)}")
    history = History(events)
    cfg = config or CheckConfig.from_history(history) or CheckConfig(1, 1 << 30, 5.0)
    return [v for name in only for v in _CHECKS[name](history, cfg)]


def format_violations(violations: Sequence[Violation], per_invariant: int = 5) -> str:
    """The violations grouped by invariant, at most ``per_invariant`` of each shown."""
    if not violations:
        return "violations: none"
    lines = [f"violations: {len(violations)}"]
    for name in dict.fromkeys(v.invariant for v in violations):
        group = [v for v in violations if v.invariant == name]
        lines.append(f"  {name}: {len(group)}")
        lines += ["    " + str(v).replace("\n", "\n    ") for v in group[:per_invariant]]
        if len(group) > per_invariant:
            lines.append(f"    ... and {len(group) - per_invariant} more")
    return "\n".join(lines)
