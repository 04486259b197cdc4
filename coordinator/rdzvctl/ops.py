"""``rdzvctl gc``: garbage-collect finished or abandoned runs.

:func:`gc_verdict` decides, purely, whether a run's keys may go; :func:`collect_run`
removes them through the state's one writer,
:class:`~coordinator.core.executor.StateExecutor` (which ``rdzvctl close`` uses too).

Safety rule of gc: a run with any node key (a live lease) is never touched, and node keys
are never deleted by gc at all: they go only when their lease ends. The run's own lease
(``coordinator.core.run_lease``), which would remove the rest after the retention, is
revoked once the run's keys are gone.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.core.actions import close
from coordinator.core.etcd_client import EtcdClient
from coordinator.core.executor import StateExecutor
from coordinator.core.keys import RunKeys
from coordinator.core.run_lease import bind_existing_run_lease
from coordinator.rdzvctl.model import RunSnapshot

__all__ = [
    "GC_REASON",
    "GcResult",
    "GcVerdict",
    "collect_run",
    "gc_verdict",
]

GC_REASON = "garbage-collected by rdzvctl gc"
"""The closed_reason gc writes while it removes a run that was not closed yet."""


@dataclass(frozen=True)
class GcVerdict:
    """Whether gc may remove a run, and why (the reason is shown to the operator)."""

    run_id: str
    collect: bool
    reason: str
    keys: int  # keys that would go: the state key, the store's keys and the events


def _age(now_ms: int, then_ms: int) -> str:
    seconds = max(0, (now_ms - then_ms) // 1000)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def gc_verdict(snapshot: RunSnapshot, now_ms: int, older_than_ms: int) -> GcVerdict:
    """Decide whether gc may remove ``snapshot``'s run (pure).

    Kept: any node key (a live lease, or an unreadable value we will not judge), an
    unreadable state, a run with only foreign keys, and a run whose last round completed
    less than ``older_than_ms`` ago. Collected: a closed run, or a run with no node alive
    (abandoned), whose last round completed at least ``older_than_ms`` ago, or that never
    completed a round (its age is unknown and nothing in it was ever agreed).

    The age comes from ``closed_at_unix_ms`` (else ``completed_at_unix_ms``), the closer's
    or coordinator's wall clock: clocks of two machines are compared here, so keep the age
    well above their skew.
    """
    run_id = snapshot.run_id
    ours = snapshot.store_keys + snapshot.event_keys + (1 if snapshot.state_mod_revision else 0)

    def keep(reason: str) -> GcVerdict:
        return GcVerdict(run_id, False, reason, ours)

    if snapshot.nodes:
        return keep(f"{len(snapshot.nodes)} node(s) alive")
    if snapshot.errors:
        return keep("a value does not decode: inspect it with etcdctl and remove it by hand")
    if ours == 0:
        return keep(
            f"only {len(snapshot.foreign_keys)} foreign key(s), not written by etcd-elastic: "
            "remove them by hand"
        )
    state = snapshot.effective_state
    what = f"closed ({state.closed_reason})" if state.closed else "abandoned: no node alive"
    if not snapshot.state_mod_revision:
        what = "never formed: no state and no node alive"
    # The age runs from the last thing that happened: the close, else the last completion.
    completed, closed_at = state.completed_at_unix_ms, state.closed_at_unix_ms
    if closed_at > 0 and closed_at >= completed:
        last, young, old = closed_at, "but it was closed only", "it was closed"
    elif completed > 0:
        last, young, old = completed, "but its last round completed only", "last round completed"
    else:
        return GcVerdict(run_id, True, f"{what}, no round ever completed", ours)
    age = _age(now_ms, last)
    if now_ms - last < older_than_ms:
        return keep(f"{what}, {young} {age} ago")
    return GcVerdict(run_id, True, f"{what}, {old} {age} ago", ours)


@dataclass(frozen=True)
class GcResult:
    """What :func:`collect_run` did."""

    run_id: str
    removed: bool
    message: str


def collect_run(client: EtcdClient, snapshot: RunSnapshot, *, written_by: str) -> GcResult:
    """Remove a run's state and store keys, unless it changed since ``snapshot`` was read.

    Steps, each guarded so that a run that came back to life is left alone: (1) in one
    transaction guarded by the state's mod_revision, write the state closed (keeping an
    existing reason) and delete the store and the run's events; from then on a node that
    arrives finds the run closed instead of forming a round whose keys are being deleted;
    (2) if a node key appeared meanwhile, stop (the run stays closed); (3) delete the state
    key guarded by the revision written in (1), and revoke the run's lease (what would
    have removed the run after its retention: nothing is left on it). Node keys are never
    deleted: they belong to live leases.

    Raises:
        CorruptValueError: the state changed to a value we cannot read.
        EtcdConnectionError: etcd did not answer.
    """
    keys: RunKeys = snapshot.keys
    state = snapshot.effective_state
    # A run that comes back to life meanwhile keeps its closed state on its lease.
    run_lease = bind_existing_run_lease(client, keys)
    executor = StateExecutor(client, keys, written_by=written_by)
    first = executor.commit(
        (state, snapshot.state_mod_revision),
        close(state, GC_REASON, "finished"),
        delete_prefixes=[keys.store_root, keys.events_prefix],
    )
    if not first.succeeded:
        return GcResult(snapshot.run_id, False, "skipped: its state changed since it was read")
    alive, _ = client.count_prefix(keys.nodes_prefix)
    if alive:
        return GcResult(
            snapshot.run_id,
            False,
            f"stopped: {alive} node(s) joined while it was being removed; it is left closed",
        )
    if not executor.remove(first.revision):
        return GcResult(snapshot.run_id, False, "stopped: its state changed during removal")
    if run_lease:
        client.lease_revoke(run_lease)
    left = f"; {len(snapshot.foreign_keys)} foreign key(s) left" if snapshot.foreign_keys else ""
    removed = snapshot.store_keys + snapshot.event_keys + 1
    return GcResult(snapshot.run_id, True, f"removed {removed} key(s){left}")
