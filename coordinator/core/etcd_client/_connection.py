"""Channels to etcd members, the auth token, and one unary RPC with failover."""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc

from coordinator.core.errors import (
    EtcdAuthError,
    EtcdConnectionError,
    EtcdPermissionError,
    LeaseLostError,
)
from coordinator.core.etcd_client._etcdrpc import etcdrpc
from coordinator.core.etcd_client._failover import (
    AUTH_DISABLED,
    AUTH_FAILED,
    AUTH_REQUIRED,
    NOT_FOUND,
    PERMISSION,
    REAUTH,
    RETRY,
    T,
    TlsSide,
    _code_name,
    _Ring,
    _status,
    classify_status,
    run_with_failover,
)
from coordinator.core.etcd_client._observer import EtcdObserver, Observed
from coordinator.core.etcd_client._tls_files import TlsFiles
from coordinator.core.etcd_client._types import EtcdConfig, key_text

__all__ = ["Metadata", "StreamEnd", "_Connection", "_stream_metadata"]

log = logging.getLogger("coordinator.core.etcd_client")  # one logger for the whole package
Metadata = tuple[tuple[str, str], ...] | None

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


@dataclass(frozen=True)
class _Stubs:
    kv: Any
    lease: Any
    watch: Any
    auth: Any


class _Channels:
    """One gRPC channel per endpoint, opened on first use; with TLS, opened again on the
    renewed files once they change (:mod:`._tls_files`). A channel left for new files
    stays open for the streams still on it (closing it would cut them) until close()."""

    def __init__(self, config: EtcdConfig) -> None:
        self._config = config
        self._tls = (
            TlsFiles(config.ca_cert, config.cert, config.cert_key)
            if config.protocol == "https"
            else None
        )
        self._lock = threading.Lock()
        self._open: dict[int, tuple[Any, _Stubs]] = {}
        self._retired: list[Any] = []
        self._closed = False

    def stubs(self, index: int) -> _Stubs:
        with self._lock:
            if self._closed:
                raise EtcdConnectionError("the etcd client is closed; create a new one")
            if self._tls is not None and self._tls.renewed():
                self._retired += [channel for channel, _ in self._open.values()]
                self._open.clear()
            if index not in self._open:
                target = self._config.endpoints[index]
                if self._tls is None:
                    channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
                else:
                    creds = self._tls.credentials
                    channel = grpc.secure_channel(target, creds, options=_CHANNEL_OPTIONS)
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
            channels = [channel for channel, _ in self._open.values()] + self._retired
            self._open.clear()
            self._retired.clear()
        for channel in channels:
            channel.close()


class StreamEnd(NamedTuple):
    """How one attempt at a long-lived stream (watch, keep-alive) ended."""

    kind: str  # a failure kind of _failover (RETRY, REAUTH, ...); "" if it was no failure
    metadata: Metadata  # the token it used (to invalidate on REAUTH)
    answered: bool  # etcd answered at least once (resets the backoff)


def _stream_metadata(metadata: Metadata) -> tuple[tuple[str, str], ...]:
    # "hasleader" asks etcd to end the stream when its member loses the leader (e.g. it
    # is partitioned away), instead of leaving us on a member that will never send
    # another event or renew a lease; we then fail over like on any broken stream.
    return (*(metadata or ()), ("hasleader", "true"))


