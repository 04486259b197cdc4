"""The writes ``rdzvctl`` makes: close a run, and garbage-collect finished or abandoned ones.

:func:`close_run` is the revision-guarded close that any closer can share (the handler's
``set_closed`` does the same steps from its watched view). :func:`gc_verdict` decides,
purely, whether a run's keys may go; :func:`collect_run` removes them with guarded
writes. Safety rule of gc: a run with any node key (a live lease) is never touched, and
node keys are never deleted by gc at all: they go only when their lease ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.errors import RendezvousError
from coordinator.etcd_client import EtcdClient, KeyValue
from coordinator.keys import RunKeys
from coordinator.rdzvctl_model import RunSnapshot
from coordinator.state import RdzvState, decode_state, encode_state
from coordinator.transitions import apply, close

__all__ = [
    "GC_REASON",
    "CloseOutcome",
    "GcResult",
    "GcVerdict",
    "close_run",
    "collect_run",
    "gc_verdict",
]

GC_REASON = "garbage-collected by rdzvctl gc"
"""The closed_reason gc writes while it removes a run that was not closed yet."""


@dataclass(frozen=True)
class CloseOutcome:
    """What :func:`close_run` left in etcd.

    Attributes:
        state: the closed state now stored.
        mod_revision: its mod_revision.
        changed: False when the run was closed already (nothing was written).
    """

    state: RdzvState
    mod_revision: int
    changed: bool


def _decode_current(state_key: bytes, kv: KeyValue | None) -> tuple[RdzvState, int]:
    if kv is None:
        return RdzvState(), 0
    return decode_state(state_key.decode(), kv.value), kv.mod_revision


def close_run(
    client: EtcdClient,
    state_key: bytes,
    reason: str,
    *,
    written_by: str,
    timeout: float,
    known: tuple[RdzvState, int] | None = None,
    on_conflict: Callable[[KeyValue | None, int], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> CloseOutcome:
    """Close the run whose state is at ``state_key``: compare-and-swap until it sticks.

    Each attempt applies :func:`coordinator.transitions.close` to the state last seen and
    writes it guarded by that state's mod_revision; a lost race returns the winner's
    value in the same round trip and the next attempt starts from it. A run whose state
    key is absent (nothing formed yet) gets a closed state, so late joiners fail at once.

    Args:
        reason: stored as ``closed_reason`` and shown to every node that finds the run
            closed.
        written_by: stored as ``written_by`` (who closed it).
        timeout: seconds to keep retrying while the state keeps changing.
        known: the state and mod_revision the caller already holds (saves a read).
        on_conflict: told of the current value after each lost race (e.g. a watched view).
        clock: monotonic seconds.

    Raises:
        CorruptValueError: the state key holds a value we cannot read (names the key).
        RendezvousError: the state kept changing for ``timeout`` seconds.
        EtcdConnectionError: etcd did not answer.
    """
    deadline = clock() + timeout
    if known is None:
        kv, _ = client.get(state_key)
        known = _decode_current(state_key, kv)
    state, mod_revision = known
    while True:
        actions = close(state, reason)
        if not actions:
            return CloseOutcome(state, mod_revision, changed=False)
        new = apply(state, actions, written_by=written_by)
        result = client.put_if_mod_revision(state_key, encode_state(new), mod_revision)
        if result.succeeded:
            return CloseOutcome(new, result.revision, changed=True)
        if on_conflict is not None:
            on_conflict(result.current, result.revision)
        state, mod_revision = _decode_current(state_key, result.current)
        if clock() > deadline:
            raise RendezvousError(
                f"could not close {state_key.decode()!r} within {timeout:g} s: "
                "the state kept changing; try again"
            )


@dataclass(frozen=True)
class GcVerdict:
    """Whether gc may remove a run, and why (the reason is shown to the operator)."""

    run_id: str
    collect: bool
    reason: str
    keys: int  # keys that would go: the state key and the store's keys


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

    The age comes from ``completed_at_unix_ms``, the coordinator's wall clock: clocks of
    the two machines are compared here, so keep the age well above their skew.
    """
    run_id = snapshot.run_id
    ours = snapshot.store_keys + (1 if snapshot.state_mod_revision else 0)

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
    completed = state.completed_at_unix_ms
    if completed <= 0:
        return GcVerdict(run_id, True, f"{what}, no round ever completed", ours)
    age = _age(now_ms, completed)
    if now_ms - completed < older_than_ms:
        return keep(f"{what}, but its last round completed only {age} ago")
    return GcVerdict(run_id, True, f"{what}, last round completed {age} ago", ours)


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
    existing reason) and delete the store; from then on a node that arrives finds the run
    closed instead of forming a round whose keys are being deleted; (2) if a node key
    appeared meanwhile, stop (the run stays closed); (3) delete the state key guarded by
    the revision written in (1). Node keys are never deleted: they belong to live leases.

    Raises:
        CorruptValueError: the state changed to a value we cannot read.
        EtcdConnectionError: etcd did not answer.
    """
    keys: RunKeys = snapshot.keys
    state = snapshot.effective_state
    closed = apply(state, close(state, GC_REASON), written_by=written_by)
    first = client.put_if_mod_revision(
        keys.state,
        encode_state(closed),
        snapshot.state_mod_revision,
        also_delete_prefixes=[keys.store_root],
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
    second = client.delete_if_mod_revision(keys.state, first.revision)
    if not second.succeeded:
        return GcResult(snapshot.run_id, False, "stopped: its state changed during removal")
    left = f"; {len(snapshot.foreign_keys)} foreign key(s) left" if snapshot.foreign_keys else ""
    return GcResult(snapshot.run_id, True, f"removed {snapshot.store_keys + 1} key(s){left}")
