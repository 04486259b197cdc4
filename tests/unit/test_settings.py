"""Settings from torch's RendezvousParameters: every accepted form and every message."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from coordinator.core.endpoints import parse_endpoints
from coordinator.core.errors import ConfigError
from coordinator.core.etcd_client import EtcdConfig
from coordinator.core.keys import RunKeys
from coordinator.core.settings import KNOWN_CONF_KEYS, RendezvousSettings

_KNOWN = ", ".join(sorted(KNOWN_CONF_KEYS))


def _params(
    endpoint: str = "h1:2379", min_nodes: int = 1, max_nodes: int = 2, **conf: Any
) -> RendezvousParameters:
    return RendezvousParameters(
        backend="etcd-v2",
        endpoint=endpoint,
        run_id=conf.pop("run_id", "job42"),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        local_addr=conf.pop("local_addr", None),
        **conf,
    )


def _settings(**kwargs: Any) -> RendezvousSettings:
    return RendezvousSettings.from_parameters(_params(**kwargs))


# --- endpoints -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("h1:2379", ("h1:2379",)),
        ("h1", ("h1:2379",)),
        ("h1:1,h2:65535", ("h1:1", "h2:65535")),
        (" h1:2379 , h2 ", ("h1:2379", "h2:2379")),
        ("http://h1:2379", ("h1:2379",)),
        ("https://h1:2380/", ("h1:2380",)),
        ("HTTP://h1", ("h1:2379",)),
        ("[::1]:2379", ("[::1]:2379",)),
        ("[::1]", ("[::1]:2379",)),
        ("https://[fe80::1%eth0]:4001", ("[fe80::1%eth0]:4001",)),
        ("127.0.0.1:2379,127.0.0.1:2379", ("127.0.0.1:2379",)),
    ],
)
def test_parse_endpoints_accepts(text: str, expected: tuple[str, ...]) -> None:
    assert parse_endpoints(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "rdzv_endpoint '' is empty: give the etcd members as host:port[,host:port...]"),
        ("  ", "rdzv_endpoint '  ' is empty: give the etcd members as host:port[,host:port...]"),
        ("h1:2379,:x", "rdzv_endpoint 'h1:2379,:x': ':x' has an empty host"),
        ("h1:2379,h2:x", "rdzv_endpoint 'h1:2379,h2:x': 'x' is not a port number (1-65535)"),
        ("h1:0", "rdzv_endpoint 'h1:0': '0' is not a port number (1-65535)"),
        ("h1:65536", "rdzv_endpoint 'h1:65536': '65536' is not a port number (1-65535)"),
        ("h1:", "rdzv_endpoint 'h1:': '' is not a port number (1-65535)"),
        ("h1:-1", "rdzv_endpoint 'h1:-1': '-1' is not a port number (1-65535)"),
        ("h1:²", "rdzv_endpoint 'h1:²': '²' is not a port number (1-65535)"),
        ("h1,,h2", "rdzv_endpoint 'h1,,h2': has an empty item (remove the extra ',')"),
        ("h1:2379:1", "rdzv_endpoint 'h1:2379:1': '2379:1' is not a port number (1-65535)"),
        ("h 1:2379", "rdzv_endpoint 'h 1:2379': 'h 1' is not a host name or IPv4 address"),
        (
            "unix://sock",
            "rdzv_endpoint 'unix://sock': 'unix://sock' has an unsupported scheme "
            "(use http or https)",
        ),
        ("[::1", "rdzv_endpoint '[::1': '[::1' opens '[' without a closing ']'"),
        ("[zz]:1", "rdzv_endpoint '[zz]:1': '[zz]' is not an IPv6 address"),
        ("[::1]x", "rdzv_endpoint '[::1]x': '[::1]x' has text after ']' that is not ':port'"),
        (
            "http://h1,https://h2",
            "rdzv_endpoint 'http://h1,https://h2': mixes http:// and https:// (use one protocol)",
        ),
    ],
)
def test_parse_endpoints_rejects(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_endpoints(text)
    assert str(exc.value) == message


# --- defaults and accepted values -------------------------------------------------------


def test_defaults() -> None:
    s = _settings()
    assert s == RendezvousSettings(
        run_id="job42",
        min_nodes=1,
        max_nodes=2,
        endpoints=("h1:2379",),
        local_addr=None,
        join_timeout=600.0,
        last_call_timeout=30.0,
        close_timeout=30.0,
        read_timeout=60.0,
        store_timeout=900.0,
        lease_ttl=5,
        key_prefix="/etcd-elastic",
        protocol="http",
    )
    assert s.keys == RunKeys("/etcd-elastic", "job42")


def test_every_own_key_is_read() -> None:
    s = _settings(
        endpoint="h1:1,h2:2",
        local_addr="10.0.0.1",
        join_timeout="120",
        last_call_timeout="2.5",
        close_timeout=7,
        read_timeout="9",
        timeout=900,
        lease_ttl="3",
        key_prefix="/team/elastic",
        user="alice",
        password="s3cret",
    )
    assert s.endpoints == ("h1:1", "h2:2")
    assert s.local_addr == "10.0.0.1"
    assert (s.join_timeout, s.last_call_timeout, s.close_timeout) == (120.0, 2.5, 7.0)
    assert (s.read_timeout, s.store_timeout, s.lease_ttl) == (9.0, 900.0, 3)
    assert s.key_prefix == "/team/elastic"
    assert (s.user, s.password) == ("alice", "s3cret")
    assert s.keys.run_prefix == b"/team/elastic/job42/"


def test_etcd_config() -> None:
    s = _settings(endpoint="h1:1,h2:2", read_timeout="3", user="u", password="p")
    assert s.etcd_config() == EtcdConfig(
        endpoints=("h1:1", "h2:2"),
        protocol="http",
        user="u",
        password="p",
        request_timeout=2.5,
        retry_budget=3.0,
    )
    # One attempt is capped even when the whole call may take a minute.
    assert _settings(lease_ttl="30").etcd_config().request_timeout == 5.0
    assert _settings().etcd_config().retry_budget == 60.0
    # ...and by half the lease TTL, at least 1 s: a write dropped in a leader change is
    # retried in time.
    assert _settings().etcd_config().request_timeout == 2.5
    assert _settings(lease_ttl="3").etcd_config().request_timeout == 1.5
    assert _settings(lease_ttl="1").etcd_config().request_timeout == 1.0


def test_password_never_in_repr() -> None:
    s = _settings(user="u", password="hunter2")
    assert "hunter2" not in repr(s)
    assert "password='***'" in repr(s)


def test_https_scheme_implies_tls(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    s = _settings(endpoint="https://h1:2379", ca_cert=str(ca))
    assert s.protocol == "https"
    assert s.etcd_config().protocol == "https"
    assert s.etcd_config().ca_cert == str(ca)
    assert _settings(endpoint="https://h1", protocol="HTTPS").protocol == "https"


def test_tls_files(tmp_path: Path) -> None:
    files = {}
    for name in ("cert", "key", "ca"):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_text("x")
    s = _settings(
        protocol="https",
        ssl_cert=str(files["cert"]),
        ssl_cert_key=str(files["key"]),
        ca_cert=str(files["ca"]),
    )
    cfg = s.etcd_config()
    assert (cfg.cert, cfg.cert_key, cfg.ca_cert) == tuple(
        str(files[n]) for n in ("cert", "key", "ca")
    )


@pytest.mark.parametrize(
    "key", ["rank", "is_host", "store_type", "keep_alive_interval", "keep_alive_max_attempt"]
)
def test_compatibility_keys_are_accepted_and_ignored(key: str) -> None:
    assert _settings(**{key: "1"}) == _settings()


def test_heartbeat_keys_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="coordinator.core.settings"):
        _settings(keep_alive_interval="5")
    assert (
        "rdzv_conf keep_alive_interval='5' is ignored for run job42: etcd leases replace "
        "heartbeats (set lease_ttl instead)" in caplog.messages
    )


def test_empty_strings_mean_unset() -> None:
    assert _settings(user="", password="", key_prefix="", local_addr="") == _settings()


# --- every error message ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"lease_tll": "5"},
            f"rdzv_conf has unknown key 'lease_tll' (did you mean 'lease_ttl'?); "
            f"known keys: {_KNOWN}",
        ),
        (
            {"zzz": "1", "cacert": "/x"},
            f"rdzv_conf has unknown keys 'cacert', 'zzz'; known keys: {_KNOWN}",
        ),
        ({"zzz": "1"}, f"rdzv_conf has unknown key 'zzz'; known keys: {_KNOWN}"),
        ({"lease_ttl": "abc"}, "rdzv_conf lease_ttl='abc' is not a whole number of seconds"),
        ({"lease_ttl": "1.5"}, "rdzv_conf lease_ttl='1.5' is not a whole number of seconds"),
        ({"lease_ttl": 1.5}, "rdzv_conf lease_ttl=1.5 is not a whole number of seconds"),
        ({"lease_ttl": True}, "rdzv_conf lease_ttl=True is not a whole number of seconds"),
        ({"lease_ttl": "0"}, "rdzv_conf lease_ttl=0 must be between 1 and 600 seconds"),
        ({"lease_ttl": "-3"}, "rdzv_conf lease_ttl=-3 must be between 1 and 600 seconds"),
        ({"lease_ttl": 601}, "rdzv_conf lease_ttl=601 must be between 1 and 600 seconds"),
        ({"join_timeout": "abc"}, "rdzv_conf join_timeout='abc' is not a number of seconds"),
        ({"join_timeout": "0"}, "rdzv_conf join_timeout=0.0 must be more than 0 seconds"),
        (
            {"last_call_timeout": "-1"},
            "rdzv_conf last_call_timeout=-1.0 must be more than 0 seconds",
        ),
        (
            {"close_timeout": "nan"},
            "rdzv_conf close_timeout='nan' is not a finite number of seconds",
        ),
        ({"read_timeout": "inf"}, "rdzv_conf read_timeout='inf' is not a finite number of seconds"),
        ({"read_timeout": [1]}, "rdzv_conf read_timeout=[1] is not a number of seconds"),
        ({"timeout": "0"}, "rdzv_conf timeout=0.0 must be more than 0 seconds"),
        ({"timeout": "x"}, "rdzv_conf timeout='x' is not a number of seconds"),
        ({"protocol": "ftp"}, "rdzv_conf protocol='ftp' must be 'http' or 'https'"),
        ({"protocol": 1}, "rdzv_conf protocol=1 must be text"),
        (
            {"endpoint": "https://h1", "protocol": "http"},
            "rdzv_endpoint 'https://h1' uses https:// but rdzv_conf protocol='http': "
            "make them agree",
        ),
        (
            {"user": "u"},
            "rdzv_conf user='u' has no password: give password_file=FILE or set "
            "$ETCD_ELASTIC_PASSWORD (or use a client certificate whose CN is the user, "
            "without user)",
        ),
        ({"password": "p"}, "rdzv_conf password is set without user: give both or neither"),
        ({"key_prefix": "x"}, "rdzv_conf key_prefix='x' is invalid: it must start with '/'"),
        (
            {"run_id": "job/x"},
            "rdzv_id 'job/x' is invalid: use 1-128 characters from A-Z a-z 0-9 . _ - "
            "starting with a letter or digit",
        ),
        (
            {"endpoint": "h1:2379,:x"},
            "rdzv_endpoint 'h1:2379,:x': ':x' has an empty host",
        ),
        (
            {"endpoint": ""},
            "rdzv_endpoint '' is empty: give the etcd members as host:port[,host:port...]",
        ),
        (
            {"ca_cert": "/nonexistent/ca.pem", "protocol": "https"},
            "rdzv_conf ca_cert='/nonexistent/ca.pem': no such file",
        ),
        (
            {"ca_cert": "/nonexistent/ca.pem"},
            "rdzv_conf ca_cert is set but protocol is 'http': set protocol=https or remove ca_cert",
        ),
        (
            {"ssl_cert": "/nonexistent/c.pem", "protocol": "https"},
            "rdzv_conf ssl_cert is set without ssl_cert_key: give both or neither",
        ),
        (
            {"ssl_cert_key": "/nonexistent/k.pem", "protocol": "https"},
            "rdzv_conf ssl_cert_key is set without ssl_cert: give both or neither",
        ),
    ],
)
def test_from_parameters_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _settings(**kwargs)
    assert str(exc.value) == message


def test_tls_file_that_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        _settings(protocol="https", ca_cert=str(tmp_path))
    assert str(exc.value) == f"rdzv_conf ca_cert={str(tmp_path)!r}: no such file"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_unreadable_tls_file(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    ca.chmod(0)
    with pytest.raises(ConfigError) as exc:
        _settings(protocol="https", ca_cert=str(ca))
    assert str(exc.value) == f"rdzv_conf ca_cert={str(ca)!r}: file is not readable by this user"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_nodes": 0, "max_nodes": 2}, "--nnodes: minimum 0 must be at least 1"),
        ({"min_nodes": 4, "max_nodes": 2}, "--nnodes: minimum 4 is greater than maximum 2"),
        ({"min_nodes": True}, "min_nodes True is not a whole number"),
        ({"max_nodes": "2"}, "max_nodes '2' is not a whole number"),
        ({"endpoints": ()}, "rdzv_endpoint is empty: give the etcd members as host:port"),
        ({"store_timeout": 0.0}, "rdzv_conf timeout=0.0 must be more than 0 seconds"),
        ({"protocol": "ftp"}, "rdzv_conf protocol='ftp' must be 'http' or 'https'"),
        (
            {"run_id": ""},
            "rdzv_id '' is invalid: use 1-128 characters from A-Z a-z 0-9 . _ - "
            "starting with a letter or digit",
        ),
    ],
)
def test_direct_construction_validates(fields: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {
        "run_id": "job",
        "min_nodes": 1,
        "max_nodes": 2,
        "endpoints": ("h:2379",),
    }
    with pytest.raises(ConfigError) as exc:
        RendezvousSettings(**{**base, **fields})
    assert str(exc.value) == message


def test_torch_checks_min_max_first_and_we_check_again() -> None:
    # torch's RendezvousParameters already refuses min > max with its own message; a
    # caller that bypasses it (e.g. by mutating the object) still gets ours.
    params = _params()
    params.min_nodes = 3
    with pytest.raises(ConfigError, match=r"^--nnodes: minimum 3 is greater than maximum 2$"):
        RendezvousSettings.from_parameters(params)


# --- where the password comes from -------------------------------------------------------


def test_password_from_the_environment_when_only_user_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ETCD_ELASTIC_PASSWORD", "from-env")
    s = _settings(user="u")
    assert s.password == "from-env" and "from-env" not in repr(s)
    config = s.etcd_config()
    assert config.password == "from-env" and "from-env" not in repr(config)


def test_password_file_is_passed_to_the_client_and_wins_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ETCD_ELASTIC_PASSWORD", "from-env")
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    s = _settings(user="u", password_file=str(secret))
    assert (s.password, s.password_file) == (None, str(secret))
    config = s.etcd_config()
    assert (config.password, config.password_file) == (None, str(secret))


def test_password_in_rdzv_conf_still_works_with_one_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("coordinator.core.settings._warned_visible_password", False)
    with caplog.at_level(logging.WARNING, logger="coordinator.core.settings"):
        assert _settings(user="u", password="visible").password == "visible"
        _settings(user="u", password="visible")
    assert [r.getMessage() for r in caplog.records] == [
        "rdzv_conf password=... is visible to every user of this machine (ps, "
        "/proc/*/cmdline, PET_RDZV_CONF): use password_file=FILE or $ETCD_ELASTIC_PASSWORD "
        "instead"
    ]
    assert "visible" not in caplog.text.replace("is visible to", "")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"password_file": "PW"}, "rdzv_conf password_file is set without user: give both or "
         "neither"),
        ({"user": "u", "password": "p", "password_file": "PW"},
         "rdzv_conf password and password_file are both set: keep password_file"),
        ({"user": "u", "password_file": "/nonexistent/pw"},
         "rdzv_conf password_file='/nonexistent/pw': no such file"),
    ],
)  # fmt: skip
def test_password_source_errors(tmp_path: Path, kwargs: dict[str, str], message: str) -> None:
    secret = tmp_path / "pw"
    secret.write_text("x")
    if kwargs.get("password_file") == "PW":
        kwargs = {**kwargs, "password_file": str(secret)}
    with pytest.raises(ConfigError) as info:
        _settings(**kwargs)
    assert str(info.value) == message


# --- events_limit (the run's timeline) ---------------------------------------------------


def test_events_limit_defaults_to_5000_and_takes_whole_numbers() -> None:
    assert _settings().events_limit == 5000
    assert _settings(events_limit="10").events_limit == 10
    assert _settings(events_limit=250_000).events_limit == 250_000


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("9", "rdzv_conf events_limit=9 must be a whole number of events from 10 to 1000000"),
        ("1000001", "rdzv_conf events_limit=1000001 must be a whole number of events from 10 "
         "to 1000000"),
        ("lots", "rdzv_conf events_limit='lots' is not a whole number"),
        ("2.5", "rdzv_conf events_limit='2.5' is not a whole number"),
    ],
)  # fmt: skip
def test_a_bad_events_limit_is_refused_naming_it(value: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _settings(events_limit=value)
    assert str(info.value) == message
