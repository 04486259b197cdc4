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
"""

from __future__ import annotations

from datetime import timedelta

from torch._C._distributed_c10d import TCPStore

__all__ = ["BootstrapStoreError", "host_bootstrap_store"]

# Timeout of the server's own operations (it waits for nobody: wait_for_workers=False).
_SERVER_TIMEOUT = timedelta(seconds=300)


class BootstrapStoreError(RuntimeError):
    """The agent could not listen for its workers' bootstrap store."""


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
