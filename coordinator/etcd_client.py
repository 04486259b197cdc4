"""The one module that talks to etcd (v3 gRPC API).

Everything else in the project uses only the names in ``__all__``; swapping the client
library must touch this module only. ``python3-etcd3`` contributes nothing but etcd's
generated stubs and messages (``etcd3.etcdrpc``); channels, failover, retries, auth
tokens, watch streams and keep-alive streams are ours (docs/decisions/etcd-client.md).

Error boundary: no ``grpc.RpcError`` leaves this module. Every failure becomes a
``coordinator.errors`` type (``raise … from exc``):

* no member answered within ``retry_budget`` → ``EtcdConnectionError`` naming every
  endpoint tried and the last gRPC status;
* wrong credentials, missing credentials, or no permission on a key → ``EtcdAuthError``;
* unreadable TLS file or a refused TLS handshake → ``EtcdTLSError``;
* a bad argument (e.g. deleting the whole keyspace) → ``ValueError``; bad settings in
  ``EtcdConfig`` → ``ConfigError`` at construction.

Threads: a client owns at most one watch thread (all watches share one gRPC stream) and
one thread per :class:`KeepAlive`; gRPC adds one request-feeding thread per stream. All
are daemon threads and are joined by :meth:`EtcdClient.close`. Construction does no
network I/O: the first call connects and authenticates.
"""

from __future__ import annotations

import functools
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import grpc
from etcd3 import etcdrpc

from coordinator.errors import ConfigError, EtcdAuthError, EtcdConnectionError, EtcdTLSError

__all__ = [
    "EtcdClient",
    "EtcdConfig",
    "KeepAlive",
    "KeyValue",
    "TxnResult",
    "Watch",
    "WatchEvent",
    "backoff_delay",
    "classify_status",
    "parse_endpoint",
    "prefix_range_end",
    "run_with_failover",
]

log = logging.getLogger(__name__)
T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...] | None

# Kinds of gRPC failure, decided by classify_status().
RETRY = "retry"  # connection-level: try the next endpoint
REAUTH = "reauth"  # the token expired or the auth store changed: authenticate again
AUTH_FAILED = "auth_failed"  # wrong user or password
AUTH_REQUIRED = "auth_required"  # etcd wants a token and we have no credentials
PERMISSION = "permission"  # the user may not touch this key
AUTH_DISABLED = "auth_disabled"  # Authenticate on a cluster without auth
NOT_FOUND = "not_found"  # e.g. the lease is gone
FATAL = "fatal"  # anything else: the request itself is refused

_BACKOFF_BASE_S = 0.05
_BACKOFF_CAP_S = 1.0
# One stream per client stays open; keepalive pings find a silently dead member (a
# SIGKILLed one resets the TCP connection and is noticed at once). 15 s stays above
# etcd's default --grpc-keepalive-min-time (5 s), below which etcd sends GOAWAY.
_CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 15_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    # A member that comes back must be usable within about a second, not grpc's 120 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.min_reconnect_backoff_ms", 2_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),  # we own retries and failover
)


# -- configuration and values -------------------------------------------------------------


@dataclass(frozen=True)
class EtcdConfig:
    """How to reach etcd. Built from validated settings; never from raw user strings.

    Attributes:
        endpoints: ``host:port`` of each member, at least one.
        protocol: ``https`` for TLS (``ca_cert`` verifies the server; ``cert`` and
            ``cert_key`` are the client certificate, both or neither).
        user, password: etcd user auth, both or neither.
        request_timeout: upper bound, in seconds, for one attempt of one unary RPC.
        retry_budget: upper bound, in seconds, for all retries and failover of one call
            (every endpoint is tried at least once even if that takes longer).

    Raises:
        ConfigError: a value is missing, malformed or inconsistent.
    """

    endpoints: tuple[str, ...]  # "host:port" each, at least one
    protocol: Literal["http", "https"] = "http"
    ca_cert: str | None = None
    cert: str | None = None
    cert_key: str | None = None
    user: str | None = None
    password: str | None = None
    request_timeout: float = 5.0
    retry_budget: float = 30.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoints", tuple(self.endpoints))
        if not self.endpoints:
            raise ConfigError("etcd endpoints: none given; pass at least one host:port")
        for endpoint in self.endpoints:
            parse_endpoint(endpoint)
        if self.protocol not in ("http", "https"):
            raise ConfigError(f"etcd protocol: {self.protocol!r} is not 'http' or 'https'")
        if (self.cert is None) != (self.cert_key is None):
            raise ConfigError(
                f"etcd TLS: cert={self.cert!r} and cert_key={self.cert_key!r}: "
                "give both the client certificate and its key, or neither"
            )
        if self.protocol == "http" and (self.ca_cert or self.cert):
            raise ConfigError(
                "etcd TLS files were given but protocol is 'http'; set protocol=https"
            )
        if (self.user is None) != (self.password is None):
            raise ConfigError("etcd auth: give both user and password, or neither")
        if not self.request_timeout > 0 or not self.retry_budget > 0:
            raise ConfigError(
                f"etcd timeouts must be positive: request_timeout={self.request_timeout}, "
                f"retry_budget={self.retry_budget}"
            )


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd stores it."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by a watch."""

    kind: Literal["put", "delete"]
    kv: KeyValue  # for "delete": key set, value b"", mod_revision = revision of the delete
    prev_kv: KeyValue | None  # only when the watch asked for prev_kv


