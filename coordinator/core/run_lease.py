"""The run's lease: what removes every key of a run once it is over, with nobody left.

A node's keys (``nodes/``, ``progress/``) hang on that node's lease. Everything else under
``<prefix>/<run>/`` — the state, the Store's rounds and their exactly-once markers, the
timeline (``events/``) — hangs on one lease per run:

* its id is computed from the key prefix and the run id (:func:`run_lease_id`), so every
  writer of the run, agent or ``rdzvctl``, knows it without a round trip and without
  agreeing on it first;
* **one node grants it**: the coordinator, as its term starts and before it writes the
  run's state, when it has not read a state on the lease (a new run, or one whose lease
  ended) — :meth:`RunLease.ensure`. Every other node keeps it alive from the moment its
  watched view shows the state on the lease (:meth:`RunLease.follow`: no grant, no round
  trip), so nothing about the run's lease is on a node's way to its key. (Before, every
  agent renewed it and, if etcd did not know it, granted it before its key: when a
  thousand agents started at once, hundreds found it absent and asked: 1,750 grants for
  1,001 leases, each failed grant a raft proposal.) A node that writes the state before
  any was read on the lease (closing a run that never formed) grants it the same way;
* its TTL is the ``retention`` (at least twice the ``lease_ttl``, see
  :func:`run_lease_ttl`); every live node that read the run's state keeps it alive (one
  keep-alive every TTL/3: every 40 minutes at the default 7200 s) and renews it once
  more when it leaves, so the run's keys go ``retention`` seconds after its last agent
  left — closed or not, cleanly or SIGKILLed (then within ``retention`` of its last
  renewal);
* the handler binds the run's folder to it in its etcd client
  (:meth:`~coordinator.core.etcd_client.EtcdClient.bind_prefix`) as it joins, before the
  lease may exist: every write under the folder that names no lease of its own goes on
  it, whichever module writes it, so no key of a run can be left behind by a feature
  that forgot to ask for a lease (a write before the lease exists fails; only the
  coordinator writes there then, after its grant).

Why the TTL is never below twice ``lease_ttl``: an agent renews the run's lease at least
every TTL/3, so in an outage the lease outlives the last renewal by ≥ 2/3 TTL, longer
than any node key (``lease_ttl``): the run's state cannot vanish under a node that is
still in the run (a node of the run read its state, so it keeps the lease alive). A lost
run lease (revoked by hand, or nobody reached etcd for its TTL) ends each node's
participation: it leaves and joins again, and the next coordinator grants the lease
anew. A ``retention`` of 0 means no lease: the keys stay until ``rdzvctl gc``.

Costs (DESIGN §10): one lease per run; **one grant per run** (one raft proposal, by the
coordinator, off the joins' path; a second only if a coordinator went before it wrote
the state and the next one finds the lease: one failed grant and one renewal); each node
adds one keep-alive when it first reads the state and one per TTL/3 after, and one
renewal when it leaves; no key is written or rewritten for it, so a close costs what it
did (one guarded put of the state). A formation of N nodes: N + 1 lease grants.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from collections.abc import Callable

from coordinator.core.errors import EtcdElasticError, LeaseLostError
from coordinator.core.etcd_client import EtcdClient, KeepAlive
from coordinator.core.keys import RunKeys

__all__ = [
    "RunLease",
    "bind_existing_run_lease",
    "ensure_run_lease",
    "existing_run_lease",
    "run_lease_id",
    "run_lease_ttl",
]

log = logging.getLogger(__name__)

_ENSURE_TRIES = 3
# A leaving agent's last renewal waits at most this long for etcd.
_LAST_RENEWAL_BUDGET = 2.0
# A node that starts to follow the lease sends its first keep-alive this long after (at
# most a sixth of its own TTL): the commit that shows the lease reaches every node at
# once, and N keep-alives then would compete with the nodes' return from the formation.
# Safe: the lease lives at least 2/3 of its TTL (never under 2 s) after any renewal of
# the node that granted it, and nothing else needs the answer sooner.
_FOLLOW_FIRST_S = 1.0


def run_lease_id(keys: RunKeys) -> int:
    """The id of the run's lease: 63 bits of SHA-256 of the run's folder (never 0).

    Two runs share an id only by a hash collision (1 in 2**63 per pair); a node lease
    (random ids below 2**62) shares it with the same odds.
    """
    digest = hashlib.sha256(b"etcd-elastic run lease " + keys.run_prefix).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1) or 1


def run_lease_ttl(retention: float, lease_ttl: int) -> int:
    """The run lease's TTL in whole seconds for ``retention`` (0: no lease)."""
    if retention <= 0:
        return 0
    return max(math.ceil(retention), 2 * lease_ttl)


