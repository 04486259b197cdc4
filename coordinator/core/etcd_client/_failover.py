"""Failover over etcd members: failure kinds of a gRPC status, backoff, the endpoint ring."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from coordinator.core.errors import EtcdConnectionError, EtcdTLSError

__all__ = [
    "AUTH_DISABLED",
    "AUTH_FAILED",
    "AUTH_REQUIRED",
    "FATAL",
    "NOT_FOUND",
    "PERMISSION",
    "REAUTH",
    "RETRY",
    "T",
    "_Ring",
    "_code_name",
    "_status",
    "backoff_delay",
    "classify_status",
    "run_with_failover",
]

T = TypeVar("T")

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


def unreachable(
    what: str, budget: float, tried: Sequence[str], name: str, code: Any, details: str
) -> EtcdConnectionError:
    """The error for "no member answered ``what`` within ``budget``", naming every
    endpoint tried and the last failure (``EtcdTLSError`` for a refused handshake)."""
    message = (
        f"no etcd member answered {what} within {budget:g} s; tried "
        f"{', '.join(tried)}; last error from {name}: {_code_name(code)}: "
        f"{details}. Check that etcd runs and is reachable at these endpoints"
    )
    return (EtcdTLSError if _tls_refused(details) else EtcdConnectionError)(message)


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
                raise unreachable(what, budget, tried, name, code, details) from exc
            if failures % len(ring.names) == 0:
                delay = backoff_delay(failures // len(ring.names) - 1, rng.random())
                sleep(max(0.0, min(delay, budget - elapsed)))
