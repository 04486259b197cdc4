"""What ``etcd_role_revoked`` holds the job to (see checker.py): etcd refusing the agents'
role for a while, a worker dying meanwhile.

A healthy job needs nothing of etcd but its keep-alives, which a revoked permission does
not touch: from the revocation until the worker dies, nothing may restart
(:func:`quiet_while_refused`). The nodes then re-form while etcd refuses them; each one
had the permission (it wrote its key), so it waits for the grant instead of giving up
(``no_agent_gives_up``), and once the grant is back the job trains in a newer round
within TTL + slack (:func:`trained_after_grant`, part of ``recovery_bound``).

Pure, like the other invariants.
"""

from __future__ import annotations

from collections.abc import Iterator

from tests.chaos import events as ev
from tests.chaos.history_view import FaultSpan, History, Indexed
from tests.chaos.scheduler import ROLE_REFUSED
from tests.chaos.verdict import CheckConfig, Violation, at

__all__ = ["quiet_while_refused", "trained_after_grant"]


def _first_in(h: History, span: FaultSpan, name: str) -> Indexed | None:
    """The first ``name`` event of the harness within ``span``."""
    return next((e for e in h.of(name) if span.start_mono <= e.mono <= span.end_mono), None)


def quiet_while_refused(h: History, cfg: CheckConfig) -> Iterator[Violation]:
    """From the role's revocation until the fault's worker kill: no ``workers_stopped``,
    no newer ``round``, no ``worker_start`` (training needs no etcd)."""
    restarts = h.judged(h.of(ev.WORKERS_STOPPED, ev.ROUND, ev.WORKER_START))
    for span in h.faults():
        if span.kind != ROLE_REFUSED:
            continue
        revoked = _first_in(h, span, ev.ROLE_REVOKED)
        if revoked is None:
            continue  # the harness could not revoke it: run_complete says so
        killed = _first_in(h, span, ev.WORKER_KILLED)
        until = killed.mono if killed is not None else span.end_mono
        before = h.last_round_before(revoked.mono)
        for item in restarts:
            if not revoked.mono <= item.mono < until:
                continue
            if item.name == ev.ROUND and 0 <= item.int_field("round") <= before:
                continue  # a late report of a round that already trained
            yield at(
                "quiet_while_refused",
                item,
                f"{item.name} {item.mono - revoked.mono:.2f} s after etcd_role_revoked "
                f"(fault #{span.start.int_field('index')}) revoked the role, before any "
                "worker died: a job that trains needs nothing of etcd a role grants",
            )
            break


def trained_after_grant(h: History, cfg: CheckConfig, span: FaultSpan) -> Iterator[Violation]:
    """A step of a newer round than the fault's start saw, within TTL + slack of the
    grant's return (nothing can re-form before it)."""
    granted = _first_in(h, span, ev.ROLE_GRANTED)
    since = granted.mono if granted is not None else span.start_mono
    took = h.recovery(span)
    after = None if took is None else max(0.0, span.start_mono + took - since)
    bound = cfg.lease_ttl + cfg.recovery_slack_s
    if after is None or after > bound:
        seen = "never" if after is None else f"{after:.2f} s after the grant"
        yield at(
            "recovery_bound",
            span.start,
            f"{ROLE_REFUSED}: a newer round trained {seen}; bound TTL {cfg.lease_ttl:g} + "
            f"{cfg.recovery_slack_s:g} = {bound:g} s from the grant",
        )
