"""Failover over etcd members: failure kinds of a gRPC status, backoff, the endpoint ring."""

from __future__ import annotations

import random
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from coordinator.core.errors import EtcdConnectionError, EtcdTLSError
from coordinator.core.etcd_client._tls_probe import serves_tls

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
    "TlsSide",
    "_Ring",
    "_code_name",
    "_status",
    "backoff_delay",
    "classify_status",
    "endpoint_mismatch",
    "run_with_failover",
    "tls_mismatch",
]

Probe = Callable[[str, float], bool]
"""Whether the member at an endpoint serves TLS, asked within a timeout (seconds)."""

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
    if "context deadline exceeded" in text:
        # The member ran out of our deadline itself (e.g. a linearizable read while the
        # cluster elects a new leader) and etcd 3.5 sends that as UNKNOWN: the same
        # unknown outcome as our own DEADLINE_EXCEEDED, so the same retry on the next
        # member (measured: a member killed mid-rendezvous failed two joins with it).
        return RETRY
    if "too many requests" in text:
        # etcd refused the request before proposing it (its apply loop is far behind
        # its commits, e.g. a thousand nodes joining at once): not applied, so safe to
        # send again after a backoff. Other RESOURCE_EXHAUSTED answers (no space left,
        # a request too large) would only repeat.
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


@dataclass(frozen=True)
class TlsSide:
    """What the client sent in a TLS handshake: what :func:`tls_mismatch` needs to name
    the likely fix (``ca_cert`` and ``cert`` are file paths, None when not given)."""

    protocol: str = "http"
    ca_cert: str | None = None
    cert: str | None = None


# The fix, named in both vocabularies: etcdrun's --rdzv-conf keys and rdzvctl's flags.
_SET_HTTPS = "use https:// endpoints (etcdrun: protocol=https,ca_cert=FILE; rdzvctl: --ca-cert)"
_SET_CA = "set ca_cert (rdzvctl: --ca-cert) to the CA that signed etcd's --cert-file"
_SET_CERT = "set ssl_cert and ssl_cert_key (rdzvctl: --cert and --key)"


def tls_mismatch(
    details: str, endpoints: Sequence[str], side: TlsSide, *, expired_client_cert: bool = False
) -> tuple[str, bool] | None:
    """One line for a TLS mismatch seen in a gRPC failure's ``details``, or None.

    Returns the message (naming ``endpoints`` as URLs and the likely fix) and whether the
    failure is certain to repeat (a certificate refused), as opposed to a connection
    closed at once, which a plain-http client sees from a TLS server but also from a
    member going away (:func:`endpoint_mismatch` settles that one). The strings matched
    are grpc's (1.6x, BoringSSL), observed against real etcd 3.5 servers
    (tests/unit/test_tls_mismatch.py pins each).
    """
    text = details.lower()
    urls = ", ".join(f"{side.protocol}://{endpoint}" for endpoint in endpoints)
    if side.protocol == "http":
        if "socket closed" in text or "wrong_version_number" in text:
            return (
                f"etcd at {urls} closed the connection before answering plain http: it most "
                f"likely serves TLS; {_SET_HTTPS}",
                False,
            )
        return None
    if "handshake read failed" in text or "wrong_version_number" in text:
        return (
            f"etcd at {urls} did not answer the TLS handshake: it most likely serves plain "
            "http; use http:// endpoints without TLS files, or start etcd with --cert-file "
            "and --key-file",
            True,
        )
    if "certificate has expired" in text:
        return (
            f"the certificate of etcd at {urls} has expired: renew etcd's --cert-file "
            "(then restart that member)",
            True,
        )
    if "hostname verification" in text or "not in peer certificate" in text:
        return (
            f"the certificate of etcd at {urls} does not name the host connected to: connect "
            "by a name or IP in its subjectAltName, or reissue it with that host in it",
            True,
        )
    if "certificate_verify_failed" in text:
        trusted = f"the CA in {side.ca_cert}" if side.ca_cert else "the system's CAs"
        return (
            f"the certificate of etcd at {urls} is not signed by {trusted}: {_SET_CA}",
            True,
        )
    if any(w in text for w in ("tsi_data_corrupted", "bad_certificate", "certificate_required")):
        if side.cert is None:
            return (
                f"etcd at {urls} requires a client certificate (--client-cert-auth) and none "
                f"was given: {_SET_CERT}",
                True,
            )
        why = (
            "it has expired: renew it"
            if expired_client_cert
            else "it has expired or is not signed by etcd's --trusted-ca-file: renew it, "
            "signed by that CA"
        )
        return (f"etcd at {urls} refused the client certificate {side.cert}: {why}", True)
    return None


