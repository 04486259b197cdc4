"""Whether an etcd member serves TLS: asked when a plain-http call was cut off.

A plain-http client sees a TLS member close the connection before answering ("Socket
closed"), and a member going away looks the same; so that failure alone would leave the
call retrying for its whole budget (read_timeout) before it could say "use https://".
One TLS handshake with the member settles it: a member that answers it serves TLS, and
no retry will help. Its certificate is not checked (only whether it speaks TLS), and
nothing is sent after the handshake. Costs one connection, only on that failure.
"""

from __future__ import annotations

import socket
import ssl

__all__ = ["serves_tls"]


def serves_tls(endpoint: str, timeout: float) -> bool:
    """Whether the member at ``endpoint`` (``host:port``, IPv6 hosts in brackets) answers
    a TLS handshake within ``timeout`` seconds. False when unsure (refused, silent, not
    TLS)."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, int(port)), timeout=timeout) as sock,
            context.wrap_socket(sock, server_hostname=host),
        ):
            return True
    except ssl.SSLError as exc:
        # A TLS alert is an answer in TLS too (a member that wants a client certificate
        # may refuse the handshake); anything else (a wrong version number: the member
        # answered in plain text) is not.
        return "ALERT" in str(exc.reason or "").upper()
    except (OSError, ValueError):
        return False
