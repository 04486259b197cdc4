"""A client's TLS files are read again when they change, and only a usable set is taken
(issue 21 item 10): a rotation seen half done keeps the files in use until it is done."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coordinator.core.errors import EtcdTLSError
from coordinator.core.etcd_client._tls_files import TlsFiles
from tests.tls_pki import Pki


def test_new_files_are_taken_once_they_make_a_usable_set(tmp_path: Path) -> None:
    pki = Pki(tmp_path, "a")
    files = pki.issue("client", "trainer", server=False)
    tls = TlsFiles(str(pki.ca), str(files.cert), str(files.key))
    first = tls.credentials
    assert not tls.renewed()  # nothing changed

    renewed = pki.issue("renewed", "trainer", server=False)
    os.replace(renewed.cert, files.cert)  # half way: the new certificate, the old key
    assert not tls.renewed()
    assert tls.credentials is first
    os.replace(renewed.key, files.key)  # done
    assert tls.renewed()
    assert tls.credentials is not first
    assert not tls.renewed()


def test_files_gone_for_a_moment_keep_the_ones_in_use(tmp_path: Path) -> None:
    pki = Pki(tmp_path, "a")
    files = pki.issue("client", "trainer", server=False)
    tls = TlsFiles(str(pki.ca), str(files.cert), str(files.key))
    first = tls.credentials
    files.key.unlink()
    assert not tls.renewed()
    assert tls.credentials is first


def test_an_unreadable_file_at_the_start_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(EtcdTLSError) as info:
        TlsFiles(str(missing), None, None)
    assert str(info.value) == (
        f"cannot read the TLS CA certificate file {str(missing)!r}: No such file or "
        "directory; check the path and its permissions"
    )