def endpoint_mismatch(
    details: str, name: str, side: TlsSide, timeout: float, probe: Probe = serves_tls
) -> tuple[str, bool] | None:
    """:func:`tls_mismatch` of one failure of endpoint ``name``. Plain http cut off by the
    member is uncertain from the failure alone (a member going away does that too): then
    the member is asked for a TLS handshake (:func:`._tls_probe.serves_tls`), and one
    that answers it makes the mismatch certain."""
    mismatch = tls_mismatch(details, [name], side)
    if mismatch is not None and not mismatch[1] and probe(name, timeout):
        return mismatch[0], True
    return mismatch


def unreachable(
    what: str,
    budget: float,
    tried: Sequence[str],
    name: str,
    code: Any,
    details: str,
    side: TlsSide | None = None,
    mismatched: Sequence[str] = (),
) -> EtcdConnectionError:
    """The error for "no member answered ``what`` within ``budget``", naming every
    endpoint tried and the last failure (``EtcdTLSError``, one line naming the likely fix,
    when that failure was a TLS mismatch: it names ``name`` and the endpoints in
    ``mismatched``, those whose last failure was a TLS mismatch too)."""
    if side is not None:
        names = [n for n in tried if n in mismatched or n == name]
        mismatch = tls_mismatch(details, names, side, expired_client_cert=_expired(side.cert))
        if mismatch is not None:
            return EtcdTLSError(mismatch[0])
    message = (
        f"no etcd member answered {what} within {budget:g} s; tried "
        f"{', '.join(tried)}; last error from {name}: {_code_name(code)}: "
        f"{details}. Check that etcd runs and is reachable at these endpoints"
    )
    return (EtcdTLSError if _tls_refused(details) else EtcdConnectionError)(message)


def _expired(cert: str | None) -> bool:
    """Whether the PEM certificate file ``cert`` is past its notAfter (False if unknown)."""
    if cert is None:
        return False
    try:
        # The standard library's only certificate parser; private, hence the broad guard.
        decoded = ssl._ssl._test_decode_cert(cert)  # type: ignore[attr-defined]
        return bool(ssl.cert_time_to_seconds(decoded["notAfter"]) < time.time())
    except Exception:
        return False


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
    side: TlsSide | None = None,
    probe: Probe = serves_tls,
) -> T:
    """Run ``attempt(endpoint_index, timeout)`` until it returns, failing over on errors.

    A connection-level failure (UNAVAILABLE, DEADLINE_EXCEEDED) moves to the next endpoint
    at once; after every endpoint failed in a row it waits :func:`backoff_delay`. It gives
    up when ``budget`` seconds have passed and every endpoint was tried at least once.
    Any other ``grpc.RpcError`` is re-raised for the caller to translate. A TLS mismatch
    certain to repeat (see :func:`endpoint_mismatch`, given ``side``; ``probe`` asks a
    member whether it serves TLS) ends the call as soon as every endpoint has refused:
    retrying would only hide it for the whole budget.

    Raises:
        EtcdConnectionError: no endpoint answered (or ``EtcdTLSError`` when the last
            failure was a refused TLS handshake); names every endpoint tried.
    """
    start = clock()
    tried: list[str] = []
    mismatched: dict[str, bool] = {}  # endpoint -> its last failure: a certain TLS mismatch
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
            if side is not None:
                mismatch = endpoint_mismatch(details, name, side, timeout, probe)
                if mismatch is None:
                    mismatched.pop(name, None)
                else:
                    mismatched[name] = mismatch[1]
                if mismatch is not None and sum(mismatched.values()) == len(ring.names):
                    raise unreachable(
                        what, budget, tried, name, code, details, side, tuple(mismatched)
                    ) from exc
            elapsed = clock() - start
            if elapsed >= budget and len(tried) == len(ring.names):
                raise unreachable(
                    what, budget, tried, name, code, details, side, tuple(mismatched)
                ) from exc
            if failures % len(ring.names) == 0:
                delay = backoff_delay(failures // len(ring.names) - 1, rng.random())
                sleep(max(0.0, min(delay, budget - elapsed)))
