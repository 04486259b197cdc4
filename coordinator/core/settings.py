"""Rendezvous settings: what ``--rdzv-endpoint``, ``--rdzv-id`` and ``--rdzv-conf`` mean.

Built once from torch's ``RendezvousParameters`` and validated completely before anything
connects; every error is a :class:`~coordinator.core.errors.ConfigError` whose message names
the flag or ``rdzv_conf`` key, the offending value, and the rule.

``rdzv_conf`` keys (values arrive as strings from the command line, or as numbers when a
program builds the parameters):

==================  =========  =====================================================
key                 default    meaning
==================  =========  =====================================================
join_timeout        600        seconds a join may take before it fails (torch's name)
last_call_timeout   30         seconds to wait for more nodes once min_nodes joined
close_timeout       30         seconds to wait for the others when closing
read_timeout        60         retry budget of one etcd call, failover included
timeout             900        default timeout of blocking Store get/wait (torchrun sets it)
lease_ttl           5          seconds a dead node keeps its key (whole number, 1-600).
                               Every node renews its lease every lease_ttl/3 s, all
                               renewals on etcd's leader; by the nodes of all jobs on
                               one etcd: 5 up to ~1,500, 10 up to ~3,000, 15 up to
                               ~5,000; above, 30 or another etcd (docs/scale.md)
retention           7200       seconds etcd keeps the state of a run an agent closed
                               (finished or failed) before removing it; 0: until gc
events_limit        5000       events kept in the run's timeline (10-1000000); the
                               oldest beyond it are deleted
key_prefix          /etcd-elastic   etcd folder holding every run
protocol            http       http or https (an https:// endpoint implies https)
ssl_cert            -          client certificate file (with ssl_cert_key)
ssl_cert_key        -          client key file (with ssl_cert)
ca_cert             -          CA bundle that signed the etcd server certificates
user                -          etcd user; its password from one of, in this order:
password            -          the password itself (visible to every user in ``ps``:
                               a warning says so; prefer the next two)
password_file       -          a file holding it, read again at every authentication
$ETCD_ELASTIC_PASSWORD         the environment variable (never passed to workers)
==================  =========  =====================================================

Accepted and ignored, because torchrun sets them or torch's other backends take them:
``rank``, ``is_host``, ``store_type``, ``keep_alive_interval``, ``keep_alive_max_attempt``.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from coordinator.core.errors import ConfigError
from coordinator.core.etcd_client import EtcdConfig
from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys, validate_key_prefix, validate_run_id

__all__ = [
    "IGNORED_CONF_KEYS",
    "KNOWN_CONF_KEYS",
    "PASSWORD_ENV",
    "ParametersLike",
    "RendezvousSettings",
    "parse_endpoints",
]

log = logging.getLogger(__name__)


class ParametersLike(Protocol):
    """What settings read of torch's ``RendezvousParameters`` (the core imports no torch)."""

    @property
    def run_id(self) -> str: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def min_nodes(self) -> int: ...
    @property
    def max_nodes(self) -> int: ...
    @property
    def local_addr(self) -> str | None: ...
    @property
    def config(self) -> dict[str, Any]: ...


_TIMEOUT_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "read_timeout", "timeout")
_OWN_CONF_KEYS = (
    *_TIMEOUT_KEYS,
    "lease_ttl",
    "retention",
    "events_limit",
    "key_prefix",
    "protocol",
    "ssl_cert",
    "ssl_cert_key",
    "ca_cert",
    "user",
    "password",
    "password_file",
)
# Where etcdrun, torchrun's handler and rdzvctl read the etcd password when it is not in
# a file; the agent removes it from its workers' environment.
PASSWORD_ENV = "ETCD_ELASTIC_PASSWORD"
_warned_visible_password = False
IGNORED_CONF_KEYS: frozenset[str] = frozenset(
    {"rank", "is_host", "store_type", "keep_alive_interval", "keep_alive_max_attempt"}
)
KNOWN_CONF_KEYS: frozenset[str] = frozenset(_OWN_CONF_KEYS) | IGNORED_CONF_KEYS

