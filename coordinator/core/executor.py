"""The one writer of a run's state key.

Every change to ``<prefix>/<run>/state`` goes through :class:`StateExecutor`, whoever
asks for it: the elected coordinator (round changes), a closing node or ``rdzvctl close``
(the one ``close`` concept, with its modes ``finished``, ``failed`` and ``drain``), and
``rdzvctl gc`` (close, then remove). The state key goes on the run's lease like every key
of the run that no node owns (:mod:`coordinator.core.run_lease`: the writer's client
binds the run's folder to it). Each write is one etcd transaction:

* guarded by the state's mod_revision (0: the key must be absent), so a write decided
  from a stale state never lands;
* for a leader, also *fenced* by its own node key's create revision (etcd's election
  recipe, STYLE 15): a coordinator that froze past its lease and resumed finds its key
  gone or re-created and its write refused, even if the state did not move meanwhile;
* whose failure branch returns the current value, so a lost race costs no extra round
  trip.

Decisions stay pure (:mod:`coordinator.core.transitions`, :mod:`coordinator.core.actions`);
this module only applies them and retries closes. It holds no lock and keeps no state
between calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.core.actions import Action, apply, close
from coordinator.core.commit_events import events_of_commit
from coordinator.core.errors import EtcdElasticError
from coordinator.core.etcd_client import EtcdClient, KeyValue
from coordinator.core.event_log import record_event
from coordinator.core.keys import RunKeys
from coordinator.core.state import CloseMode, RdzvState, decode_state, encode_state
from coordinator.core.store_rounds import round_prefixes

__all__ = ["CloseOutcome", "Commit", "Fence", "StateExecutor", "decode_current"]


def decode_current(state_key: bytes, kv: KeyValue | None) -> tuple[RdzvState, int]:
    """The state and mod_revision in ``kv`` (absent key: the initial state, revision 0)."""
    if kv is None:
        return RdzvState(), 0
    return decode_state(state_key.decode(), kv.value), kv.mod_revision


@dataclass(frozen=True)
class Fence:
    """A leader's guard: its key must still exist with the create revision it led with."""

    key: bytes
    create_revision: int


@dataclass(frozen=True)
class Commit:
    """The outcome of one guarded write.

    Attributes:
        succeeded: the write landed.
        state: on success, the state this write stored; on failure, the state the
            writer started from (the winner's value is ``current``, undecoded).
        revision: the etcd revision after the transaction.
        current: on failure, the state key's value now (None: absent).
        fenced_out: on failure, the writer's fence key is gone or re-created: it no
            longer leads and must not write again from what it knew.
    """

    succeeded: bool
    state: RdzvState
    revision: int
    current: KeyValue | None = None
    fenced_out: bool = False


@dataclass(frozen=True)
class CloseOutcome:
    """What :meth:`StateExecutor.close` left in etcd.

    Attributes:
        state: the closed state now stored.
        mod_revision: its mod_revision.
        changed: False when the run was closed already (nothing was written).
    """

    state: RdzvState
    mod_revision: int
    changed: bool


