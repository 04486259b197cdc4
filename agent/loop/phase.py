"""A blocking step of the agent (rendezvous, rank exchange, exit barrier) on its own thread.

The agent's loop never blocks inside library code: it starts the step as a
:class:`Phase`, then waits on its own wake-up event, which the phase's end, a stop
request and every membership event set. So a signal is a flag the loop reads (never an
exception raised into an RPC), and a node that leaves while the others wait on it ends
the wait within one event (DESIGN §9: every wait is bounded by membership). A phase the
loop abandons is asked to end through ``on_abandon`` (e.g. the round's Store aborts its
waits); its thread is a daemon, so one that cannot be asked (a foreign handler) never
holds the process up, and its late result or error is dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from agent.errors import MembershipChanged

__all__ = ["MembershipChanged", "Phase", "PhaseWaiter"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Phase(Generic[T]):
    """Runs ``body(phase)`` on a daemon thread; ``on_change`` is called when it ends.

    The body may report how far it got with :meth:`mark` (e.g. "the round is formed; now
    exchanging ranks"), which the loop reads with :attr:`stage`.
    """

    def __init__(
        self, name: str, body: Callable[[Phase[T]], T], on_change: Callable[[], None]
    ) -> None:
        self._name = name
        self._body = body
        self._on_change = on_change
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None
        self._abandoned = False
        self._stage = "started"
        self._on_abandon: Callable[[], None] | None = None
        # Orders mark() against abandon(): a way to end the phase given after it was
        # abandoned runs at once (else a late stage, e.g. a pre-flight check started
        # just after a stop, would run to its own timeout).
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"agent-{name}", daemon=True)

    def start(self) -> Phase[T]:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._result = self._body(self)
        except BaseException as exc:  # handed to the loop by result()
            self._error = exc
        finally:
            self._done.set()
            if self._abandoned:
                if self._error is not None:
                    log.debug("abandoned phase %s ended: %s", self._name, self._error)
            else:
                self._on_change()

    def mark(self, stage: str, on_abandon: Callable[[], None] | None = None) -> None:
        """Record progress (from the body); ``on_abandon`` is how to end it from here on
        (called at once when the phase was abandoned already)."""
        with self._lock:
            self._stage = stage
            self._on_abandon = on_abandon
            late = self._abandoned
        if late:
            self._end(on_abandon)
            return
        self._on_change()

    @property
    def abandoned(self) -> bool:
        """Whether the loop stopped caring (the body should start nothing more)."""
        return self._abandoned

    @property
    def stage(self) -> str:
        return self._stage

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> T:
        """The body's return value, or its exception raised here. Only once done."""
        if not self._done.is_set():
            raise RuntimeError(f"phase {self._name} has not ended")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def abandon(self) -> None:
        """Stop caring about this phase; ask it to end if it said how."""
        with self._lock:
            self._abandoned = True
            on_abandon = self._on_abandon
        self._end(on_abandon)

    def _end(self, on_abandon: Callable[[], None] | None) -> None:
        if on_abandon is not None and not self._done.is_set():
            try:
                on_abandon()
            except Exception:
                log.exception("could not end abandoned phase %s", self._name)


class PhaseWaiter:
    """The agent loop's side of a phase: wait on the loop's one event for the phase's
    end, a stop request, or a membership change the phase must not outlive.

    Args:
        wake: the loop's event (set by phases, stop requests, rendezvous events).
        stop_requested: whether a stop was asked for.
    """

    def __init__(self, wake: threading.Event, stop_requested: Callable[[], bool]) -> None:
        self._wake = wake
        self._stop_requested = stop_requested

    def run(self, phase: Phase[T], changed: Callable[[Phase[T]], str | None] | None) -> T | None:
        """Start ``phase`` and wait: its result, or None on a stop request.

        Raises:
            MembershipChanged: ``changed`` saw a change (the phase is abandoned).
            whatever the phase raised.
        """
        phase.start()
        while True:
            if self._stop_requested():
                phase.abandon()
                return None
            if phase.done:
                return phase.result()
            why = changed(phase) if changed is not None else None
            if why is not None:
                phase.abandon()
                raise MembershipChanged(why)
            # An event between the checks above and this wait leaves the flag set, so the
            # wait returns at once: no wake-up is lost.
            self._wake.wait()
            self._wake.clear()
