"""The one package that talks to etcd (v3 gRPC API).

Everything else in the project uses only the names in ``__all__``; swapping the client
library must touch this package only. ``python3-etcd3`` contributes nothing but etcd's
generated stubs and messages (``etcd3.etcdrpc``, loaded by ``_etcdrpc`` without the rest
of python3-etcd3); channels, failover, retries, auth tokens, watch streams and keep-alive
streams are ours (docs/decisions/etcd-client.md).

Error boundary: no ``grpc.RpcError`` leaves this package. Every failure becomes a
``coordinator.core.errors`` type (``raise … from exc``):

* no member answered within ``retry_budget`` → ``EtcdConnectionError`` naming every
  endpoint tried and the last gRPC status;
* wrong credentials, missing credentials, or no permission on a key → ``EtcdAuthError``;
* unreadable TLS file or a refused TLS handshake → ``EtcdTLSError``;
* a bad argument (e.g. deleting the whole keyspace) → ``ValueError``; bad settings in
  ``EtcdConfig`` → ``ConfigError`` at construction.

Threads: a client owns at most one watch thread (all watches share one gRPC stream) and
one keep-alive thread (all its leases share one gRPC stream, as in etcd's Go client);
gRPC adds one request-feeding thread per stream. All are daemon threads started through
``coordinator.core.threads.start_guarded`` and joined by :meth:`EtcdClient.close`. One
that dies of an unexpected exception ends what it served with an error its owner hears of
(the watches' ``on_error``, every lease's FAILED state and ``on_lost``) and is reported
to the client's death listeners. Construction does no
network I/O: the first call connects and authenticates.

Timers: only a call's own ``retry_budget`` (and ``Watch.wait_created``'s timeout) ends a
wait. Watch streams and keep-alives never give up while etcd is silent; a lease is lost
only when etcd says so (:class:`LeaseState`).

Messages name keys as text (``/etcd-elastic/job/state``), never as a bytes repr.

Layout, one concept per module (import from this package, not from them):

* ``_types``: ``EtcdConfig`` and its validation, the values etcd returns, key ranges;
* ``_etcdrpc``: etcd's generated stubs and messages, without python3-etcd3's client;
* ``_failover``: failure kinds of a gRPC status, backoff, the endpoint ring,
  ``run_with_failover`` (pure: clock, sleep and rng are injected);
* ``_connection``: channels, the auth token, one unary RPC with failover and error
  translation (the base of ``EtcdClient``);
* ``_kv``: KV calls and revision-guarded transactions (the next layer);
* ``_ranges``: the range requests of the KV reads (pure): which etcd stops at their limit;
* ``_leases``: the lease calls (grant, grant if absent, refresh, revoke, time to live);
* ``_client``: ``EtcdClient``: keep-alives, watches, thread deaths;
* ``_liveness``: ``LeaseState`` and the pure rules of a lease's keep-alive;
* ``_keepalive``: ``KeepAlive``, what the owner of one lease sees;
* ``_keepalive_stream``: the keep-alive thread, every lease of a client on one stream;
* ``_schedule``: when each lease on that stream sends its next keep-alive (pure);
* ``_watch``: ``Watch``, one watch and how it ends;
* ``_watcher``: the watch thread, every watch of a client on one resumable stream;
* ``_watch_outage``: what that stream remembers of an outage (endpoints tried, the last
  failure, members refusing its TLS handshake) and its one log line per outage;
* ``_watch_probe``: what that stream sends when its member is silent (a progress
  request, or a read where the member is an etcd gRPC proxy);
* ``_observer``: ``EtcdObserver``, what the client reports (calls, failed attempts,
  keep-alive round trips, answers) to whoever measures it (the agent's metrics).
"""

from coordinator.core.etcd_client._client import EtcdClient

# Not public, but importable from here as before the split: the unit tests pin the failure
# kinds of classify_status() and drive run_with_failover() with a _Ring.
from coordinator.core.etcd_client._failover import AUTH_DISABLED as AUTH_DISABLED
from coordinator.core.etcd_client._failover import AUTH_FAILED as AUTH_FAILED
from coordinator.core.etcd_client._failover import AUTH_REQUIRED as AUTH_REQUIRED
from coordinator.core.etcd_client._failover import FATAL as FATAL
from coordinator.core.etcd_client._failover import NOT_FOUND as NOT_FOUND
from coordinator.core.etcd_client._failover import PERMISSION as PERMISSION
from coordinator.core.etcd_client._failover import REAUTH as REAUTH
from coordinator.core.etcd_client._failover import RETRY as RETRY
from coordinator.core.etcd_client._failover import _Ring as _Ring
from coordinator.core.etcd_client._failover import (
    backoff_delay,
    classify_status,
    run_with_failover,
)
from coordinator.core.etcd_client._keepalive import KeepAlive, OnReachable, OnUnreachable
from coordinator.core.etcd_client._liveness import LeaseState, Outage
from coordinator.core.etcd_client._observer import NO_ANSWER, STREAM_ENDED, EtcdObserver
from coordinator.core.etcd_client._types import (
    EtcdConfig,
    KeyValue,
    TxnResult,
    WatchEvent,
    key_text,
    parse_endpoint,
    prefix_range_end,
)
from coordinator.core.etcd_client._watch import Watch

__all__ = [
    "NO_ANSWER",
    "STREAM_ENDED",
    "EtcdClient",
    "EtcdConfig",
    "EtcdObserver",
    "KeepAlive",
    "KeyValue",
    "LeaseState",
    "OnReachable",
    "OnUnreachable",
    "Outage",
    "TxnResult",
    "Watch",
    "WatchEvent",
    "backoff_delay",
    "classify_status",
    "key_text",
    "parse_endpoint",
    "prefix_range_end",
    "run_with_failover",
]
