"""Signals become stop requests: a flag and a wake-up, never an exception (STYLE 17).

A Python signal handler runs on the main thread between two bytecodes, wherever that
thread is: in the middle of an etcd RPC, inside a lock it holds, half way through a log
line. Raising from there (as torch's agent does) tears library code apart; even setting
a ``threading.Event`` from there can deadlock when the interrupted code holds that
event's lock. So the Python-level handler here does nothing, and the kernel's wake-up
byte does the work: :func:`signal.set_wakeup_fd` makes the interpreter write the signal
number to a pipe, and a watcher thread reads it and calls ``on_stop(signum)`` like any
other thread would (the agent's :meth:`~agent.loop.agent.Agent.request_stop`: set a flag,
wake the loop). The loop then stops cooperatively.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

__all__ = ["STOP_SIGNALS", "stop_requests"]

log = logging.getLogger(__name__)

STOP_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
)


def _ignore(_signum: int, _frame: FrameType | None) -> None:
    # Installed only so that the interpreter catches the signal (and writes its number to
    # the wake-up fd) instead of the default action killing the process.
    return


@contextlib.contextmanager
def stop_requests(
    on_stop: Callable[[int], None], signals: Sequence[signal.Signals] = STOP_SIGNALS
) -> Iterator[None]:
    """While active, each of ``signals`` calls ``on_stop(signum)`` on a watcher thread.

    Python lets only the main thread install handlers; elsewhere (tests that run agents
    in threads) this does nothing and the caller stops the agent with ``on_stop`` itself.
    On exit the previous handlers and wake-up fd are restored and the watcher is joined.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    stop_read, stop_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    watcher = threading.Thread(
        target=_watch, args=(read_fd, stop_read, on_stop), name="stop-requests", daemon=True
    )
    previous: dict[int, Any] = {}
    old_fd = -1
    try:
        watcher.start()
        old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        previous = {s: signal.signal(s, _ignore) for s in signals}
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
        signal.set_wakeup_fd(old_fd)
        os.write(stop_write, b"x")
        watcher.join(timeout=5)
        for fd in (read_fd, write_fd, stop_read, stop_write):
            os.close(fd)


def _watch(read_fd: int, stop_fd: int, on_stop: Callable[[int], None]) -> None:
    while True:
        ready, _, _ = select.select([read_fd, stop_fd], [], [])
        if read_fd in ready:
            with contextlib.suppress(BlockingIOError):
                for signum in os.read(read_fd, 64):
                    try:
                        on_stop(signum)
                    except Exception:
                        log.exception("stop request for signal %d failed", signum)
        if stop_fd in ready:
            return
