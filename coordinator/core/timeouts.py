"""How the timeouts nest: the combinations that cannot work, and those that are risky.

A dozen timeouts bound what a job waits for; each is right only relative to others (a
join must outlast a dead node's key, a hang must be declared before torch's collectives
give up, the workers' grace must end before the scheduler's). :func:`nesting` checks one
combination and returns a :class:`Finding` per broken rule, each one line naming both
values. ``docs/timeouts.md`` holds the table of every timeout, its default and the
order; the rules here are that table's checkable part. Pure: no I/O, no clock.

Who asks: the rendezvous settings refuse a combination of their own keys that cannot
work (so stock torchrun is refused too), and ``etcdrun`` checks every value at start,
refusing with exit 2 and warning about the risky ones.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "RENEWALS_PER_SECOND_ADVISED",
    "SCHEDULER_GRACE_S",
    "TORCH_COLLECTIVE_TIMEOUT_S",
    "Finding",
    "Spans",
    "advised_lease_ttl",
    "nesting",
]

SCHEDULER_GRACE_S = 30.0
"""Kubernetes' default ``terminationGracePeriodSeconds`` and Slurm's default ``KillWait``:
after it, the scheduler SIGKILLs the agent and its workers."""

TORCH_COLLECTIVE_TIMEOUT_S = 600.0
"""torch's default process-group timeout for NCCL (10 minutes; gloo's is 30): a stuck
collective fails the workers after it, whatever the agent does."""

RENEWALS_PER_SECOND_ADVISED = 1000.0
"""Lease renewals a second above which etcd's leader spends a noticeable share of its CPU
on them (every renewal lands on the leader; 1,500/s cost a leader 20 % of a core in a
reported incident, etcd issue 18069). Each node renews about 3 times per TTL."""


@dataclass(frozen=True)
class Spans:
    """The timeouts of one node, in seconds (None: that feature is off)."""

    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    store_timeout: float = 900.0
    lease_ttl: float = 5.0
    min_nodes: int = 1
    max_nodes: int = 1
    hang_timeout: float | None = None
    health_check_timeout: float | None = None
    shutdown_timeout: float = 5.0


@dataclass(frozen=True)
class Finding:
    """One broken rule: ``refuse`` (cannot work) or a warning (risky), in one line."""

    refuse: bool
    first: str  # the setting named first in the line (a flag or an rdzv_conf key)
    line: str


def advised_lease_ttl(max_nodes: int) -> int:
    """The smallest of 5, 10, 15, 30 s at which ``max_nodes`` nodes renew at most
    :data:`RENEWALS_PER_SECOND_ADVISED` times a second (about 3 renewals per TTL each)."""
    for ttl in (5, 10, 15, 30):
        if 3 * max_nodes / ttl <= RENEWALS_PER_SECOND_ADVISED:
            return ttl
    return 60


def _g(value: float) -> str:
    return f"{value:g}"


def nesting(s: Spans) -> list[Finding]:
    """Every rule ``s`` breaks, refusals first. See ``docs/timeouts.md``."""
    found: list[Finding] = []
    if s.min_nodes < s.max_nodes and s.last_call_timeout >= s.join_timeout:
        found.append(Finding(True, "last_call_timeout", (
            f"last_call_timeout={_g(s.last_call_timeout)} must be less than "
            f"join_timeout={_g(s.join_timeout)}: with fewer than {s.max_nodes} nodes a "
            "round forms only when its last call ends, and every join would time out "
            "first; raise join_timeout or lower last_call_timeout"
        )))  # fmt: skip
    if s.join_timeout <= 2 * s.lease_ttl:
        found.append(Finding(False, "join_timeout", (
            f"join_timeout={_g(s.join_timeout)} is not above twice lease_ttl="
            f"{_g(s.lease_ttl)}: a join that waits for a dead node's key to expire may "
            "time out first; give join_timeout well above lease_ttl"
        )))  # fmt: skip
    if s.store_timeout <= s.lease_ttl + 1:
        found.append(Finding(False, "timeout", (
            f"timeout={_g(s.store_timeout)} (the Store's blocking waits) is not above "
            f"lease_ttl={_g(s.lease_ttl)} + 1 s: a rank exchange or exit barrier waiting on "
            "a node that died ends in a store timeout before its loss is noticed; raise "
            "timeout"
        )))  # fmt: skip
    renewals = 3 * s.max_nodes / s.lease_ttl
    if renewals > RENEWALS_PER_SECOND_ADVISED:
        found.append(Finding(False, "lease_ttl", (
            f"lease_ttl={_g(s.lease_ttl)} with up to {s.max_nodes} nodes renews about "
            f"{renewals:.0f} leases a second on etcd's leader (above "
            f"{RENEWALS_PER_SECOND_ADVISED:.0f}/s it spends noticeable CPU on them); use "
            f"lease_ttl={advised_lease_ttl(s.max_nodes)} or more (docs/scale.md)"
        )))  # fmt: skip
    if s.hang_timeout is not None:
        if s.hang_timeout <= s.lease_ttl:
            found.append(Finding(False, "--hang-timeout", (
                f"--hang-timeout={_g(s.hang_timeout)} is not above lease_ttl="
                f"{_g(s.lease_ttl)}: a node that freezes would be declared hung (a counted "
                "restart on every node) before its lease ends (a re-formation without it, "
                "not counted); give --hang-timeout above lease_ttl"
            )))  # fmt: skip
        if s.hang_timeout >= TORCH_COLLECTIVE_TIMEOUT_S:
            found.append(Finding(False, "--hang-timeout", (
                f"--hang-timeout={_g(s.hang_timeout)} is not below torch's default "
                f"collective timeout of {_g(TORCH_COLLECTIVE_TIMEOUT_S)} s (NCCL): a stuck "
                "collective may fail the workers first, and no node is named; keep it "
                "below init_process_group(timeout=...)"
            )))  # fmt: skip
    if s.health_check_timeout is not None and s.health_check_timeout >= s.join_timeout:
        found.append(Finding(False, "--health-check-timeout", (
            f"--health-check-timeout={_g(s.health_check_timeout)} is not below "
            f"join_timeout={_g(s.join_timeout)}: nodes that arrive during a pre-flight "
            "check wait for it to end and may time out their join; raise join_timeout"
        )))  # fmt: skip
    if s.shutdown_timeout >= SCHEDULER_GRACE_S:
        found.append(Finding(False, "--shutdown-timeout", (
            f"--shutdown-timeout={_g(s.shutdown_timeout)} is not below the schedulers' "
            f"default grace of {_g(SCHEDULER_GRACE_S)} s (Kubernetes' "
            "terminationGracePeriodSeconds, Slurm's KillWait): the scheduler may kill the "
            "workers before they finish; keep it below your scheduler's grace"
        )))  # fmt: skip
    return sorted(found, key=lambda f: not f.refuse)