_DEFAULT_PORT = 2379
_MAX_LEASE_TTL = 600
# etcd's own limit on a lease's TTL (MaxLeaseTTL, about 285 years).
_MAX_RETENTION = 9_000_000_000
_EVENTS_LIMITS = (10, 1_000_000)
# One unary RPC attempt never waits longer than this; read_timeout bounds the retries.
_MAX_REQUEST_TIMEOUT = 5.0
_HOST_RE = re.compile(r"[A-Za-z0-9._-]+")
_IPV6_RE = re.compile(r"[0-9A-Fa-f:.]+(%[A-Za-z0-9._-]+)?")


def _endpoint_error(text: str, reason: str) -> ConfigError:
    return ConfigError(f"rdzv_endpoint {text!r}: {reason}")


def _parse_one_endpoint(text: str, item: str) -> tuple[str, str | None]:
    """Return (``host:port``, scheme or None) for one comma-separated item."""
    scheme: str | None = None
    rest = item
    for candidate in ("http", "https"):
        if item.lower().startswith(candidate + "://"):
            scheme = candidate
            rest = item[len(candidate) + 3 :]
    if "://" in rest:
        raise _endpoint_error(text, f"{item!r} has an unsupported scheme (use http or https)")
    rest = rest.rstrip("/")
    if rest.startswith("["):
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
    else:
        host, sep, port_part = rest.partition(":")
        port_text = port_part if sep else None
        if not host:
            raise _endpoint_error(text, f"{item!r} has an empty host")
        if not _HOST_RE.fullmatch(host):
            raise _endpoint_error(text, f"{host!r} is not a host name or IPv4 address")
    port = _DEFAULT_PORT
    if port_text is not None:
        if not re.fullmatch(r"[0-9]{1,5}", port_text) or not 1 <= int(port_text) <= 65535:
            raise _endpoint_error(text, f"{port_text!r} is not a port number (1-65535)")
        port = int(port_text)
    return f"{host}:{port}", scheme


def _parse_endpoints_with_scheme(text: str) -> tuple[tuple[str, ...], str | None]:
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
    return _parse_endpoints_with_scheme(text)[0]


def _seconds(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"rdzv_conf {key}={value!r} is not a number of seconds")
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"rdzv_conf {key}={value!r} is not a number of seconds") from None
    if not math.isfinite(number):
        raise ConfigError(f"rdzv_conf {key}={value!r} is not a finite number of seconds")
    return number


def _whole_seconds(key: str, value: object) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"rdzv_conf {key}={value!r} is not a whole number of seconds")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    raise ConfigError(f"rdzv_conf {key}={value!r} is not a whole number of seconds")


def _whole_number(key: str, value: object) -> int:
    try:
        return _whole_seconds(key, value)
    except ConfigError:
        raise ConfigError(f"rdzv_conf {key}={value!r} is not a whole number") from None


def _text(key: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"rdzv_conf {key}={value!r} must be text")
    return value or None


