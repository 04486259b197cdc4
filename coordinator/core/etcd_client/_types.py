"""Configuration and values of the etcd client: what to connect to, what etcd returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from coordinator.core.errors import ConfigError

__all__ = [
    "EtcdConfig",
    "KeyValue",
    "TxnResult",
    "WatchEvent",
    "_kv",
    "key_text",
    "parse_endpoint",
    "prefix_range_end",
]


# -- configuration and values -------------------------------------------------------------


@dataclass(frozen=True)
class EtcdConfig:
    """How to reach etcd. Built from validated settings; never from raw user strings.

    Attributes:
        endpoints: ``host:port`` of each member, at least one.
        protocol: ``https`` for TLS (``ca_cert`` verifies the server; ``cert`` and
            ``cert_key`` are the client certificate, both or neither).
        user, password: etcd user auth; the password is never shown in the repr.
        password_file: instead of ``password``, a file holding it (one line; a trailing
            newline is ignored), read again at every authentication, so a password
            rotated in the file reaches a running client.
        request_timeout: upper bound, in seconds, for one attempt of one unary RPC.
        retry_budget: upper bound, in seconds, for all retries and failover of one call
            (every endpoint is tried at least once even if that takes longer).

    Raises:
        ConfigError: a value is missing, malformed or inconsistent.
    """

    endpoints: tuple[str, ...]  # "host:port" each, at least one
    protocol: Literal["http", "https"] = "http"
    ca_cert: str | None = None
    cert: str | None = None
    cert_key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    password_file: str | None = None
    request_timeout: float = 5.0
    retry_budget: float = 30.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoints", tuple(self.endpoints))
        if not self.endpoints:
            raise ConfigError("etcd endpoints: none given; pass at least one host:port")
        for endpoint in self.endpoints:
            parse_endpoint(endpoint)
        if self.protocol not in ("http", "https"):
            raise ConfigError(f"etcd protocol: {self.protocol!r} is not 'http' or 'https'")
        if (self.cert is None) != (self.cert_key is None):
            raise ConfigError(
                f"etcd TLS: cert={self.cert!r} and cert_key={self.cert_key!r}: "
                "give both the client certificate and its key, or neither"
            )
        if self.protocol == "http" and (self.ca_cert or self.cert):
            raise ConfigError(
                "etcd TLS files were given but protocol is 'http'; set protocol=https"
            )
        if self.password is not None and self.password_file is not None:
            raise ConfigError("etcd auth: give the password or a password file, not both")
        has_password = self.password is not None or self.password_file is not None
        if (self.user is None) == has_password:
            raise ConfigError("etcd auth: give both user and password, or neither")
        if not self.request_timeout > 0 or not self.retry_budget > 0:
            raise ConfigError(
                f"etcd timeouts must be positive: request_timeout={self.request_timeout}, "
                f"retry_budget={self.retry_budget}"
            )


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd stores it."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by a watch."""

    kind: Literal["put", "delete"]
    kv: KeyValue  # for "delete": key set, value b"", mod_revision = revision of the delete
    prev_kv: KeyValue | None  # only when the watch asked for prev_kv


@dataclass(frozen=True)
class TxnResult:
    """Outcome of a revision-guarded transaction."""

    succeeded: bool
    revision: int  # header revision after the transaction
    current: KeyValue | None  # the guarded key's value when the compare failed (None: absent)
    fenced_out: bool = False  # failed because the fence key is gone or was re-created


def _kv(pb: Any) -> KeyValue:
    return KeyValue(
        key=bytes(pb.key),
        value=bytes(pb.value),
        create_revision=int(pb.create_revision),
        mod_revision=int(pb.mod_revision),
        version=int(pb.version),
        lease=int(pb.lease),
    )


# -- pure helpers ---------------------------------------------------------------------------


def parse_endpoint(text: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) into host and port.

    Raises:
        ConfigError: not ``host:port`` or the port is not 1..65535.
    """
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or "/" in text or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"etcd endpoint {text!r} is not host:port (e.g. 127.0.0.1:2379); "
            "give members as host:port without a scheme"
        )
    return host, int(port)


def key_text(key: bytes) -> str:
    """``key`` as it reads in a message or log line: text, as etcdctl prints it.

    Our keys are UTF-8; a byte that is not shows as ``\\xNN`` instead of failing, so a
    foreign key still prints. Never the Python bytes repr (``b'/etcd-elastic/…'``).
    """
    return key.decode("utf-8", errors="backslashreplace")


def prefix_range_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix``.

    The last byte below 0xff is incremented and what follows it dropped; a prefix of only
    0xff bytes (or an empty one) has no upper bound, which etcd spells ``b"\\0"``.
    """
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])
