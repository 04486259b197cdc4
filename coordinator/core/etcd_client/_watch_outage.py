"""What the watch stream remembers of one outage, from its first break to its next answer.

The endpoints that failed, the last failure and the members that refuse the TLS handshake
for a reason a retry cannot fix: what a watch that etcd did not confirm in time reports,
and when every member refuses, the error that ends the watches still waiting. The stream
logs one info line per outage and the retries of a long one at debug.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from coordinator.core.errors import EtcdConnectionError
from coordinator.core.etcd_client._failover import TlsSide, endpoint_mismatch, unreachable
from coordinator.core.etcd_client._types import EtcdConfig

__all__ = ["StreamOutage"]

log = logging.getLogger("coordinator.core.etcd_client")  # one logger for the whole package


class StreamOutage:
    """The watch stream's failures since it last got an answer (thread-safe: a leaf lock,
    never held across a call out)."""

    def __init__(self, config: EtcdConfig) -> None:
        self._config = config
        self._side = TlsSide(config.protocol, config.ca_cert, config.cert)
        self._lock = threading.Lock()
        # Endpoints that failed since the stream last got an answer, and the last failure
        # (endpoint, status code, details): what a watch not confirmed in time reports.
        self._tried: list[str] = []
        self._last_failure: tuple[str, Any, str] | None = None
        self._quiet = False  # a break was logged since the last answer: the rest at debug
        # Endpoints whose last failure was a TLS mismatch certain to repeat, since the
        # stream last got an answer: once it is every endpoint, unconfirmed watches end.
        self._tls_refused: set[str] = set()

    def unconfirmed(self, key_text: str, waited: float) -> EtcdConnectionError:
        """The error for a watch on ``key_text`` etcd did not confirm within ``waited`` s."""
        with self._lock:
            tried, failure = list(self._tried), self._last_failure
        what = f"watch on key {key_text}"
        if failure is None:
            return EtcdConnectionError(f"etcd did not confirm the {what} within {waited:g} s")
        return unreachable(what, waited, tried, *failure, self._side)

    def answered(self, name: str) -> None:
        """The stream's member ``name`` answered: the outage, if any, is over."""
        with self._lock:
            self._tried, self._last_failure = [], None
            self._tls_refused.clear()
            quiet, self._quiet = self._quiet, False
        if quiet:
            log.info("etcd watch stream open again on %s; every watch resumes", name)

    def failed(self, name: str, code: Any, details: str) -> Exception | None:
        """Record that the stream to ``name`` failed with gRPC ``code`` and ``details``.

        Returns:
            the error that ends every watch still waiting for etcd's confirmation, once
            every member refuses the handshake for a reason a retry cannot fix; else None.
        """
        mismatch = endpoint_mismatch(details, name, self._side, self._config.request_timeout)
        with self._lock:
            if name not in self._tried:
                self._tried.append(name)
            self._last_failure = (name, code, details)
            if mismatch is not None and mismatch[1]:
                self._tls_refused.add(name)
            else:
                self._tls_refused.discard(name)
            refused = len(self._tls_refused) == len(self._config.endpoints)
            tried = list(self._tried)
        if not refused:
            return None
        return unreachable("watch", 0.0, tried, name, code, details, self._side, tried)

    def broke(self, name: str, why: str) -> None:
        """Log that the stream to ``name`` broke because ``why``."""
        with self._lock:
            quiet, self._quiet = self._quiet, True
        # One info line per outage; the retries of a long one at debug.
        (log.debug if quiet else log.info)(
            "etcd watch stream to %s broke: %s; resuming on the next member", name, why
        )
