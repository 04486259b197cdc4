"""One node's live part in one run: its watched view of the state, its coordinator duty
and its key with the lease under it, started together and ended together.

The handler holds one :class:`Participation` at a time. When any of its background
threads dies, or the node leaves, the whole participation ends (the lease is revoked, so
the others see the node go at once) and a re-join starts a new one from scratch: new
watches, a new duty, a new lease and so a new key (whose new create revision also fences
anything the old duty might still try to write).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from coordinator.core.duty import CoordinatorDuty, Membership
from coordinator.core.errors import EtcdElasticError
from coordinator.core.etcd_client import EtcdClient
from coordinator.core.event_log import EventLog
from coordinator.core.keys import RunKeys
from coordinator.core.membership import NodeMembership
from coordinator.core.threads import DeathListener
from coordinator.core.transitions import Limits
from coordinator.core.view import StateView

__all__ = ["Participation"]

log = logging.getLogger(__name__)


class Participation:
    """The view, duty and membership of one node in one run.

    Args:
        client: etcd client.
        keys: the run's keys.
        node_id: this node.
        lease_ttl: seconds.
        limits: min/max nodes and last call, for the duty.
        on_change: called (from background threads; must not block) when the state or
            this node's lease changes.
        on_death: told when a background thread of this participation dies.
        clock: monotonic seconds.
        events: the run's timeline, for the duty (None: not recorded).
        before_commit: called with the view as the duty's terms start and before its
            commits (the handler's: the run's lease, :mod:`coordinator.core.run_lease`).
    """

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        node_id: str,
        lease_ttl: int,
        limits: Limits,
        *,
        on_change: Callable[[], None],
        on_death: DeathListener,
        clock: Callable[[], float],
        events: EventLog | None = None,
        before_commit: Callable[[StateView], None] = lambda _view: None,
    ) -> None:
        self.node_id, self._run_id = node_id, keys.run_id
        self._on_change = on_change
        self.member = NodeMembership(client, keys, node_id, lease_ttl, self._lease_lost)
        self.view = StateView(client, keys.state, on_death=on_death)
        self.view.subscribe(on_change)
        self.duty = CoordinatorDuty(
            client, keys, self.view, limits, self.member.current,
            clock=clock, on_death=on_death, events=events, on_key_gone=self._key_gone,
            before_commit=lambda: before_commit(self.view),
        )  # fmt: skip

    def start(self) -> None:
        """Watch the state (RPCs: call it outside any lock), then take up the duty."""
        self.view.start()
        self.duty.start()

    def _lease_lost(self) -> None:
        self.view.wake()
        self.duty.poke()
        self._on_change()

    def key_lost(self) -> bool:
        """Whether this node's key is gone: its lease ended, or the key was deleted under
        the live lease. Either way the node must ask again with a new key."""
        return self.member.lost() or self.member.key_gone()

    def must_rejoin(self, last_round: int) -> bool:
        """Whether this node, whose last completed round is ``last_round``, must
        rendezvous again although nobody waits: its key is gone, or a newer round
        completed without it (it was still starting its workers while the others re-formed
        and the last call ended: its group is of a round nobody else is in)."""
        return self.key_lost() or self.view.peek().round > last_round > 0

    def _key_gone(self, gone: Membership) -> None:
        # Deleted under the live lease: the handler and the agent take it as a lost lease
        # (num_nodes_waiting() counts it; a join in progress asks again).
        log.warning(
            "node %s: its key in run %s was deleted (by hand?) while its lease lives; it "
            "joins again", self.node_id, self._run_id,
        )  # fmt: skip
        self.member.forget(gone)
        self._lease_lost()

    def close(self) -> None:
        """Stop the duty (started or not) and the view, and revoke the lease. Idempotent."""
        self.duty.stop()
        self.view.close()
        try:
            self.member.close(revoke=True)
        except EtcdElasticError as exc:
            log.warning("node %s: lease not revoked (%s); it expires by TTL", self.node_id, exc)