@dataclass(frozen=True)
class TxnResult:
    """Outcome of a revision-guarded transaction."""

    succeeded: bool
    revision: int  # header revision after the transaction
    current: KeyValue | None  # the guarded key's value when the compare failed (None: absent)


def _kv(pb: Any) -> KeyValue:
    return KeyValue(
        key=bytes(pb.key),
        value=bytes(pb.value),
        create_revision=int(pb.create_revision),
        mod_revision=int(pb.mod_revision),
        version=int(pb.version),
        lease=int(pb.lease),
    )


# -- pure helpers ---------------------------------------------------------------------------


def parse_endpoint(text: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) into host and port.

    Raises:
        ConfigError: not ``host:port`` or the port is not 1..65535.
    """
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or "/" in text or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"etcd endpoint {text!r} is not host:port (e.g. 127.0.0.1:2379); "
            "give members as host:port without a scheme"
        )
    return host, int(port)


def prefix_range_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix``.

    The last byte below 0xff is incremented and what follows it dropped; a prefix of only
    0xff bytes (or an empty one) has no upper bound, which etcd spells ``b"\\0"``.
    """
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


def backoff_delay(
    round_no: int, jitter: float, base: float = _BACKOFF_BASE_S, cap: float = _BACKOFF_CAP_S
) -> float:
    """Seconds to wait after ``round_no`` (0-based) full rounds over every endpoint failed.

    Exponential from ``base`` up to ``cap``; ``jitter`` in [0, 1) spreads the wait over
    its upper half so clients that failed together do not retry together.
    """
    ceiling = min(cap, base * float(2 ** min(round_no, 30)))
    return ceiling * (0.5 + jitter / 2)


def classify_status(code: Any, details: str) -> str:
    """Map a gRPC status from etcd to one of the failure kinds of this module."""
    text = details.lower()
    if "invalid auth token" in text or "revision of auth store is old" in text:
        return REAUTH
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return REAUTH
    if "authentication failed" in text:
        return AUTH_FAILED
    if "user name is empty" in text or "user name not found" in text:
        return AUTH_REQUIRED
    if code == grpc.StatusCode.PERMISSION_DENIED or "permission denied" in text:
        return PERMISSION
    if "authentication is not enabled" in text:
        return AUTH_DISABLED
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return RETRY
    if code == grpc.StatusCode.NOT_FOUND:
        return NOT_FOUND
    return FATAL


def _status(exc: grpc.RpcError) -> tuple[Any, str]:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return code, str(details or "")


def _code_name(code: Any) -> str:
    return str(getattr(code, "name", code))


def _tls_refused(details: str) -> bool:
    text = details.lower()
    return any(word in text for word in ("ssl", "handshake", "certificate", "tls"))


class _Ring:
    """The endpoint in use and where to fail over to; shared by every call of a client."""

    def __init__(self, endpoints: Sequence[str], start: int) -> None:
        self.names = tuple(endpoints)
        self._current = start % len(self.names)
        self._lock = threading.Lock()

    def current(self) -> int:
        with self._lock:
            return self._current

    def failed(self, index: int) -> None:
        """``index`` failed: move on, unless another thread already did."""
        with self._lock:
            if self._current == index:
                self._current = (index + 1) % len(self.names)


