"""Background threads that cannot die silently (DESIGN §9, "no silent death").

Every long-lived thread of the core (watch dispatcher, keep-alive, coordinator duty,
state view) is started through :func:`start_guarded`: if its body raises anything
unexpected, the exception is logged with the thread's name and handed to ``on_death``,
which turns it into a clear error for whoever owns the thread (the handler makes the
agent leave and re-join, or stop with that error), instead of the node silently no longer
hearing events or coordinating.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["DeathListener", "ThreadDied", "start_guarded"]

log = logging.getLogger(__name__)

DeathListener = Callable[["ThreadDied"], None]


class ThreadDied(Exception):
    """A background thread ended with an unexpected exception (kept as ``__cause__``)."""

    def __init__(self, name: str, cause: BaseException) -> None:
        super().__init__(f"background thread {name!r} died: {type(cause).__name__}: {cause}")
        self.name = name
        self.__cause__ = cause


def start_guarded(
    name: str, body: Callable[[], None], on_death: DeathListener | None
) -> threading.Thread:
    """Start a daemon thread running ``body``; report its death to ``on_death``.

    A normal return is not a death. ``on_death`` runs on the dying thread; it must not
    block. Without ``on_death`` the death is still logged as an error.
    """

    def run() -> None:
        try:
            body()
        except BaseException as exc:  # every death is seen: that is the point
            died = ThreadDied(name, exc)
            log.error("%s", died, exc_info=exc)
            if on_death is not None:
                try:
                    on_death(died)
                except Exception:
                    log.exception("the death listener of thread %r failed", name)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
