"""The ``rdzvctl`` command line, checked: :func:`parse_args` turns it into :class:`Options`.

The syntax is :mod:`coordinator.rdzvctl.parser`'s; here every value is checked (no
network I/O: only the files named are looked at). Every bad value ends the program
before anything connects, with exit code 2 and one line ``rdzvctl: error: <flag>: <what
is wrong and what to do>``. The checks reuse the rendezvous' own validators (run id, key
prefix, endpoints), so ``rdzvctl`` accepts exactly what ``etcdrun`` accepts.

Start-up: ``rdzvctl --help`` must not pay for grpc and the etcd client (about 150 ms of
imports), so this module imports neither; the checks that need the client's config type
import it once the command line has parsed (see :func:`_etcd_config`).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from coordinator.core.errors import ConfigError
from coordinator.core.keys import (
    DEFAULT_KEY_PREFIX,
    validate_key_prefix,
    validate_node_id,
    validate_run_id,
)

# The program's names live with the parser (its help text shows them); the ones the rest
# of rdzvctl imports from here are re-exported.
from coordinator.rdzvctl.parser import (
    DEFAULT_ENDPOINT,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    PASSWORD_ENV,
    PROG,
    SHARED_PASSWORD_ENV,
    build_parser,
)

if TYPE_CHECKING:
    from coordinator.core.etcd_client import EtcdConfig

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "PROG",
    "SHARED_PASSWORD_ENV",
    "Options",
    "UsageError",
    "parse_args",
    "parse_duration",
]

# What rdzvctl timeline can write (matplotlib's formats that open anywhere).
TIMELINE_FORMATS = (".png", ".svg", ".pdf")
# One unary RPC attempt never waits longer than this; --read-timeout bounds the retries.
_MAX_REQUEST_TIMEOUT = 5.0

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smhd]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds in ``text``: ``90``, ``30s``, ``10m``, ``2h``, ``7d`` or sums like ``1h30m``.

    Raises:
        ValueError: not a duration; the message names the text and shows the forms.
    """
    rest = text.strip().lower()
    total = 0.0
    pos = 0
    while pos < len(rest):
        match = _DURATION_PART.match(rest, pos)
        if match is None:
            total = -1.0
            break
        total += float(match[1]) * _UNIT_SECONDS[match[2]]
        pos = match.end()
    if not rest or total < 0:
        raise ValueError(f"{text!r} is not a duration; give e.g. 90s, 10m, 2h, 7d or 1h30m")
    return total


class UsageError(ValueError):
    """A command-line value is invalid: ``flag`` names the option, ``reason`` the fix."""

    def __init__(self, flag: str, reason: str) -> None:
        super().__init__(f"{flag}: {reason}")
        self.flag = flag
        self.reason = reason


@dataclass(frozen=True)
class Options:
    """A checked ``rdzvctl`` command line."""

    command: str
    etcd: EtcdConfig
    key_prefix: str
    json: bool = False
    run: str | None = None
    node: str | None = None
    count: int | None = None
    timeout: float | None = None
    reason: str | None = None
    older_than: float = 0.0
    dry_run: bool = False
    follow: bool = False
    output: str | None = None
    incarnation: int | None = None


def _reword(exc: ConfigError, old: str, new: str) -> str:
    # The shared validators name etcdrun's settings; rdzvctl's flags are named otherwise.
    text = str(exc)
    return new + text[len(old) :] if text.startswith(old) else text


