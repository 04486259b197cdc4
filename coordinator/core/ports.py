"""Free TCP ports: the one place that asks the kernel for one.

A port found free here can be taken by another process before its user binds it; callers
that can, hold the socket instead (see issue 10's agent-hosted store).
"""

from __future__ import annotations

import contextlib
import random
import socket

__all__ = ["free_port", "free_ports"]


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


def free_ports(
    count: int, host: str = "127.0.0.1", *, within: tuple[int, int] | None = None
) -> list[int]:
    """``count`` distinct TCP ports that were free on ``host`` a moment ago.

    Every socket stays bound until all are chosen: the kernel may hand out a port it just
    gave back, so ``[free_port() for _ in ...]`` can name the same port twice (a 3-member
    etcd cluster once got two members on one peer port and refused to start).

    Args:
        within: pick at random from ``[low, high)`` instead of letting the kernel choose;
            a range below the ephemeral one is never taken by another process's
            outgoing connection between this choice and the user's bind.

    Raises:
        OSError: the ports could not be bound (the message names ``host``).
    """
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        tries = 0
        while len(ports) < count:
            tries += 1
            if within is not None and tries > 200 * count:
                raise OSError(f"no {count} free TCP ports in {within} on {host!r}")
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind((host, 0 if within is None else random.randrange(*within)))
            except OSError as exc:
                if within is not None:
                    continue
                raise OSError(f"no free TCP port could be bound on {host!r}: {exc}") from exc
            ports.append(int(sock.getsockname()[1]))
        return ports
