"""Free TCP ports: the one place that asks the kernel for one.

A port found free here can be taken by another process before its user binds it; callers
that can, hold the socket instead (see issue 10's agent-hosted store).
"""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1", *, fallback_any: bool = False) -> int:
    """A TCP port that was free on ``host`` a moment ago.

    Args:
        host: the address to bind; ``""`` means every interface.
        fallback_any: when ``host`` cannot be bound (a name that does not resolve to a
            local address), try every interface instead of failing.

    Raises:
        OSError: no port could be bound (the message names ``host``).
    """
    for candidate in (host, "") if fallback_any and host else (host,):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((candidate, 0))
                return int(sock.getsockname()[1])
        except OSError:
            continue
    where = f"{host!r} or on any interface" if fallback_any and host else repr(host)
    raise OSError(f"no free TCP port could be bound on {where}")
