"""One node's I/O for hang detection: its suspicion, the others', the declaration.

What the agent's hang watch (``agent/health/hang.py``) does through the rendezvous handler, kept
here so the handler stays a thin adapter. Four calls, none on a training step's path and
none while the node's workers make progress:

* :meth:`ProgressBoard.publish` puts this node's :class:`NodeProgress` at
  ``progress/<node_id>`` on the node's current lease (no lease, no write: the record must
  never outlive the node), when the node begins to suspect a hang;
* :meth:`ProgressBoard.withdraw` deletes it, when the node makes progress again;
* :meth:`ProgressBoard.read` reads every node's record in one range request (only when
  this node is about to declare a hang);
* :meth:`ProgressBoard.declare` records a :class:`Hang` in the state through the one
  writer of the state, :class:`StateExecutor`, guarded by the state's revision; a lost
  race re-decides from the winner's value, so at most one hang is recorded per round
  (:func:`~coordinator.core.actions.declare_hang`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from coordinator.core.actions import declare_hang
from coordinator.core.errors import CorruptValueError, EtcdElasticError, LeaseLostError
from coordinator.core.etcd_client import EtcdClient
from coordinator.core.executor import StateExecutor, decode_current
from coordinator.core.keys import RunKeys
from coordinator.core.progress import NodeProgress, decode_progress, encode_progress
from coordinator.core.state import Hang
from coordinator.core.view import StateView

__all__ = ["ProgressBoard"]

log = logging.getLogger(__name__)


class ProgressBoard:
    """Progress records and hang declarations of one node in one run.

    Args:
        client: etcd client.
        keys: the run's keys.
        node_id: this node.
        lease_id: this node's current lease (0: none now).
        view: this node's watched state (what a declaration starts from, and is told of).
        clock: monotonic seconds (bounds a declaration's retries).
    """

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        node_id: str,
        lease_id: Callable[[], int],
        view: StateView,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._keys = keys
        self._node_id = node_id
        self._lease_id = lease_id
        self._view = view
        self._clock = clock

    def publish(self, progress: NodeProgress) -> bool:
        """Write this node's record on its lease; False when there is no live lease.

        Raises:
            EtcdConnectionError: etcd did not answer.
        """
        lease = self._lease_id()
        if not lease:
            return False
        try:
            self._client.put(self._keys.progress(self._node_id), encode_progress(progress),
                             lease=lease)  # fmt: skip
        except LeaseLostError:
            return False  # the node re-joins with a new lease; the next write uses it
        return True

    def withdraw(self) -> None:
        """Delete this node's record (it made progress again); nothing if there is none.

        Raises:
            EtcdConnectionError: etcd did not answer.
        """
        self._client.delete(self._keys.progress(self._node_id))

    def read(self) -> dict[str, NodeProgress]:
        """Every readable progress record of the run by node id (one range request); a
        value that does not decode is logged and left out.

        Raises:
            EtcdConnectionError: etcd did not answer.
        """
        kvs, _ = self._client.get_prefix(self._keys.progress_prefix)
        out: dict[str, NodeProgress] = {}
        for kv in kvs:
            shown = kv.key.decode("utf-8", "backslashreplace")
            try:
                node = self._keys.node_id_from_progress_key(kv.key)
                out[node] = decode_progress(shown, kv.value)
            except CorruptValueError as exc:
                log.warning("ignoring a progress record: %s", exc)
        return out

    def declare(self, hang: Hang, timeout: float) -> Hang | None:
        """Record ``hang`` unless a hang of its round is recorded already.

        Returns:
            The hang the state holds for ``hang.round`` (this one, or the one another node
            declared first), or None when the round is over or the run closed.

        Raises:
            EtcdElasticError: the state kept changing for ``timeout`` seconds.
            CorruptValueError: the state key holds a value we cannot read.
            EtcdConnectionError: etcd did not answer.
        """
        executor = StateExecutor(self._client, self._keys, written_by=self._node_id)
        deadline = self._clock() + timeout
        known = self._view.snapshot()
        while True:
            state = known[0]
            actions = declare_hang(state, hang)
            if not actions:
                held = state.hang
                return held if held is not None and held.round == hang.round else None
            commit = executor.commit(known, actions)
            if commit.succeeded:
                self._view.offer_written(commit.state, commit.revision)
                return hang
            self._view.offer(commit.current, commit.revision)
            known = decode_current(self._keys.state, commit.current)
            if self._clock() > deadline:
                raise EtcdElasticError(
                    f"could not record the hang of round {hang.round} in "
                    f"{self._keys.state.decode()!r} within {timeout:g} s: the state kept "
                    "changing"
                )