def _check_unknown(conf: Mapping[str, Any]) -> None:
    unknown = sorted(k for k in conf if k not in KNOWN_CONF_KEYS)
    if not unknown:
        return
    hint = ""
    if len(unknown) == 1:
        close = difflib.get_close_matches(unknown[0], sorted(KNOWN_CONF_KEYS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(
        f"rdzv_conf has unknown key{'s' if len(unknown) > 1 else ''} "
        f"{', '.join(repr(k) for k in unknown)}{hint}; known keys: "
        f"{', '.join(sorted(KNOWN_CONF_KEYS))}"
    )


def _check_file(key: str, path: str | None) -> None:
    if path is None:
        return
    if not os.path.isfile(path):
        raise ConfigError(f"rdzv_conf {key}={path!r}: no such file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"rdzv_conf {key}={path!r}: file is not readable by this user")


@dataclass(frozen=True)
class RendezvousSettings:
    """Validated rendezvous settings of one run (see the module docstring for each key).

    Timeouts are in seconds. Construction validates every field.

    Raises:
        ConfigError: any field is invalid; the message names it and its value.
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    endpoints: tuple[str, ...]
    local_addr: str | None = None
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    read_timeout: float = 60.0
    store_timeout: float = 900.0
    # Renewals: nodes x 3 / lease_ttl a second on etcd's leader, kept at or under about
    # 1,000 (etcd issue 18069: 1,500 cost a leader 20 % CPU) by the table above.
    lease_ttl: int = 5
    retention: float = 7200.0
    events_limit: int = 5000
    key_prefix: str = DEFAULT_KEY_PREFIX
    protocol: Literal["http", "https"] = "http"
    ssl_cert: str | None = None
    ssl_cert_key: str | None = None
    ca_cert: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    password_file: str | None = None

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)
        if isinstance(self.min_nodes, bool) or not isinstance(self.min_nodes, int):
            raise ConfigError(f"min_nodes {self.min_nodes!r} is not a whole number")
        if isinstance(self.max_nodes, bool) or not isinstance(self.max_nodes, int):
            raise ConfigError(f"max_nodes {self.max_nodes!r} is not a whole number")
        if self.min_nodes < 1:
            raise ConfigError(f"--nnodes: minimum {self.min_nodes} must be at least 1")
        if self.max_nodes < self.min_nodes:
            raise ConfigError(
                f"--nnodes: minimum {self.min_nodes} is greater than maximum {self.max_nodes}"
            )
        if not self.endpoints:
            raise ConfigError("rdzv_endpoint is empty: give the etcd members as host:port")
        for key, name in (
            ("join_timeout", "join_timeout"),
            ("last_call_timeout", "last_call_timeout"),
            ("close_timeout", "close_timeout"),
            ("read_timeout", "read_timeout"),
            ("store_timeout", "timeout"),
        ):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"rdzv_conf {name}={value!r} must be more than 0 seconds")
        if not 1 <= self.lease_ttl <= _MAX_LEASE_TTL:
            raise ConfigError(
                f"rdzv_conf lease_ttl={self.lease_ttl!r} must be between 1 and "
                f"{_MAX_LEASE_TTL} seconds"
            )
        if not (
            isinstance(self.retention, (int, float))
            and math.isfinite(self.retention)
            and 0 <= self.retention <= _MAX_RETENTION
        ):
            raise ConfigError(
                f"rdzv_conf retention={self.retention!r} must be 0 (keep until rdzvctl gc) "
                f"or up to {_MAX_RETENTION} seconds"
            )
        low, high = _EVENTS_LIMITS
        if (
            isinstance(self.events_limit, bool)
            or not isinstance(self.events_limit, int)
            or not low <= self.events_limit <= high
        ):
            raise ConfigError(
                f"rdzv_conf events_limit={self.events_limit!r} must be a whole number of "
                f"events from {low} to {high}"
            )
        validate_key_prefix(self.key_prefix)
        if self.protocol not in ("http", "https"):
            raise ConfigError(f"rdzv_conf protocol={self.protocol!r} must be 'http' or 'https'")
        if (self.ssl_cert is None) != (self.ssl_cert_key is None):
            given, missing = (
                ("ssl_cert", "ssl_cert_key") if self.ssl_cert else ("ssl_cert_key", "ssl_cert")
            )
            raise ConfigError(f"rdzv_conf {given} is set without {missing}: give both or neither")
        if self.protocol == "http":
            for key in ("ssl_cert", "ssl_cert_key", "ca_cert"):
                if getattr(self, key) is not None:
                    raise ConfigError(
                        f"rdzv_conf {key} is set but protocol is 'http': "
                        f"set protocol=https or remove {key}"
                    )
        for key in ("ssl_cert", "ssl_cert_key", "ca_cert"):
            _check_file(key, getattr(self, key))
        _check_file("password_file", self.password_file)
        if self.password is not None and self.password_file is not None:
            raise ConfigError(
                "rdzv_conf password and password_file are both set: keep password_file"
            )
        has_password = self.password is not None or self.password_file is not None
        if self.user is None and has_password:
            given = "password" if self.password is not None else "password_file"
            raise ConfigError(f"rdzv_conf {given} is set without user: give both or neither")
        if self.user is not None and not has_password:
            raise ConfigError(
                f"rdzv_conf user={self.user!r} has no password: give password_file=FILE or "
                f"set ${PASSWORD_ENV} (or use a client certificate whose CN is the user, "
                "without user)"
            )

    @classmethod
    def from_parameters(cls, params: ParametersLike) -> RendezvousSettings:
        """Build settings from torch's ``RendezvousParameters``.

        Raises:
            ConfigError: a bad endpoint, run id, node count or ``rdzv_conf`` value, or an
                unknown ``rdzv_conf`` key (the message lists the known keys).
        """
        conf: Mapping[str, Any] = params.config
        _check_unknown(conf)
        for key in ("keep_alive_interval", "keep_alive_max_attempt"):
            if key in conf:
                log.info(
                    "rdzv_conf %s=%r is ignored for run %s: etcd leases replace heartbeats "
                    "(set lease_ttl instead)",
                    key,
                    conf[key],
                    params.run_id,
                )
        endpoints, scheme = _parse_endpoints_with_scheme(params.endpoint)
        protocol_raw = _text("protocol", conf.get("protocol"))
        protocol = protocol_raw.strip().lower() if protocol_raw else (scheme or "http")
        if protocol not in ("http", "https"):
            raise ConfigError(f"rdzv_conf protocol={protocol_raw!r} must be 'http' or 'https'")
        if scheme is not None and protocol != scheme:
            raise ConfigError(
                f"rdzv_endpoint {params.endpoint!r} uses {scheme}:// but rdzv_conf "
                f"protocol={protocol_raw!r}: make them agree"
            )
        timeouts = {
            key: _seconds(key, conf[key]) for key in _TIMEOUT_KEYS if conf.get(key) is not None
        }
        lease_raw = conf.get("lease_ttl")
        user = _text("user", conf.get("user"))
        password = _text("password", conf.get("password"))
        password_file = _text("password_file", conf.get("password_file"))
        if password is not None:
            _warn_visible_password()
        elif user is not None and password_file is None:
            password = os.environ.get(PASSWORD_ENV) or None
        retention_raw = conf.get("retention")
        events_raw = conf.get("events_limit")
        return cls(
            run_id=params.run_id,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            endpoints=endpoints,
            local_addr=params.local_addr or None,
            join_timeout=timeouts.get("join_timeout", 600.0),
            last_call_timeout=timeouts.get("last_call_timeout", 30.0),
            close_timeout=timeouts.get("close_timeout", 30.0),
            read_timeout=timeouts.get("read_timeout", 60.0),
            store_timeout=timeouts.get("timeout", 900.0),
            lease_ttl=5 if lease_raw is None else _whole_seconds("lease_ttl", lease_raw),
            retention=7200.0 if retention_raw is None else _seconds("retention", retention_raw),
            events_limit=5000 if events_raw is None else _whole_number("events_limit", events_raw),
            key_prefix=_text("key_prefix", conf.get("key_prefix")) or DEFAULT_KEY_PREFIX,
            protocol="https" if protocol == "https" else "http",
            ssl_cert=_text("ssl_cert", conf.get("ssl_cert")),
            ssl_cert_key=_text("ssl_cert_key", conf.get("ssl_cert_key")),
            ca_cert=_text("ca_cert", conf.get("ca_cert")),
            user=user,
            password=password,
            password_file=password_file,
        )

    @property
    def keys(self) -> RunKeys:
        """The etcd key layout of this run."""
        return RunKeys(self.key_prefix, self.run_id)

    def etcd_config(self) -> EtcdConfig:
        """How to reach etcd: ``read_timeout`` is the retry budget of one call."""
        return EtcdConfig(
            endpoints=self.endpoints,
            protocol=self.protocol,
            ca_cert=self.ca_cert,
            cert=self.ssl_cert,
            cert_key=self.ssl_cert_key,
            user=self.user,
            password=self.password,
            password_file=self.password_file,
            # An attempt stuck longer than half a lease TTL (at least 1 s) is retried on
            # the next member: a write that reached a member as its leader died is
            # dropped by etcd, which answers it only after its own 5 s + two elections
            # (measured: a round's rank exchange waited 5.0 s of a 7 s recovery bound).
            request_timeout=min(
                _MAX_REQUEST_TIMEOUT, self.read_timeout, max(1.0, self.lease_ttl / 2)
            ),
            retry_budget=self.read_timeout,
        )

    def __repr__(self) -> str:
        # The password must never reach a log line.
        shown = "***" if self.password is not None else None
        fields = ", ".join(
            f"{name}={(shown if name == 'password' else getattr(self, name))!r}"
            for name in self.__dataclass_fields__
        )
        return f"RendezvousSettings({fields})"


def _warn_visible_password() -> None:
    global _warned_visible_password
    if not _warned_visible_password:
        _warned_visible_password = True
        log.warning(
            "rdzv_conf password=... is visible to every user of this machine (ps, "
            "/proc/*/cmdline, PET_RDZV_CONF): use password_file=FILE or $%s instead",
            PASSWORD_ENV,
        )