def ensure_run_lease(client: EtcdClient, lease_id: int, ttl: int) -> int:
    """Make sure the run's lease exists, renewed now; return the TTL in force.

    A look, then one grant of ``ttl`` seconds if it does not exist (the common case: the
    coordinator of a new run, before its first commit), or one keep-alive if it does (a
    coordinator before this one granted it: it went, or stepped down for a node that came
    earlier, before the state was written). A look is a read; a grant, even a refused one,
    is a raft proposal. The TTL in force is the first grant's: agents that disagree on
    ``retention`` share it.

    Raises:
        EtcdElasticError: the lease vanished between each grant and look, 3 times.
        EtcdConnectionError: etcd did not answer.
    """
    for _ in range(_ENSURE_TRIES):
        if client.lease_time_to_live(lease_id) <= 0:
            granted = client.lease_grant_if_absent(lease_id, ttl)
            if granted > 0:
                return granted
        in_force = client.lease_refresh(lease_id)
        if in_force > 0:
            return in_force
        # Expired (or revoked) between the two calls: grant it again.
    raise EtcdElasticError(
        f"the run's lease {lease_id:x} expired each time it was found, {_ENSURE_TRIES} "
        "times in a row; is etcd's clock or this machine overloaded?"
    )


def existing_run_lease(client: EtcdClient, keys: RunKeys) -> int:
    """The run's lease id if etcd has it, else 0 (no renewal: for ``rdzvctl``).

    Raises:
        EtcdConnectionError: etcd did not answer.
    """
    lease_id = run_lease_id(keys)
    return lease_id if client.lease_time_to_live(lease_id) > 0 else 0


def bind_existing_run_lease(client: EtcdClient, keys: RunKeys) -> int:
    """Write as the run's agents do (``rdzvctl``): bind the run's folder to the run's
    lease if etcd has it, so what is written goes with the run; else nothing is bound
    (a run of ``retention`` 0: kept until ``rdzvctl gc``). Returns the lease id or 0.

    Raises:
        EtcdConnectionError: etcd did not answer.
    """
    lease_id = existing_run_lease(client, keys)
    if lease_id:
        client.bind_prefix(keys.run_prefix, lease_id)
    return lease_id