class StateExecutor:
    """Applies actions to one run's state with guarded writes.

    Args:
        client: etcd client.
        keys: the run's keys.
        written_by: recorded in every state written (a node id, or ``rdzvctl@host``).
        wall_ms: wall-clock milliseconds, recorded for operators and gc only.
        before_write: called before each write (an agent's: the run's lease exists, see
            :mod:`coordinator.core.run_lease`; may make RPCs); its errors are the write's.
    """

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        *,
        written_by: str,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        before_write: Callable[[], None] = lambda: None,
    ) -> None:
        self._client = client
        self._keys = keys
        self._written_by = written_by
        self._wall_ms = wall_ms
        self._before_write = before_write

    def read(self) -> tuple[RdzvState, int]:
        """The stored state and its mod_revision (absent: the initial state, 0).

        Raises:
            CorruptValueError: the value does not decode (names the key).
        """
        kv, _ = self._client.get(self._keys.state)
        return decode_current(self._keys.state, kv)

    def commit(
        self,
        known: tuple[RdzvState, int],
        actions: Sequence[Action],
        *,
        fence: Fence | None = None,
        delete_prefixes: Sequence[bytes] = (),
    ) -> Commit:
        """Write ``apply(state, actions)`` if the state is still at ``known``'s revision.

        An empty ``actions`` still writes (gc uses that to stamp the state while it
        deletes the store). ``delete_prefixes`` go in the same transaction, and so does
        the store of the round two before a round that this write completes, and the
        whole store when this write starts a new incarnation (every node of the old one
        has left).
        """
        self._before_write()
        state, mod_revision = known
        new = apply(state, actions, written_by=self._written_by, now_unix_ms=self._wall_ms())
        stale = (
            [self._keys.store_root]
            if new.incarnation != state.incarnation
            else self._stale_store(state.round, new.round)
        )
        result = self._client.put_if_mod_revision(
            self._keys.state,
            encode_state(new),
            mod_revision,
            also_delete_prefixes=[*delete_prefixes, *stale],
            fence=None if fence is None else (fence.key, fence.create_revision),
        )
        if result.succeeded:
            return Commit(True, new, result.revision)
        return Commit(False, state, result.revision, result.current, result.fenced_out)

    def update(
        self,
        decide: Callable[[RdzvState], Sequence[Action]],
        *,
        known: tuple[RdzvState, int] | None = None,
        tries: int = 10,
        on_conflict: Callable[[KeyValue | None, int], None] | None = None,
    ) -> Commit | None:
        """Commit ``decide(state)`` until it sticks (etcd's STM): each lost race decides
        again from the winner's value, read in the same round trip.

        Returns:
            The commit, or None when ``decide`` had nothing to do.

        Raises:
            EtcdElasticError: the state kept changing for ``tries`` attempts.
            CorruptValueError: the state key holds a value we cannot read.
        """
        state, mod_revision = self.read() if known is None else known
        for _ in range(tries):
            actions = decide(state)
            if not actions:
                return None
            outcome = self.commit((state, mod_revision), actions)
            if outcome.succeeded:
                return outcome
            if on_conflict is not None:
                on_conflict(outcome.current, outcome.revision)
            state, mod_revision = decode_current(self._keys.state, outcome.current)
        raise EtcdElasticError(
            f"could not write {self._keys.state.decode()!r}: the state kept changing for "
            f"{tries} attempts; try again"
        )

    def _stale_store(self, old_round: int, new_round: int) -> list[bytes]:
        # When round R completes, round R-1's store may still be read by an agent finishing
        # its exit barrier; R-2's cannot be, so it goes (keys and exactly-once markers) in
        # the same transaction.
        if new_round == old_round or new_round < 3:
            return []
        return round_prefixes(self._keys.store_root, new_round - 2)

    def remove(self, mod_revision: int) -> bool:
        """Delete the state key if it is still at ``mod_revision`` (gc's last step)."""
        return self._client.delete_if_mod_revision(self._keys.state, mod_revision).succeeded

    def close(
        self,
        reason: str,
        *,
        mode: CloseMode = "finished",
        timeout: float,
        known: tuple[RdzvState, int] | None = None,
        on_conflict: Callable[[KeyValue | None, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        incarnation: int = 0,
    ) -> CloseOutcome:
        """Close the run: compare-and-swap until it sticks.

        Each attempt applies :func:`~coordinator.core.actions.close` to the state last
        seen; a lost race returns the winner's value in the same round trip and the next
        attempt starts from it. A run whose state key is absent (nothing formed yet) gets
        a closed state, so late joiners fail at once.

        Args:
            reason: stored as ``closed_reason``; every node that finds the run closed
                shows it.
            mode: what agents still running should do (``finished``, ``failed``, ``drain``).
            timeout: seconds to keep retrying while the state keeps changing.
            known: the state and mod_revision the caller already holds (saves a read).
            on_conflict: told of the current value after each lost race.
            clock: monotonic seconds.
            incarnation: close only that incarnation (0: the current one); the run of
                another is left as it is (``changed`` False).

        Raises:
            CorruptValueError: the state key holds a value we cannot read (names the key).
            EtcdElasticError: the state kept changing for ``timeout`` seconds.
            EtcdConnectionError: etcd did not answer.
        """
        deadline = clock() + timeout
        state, mod_revision = self.read() if known is None else known
        while True:
            actions = close(state, reason, mode, incarnation)
            if not actions:
                return CloseOutcome(state, mod_revision, changed=False)
            outcome = self.commit((state, mod_revision), actions)
            if outcome.succeeded:
                # The run's timeline (best effort, a short wait at most: a close is not on
                # any formation's path, and the closer may be about to exit).
                for event in events_of_commit(state, outcome.state, actions, outcome.revision, {}):
                    record_event(self._client, self._keys, event, written_by=self._written_by)
                return CloseOutcome(outcome.state, outcome.revision, changed=True)
            if on_conflict is not None:
                on_conflict(outcome.current, outcome.revision)
            state, mod_revision = decode_current(self._keys.state, outcome.current)
            if clock() > deadline:
                raise EtcdElasticError(
                    f"could not close {self._keys.state.decode()!r} within {timeout:g} s: "
                    "the state kept changing; try again"
                )