def run_with_failover(
    attempt: Callable[[int, float], T],
    ring: _Ring,
    *,
    what: str,
    request_timeout: float,
    budget: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    rng: random.Random,
) -> T:
    """Run ``attempt(endpoint_index, timeout)`` until it returns, failing over on errors.

    A connection-level failure (UNAVAILABLE, DEADLINE_EXCEEDED) moves to the next endpoint
    at once; after every endpoint failed in a row it waits :func:`backoff_delay`. It gives
    up when ``budget`` seconds have passed and every endpoint was tried at least once.
    Any other ``grpc.RpcError`` is re-raised for the caller to translate.

    Raises:
        EtcdConnectionError: no endpoint answered (or ``EtcdTLSError`` when the last
            failure was a refused TLS handshake); names every endpoint tried.
    """
    start = clock()
    tried: list[str] = []
    failures = 0
    while True:
        index = ring.current()
        remaining = budget - (clock() - start)
        timeout = max(min(request_timeout, remaining), 0.05)
        try:
            return attempt(index, timeout)
        except grpc.RpcError as exc:
            code, details = _status(exc)
            if classify_status(code, details) != RETRY:
                raise
            name = ring.names[index]
            if name not in tried:
                tried.append(name)
            ring.failed(index)
            failures += 1
            elapsed = clock() - start
            if elapsed >= budget and len(tried) == len(ring.names):
                message = (
                    f"no etcd member answered {what} within {budget:g} s; tried "
                    f"{', '.join(tried)}; last error from {name}: {_code_name(code)}: "
                    f"{details}. Check that etcd runs and is reachable at these endpoints"
                )
                error = EtcdTLSError if _tls_refused(details) else EtcdConnectionError
                raise error(message) from exc
            if failures % len(ring.names) == 0:
                delay = backoff_delay(failures // len(ring.names) - 1, rng.random())
                sleep(max(0.0, min(delay, budget - elapsed)))


def _read_tls_file(what: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise EtcdTLSError(
            f"cannot read the TLS {what} file {path!r}: {exc.strerror or exc}; "
            "check the path and its permissions"
        ) from exc


@dataclass(frozen=True)
class _Stubs:
    kv: Any
    lease: Any
    watch: Any
    auth: Any


class _Channels:
    """One gRPC channel per endpoint, opened on first use."""

    def __init__(self, config: EtcdConfig) -> None:
        self._config = config
        self._creds: Any = None
        if config.protocol == "https":
            self._creds = grpc.ssl_channel_credentials(
                root_certificates=_read_tls_file("CA certificate", config.ca_cert),
                private_key=_read_tls_file("client key", config.cert_key),
                certificate_chain=_read_tls_file("client certificate", config.cert),
            )
        self._lock = threading.Lock()
        self._open: dict[int, tuple[Any, _Stubs]] = {}
        self._closed = False

    def stubs(self, index: int) -> _Stubs:
        with self._lock:
            if self._closed:
                raise EtcdConnectionError("the etcd client is closed; create a new one")
            if index not in self._open:
                target = self._config.endpoints[index]
                if self._creds is None:
                    channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
                else:
                    channel = grpc.secure_channel(target, self._creds, options=_CHANNEL_OPTIONS)
                stubs = _Stubs(
                    kv=etcdrpc.KVStub(channel),
                    lease=etcdrpc.LeaseStub(channel),
                    watch=etcdrpc.WatchStub(channel),
                    auth=etcdrpc.AuthStub(channel),
                )
                self._open[index] = (channel, stubs)
            return self._open[index][1]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels = [channel for channel, _ in self._open.values()]
            self._open.clear()
        for channel in channels:
            channel.close()


# -- the client ------------------------------------------------------------------------------


class EtcdClient:
    """A thread-safe etcd v3 client with failover, auth, watches and lease keep-alives.

    One instance may be shared by many threads. Every KV call returns etcd's header
    revision with its result, so callers can watch from exactly the revision they read.

    Args:
        config: where etcd is and how to authenticate.
        clock: monotonic seconds; injected so tests can drive retry decisions.
        sleep: waits between failover rounds (default: a wait that :meth:`close` cuts short).
        rng: picks the first endpoint (spreading clients over members) and the jitter.

    Raises:
        EtcdTLSError: a TLS file cannot be read (names the file).
    """

    def __init__(
        self,
        config: EtcdConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._config = config
        self._clock = clock
        self._rng = rng or random.Random()
        self._closed = threading.Event()
        self._sleep = sleep or self._wait
        self._ring = _Ring(config.endpoints, self._rng.randrange(len(config.endpoints)))
        self._channels = _Channels(config)
        self._auth_lock = threading.Lock()
        self._token: str | None = None  # "" once etcd said auth is not enabled
        self._keepalives: set[KeepAlive] = set()
        self._lock = threading.Lock()
        self._watcher = _Watcher(self)

    def _wait(self, seconds: float) -> None:
        # A wait that close() ends early, so a closing client does not sit out a backoff.
        self._closed.wait(seconds)

    @property
    def config(self) -> EtcdConfig:
        return self._config

    @property
    def current_endpoint(self) -> str:
        """The endpoint new calls and streams go to first (changes on failover)."""
        return self._config.endpoints[self._ring.current()]

    @property
    def watch_endpoint(self) -> str | None:
        """The endpoint the watch stream last got an answer from (None: no stream)."""
        return self._watcher.endpoint

    # -- plumbing ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise EtcdConnectionError("the etcd client is closed; create a new one")

    def _failover(self, what: str, attempt: Callable[[int, float], T], budget: float) -> T:
        return run_with_failover(
            attempt,
            self._ring,
            what=what,
            request_timeout=self._config.request_timeout,
            budget=budget,
            clock=self._clock,
            sleep=self._sleep,
            rng=self._rng,
        )

    def _metadata(self, budget: float | None = None) -> Metadata:
        """The token metadata for a call, authenticating first if we have none."""
        if self._config.user is None:
            return None
        with self._auth_lock:
            if self._token is None:
                self._token = self._authenticate(budget or self._config.retry_budget)
            token = self._token
        return (("token", token),) if token else None

    def _authenticate(self, budget: float) -> str:
        request = etcdrpc.AuthenticateRequest(
            name=self._config.user, password=self._config.password
        )

        def attempt(index: int, timeout: float) -> str:
            stubs = self._channels.stubs(index)
            return str(stubs.auth.Authenticate(request, timeout=timeout).token)

        try:
            return self._failover("Authenticate", attempt, budget)
        except grpc.RpcError as exc:
            code, details = _status(exc)
            kind = classify_status(code, details)
            if kind == AUTH_DISABLED:
                log.info("etcd auth is not enabled; user %r is not needed", self._config.user)
                return ""
            if kind in (AUTH_FAILED, AUTH_REQUIRED):
                raise EtcdAuthError(
                    f"etcd rejected the credentials of user {self._config.user!r} "
                    f"({details}); check the user and password settings"
                ) from exc
            raise EtcdConnectionError(
                f"etcd refused Authenticate for user {self._config.user!r}: "
                f"{_code_name(code)}: {details}"
            ) from exc

    def _invalidate_token(self, used: Metadata) -> None:
        """Forget the token ``used`` was built from (unless another thread already did)."""
        with self._auth_lock:
            if used is not None and self._token == used[0][1]:
                self._token = None

    def _unary(
        self,
        what: str,
        call: Callable[[_Stubs, float, Metadata], T],
        *,
        key: bytes | None = None,
        budget: float | None = None,
    ) -> T:
        """One unary RPC with failover, token refresh and error translation."""
        self._check_open()
        reauths = 0
        while True:
            metadata = self._metadata()

            def attempt(index: int, timeout: float, metadata: Metadata = metadata) -> T:
                return call(self._channels.stubs(index), timeout, metadata)

            try:
                return self._failover(what, attempt, budget or self._config.retry_budget)
            except grpc.RpcError as exc:
                code, details = _status(exc)
                kind = classify_status(code, details)
                if kind == REAUTH and metadata is not None and reauths < 2:
                    reauths += 1
                    self._invalidate_token(metadata)
                    continue
                raise self._translate(what, key, code, details) from exc
            except ValueError as exc:  # grpc's "Cannot invoke RPC on closed channel!"
                self._check_open()
                raise EtcdConnectionError(f"etcd call {what} failed: {exc}") from exc

    def _translate(self, what: str, key: bytes | None, code: Any, details: str) -> Exception:
        kind = classify_status(code, details)
        on_key = f" on key {key!r}" if key is not None else ""
        if kind == PERMISSION:
            return EtcdAuthError(
                f"etcd user {self._config.user!r} is not permitted to {what}{on_key} "
                f"({details}); grant the user's role readwrite on the key prefix"
            )
        if kind in (AUTH_REQUIRED, AUTH_FAILED, REAUTH):
            return EtcdAuthError(
                f"etcd refused {what}{on_key}: {details}; etcd has auth enabled: "
                "set the user and password settings"
            )
        if code == grpc.StatusCode.CANCELLED and self._closed.is_set():
            return EtcdConnectionError(f"the etcd client was closed during {what}{on_key}")
        return EtcdConnectionError(f"etcd refused {what}{on_key}: {_code_name(code)}: {details}")

    # -- KV ----------------------------------------------------------------------------

    def _range(self, what: str, request: Any, key: bytes) -> Any:
        return self._unary(
            what, lambda s, t, m: s.kv.Range(request, timeout=t, metadata=m), key=key
        )

    def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        """Return the key (None if absent) and the header revision."""
        rsp = self._range("get", etcdrpc.RangeRequest(key=key), key)
        return (_kv(rsp.kvs[0]) if rsp.kvs else None), int(rsp.header.revision)

    def get_prefix(
        self,
        prefix: bytes,
        *,
        sort_by_create: bool = False,
        descending: bool = False,
        limit: int = 0,
        max_create_revision: int = 0,
        keys_only: bool = False,
    ) -> tuple[list[KeyValue], int]:
        """Return the keys under ``prefix`` and the header revision.

        Sorted by key, or by create revision with ``sort_by_create``; ``limit`` 0 is no
        limit; ``max_create_revision`` > 0 keeps keys created at or before it.
        """
        request = etcdrpc.RangeRequest(
            key=prefix,
            range_end=prefix_range_end(prefix),
            limit=limit,
            keys_only=keys_only,
            max_create_revision=max_create_revision,
            sort_target=etcdrpc.RangeRequest.CREATE if sort_by_create else etcdrpc.RangeRequest.KEY,
            sort_order=etcdrpc.RangeRequest.DESCEND if descending else etcdrpc.RangeRequest.ASCEND,
        )
        rsp = self._range("get_prefix", request, prefix)
        return [_kv(kv) for kv in rsp.kvs], int(rsp.header.revision)

    def count_prefix(self, prefix: bytes) -> tuple[int, int]:
        """Return how many keys are under ``prefix`` and the header revision."""
        request = etcdrpc.RangeRequest(
            key=prefix, range_end=prefix_range_end(prefix), count_only=True
        )
        rsp = self._range("count_prefix", request, prefix)
        return int(rsp.count), int(rsp.header.revision)

    def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Write ``key`` (bound to ``lease`` if non-zero); return the header revision."""
        request = etcdrpc.PutRequest(key=key, value=value, lease=lease)
        rsp = self._unary("put", lambda s, t, m: s.kv.Put(request, timeout=t, metadata=m), key=key)
        return int(rsp.header.revision)

    def _delete_range(self, what: str, key: bytes, range_end: bytes) -> tuple[int, int]:
        request = etcdrpc.DeleteRangeRequest(key=key, range_end=range_end)
        rsp = self._unary(
            what, lambda s, t, m: s.kv.DeleteRange(request, timeout=t, metadata=m), key=key
        )
        return int(rsp.deleted), int(rsp.header.revision)

    def delete(self, key: bytes) -> tuple[int, int]:
        """Delete ``key``; return how many keys were deleted (0 or 1) and the revision."""
        return self._delete_range("delete", key, b"")

    def delete_prefix(self, prefix: bytes) -> tuple[int, int]:
        """Delete every key under ``prefix``; return the count deleted and the revision.

        Raises:
            ValueError: ``prefix`` is empty (that would wipe the whole keyspace).
        """
        _check_prefix(prefix)
        return self._delete_range("delete_prefix", prefix, prefix_range_end(prefix))

    def _guarded_txn(
        self, what: str, key: bytes, mod_revision: int, success: list[Any]
    ) -> TxnResult:
        if mod_revision == 0:
            # Revision 0 means "the key must not exist": an absent key has version 0.
            compare = etcdrpc.Compare(
                key=key, target=etcdrpc.Compare.VERSION, result=etcdrpc.Compare.EQUAL, version=0
            )
        else:
            compare = etcdrpc.Compare(
                key=key,
                target=etcdrpc.Compare.MOD,
                result=etcdrpc.Compare.EQUAL,
                mod_revision=mod_revision,
            )
        request = etcdrpc.TxnRequest(
            compare=[compare],
            success=success,
            # A lost race reads the winner's value in the same round trip.
            failure=[etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key))],
        )
        # Retrying after an unknown outcome (a timeout, a member dying mid-call) is safe:
        # if the first attempt committed, the key's mod_revision moved, so the retry's
        # compare fails and returns the current value, which the caller re-examines (it
        # sees its own write) instead of the write being applied twice.
        rsp = self._unary(what, lambda s, t, m: s.kv.Txn(request, timeout=t, metadata=m), key=key)
        current = None
        if not rsp.succeeded and rsp.responses:
            kvs = rsp.responses[0].response_range.kvs
            current = _kv(kvs[0]) if kvs else None
        return TxnResult(bool(rsp.succeeded), int(rsp.header.revision), current)

    def put_if_mod_revision(
        self,
        key: bytes,
        value: bytes,
        mod_revision: int,
        *,
        lease: int = 0,
        also_put: Sequence[tuple[bytes, bytes, int]] = (),
        also_delete_prefixes: Sequence[bytes] = (),
    ) -> TxnResult:
        """Put ``key`` only if its mod_revision is still ``mod_revision`` (0: absent).

        On success also puts each ``(key, value, lease)`` of ``also_put`` and deletes
        each prefix of ``also_delete_prefixes``, all in one transaction. On failure the
        result carries the key's current value.

        Raises:
            ValueError: a key is written twice, or a put falls under a deleted prefix
                (etcd refuses such a transaction).
        """
        puts = [(key, value, lease), *also_put]
        _check_txn_ops([k for k, _, _ in puts], also_delete_prefixes)
        success = [
            etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=k, value=v, lease=lease_id))
            for k, v, lease_id in puts
        ] + [
            etcdrpc.RequestOp(
                request_delete_range=etcdrpc.DeleteRangeRequest(
                    key=p, range_end=prefix_range_end(p)
                )
            )
            for p in also_delete_prefixes
        ]
        return self._guarded_txn("put_if_mod_revision", key, mod_revision, success)

    def delete_if_mod_revision(self, key: bytes, mod_revision: int) -> TxnResult:
        """Delete ``key`` only if its mod_revision is still ``mod_revision``."""
        success = [etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=key))]
        return self._guarded_txn("delete_if_mod_revision", key, mod_revision, success)

    # -- leases --------------------------------------------------------------------------

    def lease_grant(self, ttl: int) -> int:
        """Grant a lease of ``ttl`` seconds; return its id.

        A retry after an unknown outcome may leave an unused lease behind; it expires
        after ``ttl`` on its own.
        """
        request = etcdrpc.LeaseGrantRequest(TTL=ttl)
        rsp = self._unary(
            "lease_grant", lambda s, t, m: s.lease.LeaseGrant(request, timeout=t, metadata=m)
        )
        if rsp.error:
            raise EtcdConnectionError(f"etcd refused a lease of {ttl} s: {rsp.error}")
        return int(rsp.ID)

    def lease_revoke(self, lease_id: int, *, budget: float | None = None) -> None:
        """Revoke the lease and delete its keys. A lease already gone is not an error."""
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        try:
            self._unary(
                f"lease_revoke of lease {lease_id:x}",
                lambda s, t, m: s.lease.LeaseRevoke(request, timeout=t, metadata=m),
                budget=budget,
            )
        except EtcdConnectionError as exc:
            if (
                isinstance(exc.__cause__, grpc.RpcError)
                and classify_status(*_status(exc.__cause__)) == NOT_FOUND
            ):
                return
            raise

    def lease_time_to_live(self, lease_id: int) -> int:
        """Seconds the lease has left, or -1 if it expired or was revoked."""
        request = etcdrpc.LeaseTimeToLiveRequest(ID=lease_id)
        rsp = self._unary(
            "lease_time_to_live",
            lambda s, t, m: s.lease.LeaseTimeToLive(request, timeout=t, metadata=m),
        )
        return int(rsp.TTL)

    def keep_alive(
        self, lease_id: int, ttl: int, on_lost: Callable[[], None] | None = None
    ) -> KeepAlive:
        """Keep the lease alive on one long-lived stream until closed or lost.

        ``on_lost`` runs once, on the keep-alive thread, when the lease is lost; it must
        not block.
        """
        self._check_open()
        keepalive = KeepAlive(self, lease_id, ttl, on_lost)
        with self._lock:
            self._keepalives.add(keepalive)
        keepalive._start()
        return keepalive

    def _forget(self, keepalive: KeepAlive) -> None:
        with self._lock:
            self._keepalives.discard(keepalive)

    # -- watches -------------------------------------------------------------------------

    def watch(
        self,
        key: bytes,
        start_revision: int,
        on_events: Callable[[list[WatchEvent], int], None],
        on_compacted: Callable[[int], None],
        *,
        prefix: bool = False,
        prev_kv: bool = False,
        on_error: Callable[[Exception], None] | None = None,
    ) -> Watch:
        """Watch ``key`` (every key under it with ``prefix``) from ``start_revision``.

        ``start_revision`` 0 means "from now". Events arrive in revision order through
        ``on_events(events, header_revision)``; after a broken stream the watch resumes
        from the revision after the last event delivered, so none is lost or repeated.
        When etcd has compacted the revision needed, ``on_compacted(compact_revision)``
        runs once and the watch ends: re-read and watch again. When etcd cancels the watch
        for another reason (e.g. no permission), ``on_error(error)`` runs once (default:
        logged). All callbacks run on the client's single watch thread: they must not
        block (no RPCs, no waiting); hand work to another thread instead.

        Creating and cancelling a watch is one message on the shared stream.
        """
        self._check_open()
        if prefix:
            _check_prefix(key)
        state = _WatchState(
            key=key,
            range_end=prefix_range_end(key) if prefix else b"",
            next_rev=start_revision,
            on_events=on_events,
            on_compacted=on_compacted,
            on_error=on_error,
            prev_kv=prev_kv,
        )
        self._watcher.add(state)
        return Watch(self._watcher, state)

    def close(self) -> None:
        """Stop every keep-alive (without revoking), the watch thread and all channels."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            keepalives = list(self._keepalives)
        for keepalive in keepalives:
            keepalive.close(revoke=False)
        self._watcher.close()
        self._channels.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_prefix(prefix: bytes) -> None:
    if not prefix:
        raise ValueError("an empty key prefix would select the whole keyspace; refusing it")


def _check_txn_ops(put_keys: Sequence[bytes], delete_prefixes: Sequence[bytes]) -> None:
    seen: set[bytes] = set()
    for key in put_keys:
        if key in seen:
            raise ValueError(f"key {key!r} is written twice in one transaction")
        seen.add(key)
        for prefix in delete_prefixes:
            _check_prefix(prefix)
            if key.startswith(prefix):
                raise ValueError(
                    f"key {key!r} is put and deleted (prefix {prefix!r}) in one transaction"
                )
    for prefix in delete_prefixes:
        _check_prefix(prefix)


# -- lease keep-alive --------------------------------------------------------------------------


class KeepAlive:
    """One long-lived keep-alive stream for one lease.

    Sends a keep-alive about every ``ttl / 3`` and reads the answers. The lease counts as
    lost when etcd answers TTL 0 (expired or revoked) or when no keep-alive succeeded for
    ``ttl`` seconds (etcd may have expired it meanwhile: assume it did). A broken stream is
    reopened on the next endpoint within that time. Safety: once :meth:`lost` is true, the
    keys on the lease must be assumed gone.
    """

    lease_id: int
    ttl: int

    def __init__(
        self, client: EtcdClient, lease_id: int, ttl: int, on_lost: Callable[[], None] | None
    ) -> None:
        self.lease_id = lease_id
        self.ttl = ttl
        self._client = client
        self._on_lost = on_lost
        self._interval = max(ttl / 3.0, 0.1)
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._last_ok = client._clock()
        # Where the stream last got an answer (None while reconnecting), for diagnostics.
        self.endpoint: str | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-keepalive-{lease_id:x}", daemon=True
        )

    def _start(self) -> None:
        self._thread.start()

    def lost(self) -> bool:
        """Whether the lease is lost (expired, revoked, or not renewed within its TTL)."""
        return self._lost.is_set()

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until the lease is lost or ``timeout`` passes; return :meth:`lost`."""
        return self._lost.wait(timeout)

    def close(self, revoke: bool = True) -> None:
        """Stop the stream and, with ``revoke``, revoke the lease (best effort, bounded)."""
        first = not self._stop.is_set()
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if threading.current_thread() is not self._thread and self._thread.ident is not None:
            self._thread.join()
        self._client._forget(self)
        if first and revoke and not self._lost.is_set() and not self._client._closed.is_set():
            try:
                self._client.lease_revoke(self.lease_id, budget=self._client.config.request_timeout)
            except EtcdConnectionError as exc:
                log.warning("could not revoke lease %x (it expires by TTL): %s", self.lease_id, exc)

    def _declare_lost(self, reason: str) -> None:
        if self._stop.is_set() or self._lost.is_set():
            return
        log.warning("etcd lease %x lost: %s", self.lease_id, reason)
        self._lost.set()
        if self._on_lost is not None:
            try:
                self._on_lost()
            except Exception:
                log.exception("on_lost callback of lease %x failed", self.lease_id)

    def _requests(self, done: threading.Event, pending: list[float]) -> Iterator[Any]:
        """Requests of one stream; runs on gRPC's feeding thread. Cancels a stale stream."""
        clock = self._client._clock
        while not done.is_set():
            with self._lock:
                pending.append(clock())
            yield etcdrpc.LeaseKeepAliveRequest(ID=self.lease_id)
            if done.wait(self._interval):
                return
            with self._lock:
                stale = bool(pending)
                call = self._call
            if stale and call is not None:
                # No answer within an interval: this member is hung; try the next one.
                done.set()
                call.cancel()
                return

    def _run(self) -> None:
        client = self._client
        clock = client._clock
        failures = 0
        while not self._stop.is_set():
            if clock() - self._last_ok >= self.ttl:
                self._declare_lost(f"no keep-alive succeeded for {self.ttl} s")
                return
            index = client._ring.current()
            done = threading.Event()
            pending: list[float] = []
            metadata: Metadata = None
            try:
                # Re-authenticating must not outlast the lease's own deadline.
                metadata = client._metadata(max(0.1, self.ttl - (clock() - self._last_ok)))
                call = client._channels.stubs(index).lease.LeaseKeepAlive(
                    self._requests(done, pending), metadata=_stream_metadata(metadata)
                )
                with self._lock:
                    self._call = call
                if self._stop.is_set():
                    call.cancel()
                for rsp in call:
                    self.endpoint = client.config.endpoints[index]
                    if rsp.TTL <= 0:
                        self._declare_lost("etcd says it expired or was revoked")
                        return
                    with self._lock:
                        pending.clear()
                    self._last_ok = clock()
                    failures = 0
                raise_kind = RETRY  # the server ended the stream: reconnect elsewhere
            except grpc.RpcError as exc:
                code, details = _status(exc)
                raise_kind = RETRY if done.is_set() else classify_status(code, details)
                if not self._stop.is_set():
                    log.info("keep-alive stream of lease %x broke: %s", self.lease_id, details)
            except (EtcdConnectionError, ValueError) as exc:
                raise_kind = RETRY
                log.info("keep-alive of lease %x cannot connect: %s", self.lease_id, exc)
            finally:
                done.set()
                with self._lock:
                    self._call = None
                self.endpoint = None
            if self._stop.is_set():
                return  # closed on purpose: not an endpoint failure
            if raise_kind == REAUTH:
                client._invalidate_token(metadata)
            else:
                client._ring.failed(index)
            failures += 1
            if failures % len(client.config.endpoints) == 0:
                left = self.ttl - (clock() - self._last_ok)
                delay = backoff_delay(
                    failures // len(client.config.endpoints) - 1, client._rng.random()
                )
                self._stop.wait(max(0.0, min(delay, left)))


# -- watches ---------------------------------------------------------------------------------


class _WatchState:
    """One watch as the watch thread sees it; ``next_rev`` is where a resume starts."""

    def __init__(
        self,
        *,
        key: bytes,
        range_end: bytes,
        next_rev: int,
        on_events: Callable[[list[WatchEvent], int], None],
        on_compacted: Callable[[int], None],
        on_error: Callable[[Exception], None] | None,
        prev_kv: bool,
    ) -> None:
        self.key = key
        self.range_end = range_end
        self.next_rev = next_rev
        self.on_events = on_events
        self.on_compacted = on_compacted
        self.on_error = on_error
        self.prev_kv = prev_kv
        self.server_id: int | None = None
        self.cancelled = False
        self.auth_retried = False
        # Held while a callback runs, so cancel() from another thread returns only after
        # it: no callback of a cancelled watch starts later. Reentrant for cancel() from
        # inside a callback.
        self.lock = threading.RLock()


class Watch:
    """A running watch; events are delivered on the client's watch thread."""

    def __init__(self, watcher: _Watcher, state: _WatchState) -> None:
        self._watcher = watcher
        self._state = state

    @property
    def next_revision(self) -> int:
        """The revision the watch would resume from (0: not yet created, from now)."""
        return self._state.next_rev

    def cancel(self) -> None:
        """Stop the watch; no callback of it starts after this returns. Idempotent."""
        self._watcher.cancel(self._state)


def _event(pb: Any) -> WatchEvent:
    prev = _kv(pb.prev_kv) if pb.HasField("prev_kv") and pb.prev_kv.key else None
    kind: Literal["put", "delete"] = "delete" if pb.type == 1 else "put"
    return WatchEvent(kind=kind, kv=_kv(pb.kv), prev_kv=prev)


def _stream_metadata(metadata: Metadata) -> tuple[tuple[str, str], ...]:
    # "hasleader" asks etcd to end the stream when its member loses the leader (e.g. it
    # is partitioned away), instead of leaving us on a member that will never send
    # another event or renew a lease; we then fail over like on any broken stream.
    return (*(metadata or ()), ("hasleader", "true"))


def _queue_iter(requests: queue.SimpleQueue[Any]) -> Iterator[Any]:
    while True:
        item = requests.get()
        if item is None:
            return
        yield item


class _Watcher:
    """One watch stream per client, multiplexing every watch; one thread reads it.

    etcd answers create requests of one stream in order, so the watch a ``created``
    response belongs to is the oldest create still pending on that stream.
    """

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._cond = threading.Condition()
        self._watches: set[_WatchState] = set()
        self._by_id: dict[int, _WatchState] = {}
        self._pending: deque[_WatchState] = deque()
        self._requests: queue.SimpleQueue[Any] | None = None
        self._call: Any = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self.endpoint: str | None = None

    def add(self, state: _WatchState) -> None:
        with self._cond:
            if self._closed:
                raise EtcdConnectionError("the etcd client is closed; create a new one")
            self._watches.add(state)
            if self._requests is not None:
                self._send_create(state, self._requests)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="etcd-watch", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def cancel(self, state: _WatchState) -> None:
        with state.lock:
            state.cancelled = True
        with self._cond:
            self._watches.discard(state)
            if state.server_id is not None:
                self._by_id.pop(state.server_id, None)
                self._send_cancel(state.server_id)
                state.server_id = None

    def _send_create(self, state: _WatchState, requests: queue.SimpleQueue[Any]) -> None:
        create = etcdrpc.WatchCreateRequest(
            key=state.key,
            range_end=state.range_end,
            start_revision=state.next_rev,
            prev_kv=state.prev_kv,
        )
        requests.put(etcdrpc.WatchRequest(create_request=create))
        self._pending.append(state)

    def _send_cancel(self, server_id: int) -> None:
        if self._requests is not None:
            cancel = etcdrpc.WatchCancelRequest(watch_id=server_id)
            self._requests.put(etcdrpc.WatchRequest(cancel_request=cancel))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            call, thread = self._call, self._thread
            self._cond.notify_all()
        if call is not None:
            call.cancel()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        client = self._client
        failures = 0
        while True:
            with self._cond:
                while not self._closed and not self._watches:
                    self._cond.wait()
                if self._closed:
                    return
            index = client._ring.current()
            metadata: Metadata = None
            kind = RETRY
            requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
            try:
                metadata = client._metadata()
                call = client._channels.stubs(index).watch.Watch(
                    _queue_iter(requests), metadata=_stream_metadata(metadata)
                )
                with self._cond:
                    if self._closed:
                        call.cancel()
                    self._call, self._requests = call, requests
                    for state in self._watches:
                        self._send_create(state, requests)
                for response in call:
                    failures = 0
                    self.endpoint = client.config.endpoints[index]
                    self._handle(response, metadata)
            except grpc.RpcError as exc:
                code, details = _status(exc)
                kind = classify_status(code, details)
                if not self._closed:
                    log.info("etcd watch stream to %s broke: %s", self.endpoint, details)
            except EtcdAuthError as exc:
                # The credentials are refused: no retry can help these watches.
                self._fail_all(exc)
            except (EtcdConnectionError, ValueError) as exc:
                log.warning("etcd watch stream cannot connect: %s", exc)
            finally:
                requests.put(None)
                with self._cond:
                    self._call = self._requests = self.endpoint = None
                    self._pending.clear()
                    self._by_id.clear()
                    for state in self._watches:
                        state.server_id = None
            if self._closed:
                return  # closed on purpose: not an endpoint failure
            if kind == REAUTH:
                client._invalidate_token(metadata)
            elif kind == RETRY:
                client._ring.failed(index)
            failures += 1
            if failures % len(client.config.endpoints) == 0:
                client._sleep(
                    backoff_delay(
                        failures // len(client.config.endpoints) - 1, client._rng.random()
                    )
                )

    def _fail_all(self, error: Exception) -> None:
        with self._cond:
            states = list(self._watches)
            self._watches.clear()
        for state in states:
            self._deliver(state, functools.partial(_report, state, error))

    def _handle(self, rs: Any, metadata: Metadata) -> None:
        with self._cond:
            if rs.created:
                state = self._pending.popleft() if self._pending else None
                if state is None:
                    return
                if not (rs.canceled or rs.compact_revision or rs.watch_id < 0):
                    if state.cancelled or state not in self._watches:
                        self._send_cancel(rs.watch_id)
                        return
                    state.server_id = rs.watch_id
                    self._by_id[rs.watch_id] = state
                    if state.next_rev == 0:
                        state.next_rev = int(rs.header.revision) + 1
                    if not rs.events:
                        return
            else:
                state = self._by_id.get(rs.watch_id)
                if state is None:
                    return
            if rs.compact_revision or rs.canceled:
                self._watches.discard(state)
                self._by_id.pop(rs.watch_id, None)
                state.server_id = None
                retry = (
                    not rs.compact_revision
                    and metadata is not None
                    and not state.auth_retried
                    and classify_status(None, rs.cancel_reason) in (PERMISSION, REAUTH)
                )
                if retry:
                    # etcd reports an expired token on a watch as "permission denied":
                    # authenticate again and recreate every watch on a new stream.
                    state.auth_retried = True
                    self._watches.add(state)
                    self._client._invalidate_token(metadata)
                    if self._call is not None:
                        self._call.cancel()
                    return
        if rs.compact_revision:
            self._deliver(state, lambda: state.on_compacted(int(rs.compact_revision)))
        elif rs.canceled:
            error = _watch_error(self._client.config, state, rs.cancel_reason)
            self._deliver(state, lambda: _report(state, error))
        elif rs.events:
            events = [_event(ev) for ev in rs.events]
            state.next_rev = events[-1].kv.mod_revision + 1
            self._deliver(state, lambda: state.on_events(events, int(rs.header.revision)))

    @staticmethod
    def _deliver(state: _WatchState, callback: Callable[[], None]) -> None:
        with state.lock:
            if state.cancelled:
                return
            try:
                callback()
            except Exception:
                log.exception("etcd watch callback for key %r failed", state.key)


def _watch_error(config: EtcdConfig, state: _WatchState, reason: str) -> Exception:
    if classify_status(None, reason) in (PERMISSION, REAUTH, AUTH_REQUIRED):
        return EtcdAuthError(
            f"etcd user {config.user!r} may not watch key {state.key!r} ({reason}); "
            "grant the user's role read on the key prefix"
        )
    return EtcdConnectionError(f"etcd cancelled the watch on key {state.key!r}: {reason}")


def _report(state: _WatchState, error: Exception) -> None:
    if state.on_error is not None:
        state.on_error(error)
    else:
        log.error("%s", error)
