"""What ``--rdzv-endpoint`` means: etcd members as ``host[:port]``, comma-separated.

Pure text parsing (no grpc, no etcd client): the port defaults to 2379, ``http://`` and
``https://`` schemes are accepted (one for all members), IPv6 addresses are written
``[::1]:2379``. Every error is a :class:`~coordinator.core.errors.ConfigError` naming the
whole value and the bad item.
"""

from __future__ import annotations

import re

from coordinator.core.errors import ConfigError

__all__ = ["parse_endpoints", "parse_endpoints_with_scheme"]

_DEFAULT_PORT = 2379
_HOST_RE = re.compile(r"[A-Za-z0-9._-]+")
_IPV6_RE = re.compile(r"[0-9A-Fa-f:.]+(%[A-Za-z0-9._-]+)?")


def _endpoint_error(text: str, reason: str) -> ConfigError:
    return ConfigError(f"rdzv_endpoint {text!r}: {reason}")


def _parse_one_endpoint(text: str, item: str) -> tuple[str, str | None]:
    """Return (``host:port``, scheme or None) for one comma-separated item."""
    scheme, rest = _split_scheme(text, item)
    rest = rest.rstrip("/")
    host, port_text = (
        _bracketed(text, item, rest) if rest.startswith("[") else _plain(text, item, rest)
    )
    return f"{host}:{_port(text, port_text)}", scheme


def _split_scheme(text: str, item: str) -> tuple[str | None, str]:
    """The item's scheme (None: none written) and the rest of it."""
    scheme: str | None = None
    rest = item
    for candidate in ("http", "https"):
        if item.lower().startswith(candidate + "://"):
            scheme = candidate
            rest = item[len(candidate) + 3 :]
    if "://" in rest:
        raise _endpoint_error(text, f"{item!r} has an unsupported scheme (use http or https)")
    return scheme, rest


def _bracketed(text: str, item: str, rest: str) -> tuple[str, str | None]:
    """Host and port text of ``[IPv6]`` or ``[IPv6]:port``."""
    close = rest.find("]")
    if close < 0:
        raise _endpoint_error(text, f"{item!r} opens '[' without a closing ']'")
    host = rest[: close + 1]
    port_text: str | None = None
    after = rest[close + 1 :]
    if after:
        if not after.startswith(":"):
            raise _endpoint_error(text, f"{item!r} has text after ']' that is not ':port'")
        port_text = after[1:]
    if not _IPV6_RE.fullmatch(host[1:-1]):
        raise _endpoint_error(text, f"{host!r} is not an IPv6 address")
    return host, port_text


def _plain(text: str, item: str, rest: str) -> tuple[str, str | None]:
    """Host and port text of ``host`` or ``host:port`` (a name or an IPv4 address)."""
    host, sep, port_part = rest.partition(":")
    if not host:
        raise _endpoint_error(text, f"{item!r} has an empty host")
    if not _HOST_RE.fullmatch(host):
        raise _endpoint_error(text, f"{host!r} is not a host name or IPv4 address")
    return host, (port_part if sep else None)


def _port(text: str, port_text: str | None) -> int:
    if port_text is None:
        return _DEFAULT_PORT
    if not re.fullmatch(r"[0-9]{1,5}", port_text) or not 1 <= int(port_text) <= 65535:
        raise _endpoint_error(text, f"{port_text!r} is not a port number (1-65535)")
    return int(port_text)


def parse_endpoints_with_scheme(text: str) -> tuple[tuple[str, ...], str | None]:
    """:func:`parse_endpoints`, and the scheme the items were written with (``http`` or
    ``https``; None when none has one).

    Raises:
        ConfigError: as :func:`parse_endpoints`, or the items mix ``http://`` and
            ``https://``.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(
            f"rdzv_endpoint {text!r} is empty: give the etcd members as host:port[,host:port...]"
        )
    endpoints: list[str] = []
    schemes: set[str] = set()
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise _endpoint_error(text, "has an empty item (remove the extra ',')")
        endpoint, scheme = _parse_one_endpoint(text, item)
        if scheme is not None:
            schemes.add(scheme)
        if endpoint not in endpoints:
            endpoints.append(endpoint)
    if len(schemes) > 1:
        raise _endpoint_error(text, "mixes http:// and https:// (use one protocol)")
    return tuple(endpoints), (schemes.pop() if schemes else None)


def parse_endpoints(text: str) -> tuple[str, ...]:
    """Parse ``--rdzv-endpoint``: comma-separated etcd members, each ``host[:port]``.

    The port defaults to 2379; ``http://`` / ``https://`` schemes are stripped (use
    :meth:`RendezvousSettings.from_parameters` to have ``https://`` select TLS); IPv6
    addresses are written ``[::1]:2379``. Duplicates are dropped, order is kept.

    Raises:
        ConfigError: empty text, empty item, empty host, or a port that is not 1-65535;
            the message names the whole value and the bad item.
    """
    return parse_endpoints_with_scheme(text)[0]
