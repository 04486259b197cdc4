"""This node's place in a run: its node key and the lease (session) it hangs on.

The handler asks for a round with :meth:`NodeMembership.write`; the coordinator duty
reads :meth:`NodeMembership.current` (the key's create revision is the fence of its
commits; its turn key, written with it, its place in the election). A lost lease (etcd
said so) is replaced on the next write, and the new key has a new create revision, so a
node that lost its lease can never commit as the leader it was before. A key deleted
under a live lease (an operator's ``etcdctl del``) is created again by the next write,
and that new create revision is the one the node goes by from then on (its turn key,
written again with it, keeps its place). Until then :meth:`key_gone` says the key is known
gone (the duty found out: its commit was fenced out), and the node asks to re-join as
after a lost lease.

Locking: ``_lock`` guards only the two references below and is a leaf lock: no RPC, no
callback and no other lock is ever taken while it is held (docs/architecture.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from coordinator.core.duty import Membership
from coordinator.core.errors import LeaseLostError
from coordinator.core.etcd_client import EtcdClient
from coordinator.core.keys import RunKeys
from coordinator.core.session import Session
from coordinator.core.state import NodeInfo, encode_node

__all__ = ["Membership", "NodeMembership", "create_node_key"]

log = logging.getLogger(__name__)

_LEASE_TRIES = 3


def create_node_key(
    client: EtcdClient, keys: RunKeys, node_id: str, value: bytes, lease: int, revision: int
) -> tuple[int, bytes]:
    """Write a node's key and its turn key (:meth:`RunKeys.turn`) on ``lease``, in one
    transaction; return the node key's create revision and the turn key.

    ``revision``: what etcd's revision was when the node's lease was granted (0: not
    known; then read now). Later than any node key that existed then, so a node that comes
    to a running job waits behind its coordinator and never takes over from it.
    """
    key = keys.node(node_id)
    if not revision:
        _, revision = client.get(key)
    turn = keys.turn(revision, node_id)
    created = client.put_created(
        key, value, lease=lease, also_put=((turn, node_id.encode("ascii")),)
    )
    return created, turn


class NodeMembership:
    """One node's key and lease in one run.

    Args:
        client: etcd client.
        keys: the run's keys.
        node_id: this node.
        lease_ttl: seconds.
        on_lost: called (from a background thread, must not block) when the lease is lost.
        make_session: builds a session (tests and the handler pass extra callbacks).
    """

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        node_id: str,
        lease_ttl: int,
        on_lost: Callable[[], None],
        make_session: Callable[[], Session] | None = None,
    ) -> None:
        self._client = client
        self._keys = keys
        self.node_id = node_id
        self._ttl = lease_ttl
        self._on_lost = on_lost
        self._make_session = make_session or (lambda: Session(client, lease_ttl, on_lost))
        self._lock = threading.Lock()
        self._session: Session | None = None
        self._membership: Membership | None = None
        self._gone: Membership | None = None  # found deleted under the live lease

    def current(self) -> Membership | None:
        """This node's key while its lease lives, else None."""
        with self._lock:
            session, membership = self._session, self._membership
        if session is None or session.lost():
            return None
        return membership

    def forget(self, gone: Membership) -> None:
        """The key ``gone`` was deleted under the live lease (the duty's commit was fenced
        out with it): :meth:`key_gone` says so until this node writes its key anew."""
        with self._lock:
            self._gone = gone

    def key_gone(self) -> bool:
        """Whether this node's key, as it last wrote it, is known deleted under its lease."""
        with self._lock:
            return self._gone is not None and self._gone == self._membership

    def lease_id(self) -> int:
        """The lease this node's key hangs on while it lives, else 0."""
        with self._lock:
            session = self._session
        return 0 if session is None or session.lost() else session.lease_id

    def lost(self) -> bool:
        """Whether this node had a lease and etcd said it is gone."""
        with self._lock:
            session = self._session
        return session is not None and session.lost()

    def _live_session(self) -> Session:
        """The current session, or a new one if there is none or it was lost."""
        with self._lock:
            old = self._session
        if old is not None and not old.lost():
            return old
        if old is not None:
            old.close(revoke=False)
        new = self._make_session()  # a lease grant: outside the lock
        with self._lock:
            self._session, self._membership = new, None
        return new

    def _drop(self, session: Session) -> None:
        with self._lock:
            if self._session is session:
                self._session, self._membership = None, None
        session.close(revoke=False)

    def write(self, record: Callable[[int], NodeInfo]) -> Membership:
        """Write this node's key (``record(lease_id)``) on a live lease; return the key.

        Raises:
            LeaseLostError: three leases in a row expired before they could be used.
            EtcdConnectionError: etcd did not answer.
        """
        key = self._keys.node(self.node_id)
        for _ in range(_LEASE_TRIES):
            session = self._live_session()
            with self._lock:
                held = self._membership if self._gone != self._membership else None
            try:
                value = encode_node(record(session.lease_id))
                if held is not None:
                    # The next round asked for on the same key: its turn key stands.
                    create_revision = self._client.put_created(key, value, lease=session.lease_id)
                    turn = held.turn
                else:
                    create_revision, turn = create_node_key(
                        self._client, self._keys, self.node_id, value, session.lease_id,
                        session.granted_revision,
                    )  # fmt: skip
            except LeaseLostError as exc:
                # The lease expired between grant and put (a process starved for a TTL):
                # drop it and ask again with a new one.
                log.warning("node %s: %s; taking a new lease", self.node_id, exc)
                self._drop(session)
                continue
            with self._lock:
                if self._membership is None or self._membership.create_revision != create_revision:
                    # A new key: a new lease's, or ours deleted under a live lease (etcdctl
                    # del) and created again by this put. Its create revision is the fence
                    # from now on: the old one would fence out every commit.
                    self._membership = Membership(
                        self.node_id, key, create_revision, turn, session.lease_id
                    )
                membership = self._membership
            return membership
        raise LeaseLostError(
            f"node {self.node_id}: {_LEASE_TRIES} leases in a row expired before this node "
            f"could use them (lease_ttl={self._ttl} s); is the machine overloaded?"
        )

    def close(self, revoke: bool) -> None:
        """Give up the session (revoking the lease deletes the key now). Idempotent."""
        with self._lock:
            session, self._session, self._membership = self._session, None, None
        if session is not None:
            session.close(revoke=revoke)
