"""The embedded etcd behind ``etcdrun --standalone``: one member on a free loopback port.

``torchrun --standalone`` hosts its rendezvous in a TCP store inside the agent; ours starts
a real single-member etcd (the same server the multi-node case talks to), so one machine
needs nothing else. The member and its data directory live exactly as long as the
``with`` block, however the block is left: a normal return, an exception, SIGTERM or
SIGINT. When the agent itself is SIGKILLed no block is left, but nothing stays either (on
Linux): the kernel kills the member with the agent (a parent-death signal) and a janitor
process removes its data directory a moment later (``coordinator.core.lifeline``).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from coordinator.etcd_server import EtcdCluster

__all__ = ["embedded_etcd"]

log = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SignalHandler = Callable[[int, FrameType | None], Any]


def _raise_on_signal(signum: int, frame: FrameType | None) -> None:
    """Turn SIGTERM/SIGINT into exceptions so every ``finally`` (ours included) runs."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    # 128 + signal number: the exit status a shell reports for a process ended by it.
    raise SystemExit(128 + signum)


def _note_signal_while_stopping(signum: int, frame: FrameType | None) -> None:
    # A second Ctrl-C during clean-up must not abandon a running etcd; stopping is
    # bounded (SIGTERM, grace period, SIGKILL), so the user waits a few seconds at most.
    log.warning("standalone: signal %d while stopping the embedded etcd; finishing first", signum)


def _install(handler: _SignalHandler) -> dict[int, Any]:
    """Install ``handler`` for SIGTERM and SIGINT and return the handlers it replaced.

    Off the main thread, where Python does not allow installing handlers, nothing is
    changed and the result is empty.
    """
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, handler) for signum in _SIGNALS}


@contextlib.contextmanager
def embedded_etcd(*, timeout: float = 30.0) -> Iterator[str]:
    """Run a single-member etcd on loopback for the duration of the block.

    While the block runs, SIGTERM raises ``SystemExit(143)`` and SIGINT
    ``KeyboardInterrupt`` (unless code inside installs its own handlers), so the member is
    stopped, reaped and its data directory removed on every way out. The previous signal
    handlers are restored afterwards.

    Args:
        timeout: seconds to wait for the member to become healthy.

    Yields:
        The member's client endpoint as ``127.0.0.1:<port>``, ready for
        ``--rdzv-endpoint``.

    Raises:
        coordinator.etcd_server.EtcdBinaryNotFoundError: no etcd binary was found.
        coordinator.etcd_server.EtcdStartError: the member exited or stayed unhealthy.
    """
    previous = _install(_raise_on_signal)
    try:
        # fsync off: the data directory is deleted when the run ends, so durability
        # across a machine crash buys nothing and fsync latency would slow every round.
        cluster = EtcdCluster(1, no_fsync=True)
        try:
            cluster.start(timeout=timeout)
            endpoint = cluster.endpoint_list
            log.info("standalone: embedded etcd listening on %s", endpoint)
            yield endpoint
        finally:
            if previous:
                _install(_note_signal_while_stopping)
            cluster.stop()
            log.info("standalone: embedded etcd stopped and its data removed")
    finally:
        for signum, handler in previous.items():
            # None: the old handler was not installed from Python; the default is the
            # closest we can restore.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
