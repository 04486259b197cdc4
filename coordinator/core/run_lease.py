"""The run's lease: what removes every key of a run once it is over, with nobody left.

A node's keys (``nodes/``, ``progress/``) hang on that node's lease. Everything else under
``<prefix>/<run>/`` — the state, the Store's rounds and their exactly-once markers, the
timeline (``events/``) — hangs on one lease per run:

* its id is computed from the key prefix and the run id (:func:`run_lease_id`), so every
  writer of the run, agent or ``rdzvctl``, knows it without a round trip and without
  agreeing on it first; the first agent of a run grants it, the others find it;
* its TTL is the ``retention`` (at least twice the ``lease_ttl``, see
  :func:`run_lease_ttl`); every live agent of the run keeps it alive (one keep-alive
  every TTL/3: every 40 minutes at the default 7200 s) and renews it once more when it
  leaves, so the run's keys go ``retention`` seconds after its last agent left — closed
  or not, cleanly or SIGKILLed (then within ``retention`` of its last renewal);
* the handler binds the run's folder to it in its etcd client
  (:meth:`~coordinator.core.etcd_client.EtcdClient.bind_prefix`): every write under the
  folder that names no lease of its own goes on it, whichever module writes it, so no
  key of a run can be left behind by a feature that forgot to ask for a lease.

Why the TTL is never below twice ``lease_ttl``: an agent renews the run's lease at least
every TTL/3, so in an outage the lease outlives the last renewal by ≥ 2/3 TTL, longer
than any node key (``lease_ttl``): the run's state cannot vanish under a node that is
still in the run. A ``retention`` of 0 means no lease: the keys stay until ``rdzvctl gc``.

Costs (DESIGN §10): one lease per run; one grant per run (the first agent; the others
learn it exists from their first keep-alive's answer); each agent adds one keep-alive per
TTL/3 and one when it leaves; no key is written or rewritten for it, so a close costs
what it did (one guarded put of the state).
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

    One keep-alive if it exists (the common case: every agent but the first); a grant of
    ``ttl`` seconds if it does not. The TTL in force is the first grant's: agents that
    disagree on ``retention`` share the first one's.

    Raises:
        EtcdElasticError: the lease vanished between each look and grant, 3 times.
        EtcdConnectionError: etcd did not answer.
    """
    for _ in range(_ENSURE_TRIES):
        in_force = client.lease_refresh(lease_id)
        if in_force > 0:
            return in_force
        granted = client.lease_grant_if_absent(lease_id, ttl)
        if granted > 0:
            return granted
        # Granted by another agent between the two calls (or about to expire): look again.
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
    """One agent's part in keeping its run's lease: it makes sure the lease exists, binds
    the run's folder to it, keeps it alive while the agent is in the run, and renews it a
    last time when the agent leaves. With ``retention`` 0 it does nothing.

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

    def start(self, client: EtcdClient, on_lost: Callable[[LeaseLostError], None]) -> None:
        """Make sure the lease exists, bind the run's folder to it, and keep it alive
        (RPCs: call it outside any lock). A no-op while it is kept alive already, and
        after :meth:`stop`; after the lease was lost it is granted again.

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

        keepalive = client.keep_alive(self.id, ttl, lost, granted_at=granted_at)
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
        """Stop keeping the lease alive, renew it a last time (so the run's keys stay
        ``retention`` seconds from now), and unbind the run's folder. Idempotent; never
        raises (a failed renewal leaves the keys to go up to TTL/3 earlier)."""
        with self._lock:
            first = not self._stopped
            self._stopped = True
            keepalive, self._keepalive = self._keepalive, None
            unbind, self._unbind = self._unbind, None
            client = self._client
        if keepalive is not None:
            keepalive.close(revoke=False)
        if first and client is not None:
            try:
                client.lease_refresh(self.id, budget=_LAST_RENEWAL_BUDGET)
            except EtcdElasticError as exc:
                log.info(
                    "run %s: its lease was not renewed a last time (%s); its keys go up "
                    "to a third of %d s earlier", self._keys.run_id, exc, self.ttl,
                )  # fmt: skip
        if unbind is not None:
            unbind()
