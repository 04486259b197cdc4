"""Closing a run: one revision-guarded write that every closer shares.

The handler's ``set_closed``/``shutdown`` and ``rdzvctl close``/``gc`` all close through
:func:`close_run`, so the run is closed exactly one way: compare-and-swap on the state
key's mod_revision until it sticks, the failure branch returning the winner's value.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.errors import RendezvousError
from coordinator.etcd_client import EtcdClient, KeyValue
from coordinator.state import CloseMode, RdzvState, decode_state, encode_state
from coordinator.transitions import apply, close

__all__ = ["CloseOutcome", "close_run", "decode_current"]


def decode_current(state_key: bytes, kv: KeyValue | None) -> tuple[RdzvState, int]:
    """The state and mod_revision in ``kv`` (absent key: the initial state, revision 0)."""
    if kv is None:
        return RdzvState(), 0
    return decode_state(state_key.decode(), kv.value), kv.mod_revision


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


def close_run(
    client: EtcdClient,
    state_key: bytes,
    reason: str,
    *,
    mode: CloseMode = "finished",
    written_by: str,
    timeout: float,
    known: tuple[RdzvState, int] | None = None,
    on_conflict: Callable[[KeyValue | None, int], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
) -> CloseOutcome:
    """Close the run whose state is at ``state_key``: compare-and-swap until it sticks.

    Each attempt applies :func:`coordinator.transitions.close` to the state last seen and
    writes it guarded by that state's mod_revision; a lost race returns the winner's
    value in the same round trip and the next attempt starts from it. A run whose state
    key is absent (nothing formed yet) gets a closed state, so late joiners fail at once.

    Args:
        reason: stored as ``closed_reason`` and shown to every node that finds the run
            closed.
        mode: what agents still running should do (``finished``, ``failed``, ``drain``).
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
        known = decode_current(state_key, kv)
    state, mod_revision = known
    while True:
        actions = close(state, reason, mode)
        if not actions:
            return CloseOutcome(state, mod_revision, changed=False)
        new = apply(state, actions, written_by=written_by, now_unix_ms=wall_ms())
        result = client.put_if_mod_revision(state_key, encode_state(new), mod_revision)
        if result.succeeded:
            return CloseOutcome(new, result.revision, changed=True)
        if on_conflict is not None:
            on_conflict(result.current, result.revision)
        state, mod_revision = decode_current(state_key, result.current)
        if clock() > deadline:
            raise RendezvousError(
                f"could not close {state_key.decode()!r} within {timeout:g} s: "
                "the state kept changing; try again"
            )