def _positive_seconds(flag: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise UsageError(flag, f"{text!r} is not a number of seconds above 0")
    return value


def _file(flag: str, path: str | None) -> str | None:
    if path is None:
        return None
    if not os.path.isfile(path):
        raise UsageError(flag, f"{path!r}: no such file")
    if not os.access(path, os.R_OK):
        raise UsageError(flag, f"{path!r}: file is not readable by this user")
    return path


def _output(path: str) -> str:
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in TIMELINE_FORMATS:
        raise UsageError("-o", f"{path!r}: give a file ending in {', '.join(TIMELINE_FORMATS)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError("-o", f"{path!r}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError("-o", f"{path!r}: folder {folder} is not writable by this user")
    if os.path.isdir(path):
        raise UsageError("-o", f"{path!r} is a folder: give a file name")
    return path


def _protocol(given: str | None, endpoints_text: str) -> Literal["http", "https"]:
    schemes = {
        item.strip().lower().split("://", 1)[0]
        for item in endpoints_text.split(",")
        if "://" in item
    }
    scheme = schemes.pop() if len(schemes) == 1 else None
    chosen = (given or scheme or "http").strip().lower()
    if chosen not in ("http", "https"):
        raise UsageError("--protocol", f"{given!r} is not http or https")
    if scheme is not None and chosen != scheme:
        raise UsageError(
            "--protocol", f"{given!r} but --endpoints uses {scheme}://: make them agree"
        )
    return "https" if chosen == "https" else "http"


def _etcd_config(ns: Mapping[str, object], environ: Mapping[str, str]) -> EtcdConfig:
    # Here, not at the top: both modules load grpc (core.settings through the etcd
    # client package), which only a command that connects needs.
    from coordinator.core.etcd_client import EtcdConfig
    from coordinator.core.settings import parse_endpoints

    def text(name: str) -> str | None:
        value = ns.get(name)
        return value if isinstance(value, str) and value else None

    given = ns.get("endpoints")
    endpoints_text = given if isinstance(given, str) else DEFAULT_ENDPOINT
    try:
        endpoints = parse_endpoints(endpoints_text)
    except ConfigError as exc:
        raise UsageError("--endpoints", _reword(exc, "rdzv_endpoint ", "")) from None
    protocol = _protocol(text("protocol"), endpoints_text)
    ca_cert, cert, key = (
        _file(f"--{n.replace('_', '-')}", text(n)) for n in ("ca_cert", "cert", "key")
    )
    if (cert is None) != (key is None):
        given, missing = ("--cert", "--key") if cert else ("--key", "--cert")
        raise UsageError(given, f"is set without {missing}: give both or neither")
    if protocol == "http" and (ca_cert or cert):
        flag = "--ca-cert" if ca_cert else "--cert"
        raise UsageError(flag, "is set but the protocol is http: add --protocol=https")
    user = text("user")
    password_file = _file("--password-file", text("password_file"))
    if text("password") is not None and password_file is not None:
        raise UsageError("--password", "and --password-file are both set: keep --password-file")
    password = (
        None
        if password_file is not None
        else text("password")
        or environ.get(PASSWORD_ENV)
        or environ.get(SHARED_PASSWORD_ENV)
        or None
    )
    for flag, given in (("--password", text("password")), ("--password-file", password_file)):
        if user is None and given is not None:
            raise UsageError(flag, "is set without --user: give both or neither")
    if user is not None and password is None and password_file is None:
        raise UsageError(
            "--user",
            f"is set without a password: give --password-file FILE or set ${PASSWORD_ENV} "
            f"or ${SHARED_PASSWORD_ENV}",
        )
    read_timeout = _positive_seconds("--read-timeout", text("read_timeout") or "10")
    return EtcdConfig(
        endpoints=endpoints,
        protocol=protocol,
        ca_cert=ca_cert,
        cert=cert,
        cert_key=key,
        user=user,
        password=password if user is not None else None,
        password_file=password_file if user is not None else None,
        request_timeout=min(_MAX_REQUEST_TIMEOUT, read_timeout),
        retry_budget=read_timeout,
    )


def _check(ns: argparse.Namespace, environ: Mapping[str, str]) -> Options:
    values = vars(ns)
    etcd = _etcd_config(values, environ)
    try:
        key_prefix = validate_key_prefix(values.get("key_prefix") or DEFAULT_KEY_PREFIX)
    except ConfigError as exc:
        raise UsageError("--key-prefix", _reword(exc, "rdzv_conf key_prefix=", "")) from None
    run = values.get("run")
    if run is not None:
        try:
            validate_run_id(run)
        except ConfigError as exc:
            raise UsageError("RUN", _reword(exc, "rdzv_id ", "")) from None
    node = values.get("node")
    if node is not None:
        try:
            validate_node_id(node)
        except ConfigError as exc:
            raise UsageError("NODE", _reword(exc, "node id ", "")) from None
    count = None
    if values.get("count") is not None:
        text = values["count"]
        if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < 1:
            raise UsageError("--count", f"{text!r} is not a whole number of changes above 0")
        count = int(text)
    timeout = None
    if values.get("timeout") is not None:
        timeout = _positive_seconds("--timeout", values["timeout"])
    older_than = 0.0
    if values.get("older_than") is not None:
        try:
            older_than = parse_duration(values["older_than"])
        except ValueError as exc:
            raise UsageError("--older-than", str(exc)) from None
    incarnation = values.get("incarnation")
    if incarnation is not None and not re.fullmatch(r"\s*[1-9]\d{0,9}\s*", incarnation):
        raise UsageError("--incarnation", f"{incarnation!r} is not a whole number above 0")
    reason = values.get("reason")
    if reason is not None and not reason.strip():
        raise UsageError("--reason", "is empty: say why the run ends, or leave it out")
    return Options(
        command=ns.command,
        etcd=etcd,
        key_prefix=key_prefix,
        json=bool(values.get("json", False)),
        run=run,
        node=node,
        count=count,
        timeout=timeout,
        reason=" ".join(reason.split()) if reason is not None else None,
        older_than=older_than,
        dry_run=bool(values.get("dry_run", False)),
        follow=bool(values.get("follow", False)),
        output=_output(values["output"]) if values.get("output") is not None else None,
        incarnation=int(incarnation) if incarnation is not None else None,
    )


def parse_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Options:
    """Parse and check a command line.

    Raises:
        SystemExit: code 2 after printing one ``rdzvctl: error: …`` line (bad syntax or
            value), or code 0 after ``--help``.
    """
    parser = build_parser()
    ns = parser.parse_args(list(argv))
    try:
        return _check(ns, os.environ if environ is None else environ)
    except (UsageError, ConfigError) as exc:
        parser.error(str(exc))