class _Connection:
    """What every etcd call of a client shares: endpoint ring, channels, auth token.

    :class:`EtcdClient` builds on it; its watch and keep-alive threads use these parts
    directly. ``_unary`` runs one RPC with failover, token refresh and error translation,
    and reports it to the client's observer (``_observed``), if any.
    """

    def __init__(
        self,
        config: EtcdConfig,
        *,
        clock: Callable[[], float],
        sleep: Callable[[float], None] | None,
        rng: random.Random | None,
        observer: EtcdObserver | None = None,
    ) -> None:
        self._config = config
        self._observed = Observed(observer)
        self._clock = clock
        self._rng = rng or random.Random()
        self._closed = threading.Event()
        self._sleep = sleep or self._wait
        self._ring = _Ring(config.endpoints, self._rng.randrange(len(config.endpoints)))
        self._channels = _Channels(config)
        self._tls_side = TlsSide(config.protocol, config.ca_cert, config.cert)
        self._auth_lock = threading.Lock()
        self._token: str | None = None  # "" once etcd said auth is not enabled
        self._authenticated = False  # etcd accepted our password once
        # When each member last answered anything on this client (monotonic): the
        # keep-alive takes a member that answers other calls as slow, not hung.
        self._heard = [-math.inf] * len(config.endpoints)

    def _answered_by(self, index: int) -> float:
        """Member ``index`` answered (a reply, or an error status from etcd itself): noted
        for the keep-alive's hang rule and told to the observer. Returns the time."""
        now = self._clock()
        self._heard[index] = now
        self._observed.answered(now)
        return now

    def last_heard(self, index: int) -> float:
        """When member ``index`` last answered anything on this client (monotonic)."""
        return self._heard[index]

    def _wait(self, seconds: float) -> None:
        # A wait that close() ends early, so a closing client does not sit out a backoff.
        self._closed.wait(seconds)

    @property
    def config(self) -> EtcdConfig:
        return self._config

    @property
    def clock(self) -> Callable[[], float]:
        """The monotonic clock this client times its retries and leases by."""
        return self._clock

    @property
    def current_endpoint(self) -> str:
        """The endpoint new calls and streams go to first (changes on failover)."""
        return self._config.endpoints[self._ring.current()]

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
            side=self._tls_side,
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

    def _password(self) -> str:
        """The password, read again from ``password_file`` each time (rotation)."""
        config = self._config
        if config.password_file is None:
            return config.password or ""
        try:
            with open(config.password_file, encoding="utf-8") as handle:
                return handle.read().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise EtcdAuthError(
                f"cannot read the etcd password file {config.password_file!r} of user "
                f"{config.user!r}: {getattr(exc, 'strerror', None) or exc}; check the path "
                "and its permissions"
            ) from None

    def _authenticate(self, budget: float) -> str:
        start = self._clock()
        while True:
            try:
                return self._authenticate_once(budget)
            except EtcdAuthError:
                # A password that worked before and fails now is being rotated: the file
                # and etcd may disagree for a moment. Read it again within the budget.
                rotating = self._authenticated and self._config.password_file is not None
                if not rotating or self._clock() - start >= budget:
                    raise
                log.info("etcd refused the password of user %r; reading the password file "
                         "again (rotation?)", self._config.user)  # fmt: skip
                self._sleep(0.5)

    def _authenticate_once(self, budget: float) -> str:
        request = etcdrpc.AuthenticateRequest(name=self._config.user, password=self._password())

        def attempt(index: int, timeout: float) -> str:
            stubs = self._channels.stubs(index)
            return str(stubs.auth.Authenticate(request, timeout=timeout).token)

        started, failed = self._clock(), True
        try:
            token = self._failover("Authenticate", self._observing("authenticate", attempt), budget)
            self._authenticated, failed = True, False
            return token
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
        finally:
            self._observed.call_done("authenticate", self._clock() - started, failed)

    def _observe_failure(self, method: str, index: int, exc: grpc.RpcError) -> None:
        """Report one failed attempt; an error status other than a connection failure
        is an answer from etcd too (the member is up and said no)."""
        code, details = _status(exc)
        self._observed.attempt_failed(method, _code_name(code))
        if classify_status(code, details) != RETRY:
            self._answered_by(index)

    def _observing(
        self, method: str, attempt: Callable[[int, float], T]
    ) -> Callable[[int, float], T]:
        """``attempt``, noting which member answered and reporting the answer or the
        failure to the observer (if any)."""

        def observed(index: int, timeout: float) -> T:
            try:
                result = attempt(index, timeout)
            except grpc.RpcError as exc:
                self._observe_failure(method, index, exc)
                raise
            self._answered_by(index)
            return result

        return observed

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
        method: str | None = None,
    ) -> T:
        """One unary RPC with failover, token refresh and error translation.

        ``method`` names the call to the observer (a metric label, so a fixed string);
        default ``what``, which must then be one too.
        """
        self._check_open()
        name = method or what
        started, failed = self._clock(), True
        try:
            result = self._unary_retrying(what, name, call, key, budget)
            failed = False
            return result
        finally:
            self._observed.call_done(name, self._clock() - started, failed)

    def _unary_retrying(
        self,
        what: str,
        method: str,
        call: Callable[[_Stubs, float, Metadata], T],
        key: bytes | None,
        budget: float | None,
    ) -> T:
        reauths = 0
        while True:
            metadata = self._metadata()

            def attempt(index: int, timeout: float, metadata: Metadata = metadata) -> T:
                return call(self._channels.stubs(index), timeout, metadata)

            try:
                return self._failover(
                    what, self._observing(method, attempt), budget or self._config.retry_budget
                )
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
        on_key = f" on key {key_text(key)}" if key is not None else ""
        if kind == PERMISSION:
            return EtcdPermissionError(
                f"etcd user {self._config.user!r} is not permitted to {what}{on_key} "
                f"({details}); grant the user's role readwrite on the key prefix"
            )
        if kind in (AUTH_REQUIRED, AUTH_FAILED, REAUTH):
            return EtcdAuthError(
                f"etcd refused {what}{on_key}: {details}; etcd has auth enabled: "
                "set the user and password settings"
            )
        if kind == NOT_FOUND and "lease not found" in details.lower():
            return LeaseLostError(
                f"etcd has no lease for {what}{on_key} ({details}): it expired or was revoked"
            )
        if code == grpc.StatusCode.CANCELLED and self._closed.is_set():
            return EtcdConnectionError(f"the etcd client was closed during {what}{on_key}")
        return EtcdConnectionError(f"etcd refused {what}{on_key}: {_code_name(code)}: {details}")
