"""The workers' bootstrap store, hosted by the agent of group rank 0 before any worker
starts (torchrun's agent store, ``TORCHELASTIC_USE_AGENT_STORE=True``).

Without it, rank 0's worker starts a ``TCPStore`` server at ``MASTER_PORT`` when it calls
``init_process_group``, and the other ranks connect to it: a rank that starts first finds
nobody listening and backs off (0.5 to 1.2 s measured per restart, issue 10), and the
port, chosen free by the agent and bound only later by the worker, can be taken in
between. Here the agent of group rank 0 binds the server first (port 0: the kernel picks
a free one, nothing to race), publishes that port through the round's store, and keeps
the server for the round; every worker, rank 0 included, connects as a client
(torch's ``_create_c10d_store``). A new server per round: torch adds no per-attempt prefix
to an agent store's keys, and a round's restart count does not change on a membership
change, so keys must not outlive their round.

One server at a time (:class:`BootstrapHost`): the last round's server is released before
the next formation may bind, and a formation that was abandoned (a membership change, a
stop) can bind nothing afterwards. Without that, ``--master-port`` (one fixed port for
every round) failed every restart with EADDRINUSE: the next round was formed while the
last round's server still held the port (issue 21, item 1).

Agents connect to it too, before any worker starts (:func:`connect_bootstrap_store`): the
pre-flight check's pairs and its result exchange, under a per-round key prefix.
"""

from __future__ import annotations

import threading
from datetime import timedelta

from torch._C._distributed_c10d import TCPStore

__all__ = [
    "BootstrapHost",
    "BootstrapStoreError",
    "BootstrapSuperseded",
    "BootstrapTicket",
    "connect_bootstrap_store",
    "host_bootstrap_store",
]

# Timeout of the server's own operations (it waits for nobody: wait_for_workers=False).
_SERVER_TIMEOUT = timedelta(seconds=300)


class BootstrapStoreError(RuntimeError):
    """The agent could not listen for its workers' bootstrap store."""


class BootstrapSuperseded(BootstrapStoreError):
    """A formation that is no longer the agent's newest asked for a server."""


def host_bootstrap_store(addr: str, port: int | None) -> TCPStore:
    """A listening ``TCPStore`` server for one round's workers, on ``port`` (None: any
    free port; read it from ``.port``). It stops when the object is released.

    Raises:
        BootstrapStoreError: the port cannot be bound (``--master-port`` in use).
    """
    try:
        return TCPStore(
            host_name=addr,
            port=port or 0,
            is_master=True,
            wait_for_workers=False,
            timeout=_SERVER_TIMEOUT,
            use_libuv=True,
        )
    except RuntimeError as exc:  # DistNetworkError is one
        text = " ".join(str(exc).split())
        raise BootstrapStoreError(
            f"cannot listen for the workers' bootstrap store on port {port or 'any'}: {text}"
            + ("; choose another --master-port" if port else "")
        ) from exc


def connect_bootstrap_store(
    addr: str, port: int, timeout: timedelta, connect_timeout: timedelta
) -> TCPStore:
    """A client of the round's server at ``addr``:``port``; its operations time out after
    ``timeout``. It disconnects when the object is released; a release of the server
    (:meth:`BootstrapHost.release`) ends its waits at once with an error.

    Raises:
        BootstrapStoreError: no server answered within ``connect_timeout`` (torch retries
            the connection until then).
    """
    try:
        client = TCPStore(
            host_name=addr,
            port=port,
            is_master=False,
            wait_for_workers=False,
            timeout=connect_timeout,
        )
    except RuntimeError as exc:  # DistNetworkError is one
        text = " ".join(str(exc).split())
        raise BootstrapStoreError(
            f"cannot reach the workers' bootstrap store at {addr}:{port} within "
            f"{connect_timeout.total_seconds():g} s: {text}; check that group rank 0's host "
            "is reachable at that address (--master-addr, --local-addr)"
        ) from exc
    client.set_timeout(timeout)
    return client


class BootstrapHost:
    """The agent's bootstrap store: at most one server, owned here and only here (so
    releasing it frees its port at once; a server object kept by a phase's thread or an
    exception's frame would keep the port bound for as long)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a leaf lock: guards the two fields below
        self._server: TCPStore | None = None
        self._epoch = 0

    def next_formation(self) -> BootstrapTicket:
        """Release the server (the workers that used it are stopped) and return the
        ticket of the formation about to start; every older ticket is void."""
        return BootstrapTicket(self, self.release())

    def release(self) -> int:
        """Stop the server, if any, and void every ticket given so far; returns the new
        epoch. After this returns no server of an earlier formation listens, and none
        will."""
        with self._lock:
            old, self._server = self._server, None
            self._epoch += 1
            epoch = self._epoch
        del old  # the last reference: the server stops listening here, outside the lock
        return epoch

    def _serve(self, epoch: int, addr: str, port: int | None) -> int:
        with self._lock:
            if epoch != self._epoch:
                raise BootstrapSuperseded(
                    "this formation was abandoned; a newer one hosts the bootstrap store"
                )
            # Binding a local socket is no RPC; under the lock, a release() that comes
            # meanwhile waits for it and then stops it, so nothing stale stays bound.
            self._server = host_bootstrap_store(addr, port)
            return int(self._server.port)


class BootstrapTicket:
    """One formation's right to host the round's server (see :class:`BootstrapHost`)."""

    def __init__(self, host: BootstrapHost, epoch: int) -> None:
        self._host = host
        self._epoch = epoch

    def serve(self, addr: str, port: int | None) -> int:
        """Listen on ``addr``:``port`` (None: any free port); returns the port.

        Raises:
            BootstrapSuperseded: a newer formation started (or the host was released).
            BootstrapStoreError: the port cannot be bound.
        """
        return self._host._serve(self._epoch, addr, port)