class RunLease:
    """One agent's part in keeping its run's lease: it binds the run's folder to it, keeps
    it alive while the agent is in the run, and renews it a last time when the agent
    leaves. One node grants it (:meth:`ensure`: the coordinator, before it writes the
    run's state); every other node keeps it alive once it read a state on it
    (:meth:`follow`). With ``retention`` 0 it does nothing.

    Thread-safe. ``_lock`` is a leaf lock: it guards the references below, and only the
    client's bindings (another leaf) are changed while it is held; no RPC runs under it.

    Args:
        keys: the run's keys.
        retention: seconds the run's keys are kept after its last agent left (0: until
            ``rdzvctl gc``).
        lease_ttl: the nodes' lease TTL (the run lease's TTL is at least twice it).
    """

    def __init__(self, keys: RunKeys, retention: float, lease_ttl: int) -> None:
        self._keys = keys
        self.ttl = run_lease_ttl(retention, lease_ttl)
        self.id = run_lease_id(keys) if self.ttl else 0
        self._lock = threading.Lock()
        self._client: EtcdClient | None = None
        self._keepalive: KeepAlive | None = None
        self._unbind: Callable[[], None] | None = None
        self._stopped = False

    def _kept(self) -> bool:
        with self._lock:
            return self._stopped or (self._keepalive is not None and not self._keepalive.lost())

    def writable(self) -> bool:
        """Whether the run's keys can be written, as far as this agent knows: no lease
        (``retention`` 0), or this agent keeps it alive (so etcd has it)."""
        with self._lock:
            return not self.id or (self._keepalive is not None and not self._keepalive.lost())

    def bind(self, client: EtcdClient) -> None:
        """Bind the run's folder to the run's lease in ``client`` (no RPC): every write
        under it that names no lease of its own goes on the run's lease, and fails while
        etcd has no such lease (a key of the run is never written without it). Before the
        lease exists, only the coordinator writes there (after :meth:`ensure`).
        Idempotent; nothing after :meth:`stop`."""
        if not self.id:
            return
        with self._lock:
            if self._unbind is None and not self._stopped:
                self._client = client
                self._unbind = client.bind_prefix(self._keys.run_prefix, self.id)

    def follow(self, client: EtcdClient, on_lost: Callable[[LeaseLostError], None]) -> None:
        """Keep alive the run's lease, known to exist (this node read a state on it):
        no grant, no RPC here (the first renewal goes out on the client's stream about a
        second later, and its answer sets the TTL in force). A no-op while it is kept
        alive, and after :meth:`stop`. ``on_lost``: see :meth:`ensure`. Never blocks: a
        listener of the state's view may call it."""
        if not self.id or self._kept():
            return
        self._keep(client, self.ttl, None, on_lost, first_in=min(_FOLLOW_FIRST_S, self.ttl / 6))

    def ensure(self, client: EtcdClient, on_lost: Callable[[LeaseLostError], None]) -> None:
        """Make sure the lease exists and keep it alive, before this node writes the run's
        state without having read one on the lease (the coordinator of a new run): one
        grant (RPCs: call it outside any lock). A no-op while it is kept alive, and after
        :meth:`stop`; after the lease was lost it is granted again.

        ``on_lost(error)`` runs (on the keep-alive thread; it must not block) when etcd
        says the lease is gone while this agent keeps it: every key of the run went with
        it (revoked by hand, or no agent reached etcd for its TTL).

        Raises:
            EtcdConnectionError: etcd did not answer.
            EtcdElasticError: see :func:`ensure_run_lease`.
        """
        if not self.id or self._kept():
            return
        granted_at = client.clock()
        ttl = ensure_run_lease(client, self.id, self.ttl)
        self._keep(client, ttl, granted_at, on_lost)

    def _keep(
        self,
        client: EtcdClient,
        ttl: int,
        granted_at: float | None,
        on_lost: Callable[[LeaseLostError], None],
        first_in: float = 0.0,
    ) -> None:
        """Start the keep-alive (a loser of a race with another thread closes its own)."""
        holder: list[KeepAlive] = []

        def lost() -> None:
            with self._lock:
                current = bool(holder) and self._keepalive is holder[0] and not self._stopped
            if current:
                on_lost(
                    LeaseLostError(
                        f"run {self._keys.run_id}: its lease {self.id:x} is gone, and every "
                        "key of the run with it (revoked by hand, or no agent reached etcd "
                        f"for {ttl} s); its nodes join again from scratch"
                    )
                )

        keepalive = client.keep_alive(self.id, ttl, lost, granted_at=granted_at, first_in=first_in)
        holder.append(keepalive)
        with self._lock:
            if self._stopped or (self._keepalive is not None and not self._keepalive.lost()):
                loser: KeepAlive | None = keepalive  # another thread won, or we left
            else:
                loser, self._keepalive = self._keepalive, keepalive
                self._client = client
                if self._unbind is None:
                    self._unbind = client.bind_prefix(self._keys.run_prefix, self.id)
        if loser is not None:
            loser.close(revoke=False)

    def stop(self) -> None:
        """Stop keeping the lease alive, renew it a last time if this agent kept it (so
        the run's keys stay ``retention`` seconds from now), and unbind the run's folder.
        Idempotent; never raises (a failed renewal leaves the keys to go up to TTL/3
        earlier)."""
        with self._lock:
            first = not self._stopped
            self._stopped = True
            keepalive, self._keepalive = self._keepalive, None
            unbind, self._unbind = self._unbind, None
            client = self._client
        if keepalive is not None:
            keepalive.close(revoke=False)
        if first and keepalive is not None and client is not None:
            try:
                client.lease_refresh(self.id, budget=_LAST_RENEWAL_BUDGET)
            except EtcdElasticError as exc:
                log.info(
                    "run %s: its lease was not renewed a last time (%s); its keys go up "
                    "to a third of %d s earlier", self._keys.run_id, exc, self.ttl,
                )  # fmt: skip
        if unbind is not None:
            unbind()
