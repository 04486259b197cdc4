"""What an etcd client tells an observer: its calls, failed attempts, keep-alives, answers.

The client reports to one optional :class:`EtcdObserver` (the agent's Prometheus metrics
implement it, ``agent/observe/metrics.py``; the core imports no metrics library). Reports are
made on the thread that did the work (a caller's, the keep-alive thread, the watch
thread), with no lock of the client held, after the RPC: an observer must be quick and
must not block. One that raises is logged once and then ignored, never allowed to cost a
call, a watch or a lease (:class:`Observed`).

Method names are fixed strings (a bounded set, fit for a metric label): the client's
own method names for unary calls (``get``, ``get_prefix``, ``count_prefix``, ``put``,
``delete``, ``delete_prefix``, ``put_if_mod_revision``, ``delete_if_mod_revision``,
``lease_grant``, ``lease_refresh``, ``lease_revoke``, ``lease_time_to_live``,
``authenticate``), and
``lease_keepalive`` and ``watch`` for the two streams.
"""

from __future__ import annotations

import logging
from typing import Protocol

__all__ = ["NO_ANSWER", "STREAM_ENDED", "EtcdObserver", "Observed"]

log = logging.getLogger("coordinator.core.etcd_client")  # one logger for the whole package

NO_ANSWER = "NO_ANSWER"
"""Code of a keep-alive stream the client gave up on: no answer within the interval."""

STREAM_ENDED = "STREAM_ENDED"
"""Code of a stream the member closed without an error status."""


class EtcdObserver(Protocol):
    """Hears what an :class:`~coordinator.core.etcd_client.EtcdClient` does. Every method
    runs on the thread that did the work, must return at once and should not raise."""

    def call_done(self, method: str, seconds: float, failed: bool) -> None:
        """A unary call returned (``failed`` False) or raised to its caller, after
        ``seconds`` in all: failover, backoff and re-authentication included."""

    def attempt_failed(self, method: str, code: str) -> None:
        """One attempt at ``method`` on one member failed with gRPC status ``code`` (its
        name, e.g. ``UNAVAILABLE``), whether or not a retry then succeeded; or a stream
        broke (``code`` may then be :data:`NO_ANSWER` or :data:`STREAM_ENDED`)."""

    def keepalive_answered(self, seconds: float) -> None:
        """etcd answered a keep-alive request ``seconds`` after it was sent."""

    def answered(self, at: float) -> None:
        """A member answered something at ``at`` (the client's monotonic clock): a call's
        result or an error status it sent, a keep-alive, a watch response."""


class Observed:
    """The client's side of an observer: each report guarded, none if there is none."""

    __slots__ = ("_observer", "_warned")

    def __init__(self, observer: EtcdObserver | None) -> None:
        self._observer = observer
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self._observer is not None

    def call_done(self, method: str, seconds: float, failed: bool) -> None:
        if self._observer is not None:
            try:
                self._observer.call_done(method, seconds, failed)
            except Exception:
                self._failed()

    def attempt_failed(self, method: str, code: str) -> None:
        if self._observer is not None:
            try:
                self._observer.attempt_failed(method, code)
            except Exception:
                self._failed()

    def keepalive_answered(self, seconds: float) -> None:
        if self._observer is not None:
            try:
                self._observer.keepalive_answered(seconds)
            except Exception:
                self._failed()

    def answered(self, at: float) -> None:
        if self._observer is not None:
            try:
                self._observer.answered(at)
            except Exception:
                self._failed()

    def _failed(self) -> None:
        # An observer is diagnostics: its bug is logged (once, not per call) and the
        # call, watch or keep-alive goes on.
        if not self._warned:
            self._warned = True
            log.exception("the etcd client's observer %r failed; its reports are ignored "
                          "from now on where they fail", self._observer)  # fmt: skip
