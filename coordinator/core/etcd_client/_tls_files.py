"""A client's TLS files (CA, certificate, key): read at the start, and again when they
change on disk.

Why: short-lived client certificates (cert-manager, SPIFFE, Vault: hours, not years)
are renewed in place under a running agent. Read once, the first connection after the
old certificate expired (or was revoked) would present it again and be refused for the
rest of the job. So each new connection first looks at the files (three ``stat`` calls);
when they changed and form a usable set (the key matches the certificate, the CA parses),
new connections use them. A half-done rotation (the certificate replaced, its key not
yet) is not a usable set: the previous files serve until the next change completes it.
Connections already open keep the certificate they were made with; TLS checks it only
at the handshake.
"""

from __future__ import annotations

import logging
import os
import ssl
from typing import Any

import grpc

from coordinator.core.errors import EtcdTLSError

__all__ = ["TlsFiles"]

log = logging.getLogger("coordinator.core.etcd_client")  # one logger for the whole package

_Signature = tuple[tuple[int, int, int] | None, ...]


def _read(what: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise EtcdTLSError(
            f"cannot read the TLS {what} file {path!r}: {exc.strerror or exc}; "
            "check the path and its permissions"
        ) from exc


def _stat(path: str | None) -> tuple[int, int, int] | None:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None  # being replaced, or gone: the files in use stay
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class TlsFiles:
    """The channel credentials made from ``ca_cert``, ``cert`` and ``cert_key`` (paths,
    each None when not given), kept up to date with the files.

    Raises:
        EtcdTLSError: a file cannot be read at construction (names it).
    """

    def __init__(self, ca_cert: str | None, cert: str | None, cert_key: str | None) -> None:
        self._ca_cert, self._cert, self._key = ca_cert, cert, cert_key
        self._signature = self._look()
        self.credentials: Any = self._credentials()

    def _look(self) -> _Signature:
        return (_stat(self._ca_cert), _stat(self._cert), _stat(self._key))

    def _credentials(self) -> Any:
        return grpc.ssl_channel_credentials(
            root_certificates=_read("CA certificate", self._ca_cert),
            private_key=_read("client key", self._key),
            certificate_chain=_read("client certificate", self._cert),
        )

    def renewed(self) -> bool:
        """Whether the files changed since last looked at and form a usable set: then
        :attr:`credentials` holds the new ones. Not thread-safe (the caller's lock)."""
        signature = self._look()
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            self._check()
            credentials = self._credentials()
        except (OSError, ssl.SSLError, EtcdTLSError) as exc:
            log.warning(
                "etcd TLS files changed but are not usable yet (%s); new connections keep "
                "the previous ones until they are",
                exc,
            )
            return False
        self.credentials = credentials
        log.info("etcd TLS files changed: new connections use them")
        return True

    def _check(self) -> None:
        """Raise unless the files make a usable set (grpc would only find out at the
        handshake, as a refused connection)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if self._ca_cert is not None:
            context.load_verify_locations(cafile=self._ca_cert)
        if self._cert is not None:
            context.load_cert_chain(self._cert, self._key)
