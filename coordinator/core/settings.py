"""Rendezvous settings: what ``--rdzv-endpoint``, ``--rdzv-id`` and ``--rdzv-conf`` mean.

Built once from torch's ``RendezvousParameters`` and validated completely before anything
connects; every error is a :class:`~coordinator.core.errors.ConfigError` whose message names
the flag or ``rdzv_conf`` key, the offending value, and the rule. The endpoints' syntax is
:mod:`coordinator.core.endpoints`; how each ``rdzv_conf`` value is read,
:mod:`coordinator.core.conf_values`.

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
retention           7200       seconds etcd keeps a run's keys (state, store, events)
                               after its last agent left, closed or not (at least
                               2 x lease_ttl); 0: until rdzvctl gc
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

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from coordinator.core.conf_values import (
    check_file,
    check_unknown,
    read_or_default,
    read_protocol,
    read_seconds,
    read_text,
    read_whole_number,
    read_whole_seconds,
)
from coordinator.core.endpoints import parse_endpoints, parse_endpoints_with_scheme
from coordinator.core.errors import ConfigError
from coordinator.core.etcd_client import EtcdConfig
from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys, validate_key_prefix, validate_run_id
from coordinator.core.timeouts import Spans, nesting

__all__ = [
    "IGNORED_CONF_KEYS",
    "KNOWN_CONF_KEYS",
    "PASSWORD_ENV",
    "ParametersLike",
    "RendezvousSettings",
    # Re-exported only for coordinator/rdzvctl/cli.py (left alone while its split was
    # under way): once it imports coordinator.core.endpoints, this line goes.
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

_MAX_LEASE_TTL = 600
# etcd's own limit on a lease's TTL (MaxLeaseTTL, about 285 years).
_MAX_RETENTION = 9_000_000_000
_EVENTS_LIMITS = (10, 1_000_000)
# One unary RPC attempt never waits longer than this; read_timeout bounds the retries.
_MAX_REQUEST_TIMEOUT = 5.0


def _log_ignored(conf: Mapping[str, Any], run_id: str) -> None:
    for key in ("keep_alive_interval", "keep_alive_max_attempt"):
        if key in conf:
            log.info(
                "rdzv_conf %s=%r is ignored for run %s: etcd leases replace heartbeats "
                "(set lease_ttl instead)",
                key,
                conf[key],
                run_id,
            )


def _credentials(conf: Mapping[str, Any]) -> tuple[str | None, str | None, str | None]:
    """user, password and password_file; a user with neither password nor file takes the
    password from ``$ETCD_ELASTIC_PASSWORD``."""
    user = read_text("user", conf.get("user"))
    password = read_text("password", conf.get("password"))
    password_file = read_text("password_file", conf.get("password_file"))
    if password is not None:
        _warn_visible_password()
    elif user is not None and password_file is None:
        password = os.environ.get(PASSWORD_ENV) or None
    return user, password, password_file


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
        # In this order: with several bad values, the first one here is the one named.
        validate_run_id(self.run_id)
        self._check_nodes()
        self._check_timeouts()
        self._check_retention_and_events()
        validate_key_prefix(self.key_prefix)
        self._check_tls()
        self._check_credentials()

    def _check_nodes(self) -> None:
        """Node counts that can form a round, and somewhere to find etcd."""
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

    def _check_timeouts(self) -> None:
        """Every timeout positive, the lease TTL in range, and timeouts that nest."""
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
        for finding in nesting(self.spans()):
            if finding.refuse:  # the risky ones are etcdrun's to warn about, once
                raise ConfigError(f"rdzv_conf {finding.line}")

    def _check_retention_and_events(self) -> None:
        """How long a run's keys stay and how many events its timeline keeps."""
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

    def _check_tls(self) -> None:
        """The protocol, a certificate with its key, TLS files only for https, readable."""
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
            check_file(key, getattr(self, key))

    def _check_credentials(self) -> None:
        """A user with exactly one source of its password, or neither."""
        check_file("password_file", self.password_file)
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
        check_unknown(conf, KNOWN_CONF_KEYS)
        _log_ignored(conf, params.run_id)
        endpoints, scheme = parse_endpoints_with_scheme(params.endpoint)
        protocol = read_protocol(conf, params.endpoint, scheme)
        timeouts = {
            key: read_seconds(key, conf[key]) for key in _TIMEOUT_KEYS if conf.get(key) is not None
        }
        user, password, password_file = _credentials(conf)
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
            lease_ttl=read_or_default(conf, "lease_ttl", read_whole_seconds, 5),
            retention=read_or_default(conf, "retention", read_seconds, 7200.0),
            events_limit=read_or_default(conf, "events_limit", read_whole_number, 5000),
            key_prefix=read_text("key_prefix", conf.get("key_prefix")) or DEFAULT_KEY_PREFIX,
            protocol="https" if protocol == "https" else "http",
            ssl_cert=read_text("ssl_cert", conf.get("ssl_cert")),
            ssl_cert_key=read_text("ssl_cert_key", conf.get("ssl_cert_key")),
            ca_cert=read_text("ca_cert", conf.get("ca_cert")),
            user=user,
            password=password,
            password_file=password_file,
        )

    def spans(self) -> Spans:
        """The timeouts these settings hold, for :func:`coordinator.core.timeouts.nesting`."""
        return Spans(
            join_timeout=self.join_timeout,
            last_call_timeout=self.last_call_timeout,
            store_timeout=self.store_timeout,
            lease_ttl=self.lease_ttl,
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
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
