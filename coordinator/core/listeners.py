"""A thread-safe set of callbacks: who wants to hear that something changed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["Listener", "Listeners"]

log = logging.getLogger(__name__)

Listener = Callable[[], None]


class Listeners:
    """Callbacks run by :meth:`notify` on the notifying thread (they must not block)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Listener] = []

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Add ``listener``; returns the function that removes it again."""
        with self._lock:
            self._items.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._items:
                    self._items.remove(listener)

        return unsubscribe

    def notify(self) -> None:
        """Call every listener; one listener's bug must not stop the others (or the
        watch thread that usually notifies)."""
        with self._lock:
            items = list(self._items)
        for listener in items:
            try:
                listener()
            except Exception:
                log.exception("listener %r failed", listener)
